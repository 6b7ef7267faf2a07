"""One measured run in its own process, so peak RSS, JIT state and threads belong to that variant alone.

    python -m engine.bench.worker < run.json      # prints one line: BENCH_RESULT {json}

The parent passes the wall-clock time it spawned us (NINFER_BENCH_T0) so time-to-first-token includes the
interpreter start, imports, model load and (cold) compilation: what a user waits for after pressing Enter.
Prefix reuse is always off (each run starts from an empty cache) for repeatability.
"""
from __future__ import annotations

import hashlib
import json
import os
import resource
import sys
import time

RESULT_TAG = "BENCH_RESULT "

# Tokens after the first one that a reply's "steady" decode rate leaves out. After an idle spell this host's
# memory reads ramp up over ~10-20 ms of traffic (probes/memory_ramp.py: the bandwidth probe's first passes
# read 32-34 GB/s against 50-54 once warm; a decode step after 0.2 s idle ~5 ms against 2.6), so every
# reply's first ~10 tokens decode slower. The probe reports the warm rate: the roofline share that compares
# like with like is the steady rate's.
RAMP_TOKENS = 16


def steady_rate(marks: list[tuple[int, float]]) -> float | None:
    """Decode tok/s after the ramp from (tokens so far, time) marks in order, the last one the reply's end:
    from the first mark past 1 + RAMP_TOKENS tokens to the last; None when fewer than 8 tokens follow it."""
    cut = next((m for m in marks if m[0] >= 1 + RAMP_TOKENS), None)
    if cut is None or marks[-1][0] - cut[0] < 8 or marks[-1][1] <= cut[1]:
        return None
    return (marks[-1][0] - cut[0]) / (marks[-1][1] - cut[1])


def _peak_rss() -> int:
    """Peak resident set size of this process in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _since_spawn(t0_wall: float) -> float:
    return time.time() - t0_wall


# ------------------------------------------------------------------------------------------------ ours
def run_ours(run, t0_wall: float) -> dict:
    """Our engine: Engine.load, then the workload through the product's reply loop (Session.generate, or
    generate_ids for the synthetic token prompt): its decode blocks, speculation and statistics."""
    from .. import numba_env  # noqa: F401  (flags before numba is imported)
    from ..api import Engine
    from ..config import EngineArgs, GenerateRequest, SamplingParams, ThinkingParams
    from ..events import FinalStats, ReasoningDelta, StepStats, TextDelta

    v, w = run.variant, run.workload
    args = EngineArgs(**{"model": run.model, "threads": v.threads, "prefix_reuse": False,
                         "max_context": run.max_context, **v.engine})  # a variant's max_context wins
    t = time.perf_counter()
    eng = Engine.load(args)
    out = {"load_s": time.perf_counter() - t, "warmup_s": getattr(eng.model, "warmup_s", None)}
    session = eng.session()
    session.stats_interval_s = 0.0  # a StepStats every round: the steady rate's marks
    sp = SamplingParams(greedy=w.greedy, temperature=0.0 if w.greedy else w.temperature, top_p=w.top_p,
                        top_k=w.top_k, seed=w.seed, max_new=w.decode_tokens,
                        presence_penalty=w.greedy_presence_penalty if w.greedy else w.presence_penalty)
    first = None
    fs = None
    marks: list[tuple[int, float]] = []
    if w.mode == "synthetic":  # the token prompt as it is, exactly decode_tokens tokens (no end-of-text stop)
        events = session.generate_ids(w.prompt_ids, GenerateRequest(sampling=sp))
    else:
        req = GenerateRequest(sampling=sp, thinking=ThinkingParams(budget=w.thinking_budget))
        events = session.generate(w.messages, req)
    for ev in events:
        if first is None and isinstance(ev, (TextDelta, ReasoningDelta)):
            first = _since_spawn(t0_wall)
        if isinstance(ev, StepStats):
            marks.append((ev.output_tokens, time.perf_counter()))
        if isinstance(ev, FinalStats):
            fs = ev
            marks.append((ev.output_tokens, time.perf_counter()))
    out.update(decode_steady_tok_s=steady_rate(marks), prompt_tokens=fs.prompt_tokens,
               output_tokens=fs.output_tokens, prefill_tok_s=fs.prefill_tok_s,
               ttft_s=first if first is not None else _since_spawn(t0_wall), decode_tok_s=fs.decode_tok_s,
               ms_per_round=fs.ms_per_round or (1e3 / fs.decode_tok_s if fs.decode_tok_s else None),
               tokens_per_round=fs.tokens_per_round or 1.0, acceptance=fs.acceptance if fs.drafted else None,
               rounds=fs.rounds, finish_reason=fs.finish_reason, output_sha256=fs.output_sha256,
               token_ids=list(fs.token_ids[:64]), wall_s=fs.wall_s, reasoning_tokens=fs.reasoning_tokens,
               thinking_forced=fs.thinking_forced)
    return out


# ------------------------------------------------------------------------------------------- llama.cpp
def run_llama_cpp(run, t0_wall: float) -> dict:
    """The peer: llama-cpp-python with n_threads = n_threads_batch = the variant's threads."""
    import numpy as np
    from llama_cpp import Llama

    v, w = run.variant, run.workload
    t = time.perf_counter()
    llm = Llama(model_path=run.model, n_threads=v.threads, n_threads_batch=v.threads, n_ctx=run.max_context,
                n_batch=512, n_ubatch=512, logits_all=False, verbose=False, seed=w.seed)
    out = {"load_s": time.perf_counter() - t}
    try:
        import llama_cpp
        out["peer_info"] = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
        out["peer_version"] = getattr(llama_cpp, "__version__", "?")
    except Exception:  # pragma: no cover - informational only
        pass
    if w.mode == "synthetic":
        ids = list(w.prompt_ids)
        t = time.perf_counter()
        llm.eval(ids)
        tok = int(np.argmax(_last_logits(llm)))
        t_pf = time.perf_counter() - t
        ttft = _since_spawn(t0_wall)
        gen = [tok]
        steps = np.zeros(w.decode_tokens - 1, np.float64)
        t = time.perf_counter()
        for i in range(w.decode_tokens - 1):
            ts = time.perf_counter()
            llm.eval([tok])
            tok = int(np.argmax(_last_logits(llm)))
            gen.append(tok)
            steps[i] = time.perf_counter() - ts
        t_dec = time.perf_counter() - t
        text = llm.detokenize(gen).decode("utf-8", errors="replace")
        out.update(prompt_tokens=len(ids), output_tokens=len(gen), prefill_s=t_pf, prefill_tok_s=len(ids) / t_pf,
                   ttft_s=ttft, decode_s=t_dec, decode_tok_s=(len(gen) - 1) / t_dec,
                   decode_steady_tok_s=steady_rate(list(zip(range(2, len(gen) + 1), np.cumsum(steps)))),
                   ms_per_round=float(np.mean(steps) * 1e3), ms_per_round_p90=float(np.percentile(steps, 90) * 1e3),
                   tokens_per_round=1.0, output_sha256=hashlib.sha256(text.encode()).hexdigest(),
                   token_ids=gen[:64], text_head=text[:120])
        return out
    if w.greedy:
        kw = dict(temperature=0.0, top_k=1, presence_penalty=w.greedy_presence_penalty)
    else:
        kw = dict(temperature=w.temperature, top_p=w.top_p, top_k=w.top_k, presence_penalty=w.presence_penalty)
    t = time.perf_counter()
    first = t_first = None
    parts = []
    marks: list[tuple[int, float]] = []  # (chunks so far, time): a streamed chunk is one token
    for chunk in llm.create_chat_completion(messages=w.messages, max_tokens=w.decode_tokens, stream=True,
                                            seed=w.seed, **kw):
        delta = chunk["choices"][0].get("delta", {}).get("content")
        if delta:
            if first is None:
                first, t_first = _since_spawn(t0_wall), time.perf_counter()
            parts.append(delta)
            marks.append((len(parts), time.perf_counter()))
    t_end = time.perf_counter()
    text = "".join(parts)
    n_out = len(llm.tokenize(text.encode(), add_bos=False, special=True)) if text else 0
    dec_s = t_end - (t_first or t_end)
    out.update(output_tokens=n_out, ttft_s=first, decode_tok_s=(n_out - 1) / dec_s if dec_s > 0 else None,
               decode_steady_tok_s=steady_rate(marks) if marks else None,
               ms_per_round=dec_s * 1e3 / max(n_out - 1, 1), tokens_per_round=1.0,
               output_sha256=hashlib.sha256(text.encode()).hexdigest(), wall_s=t_end - t)
    return out


def _last_logits(llm):
    """Logits of the last evaluated position: the context's output buffer (without logits_all,
    llama-cpp-python >= 0.3 computes logits for the last position of each batch only, row 0 of it)."""
    import numpy as np
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def main() -> int:
    from .variants import Run
    t0_wall = float(os.environ.get("NINFER_BENCH_T0", time.time()))
    run = Run.from_json(sys.stdin.read())
    try:
        res = (run_ours if run.variant.kind == "ours" else run_llama_cpp)(run, t0_wall)
        res["ok"] = True
    except Exception as e:  # reported, not raised: one failing variant must not kill the whole bench
        import traceback
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    res.update(variant=run.variant.name, repeat=run.repeat, peak_rss=_peak_rss(),
               threading_layer=_threading_layer())
    sys.stdout.write(RESULT_TAG + json.dumps(res) + "\n")
    sys.stdout.flush()
    return 0 if res["ok"] else 1


def _threading_layer():
    if "numba" not in sys.modules:
        return None
    try:
        import numba
        return numba.threading_layer()
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
