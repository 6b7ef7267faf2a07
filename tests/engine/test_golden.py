"""Every output of the default model bit-identical to what the tree before the forward/backends redesign
computed (tests/engine/golden/, recorded by tests/engine/golden_outputs.py from that tree): whole replies
(greedy, seeded sampling with penalties, n-gram speculation, prefix reuse), an int8 cache, the numpy
reference backend, TP2 over two CPU devices, and the logits of each runner's passes.

The bits depend on the instruction set the kernels are compiled for: attention's scores sum in 16 lanes
where the target has AVX-512 (attn_avx2.SCORE_LANES), the int8 cache's scores in integer dot products where
it has AVX512-VNNI, and numpy (the reference backend) dispatches its own SIMD loops. So there is one
recording per instruction set: smollm2.json from an AVX2-only host (Zen 3), smollm2-avx512.json from an
AVX-512 + AVX512-VNNI host (a Xeon, 2026-12-06), both from the tree before the redesign (31b77c2)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from golden_outputs import CASES, run_case  # noqa: E402



def _recording() -> Path | None:
    """The recorded outputs for the instruction set this host's kernels compile for, or None."""
    from engine.backends.cpu.target import isa
    name = {"avx2": "smollm2.json", "avx512-vnni": "smollm2-avx512.json"}.get(isa())
    return HERE / "golden" / name if name else None


GOLDEN_FILE = _recording()
GOLDEN = json.loads(GOLDEN_FILE.read_text()) if GOLDEN_FILE is not None else None


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_equal_the_recorded_tree(case, smollm2_path):
    if GOLDEN is None:
        pytest.skip("no recording for this instruction set (AVX-512 without VNNI, or no AVX2): record one with "
                    "golden_outputs.py from the tree before the redesign")
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

