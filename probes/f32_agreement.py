#!/usr/bin/env python3
"""Teacher-forced top-1 agreement of the cpu backend (8-bit activations, Q4_1 kernels) with our own f32 numpy
forward (backend "ref": dequantized weights, f32 activations) on the first N tokens of probes/oracle_text.txt.

Complements probes/oracle_agreement.py: llama.cpp is one rounding recipe; this is the distance to the model
without activation rounding. Usage: PYTHONPATH=. probes/f32_agreement.py [--tokens 1024]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "2")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from engine.api import Engine  # noqa: E402
from engine.config import EngineArgs  # noqa: E402


def logits(backend: str, n: int) -> np.ndarray:
    e = Engine.load(EngineArgs(threads=2, backend=backend, max_context=max(2048, n + 64)))
    ids = e.tokenizer.encode((ROOT / "probes" / "oracle_text.txt").read_text())[:n]
    cache = e.model.new_cache(n + 64)
    out = [e.model.forward(np.array(ids[c:c + 256], np.int32), c, cache, all_logits=True) for c in range(0, len(ids), 256)]
    return np.concatenate(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    n = ap.parse_args().tokens
    a, b = logits("cpu", n), logits("ref", n)
    print(f"top-1 vs f32 reference: {100 * np.mean(a.argmax(-1) == b.argmax(-1)):.2f}% of {len(a)} positions, "
          f"mean |logit diff| {np.abs(a - b).mean():.4f}")


if __name__ == "__main__":
    main()
