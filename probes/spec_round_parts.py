"""Where a drafting round's time goes in a real reply: the drafter's parts and the verify's.

    PYTHONPATH=. .venv/bin/python probes/spec_round_parts.py [--workload count300_plain_en.json] [VARIANT ...]
    (default dflash:7:hot)

Runs engine.bench.speculative.run_one (greedy, 2 threads, prefix reuse off) with timers around the round's
steps (engine/spec/round.spec_round): the drafter's propose (for DFlash also its catch-up and block forward),
the target's pass (model.forward over [last, drafts], its logits and captured rows), verify (the chooser per
row) and the drafter's observe, and prints each one's mean ms per drafting round beside the round's own
draft_ms / verify_ms. What is left of verify_ms after the pass, verify and observe is the round's Python.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="*", default=["dflash:7:hot"])
    ap.add_argument("--workload", default="count300_plain_en.json")
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    from engine.api import Engine
    from engine.bench.speculative import load_workloads, parse_variant, run_one
    from engine.config import EngineArgs
    from engine.spec import dflash, round as sr
    from probe_timers import time_calls
    eng = Engine.load(EngineArgs(threads=2, prefix_reuse=False, max_context=2048, draft_tokens=7))
    (_, msgs), = load_workloads([a.workload], [], None, 0)
    acc: dict[str, float] = defaultdict(float)

    time_calls(sr, "target_forward", acc, "verify: target pass")
    time_calls(sr, "verify", acc, "verify: chooser rows")
    time_calls(dflash.DFlashDrafter, "_catch_up", acc, "draft: catch-up")
    time_calls(dflash.DFlashNet, "draft", acc, "draft: block forward + head")
    time_calls(dflash.DFlashDrafter, "propose", acc, "draft: DFlash propose")
    time_calls(dflash.DFlashDrafter, "observe", acc, "verify: DFlash observe")
    time_calls(eng.model, "forward", acc, "model.forward (any)")
    for v in a.variants:
        for rep in range(a.repeats):
            acc.clear()
            st = run_one(eng, msgs, *parse_variant(v), a.max_new)
            n = max(st.rounds - st.block_rounds, 1)
            print(f"{v} rep {rep}: {st.output_tokens} tok, {st.decode_tok_s:.1f} tok/s, {st.rounds} rounds "
                  f"({st.block_rounds} blocks), draft_ms {st.draft_ms / n:.3f} verify_ms "
                  f"{(st.verify_ms - st.block_ms) / n:.3f} per drafting round")
            for key in sorted(acc):
                print(f"  {key:32s} {1e3 * acc[key] / n:7.3f} ms/round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
