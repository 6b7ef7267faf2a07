"""Time one matmul (engine/backends/cpu/fast.py's `matmul`, as the plain walk calls it) per weight type and row
count T: the K-quant / Q5 kernels (kquant.py) against the generic fallback (kernels.py: float activations, each
row dequantized) and against the Q4_1 / Q8_0 fast kernels of the same shape.

N random matrices of one shape are swept per timing (their bytes well past the L3), so the weights stream
from memory as in a forward pass; the fastest of --repeats sweeps is kept and the variants alternate (A B A
B ...) so a shared machine's load hits all alike. Columns: us per matrix, GB/s of the bytes the kernel reads
(its layout) and of the GGUF bytes of the same matrix (what the file holds), and x the generic fallback.

    NUMBA_NUM_THREADS=2 PYTHONPATH=. .venv/bin/python probes/kquant_bench.py --shape 3072x1024 --t 1 8 64

--decode FILE [FILE ...]: instead, ms per decoded token of each model file through the plain walk
(engine.model's kernel-by-kernel forward, what a model with K-quant / Q5 matrices runs) and, where it applies,
the fused step (Q4_0 / Q4_1 / Q8_0 models), alternating; separates the kernels from the runner.
"""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np

from engine import numba_env  # noqa: F401  (flags before numba)
from engine.backends.cpu import fast
from engine.backends.cpu import kernels as generic
from engine.gguf_types import GGMLQuantizationType as QT
from engine.quant import SUPPORTED, QTensor

TYPES = ["Q4_1", "Q8_0", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"]


def random_qtensor(rng, qtype, rows, cols, name="w"):
    """Random blocks of qtype with realistic f16 scales (weights ~0.02-0.05): every value pattern occurs."""
    bs, bb = SUPPORTED[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // bs, bb), dtype=np.uint8)

    def halves(n, scale, sign=1.0):
        return (sign * rng.random((rows, cols // bs, n)) * scale).astype(np.float16).view(np.uint8)
    if qtype in (QT.Q4_0, QT.Q8_0, QT.Q5_0):
        raw[..., 0:2] = halves(1, 0.004)
    elif qtype in (QT.Q4_1, QT.Q5_1):
        raw[..., 0:2], raw[..., 2:4] = halves(1, 0.004), halves(1, 0.05, -1.0)
    elif qtype in (QT.Q4_K, QT.Q5_K):
        raw[..., 0:4] = halves(2, 0.0002)
    elif qtype == QT.Q6_K:
        raw[..., 192:208] = rng.integers(-40, 41, size=(rows, cols // bs, 16)).astype(np.int8).view(np.uint8)
        raw[..., 208:210] = halves(1, 0.0002)
    return QTensor(name, qtype, (rows, cols), raw.reshape(rows, -1))


def kernel_bytes(w) -> int:
    if hasattr(w, "blocks"):
        return w.blocks.nbytes
    return sum(a.nbytes for a in w.arrays)


def decode(paths, n_tokens: int, repeats: int) -> None:
    """ms per decoded token (greedy, after a 32-token prompt) of each file: plain walk and fused step."""
    from engine.backends.cpu import build_model
    from engine.backends.cpu.step import build
    from engine.gguf import load_gguf
    variants = {}
    for p in paths:
        model = build_model(load_gguf(p), 8)
        name = Path(p).name
        variants[f"{name} walk"] = (model, model.forward)
        step = build(model)
        if step is not None:
            variants[f"{name} fused"] = (model, step)
    prompt = np.arange(100, 132, dtype=np.int32)

    def run(model, fwd):
        cache = model.new_cache(64 + n_tokens)
        logits = fwd(prompt, 0, cache) if callable(fwd) else fwd.run(prompt, 0, cache, 1)
        tok, t0 = int(np.argmax(logits[-1])), time.perf_counter()
        for i in range(n_tokens):
            x = np.array([tok], np.int32)
            logits = fwd(x, 32 + i, cache) if callable(fwd) else fwd.run(x, 32 + i, cache, 1)
            tok = int(np.argmax(logits[-1]))
        return (time.perf_counter() - t0) / n_tokens
    for model, fwd in variants.values():  # compile and warm
        run(model, fwd)
    times = {k: [] for k in variants}
    for _ in range(repeats):
        for k, (model, fwd) in variants.items():
            times[k].append(run(model, fwd))
    print(f"ms per decoded token ({n_tokens} tokens after a 32-token prompt; best / median of {repeats}, alternated)")
    for k, v in times.items():
        print(f"  {k:>44} {min(v) * 1e3:7.2f} {np.median(v) * 1e3:7.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", nargs="+", metavar="FILE", help="model files: decode ms per token instead")
    ap.add_argument("--tokens", type=int, default=64, help="tokens decoded per run (--decode)")
    ap.add_argument("--shape", default="3072x1024", help="ROWSxCOLS (cols a multiple of 256 for the K-quants)")
    ap.add_argument("--t", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--mb", type=float, default=48.0, help="GGUF megabytes of matrices swept per timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-generic", action="store_true", help="skip the generic fallback (slow at large T)")
    a = ap.parse_args()
    import numba
    if a.decode:
        decode(a.decode, a.tokens, a.repeats)
        return
    rows, cols = (int(v) for v in a.shape.lower().split("x"))
    rng = np.random.default_rng(0)
    variants = {}  # name -> (weights, gguf bytes of one)
    for name in a.types:
        qt = QT[name]
        bs, bb = SUPPORTED[qt]
        gg = rows * cols // bs * bb
        n = max(2, int(a.mb * 1e6 / gg))
        ts = [random_qtensor(rng, qt, rows, cols, f"{name}.{i}") for i in range(n)]
        variants[f"{name} fast"] = ([fast.prepare_weight(t) for t in ts], gg)
        if not a.no_generic and qt not in (QT.Q5_0, QT.Q5_1, QT.Q5_K):  # kernels.py has no Q5 decoder (dense f32)
            variants[f"{name} generic"] = ([generic.prepare_weight(t) for t in ts], gg)
    print(f"{rows}x{cols}, threads {numba.get_num_threads()}; us per matrix (fastest of {a.repeats} sweeps), "
          "GB/s of kernel / GGUF bytes, x generic")
    for kind in sorted({type(ws[0]).__name__ for ws, _ in variants.values()}):
        print(f"  {kind}: " + ", ".join(k for k, (ws, _) in variants.items() if type(ws[0]).__name__ == kind))
    print(f"{'T':>4} {'variant':>14} {'us':>9} {'GB/s':>6} {'GGUF':>6} {'xgen':>6}")
    for t_n in a.t:
        x = np.random.default_rng(t_n).standard_normal((t_n, cols)).astype(np.float32)
        out = np.zeros((t_n, rows), np.float32)
        scratch = fast.new_scratch(t_n, cols)
        for ws, _ in variants.values():  # compile and warm
            fast.matmul(out, x, ws[0], scratch)
        best = {k: np.inf for k in variants}
        for _ in range(a.repeats):
            for k, (ws, _) in variants.items():
                t0 = time.perf_counter()
                for w in ws:
                    fast.matmul(out, x, w, scratch)
                best[k] = min(best[k], (time.perf_counter() - t0) / len(ws))
        for k, (ws, gg) in variants.items():
            gen = best.get(k.split()[0] + " generic")
            xg = f"{gen / best[k]:6.2f}" if gen and "fast" in k else ""
            print(f"{t_n:>4} {k:>14} {best[k] * 1e6:9.1f} {kernel_bytes(ws[0]) / best[k] / 1e9:6.1f} "
                  f"{gg / best[k] / 1e9:6.1f} {xg:>6}", flush=True)


if __name__ == "__main__":
    main()
