"""What rounding Q4_K's sub-block scales and mins to f16 (engine/backends/cpu/kquant.py: Q4_K as Q4_1 blocks)
costs, on a model file's Q4_K tensors:

1. per tensor, the matmul error the rounding adds (quantized activations, the rounded weights against the
   exact ones) relative to the error of the activations' own int8 rounding (rms, random activations with a
   few outlier channels);
2. the KL divergence it adds to the whole model: the ref backend (f32 activations) with the exact Q4_K
   weights against the same with the rounded ones, next to the cpu backend's own KL against that truth, on
   the first N tokens of probes/oracle_text.txt.

    PYTHONPATH=. .venv/bin/python probes/kquant_error.py MODEL.Q4_K_M.gguf --tokens 256
"""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np

from engine.backends.cpu import fast, kquant
from engine.gguf_types import GGMLQuantizationType as QT
from engine.quant import QTensor, dequantize


def rounded(qt: QTensor) -> QTensor:
    """A Q4_K tensor as the Q4_1 blocks the cpu backend runs."""
    raw = np.ascontiguousarray(qt.data).view(np.uint8).reshape(qt.shape[0], -1)
    return QTensor(qt.name, QT.Q4_1, tuple(qt.shape), kquant.q4k_as_q41(raw))


def matmul_errors(tensors) -> None:
    rng = np.random.default_rng(0)
    ratios, werr = [], []
    for qt in tensors:
        w, wr = dequantize(qt).astype(np.float64), dequantize(rounded(qt)).astype(np.float64)
        werr.append(np.sqrt(((wr - w) ** 2).mean() / (w ** 2).mean()))
        n = qt.shape[1]
        x = (rng.standard_normal((16, n)) * (1 + 3 * (rng.random(n) < 0.02))).astype(np.float32)
        qa, sa, xs = np.zeros((16, n), np.int8), np.zeros((16, n // 32), np.float32), np.zeros((16, fast.XS * (n // 32)), np.float32)
        fast.quantize_rows(qa, sa, xs, x)
        xq = (qa.reshape(16, -1, 32) * sa[..., None].astype(np.float64)).reshape(16, n)
        y, yq, yr = x.astype(np.float64) @ w.T, xq @ w.T, xq @ wr.T
        ratios.append(np.sqrt(((yr - yq) ** 2).mean() / ((yq - y) ** 2).mean()))
    print(f"{len(ratios)} Q4_K tensors: rms weight error of the f16 scales / rms weight {np.mean(werr):.2e} "
          f"(max {np.max(werr):.2e}); matmul error they add / the activations' int8 error: mean "
          f"{np.mean(ratios):.3f}, max {np.max(ratios):.3f}")


def kl(path: str, n: int) -> None:
    from engine.api import Engine
    from engine.backends.kernels import get_kernels
    from engine.config import EngineArgs
    text = (ROOT / "probes" / "oracle_text.txt").read_text()

    def logits(backend):
        e = Engine.load(EngineArgs(model=path, threads=2, backend=backend, max_context=max(2048, n + 64)))
        ids = e.tokenizer.encode(text)[:n]
        cache = e.model.new_cache(n + 64)
        return np.concatenate([e.model.forward(np.array(ids[c:c + 64], np.int32), c, cache, all_logits=True)
                               for c in range(0, len(ids), 64)]).astype(np.float64)

    def lsm(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    def mean_kl(p, q):
        p, q = lsm(p), lsm(q)
        return (np.exp(p) * (p - q)).sum(-1).mean()
    ref = get_kernels("ref")
    exact = logits("ref")
    orig = ref.prepare_weight
    ref.prepare_weight = lambda qt: orig(rounded(qt) if qt.qtype == QT.Q4_K else qt)
    try:
        rnd = logits("ref")
    finally:
        ref.prepare_weight = orig
    cpu = logits("cpu")
    print(f"{len(exact)} tokens: mean KL(exact Q4_K || f16-rounded), both f32 activations: {mean_kl(exact, rnd):.3e}; "
          f"mean KL(ref || cpu backend): {mean_kl(exact, cpu):.3e}; top-1 rounded vs exact "
          f"{100 * np.mean(exact.argmax(-1) == rnd.argmax(-1)):.2f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a GGUF file with Q4_K tensors (e.g. scripts/make_q4km.py's copy)")
    ap.add_argument("--tokens", type=int, default=256)
    a = ap.parse_args()
    from engine.gguf import load_gguf
    ts = [t for t in load_gguf(a.model).tensors.values() if t.qtype == QT.Q4_K]
    if not ts:
        sys.exit(f"{a.model}: no Q4_K tensors")
    matmul_errors(ts)
    kl(a.model, a.tokens)


if __name__ == "__main__":
    main()
