"""Every output of the default model bit-identical to what the tree before the forward/backends redesign
computed (tests/engine/golden/smollm2.json, recorded by tests/engine/golden_outputs.py from that tree):
whole replies (greedy, seeded sampling with penalties, n-gram speculation, prefix reuse), an int8 cache,
the numpy reference backend, TP2 over two CPU devices, and the logits of each runner's passes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from golden_outputs import CASES, run_case  # noqa: E402

GOLDEN = json.loads((HERE / "golden" / "smollm2.json").read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_equal_the_recorded_tree(case, smollm2_path):
    got = run_case(case)
    want = GOLDEN[case]
    assert got["logits"] == want["logits"]
    for i, (g, w) in enumerate(zip(got["replies"], want["replies"])):
        assert g == w, (case, i)
    assert len(got["replies"]) == len(want["replies"])
    assert got.get("turn2") == want.get("turn2")
    # TP2 vs TP1 on this model: the all-reduce sums partial projections, so the logits differ in the last
    # bits and greedy prompt 0 flips a near tie at token 19, in the old tree as in this one (TP2 == TP1 tokens
    # on tiny models: test_tp.py; TP2 == its own recorded outputs: here)

