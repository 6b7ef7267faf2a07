"""Where a DFlash drafting round's time goes (issue 44's draft cost), at context ~200 on the default model.

    PYTHONPATH=. .venv/bin/python probes/dflash_round_parts.py [--k 7] [--repeats 40] [--hot]

Runs engine.bench.speculative.draft_cost's loop (propose k, a real target pass of 2 tokens, observe them) with
timers around DFlashDrafter's parts: the catch-up (kv_rows: the taps read from the target's cache; add_context:
the context rows' fc, norm and each draft layer's K/V), the block forward (draft: the layers before the last,
the last layer, the head) and the rest of propose (argmax, tokens). Prints the medians in microseconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import numba_env  # noqa: F401,E402  (flags before numba)
from probe_timers import time_calls  # noqa: E402

import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--ctx", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--full-head", action="store_true", help="all head rows (default: the hot vocabulary)")
    a = ap.parse_args()
    import numba
    numba.set_num_threads(a.threads)
    from engine.api import Engine
    from engine.config import EngineArgs
    from engine.spec import SpecRound, dflash
    from engine.bench.speculative import variant_round

    engine = Engine.load(EngineArgs(prefix_reuse=False, max_context=2048))
    rnd = variant_round(engine, "dflash", a.k, frozenset({"fixed"} | (set() if a.full_head else {"hot"})))
    drafter, m = rnd.drafter, engine.model
    net = drafter.net
    acc: dict[str, list[float]] = defaultdict(list)
    cur: dict[str, float] = defaultdict(float)

    time_calls(dflash, "kv_rows", cur, "catch-up: kv_rows")
    time_calls(net, "add_context", cur, "catch-up: add_context")
    time_calls(net, "_layer", cur, "draft: layers")
    time_calls(net, "_attention", cur, "draft: attention (all layers)")
    time_calls(net.be, "matmul", cur, "matmuls (all)")
    be_mm = net.be.matmul

    def mm(out, x, w, scratch):  # each matmul by its shape: rows x in -> out
        t0 = time.perf_counter()
        be_mm(out, x, w, scratch)
        cur[f"  matmul {x.shape[0]} x {x.shape[1]} -> {out.shape[1]}"] += time.perf_counter() - t0
    net.be.matmul = mm
    time_calls(net, "draft", cur, "draft (block forward + head)")
    time_calls(drafter, "propose", cur, "propose (all)")
    time_calls(drafter, "observe", cur, "observe")

    rng = np.random.default_rng(0)
    n = a.ctx + 2 * a.repeats + 2
    toks = rng.integers(10, 1000, n).astype(np.int32).tolist()
    cache = m.new_cache(n + 4, engine.args.kv_dtype)
    sr = SpecRound(drafter, a.k)
    sr.begin()
    layers = sr.capture
    m.forward(np.asarray(toks[:a.ctx], np.int32), 0, cache, capture=layers)
    sr.observe_prefill(toks[:a.ctx], {i: m.captured[i] for i in layers})
    for r in range(a.repeats):
        pos = a.ctx + 2 * r
        drafter.bind_target(m, cache)
        cur.clear()
        drafter.propose(toks[:pos + 1], a.k, None)
        m.forward(np.asarray(toks[pos:pos + 2], np.int32), pos, cache, all_logits=True, capture=layers)
        drafter.observe(toks[pos:pos + 2], {i: m.captured[i] for i in layers})
        if r >= 3:
            for key, v in cur.items():
                acc[key].append(v)
    print(f"DFlash round parts, k={a.k}, context {a.ctx}, {a.threads} threads, median us over {a.repeats - 3}:")
    for key in sorted(acc):
        print(f"  {key:34s} {1e6 * statistics.median(acc[key]):8.1f}")


if __name__ == "__main__":
    main()
