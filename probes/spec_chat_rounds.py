"""Where a speculative reply's time goes on chat: its decode blocks against its drafting rounds, per token.

On held-out chat the trained drafters read ~0.96-0.99x plain decode (bench/results-spec-*.md). This splits a
reply of each variant into the decode blocks its adaptive length ran where drafting would not pay, and the
rounds that drafted (the probes among them), and prints ms per token of each beside plain decode's, summed
over the held-out prompts (greedy, 128 tokens, 2 threads, prefix reuse off, as the speculative benchmark).
A block's tokens cost more than plain decode's by what the drafter does to follow the reply (it observes
every position); a drafting round pays when its ms per token is below plain decode's.

    PYTHONPATH=. .venv/bin/python probes/spec_chat_rounds.py [--heldout-n 16] [VARIANT ...]   (default
    mtp:3:hot dflash:7:hot)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="*", default=["mtp:3:hot", "dflash:7:hot"])
    ap.add_argument("--heldout", default="train/heldout.json")
    ap.add_argument("--heldout-n", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--sampled", action="store_true", help="the users' sampled preset instead of greedy")
    a = ap.parse_args()
    from engine.api import Engine
    from engine.bench.speculative import load_workloads, parse_variant, run_one
    from engine.config import EngineArgs
    eng = Engine.load(EngineArgs(threads=2, prefix_reuse=False, max_context=2048, draft_tokens=7))
    items = load_workloads([], [], a.heldout, a.heldout_n)
    keys = ("tok", "s", "rounds", "block_rounds", "block_tok", "draft_ms", "verify_ms", "block_ms")
    tot = {v: dict.fromkeys(keys, 0.0) for v in ["off", *a.variants]}
    for _, msgs in items:
        for v, d in tot.items():  # plain and each variant in turn, prompt by prompt
            st = run_one(eng, msgs, *parse_variant(v), a.max_new, a.sampled)
            d["tok"] += st.output_tokens
            d["s"] += st.output_tokens / st.decode_tok_s
            d["rounds"] += st.rounds
            d["block_rounds"] += st.block_rounds
            d["block_tok"] += st.block_tokens
            d["draft_ms"] += st.draft_ms
            d["verify_ms"] += st.verify_ms
            d["block_ms"] += st.block_ms
    off = tot["off"]
    plain = off["s"] * 1e3 / off["tok"]
    print(f"{len(items)} held-out prompts, {int(off['tok'])} tokens; plain decode {plain:.2f} ms/token")
    for v in a.variants:
        d = tot[v]
        spec_tok, spec_ms = d["tok"] - d["block_tok"], d["draft_ms"] + d["verify_ms"] - d["block_ms"]
        spec_rounds = d["rounds"] - d["block_rounds"]
        print(f"{v}: speedup {off['s'] / d['s']:.3f}x; decode blocks {int(d['block_rounds'])} "
              f"({int(d['block_tok'])} tok) {d['block_ms'] / max(d['block_tok'], 1):.2f} ms/token; "
              f"drafting rounds {int(spec_rounds)} "
              f"({int(spec_tok)} tok, {spec_tok / max(spec_rounds, 1):.2f} tok/round, drafting "
              f"{d['draft_ms'] / max(spec_rounds, 1):.2f} ms/round) {spec_ms / max(spec_tok, 1):.2f} ms/token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
