#!/usr/bin/env python3
"""Error of the cpu backend's Q4_1 matmul against the exact dot product of the dequantized weights with the
dequantized (8-bit) activations, in f64, for one SmolLM2 matrix and a heavy-tailed random activation row;
also the error that two block-term forms alone carry (xs = the f16 block sum of the quantized row):
  llama.cpp's   m * xs                  error m * (xs - sa * A)
  ours          (m + 8 d) * xs - 8 d sa A  error (m + 8 d) * (xs - sa * A)   (m + 8 d is small for most blocks)
Usage: PYTHONPATH=. probes/block_term_error.py [--tensor blk.5.ffn_down.weight]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from engine import paths  # noqa: E402
from engine.gguf import load_gguf  # noqa: E402
from engine.backends.cpu import fast as cpu_fast  # noqa: E402
from engine.quant import dequantize  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensor", default="blk.5.ffn_down.weight")
    qt = load_gguf(paths.resolve_model(None, None)).tensors[ap.parse_args().tensor]
    w = dequantize(qt).astype(np.float64)
    rows, cols = w.shape
    raw = np.ascontiguousarray(qt.data).view(np.uint8).reshape(rows, cols // 32, 20)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1, cols)) * np.exp(rng.standard_normal((1, cols)))).astype(np.float32)
    qa, sa, xs = np.zeros((1, cols), np.int8), np.zeros((1, cols // 32), np.float32), np.zeros((1, cpu_fast.XS * (cols // 32)), np.float32)
    cpu_fast.quantize_rows(qa, sa, xs, x)
    xq = (qa.astype(np.float64).reshape(-1, 32) * sa[0].astype(np.float64)[:, None]).reshape(-1)
    exact = w @ xq
    rounding = xs[0, cpu_fast.XS_SCALED::cpu_fast.XS].astype(np.float64) - sa[0].astype(np.float64) * qa.astype(np.int64).reshape(-1, 32).sum(1)
    out = np.zeros((1, rows), np.float32)
    cpu_fast.matmul(out, x, cpu_fast.prepare_weight(qt), cpu_fast.new_scratch(1, cols))
    rms = lambda v: float(np.sqrt(np.mean(v ** 2)))  # noqa: E731
    print(f"rms of the exact outputs {rms(exact):.4g}")
    print(f"block-term error alone: llama.cpp's m * xs {rms((m * rounding).sum(1)):.4g}, "
          f"ours (m + 8 d) * xs {rms(((m + 8 * d) * rounding).sum(1)):.4g}")
    print(f"our kernel vs exact: rms {rms(out[0] - exact):.4g}")


if __name__ == "__main__":
    main()
