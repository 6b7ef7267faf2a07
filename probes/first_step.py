"""A fresh process's first reply, pass by pass: what the first passes cost beyond the same passes later.

    PYTHONPATH=. .venv/bin/python probes/first_step.py [--prompt-tokens 512] [--runs 6] [--trees DIR ...]
    PYTHONPATH=. .venv/bin/python probes/first_step.py --pages CTX [--steps 300]

Each run is a fresh process (this script's --child mode) that loads the engine, then, on a new KV cache,
runs the prompt's chunks and one decode step, and then the same again on a second new cache. The first
cache's extra cost over the second is what a fresh process pays once (memory touched for the first time,
lazy set-up). Per pass: wall ms, minor page faults, system CPU ms (both threads). With several --trees (git
worktrees or clones of this repo, each with a warm numba cache) the runs alternate between them (A-B-B-A...),
each tree running its own engine; medians per tree.

--pages CTX: what the KV cache's page size costs decode, in one process: a cache from the backend
(engine/backend.py zeros_sparse: 4 KiB pages) and one of plain numpy arrays (2 MiB pages where the kernel
gives them), both filled to CTX positions, then one-token steps alternated between them at CTX..CTX+39.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "FIRST_STEP "


def _usage():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter(), r.ru_minflt, r.ru_stime


def _timed(fn) -> dict:
    t0, f0, s0 = _usage()
    fn()
    t1, f1, s1 = _usage()
    return {"ms": 1e3 * (t1 - t0), "faults": f1 - f0, "sys_ms": 1e3 * (s1 - s0)}


def child(prompt_tokens: int) -> None:
    import numpy as np
    t = time.perf_counter()
    from engine.api import Engine
    from engine.config import EngineArgs
    eng = Engine.load(EngineArgs(threads=2))
    out = {"load_s": time.perf_counter() - t}
    m = eng.model
    ids = np.random.default_rng(0).integers(100, 40000, prompt_tokens).astype(np.int32)
    chunk = eng.args.prefill_chunk
    for name in ("first", "second"):
        cache = m.new_cache(eng.capacity, eng.args.kv_dtype)

        def prefill():
            for s in range(0, prompt_tokens, chunk):
                m.forward(ids[s:s + chunk], s, cache)
        out[f"{name}_prefill"] = _timed(prefill)
        out[f"{name}_step"] = _timed(lambda: m.forward(ids[:1], prompt_tokens, cache))
    print(TAG + json.dumps(out), flush=True)


def pages(ctx: int, steps: int) -> None:
    import numpy as np
    from engine.api import Engine
    from engine.config import EngineArgs
    from engine.kv_cache import KVCache
    eng = Engine.load(EngineArgs(threads=2))
    m, a = eng.model, eng.model.args

    class NumpyZeros:  # the backend's memory, but plain numpy arrays for the cache
        zeros_sparse = staticmethod(np.zeros)
        kv_group = staticmethod(m.be.kv_group)
    caches = {"4 KiB (zeros_sparse)": m.new_cache(eng.capacity, "f16"),
              "numpy zeros": KVCache(NumpyZeros(), a.n_layer, eng.capacity, a.n_kv_head, a.head_dim, "f16")}
    ids = np.random.default_rng(0).integers(100, 40000, ctx).astype(np.int32)
    for c in caches.values():
        for s in range(0, ctx, eng.args.prefill_chunk):
            m.forward(ids[s:s + eng.args.prefill_chunk], s, c)
    ms = {k: [] for k in caches}
    tok = np.array([7], np.int32)
    for i in range(steps):
        for name in (list(caches) if i % 2 == 0 else list(caches)[::-1]):
            c = caches[name]
            if c.length >= ctx + 40:
                c.truncate(ctx)
            t = time.perf_counter()
            m.forward(tok, c.length, c)
            ms[name].append(1e3 * (time.perf_counter() - t))
    for name, v in ms.items():
        print(f"context {ctx}-{ctx + 39}, KV in {name}: median {statistics.median(v):.3f} ms per step, "
              f"mean {statistics.fmean(v):.3f} ({steps} steps)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=6, help="fresh processes per tree")
    ap.add_argument("--trees", nargs="*", default=[ROOT], help="repo checkouts to alternate (default: this one)")
    ap.add_argument("--pages", type=int, metavar="CTX", help="decode at CTX with 4 KiB vs numpy's KV pages")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.pages:
        pages(a.pages, a.steps)
        return 0
    if a.child:
        child(a.prompt_tokens)
        return 0
    trees = [os.path.abspath(t) for t in a.trees]
    got: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(a.runs):
        for tree in (trees if r % 2 == 0 else trees[::-1]):
            env = dict(os.environ, PYTHONPATH=tree)
            here = os.path.join(tree, "probes", "first_step.py")  # a checkout from before probes/: scripts/
            script = here if os.path.exists(here) else os.path.join(tree, "scripts", "first_step.py")
            p = subprocess.run([sys.executable, script, "--child",
                                "--prompt-tokens", str(a.prompt_tokens)], cwd=tree, env=env,
                               capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith(TAG)]
            if p.returncode != 0 or not line:
                sys.exit(f"run in {tree} failed: {p.stderr.strip().splitlines()[-1:]}")
            got[tree].append(json.loads(line[0][len(TAG):]))
    print(f"{a.prompt_tokens}-token prompt, {a.runs} fresh processes per tree, medians "
          "(ms / minor faults / system ms):")
    for tree, runs in got.items():
        med = lambda k, f: statistics.median(x[k][f] for x in runs)  # noqa: E731
        cells = [f"load {statistics.median(x['load_s'] for x in runs):.3f} s"]
        for k in ("first_prefill", "second_prefill", "first_step", "second_step"):
            cells.append(f"{k} {med(k, 'ms'):.1f} / {med(k, 'faults'):.0f} / {med(k, 'sys_ms'):.0f}")
        print(f"  {tree}: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
