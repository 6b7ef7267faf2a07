#!/usr/bin/env python3
"""A numpy emulation of llama.cpp's CPU forward pass (the path probes/oracle_agreement.py compares against),
with each of llama.cpp's roundings switchable, to find which of them explain our gap to llama.cpp (issue 2).

The oracle runs llama-cpp-python's Llama(flash_attn=False, n_batch=512, n_ubatch=512, type_k=type_v=f16)
on an AVX2 CPU. On a llama Q4_1 file (Q8_0 tied head) that path rounds, beyond plain f32 arithmetic:
  act   activations to 8 bits before every quantized matmul (quantize_row_q8_1 / _q8_0, AVX2):
        per 32 values amax = max|x|, d = amax/127 (f32 divide), x*(127/amax) rounded half-to-even;
        d is stored as f16, and for Q8_1 also s = f16(d_f32 * sum(q)) (the Q4_1 offset term uses m * s)
  kv    K (after RoPE) and V to f16 in the KV cache
  q     q to f16 before K.q (src1 of an f16 mul_mat is converted to f16)
  soft  the softmax weights to f16 before the V product (same reason)
  rope  theta = pos * theta_scale^i built by repeated f32 multiplication, cos/sin of the f32 angle
  norm  rms_norm: f32 x*x summed in double, scale = 1/sqrtf(mean + eps) as f32
Everything else is computed in float64 (weights are exact in f64); llama.cpp's f32 summation order is
not emulated.

What it shows (SmolLM2-135M Q4_1, first 512 tokens of probes/oracle_text.txt, `--table --sensitivity`):
every variant, all roundings on included, lands at 96.3-97.5% top-1 / mean |logit diff| 0.146-0.166 from
llama.cpp, like our engine; and each variant differs from *itself computed with f32 instead of f64 sums*
by as much (95.9-97.3%, 0.15-0.16) -- except with `act` off (100%, 0.002). The 8-bit activation rounding
turns last-bit differences into whole quanta that cascade through the 30 layers, so no set of roundings
closes the gap: only bit-exact summation order would (see probes/llama_bitexact.py).

`--table` switches the roundings off one at a time (and all together) and prints, for each variant,
teacher-forced top-1 agreement and mean |logit diff| against llama.cpp (`--greedy`: also 32-token
greedy prefixes, slow: the emulation has no KV cache).

Usage: probes/llama_numerics.py [MODEL] [--table] [--off act,kv,...] [--greedy] [--floor]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ROUNDINGS = ("act", "s16", "kv", "q", "soft", "rope", "norm")
F32, F64 = np.float32, np.float64


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(F32)


def quantize_act(x: np.ndarray, s16: bool = True):
    """llama.cpp's AVX2 quantize_row_q8_1: x (T, n) f32 -> (q (T, nb, 32) f64 ints, d16 (T, nb), s (T, nb))."""
    xb = x.astype(F32).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1)
    d = amax / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint(xb * inv[..., None])  # f32 product, round half to even (_mm256_round_ps NEAREST)
    d16 = f16(d)
    s = d * q.sum(-1, dtype=F32)  # f32 d (not the f16 one) times the integer sum
    return q.astype(F64), d16.astype(F64), (f16(s) if s16 else s).astype(F64)


class QWeight:
    """A Q4_1 / Q8_0 / F32 matrix split into its integer part A = d*q (f64, exact) and offsets m (Q4_1)."""

    def __init__(self, qt):
        from gguf import GGMLQuantizationType as QT

        from engine.quant import _raw_rows, dequantize
        self.qtype = qt.qtype
        rows, cols = qt.shape
        if qt.qtype == QT.Q4_1:
            raw = _raw_rows(qt).reshape(rows, cols // 32, 20)
            d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(F64)
            self.m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(F64)  # (rows, nb)
            qs = raw[..., 4:]
            q = np.concatenate([qs & 15, qs >> 4], -1).astype(F64)  # (rows, nb, 32)
            self.a = (d[..., None] * q).reshape(rows, cols)
        else:
            self.m = None
            self.a = dequantize(qt).astype(F64)  # Q8_0: d*q exactly

    def __call__(self, x: np.ndarray, act: bool, s16: bool) -> np.ndarray:
        """x (T, n) f32 -> (T, rows) f32, as llama.cpp's mul_mat (act: with activation quantization).
        With SUM32 the sums run in f32 (BLAS order): the same math rounded differently at the last bit."""
        if SUM32:
            return self._f32(x, act, s16)
        if not act:  # exact f32 inputs against the dequantized weights
            y = x.astype(F64) @ self.a.T
            if self.m is not None:
                y += x.astype(F64).reshape(x.shape[0], -1, 32).sum(-1) @ self.m.T
            return y.astype(F32)
        q, d, s = quantize_act(x, s16)
        y = (q * d[..., None]).reshape(x.shape) @ self.a.T
        if self.m is not None:
            y += s @ self.m.T
        return y.astype(F32)


    def _f32(self, x, act, s16):
        if not hasattr(self, "a32"):
            self.a32 = self.a.astype(F32)
            self.m32 = None if self.m is None else self.m.astype(F32)
        if not act:
            y = x @ self.a32.T
            return y if self.m is None else y + x.reshape(x.shape[0], -1, 32).sum(-1) @ self.m32.T
        q, d, s = quantize_act(x, s16)
        y = (q * d[..., None]).astype(F32).reshape(x.shape) @ self.a32.T
        return y if self.m is None else y + s.astype(F32) @ self.m32.T


SUM32 = False


class Emulator:
    """llama.cpp's forward for a llama-architecture GGUF, with roundings `on` (subset of ROUNDINGS)."""

    def __init__(self, path):
        from engine.gguf import load_gguf
        mf = load_gguf(path)
        self.a, t = mf.args, mf.tensors
        assert self.a.arch == "llama" and not self.a.rope_neox, "emulates the llama layout only"
        vec = lambda n: np.asarray(t[n].data, F32)  # noqa: E731
        self.emb = QWeight(t["token_embd.weight"])
        self.head = QWeight(t["output.weight"]) if "output.weight" in t else self.emb
        self.layers = []
        for i in range(self.a.n_layer):
            p = f"blk.{i}."
            self.layers.append({k: (vec(p + k + ".weight") if k.endswith("norm") else QWeight(t[p + k + ".weight"]))
                                for k in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                          "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")})
        self.out_norm = vec("output_norm.weight")

    def norm(self, x, w, on):
        if "norm" in on:
            mean = F32((x * x).astype(F64).sum(-1, keepdims=True) / x.shape[-1])
            scale = F32(1) / np.sqrt(F32(mean + F64(F32(self.a.rms_eps))).astype(F32))
            return (x * scale) * w
        return (x / np.sqrt((x.astype(F64) ** 2).mean(-1, keepdims=True) + self.a.rms_eps)).astype(F32) * w

    def rope(self, x, pos, on):
        """x (T, H, hd) f32, llama's adjacent-pair rotation."""
        hd = x.shape[-1]
        if "rope" in on:
            ts = F32(np.float32(self.a.rope_base) ** F32(-2.0 / hd))
            theta = np.empty((len(pos), hd // 2), F32)
            th = pos.astype(F32)
            for i in range(hd // 2):
                theta[:, i] = th
                th = (th * ts).astype(F32)
            c, s = np.cos(theta), np.sin(theta)
        else:
            theta = pos[:, None].astype(F64) * self.a.rope_base ** (-np.arange(0, hd, 2) / hd)
            c, s = np.cos(theta), np.sin(theta)
        x0, x1 = x[..., 0::2].astype(F64), x[..., 1::2].astype(F64)
        c, s = c[:, None, :].astype(F64), s[:, None, :].astype(F64)
        return np.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).reshape(x.shape).astype(F32)

    def attention(self, q, k, v, on):
        """q (T, H, hd), k/v (T, Hkv, hd) f32 -> (T, H*hd) f32, causal, as ggml's non-flash path."""
        a, t_n = self.a, q.shape[0]
        if "kv" in on:
            k, v = f16(k), f16(v)
        if "q" in on:
            q = f16(q)
        out = np.empty((t_n, a.n_head, a.head_dim), F32)
        mask = np.triu(np.full((t_n, t_n), -np.inf, F32), 1)
        for h in range(a.n_head):
            kh, vh = k[:, h // a.group].astype(F64), v[:, h // a.group].astype(F64)
            sc = (q[:, h].astype(F64) @ kh.T).astype(F32) * F32(1 / np.sqrt(a.head_dim)) + mask
            e = np.exp(sc - sc.max(-1, keepdims=True))  # f32
            w = e * F32(1.0 / e.sum(-1, dtype=F64, keepdims=True))
            if "soft" in on:
                w = f16(w)
            out[:, h] = (w.astype(F64) @ vh).astype(F32)
        return out.reshape(t_n, -1)

    def forward(self, ids, on=ROUNDINGS, last_only=False, trace=None) -> np.ndarray:
        """Logits (T, vocab) f32 (or (1, vocab) for the last position) of ids read from position 0.
        trace: a list that receives each layer's output (T, d)."""
        a, act, s16 = self.a, "act" in on, "s16" in on
        ids = np.asarray(ids)
        pos = np.arange(len(ids))
        x = self.emb.a[ids].astype(F32)
        for L in self.layers:
            h = self.norm(x, L["attn_norm"], on)
            q = self.rope(L["attn_q"](h, act, s16).reshape(len(ids), a.n_head, a.head_dim), pos, on)
            k = self.rope(L["attn_k"](h, act, s16).reshape(len(ids), a.n_kv_head, a.head_dim), pos, on)
            v = L["attn_v"](h, act, s16).reshape(len(ids), a.n_kv_head, a.head_dim)
            x = x + L["attn_output"](self.attention(q, k, v, on), act, s16)
            h = self.norm(x, L["ffn_norm"], on)
            g, u = L["ffn_gate"](h, act, s16), L["ffn_up"](h, act, s16)
            x = x + L["ffn_down"]((g / (F32(1) + np.exp(-g))) * u, act, s16)
            if trace is not None:
                trace.append(x)
        x = self.norm(x[-1:] if last_only else x, self.out_norm, on)
        return self.head(x, act, False)

    def greedy(self, ids, n_new, stops, on=ROUNDINGS) -> list[int]:
        out = []
        for _ in range(n_new):
            out.append(int(np.argmax(self.forward(list(ids) + out, on, last_only=True)[0])))
            if out[-1] in stops:
                break
        return out


def compare(ours: np.ndarray, theirs: np.ndarray) -> dict:
    """Top-1 agreement over positions 0..n-2 (those that predict a token of the text) and mean |diff|."""
    a, b = ours[:-1].argmax(-1), theirs[:-1].argmax(-1)
    bad = np.nonzero(a != b)[0]
    gaps = theirs[bad, b[bad]] - theirs[bad, a[bad]]
    return {"rate": float((a == b).mean()), "positions": len(a), "mismatches": int(bad.size),
            "near_ties": int((gaps < 0.1).sum()), "mean_abs_diff": float(np.abs(ours - theirs).mean())}


def llama_logits(path, ids, one_by_one=False, flash_attn=False, n_batch=512) -> np.ndarray:
    """llama.cpp's logits (T, vocab) for ids, the oracle's settings (batched, or one token per eval)."""
    sys.path.insert(0, str(ROOT / "probes"))
    import oracle_agreement as oa
    ref = oa.llama_cpp_model(path, n_ctx=max(512, len(ids) + 16), n_batch=n_batch, logits_all=True,
                             flash_attn=flash_attn)
    ref.reset()
    for part in ([[t] for t in ids] if one_by_one else [ids]):
        ref.eval(part)
    return np.array(ref.scores[:len(ids)], dtype=F32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--off", default="", help="comma-separated roundings to switch off (of %s)" % ",".join(ROUNDINGS))
    ap.add_argument("--table", action="store_true", help="all on, each off alone, all off")
    ap.add_argument("--greedy", action="store_true", help="also greedy 32-token prefixes on the 10 prompts")
    ap.add_argument("--floor", action="store_true", help="llama.cpp against itself (batch vs one by one, FA)")
    ap.add_argument("--tokens", type=int, default=0, help="use only the first N tokens of the text")
    ap.add_argument("--sensitivity", action="store_true",
                    help="also compare each variant with itself computed with f32 instead of f64 sums")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "probes"))
    import oracle_agreement as oa

    from engine.paths import resolve_model
    from engine.tokenizer import Tokenizer
    path = resolve_model(args.model)
    tok = Tokenizer.from_gguf(path)
    ids = tok.encode(oa.TEXT_FILE.read_text(encoding="utf-8"))
    ids = ids[:args.tokens] if args.tokens else ids
    t0 = time.time()
    ref = llama_logits(path, ids)
    print(f"llama.cpp batch logits for {len(ids)} tokens [{time.time() - t0:.0f}s]", flush=True)
    if args.floor:
        for name, kw in (("one token per eval", {"one_by_one": True}), ("flash_attn=True batch", {"flash_attn": True}),
                         ("n_batch=64", {"n_batch": 64})):
            t0 = time.time()
            r = compare(llama_logits(path, ids, **kw), ref)
            print(f"llama.cpp {name} vs batch: top-1 {100 * r['rate']:.2f}% ({r['mismatches']} mismatches, "
                  f"{r['near_ties']} near ties), mean |diff| {r['mean_abs_diff']:.4f} [{time.time() - t0:.0f}s]",
                  flush=True)
    llama_greedy = []
    if args.greedy:
        lref = oa.llama_cpp_model(path, n_ctx=1024, n_batch=512, logits_all=True)
        llama_greedy = [oa._llama_greedy(lref, tok.encode_chat(m), 32, tok.stop_ids)[0] for m in oa.PROMPTS]
        del lref
    emu = Emulator(path)
    off = [s for s in args.off.split(",") if s]
    variants = [("all on", ())]
    if args.table:
        variants += [(f"{r} off", (r,)) for r in ROUNDINGS] + [("all off", ROUNDINGS)]
    elif off:
        variants = [("off: " + ",".join(off), tuple(off))]
    global SUM32
    for name, off_set in variants:
        on = tuple(r for r in ROUNDINGS if r not in off_set)
        t0 = time.time()
        SUM32 = False
        mine = emu.forward(ids, on)
        r = compare(mine, ref)
        line = (f"{name:12s} vs llama.cpp: top-1 {100 * r['rate']:.2f}% ({r['mismatches']} mismatches, "
                f"{r['near_ties']} near ties), mean |diff| {r['mean_abs_diff']:.4f}")
        if args.sensitivity:  # the same emulation with f32 (BLAS-order) sums: last-bit changes only
            SUM32 = True
            r = compare(emu.forward(ids, on), mine)
            SUM32 = False
            line += f"; f64 vs f32 sums: top-1 {100 * r['rate']:.2f}%, mean |diff| {r['mean_abs_diff']:.4f}"
        if args.greedy:
            same = 0
            for msgs, theirs in zip(oa.PROMPTS, llama_greedy):
                p = tok.encode_chat(msgs)
                same += oa._first_diff(emu.greedy(p, 32, tok.stop_ids, on), theirs) is None
            line += f"; greedy {same}/10"
        print(line + f" [{time.time() - t0:.0f}s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
