"""Decode attention A/B: the attention kernel alone (all layers) and the whole fused decode step, old vs
new, alternated in one process at several context lengths.

"old" is attention_f16_split as it was at --base (its source is read from git and loaded as a module);
"new" is engine.kernels.cpu_attn. The whole-step comparison runs two copies of the fused step that differ
only in the attention they call (fused_forward recompiled with another `_attend`). Timings are per token
(30 layers for SmolLM2-135M); min and median over alternated repetitions.

    NUMBA_NUM_THREADS=2 .venv/bin/python scripts/attn_bench.py [--ctx 64 600 1500] [--reps 30]
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import types as pytypes
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine.numba_env  # noqa: E402,F401  (flags before numba)

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import types  # noqa: E402
from numba.extending import overload  # noqa: E402

OLD_NAMES = ("_LOG2E", "exp_fast", "_h2f", "SPLITS", "attention_f16_split")


def load_old_attention(rev: str):
    """attention_f16_split (and what it uses) from engine/kernels/cpu_fast_step.py at git revision rev."""
    src = subprocess.run(["git", "show", f"{rev}:engine/kernels/cpu_fast_step.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    start = src.index("F32 = np.float32")
    end = src.index("@njit(cache=True, nogil=True, fastmath=True)\ndef swiglu_fast")
    body = src[start:end]
    if "def attention_f16_split" not in body:
        raise SystemExit(f"{rev}: no attention_f16_split in cpu_fast_step.py")
    head = "import numba\nimport numpy as np\nfrom numba import njit, prange\n\n"
    path = Path(tempfile.mkdtemp(prefix="attn_old_")) / "attn_old.py"
    path.write_text(head + body)
    spec = importlib.util.spec_from_file_location("attn_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fused_with(attention):
    """A copy of cpu_fast_step.fused_forward whose f16 attention is `attention` (same signature)."""
    from engine.kernels import cpu_fast_step as cfs

    def attend(a3, q3, k3, v3, kv, l, pos0, scale, scr):
        raise NotImplementedError

    @overload(attend)
    def _attend_impl(a3, q3, k3, v3, kv, l, pos0, scale, scr):
        if not (isinstance(kv, types.UniTuple) and kv.count == 2):
            return None

        def f16(a3, q3, k3, v3, kv, l, pos0, scale, scr):
            cfs.store_f16(kv[0][l], k3, pos0)
            cfs.store_f16(kv[1][l], v3, pos0)
            attention(a3, q3, kv[0][l], kv[1][l], pos0, scale, scr[0], scr[1], scr[2])
        return f16

    py = cfs.fused_forward.py_func
    g = dict(py.__globals__)
    g["_attend"] = attend
    return numba.njit(nogil=True)(pytypes.FunctionType(py.__code__, g, py.__name__ + "_bench"))


def timed(fn, reps_inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps_inner):
        fn()
    return (time.perf_counter() - t0) / reps_inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[64, 600, 1500])
    ap.add_argument("--reps", type=int, default=30, help="alternated repetitions per context")
    ap.add_argument("--base", default="a0846fb^", help="git revision holding the old attention")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    from engine.api import Engine
    from engine.config import EngineArgs
    from engine.kernels import cpu_attn

    numba.set_num_threads(a.threads)
    old = load_old_attention(a.base)
    eng = Engine.load(EngineArgs(max_context=max(a.ctx) + 8, threads=a.threads))
    model = eng.model
    ff = getattr(model.fused, "ff", model.fused)  # the FusedForward under a tiered-compile wrapper
    if ff is None:
        raise SystemExit("the default model did not get a fused CPU step")
    margs = model.args
    cache = model.new_cache(max(a.ctx) + 8, "f16")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, margs.vocab_size, max(a.ctx), dtype=np.int32)
    for p0 in range(0, len(prompt), 256):  # fill the cache with real keys/values
        ff.run(prompt[p0:p0 + 256], p0, cache, 1)
    kv = ff.kv_tuple(cache)
    scr = ff._attn_scratch(cache.capacity)
    steps = {"old": fused_with(old.attention_f16_split), "new": fused_with(cpu_attn.attention_f16_split)}
    kernels = {"old": old.attention_f16_split, "new": cpu_attn.attention_f16_split}
    r = ff.roles
    L, H, hd = margs.n_layer, margs.n_head, margs.head_dim
    q = rng.standard_normal((1, H, hd)).astype(np.float32)
    out = np.zeros_like(q)
    scale = np.float32(model.attn_scale)
    tok = np.array([7], np.int32)

    def step_fn(name, pos):
        f = steps[name]
        return lambda: f(tok, pos, 1, ff.bufs, ff.emb, ff.head, ff.norms, ff.rope, r["wq"], r["wk"], r["wv"],
                         r["wo"], r["w_gate"], r["w_up"], r["w_down"], ff.bias, ff.qk_norm, kv, scr)

    def attn_fn(name, pos):
        f = kernels[name]

        def run():
            for layer in range(L):
                f(out, q, kv[0][layer], kv[1][layer], pos, scale, *scr)
        return run

    print(f"model {eng.name}: {L} layers, {H} q heads / {margs.n_kv_head} kv heads, hd {hd}; "
          f"threads {numba.get_num_threads()}; old = {a.base}")
    for name in steps:  # compile both outside the timing
        step_fn(name, 1)()
        attn_fn(name, 1)()
    print(f"{'ctx':>5} {'what':>9} {'old min':>9} {'new min':>9} {'old med':>9} {'new med':>9}  (ms/token)"
          f"  -> tok/s old / new (median step)")
    for ctx in a.ctx:
        pos = ctx - 1  # the step at position ctx - 1 attends over ctx positions
        res = {(w, n): [] for w in ("attention", "step") for n in steps}
        for _ in range(a.reps):
            for n in steps:
                res[("attention", n)].append(timed(attn_fn(n, pos), 3))
                res[("step", n)].append(timed(step_fn(n, pos), 3))
        for w in ("attention", "step"):
            o, nw = res[(w, "old")], res[(w, "new")]
            line = (f"{ctx:>5} {w:>9} {min(o) * 1e3:9.3f} {min(nw) * 1e3:9.3f} "
                    f"{statistics.median(o) * 1e3:9.3f} {statistics.median(nw) * 1e3:9.3f}")
            if w == "step":
                line += f"  -> {1 / statistics.median(o):6.1f} / {1 / statistics.median(nw):6.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
