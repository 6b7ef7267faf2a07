"""Q4_K's two layouts, one harness, matrices swept from DRAM, alternated:

    PYTHONPATH=. .venv/bin/python probes/layout_bytes.py [--shape 8192x2048] [--t 1 4 64] [--mb 600] [--repeats 6]

  640  fast's 'q4' blocks (Q4_1: f16 d and m per row and 32 values, 640 bytes a block of 32 rows x 32 values), as
       Q4_K ran before the 'q4k' layout (fast.mm_q4)
  q4k  the 'q4k' layout (layout.py: the file's 6-bit scales and mins per block, the rows' f16 d and dmin per
       super-block of 8 blocks; 592 bytes a block), the kernel forming f16(d sc) and f16(-dmin mn) (q4k.mm)
Printed per T: us per matrix (best and median of the sweeps), GB/s of its bytes, and us with one matrix hot
(in L3). The bytes are random (nibbles; scales and mins < 64; a constant f16 header), not a model's: the work
per block and the bytes streamed are the point. Matrices are written in place (np.empty, then filled): fresh
arrays from numpy's generator streamed 2.7x slower on the AVX-512 Xeon guest.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from engine.backends.cpu import fast, q4k  # noqa: E402
from engine.backends.cpu.layout import K_HDR, SB4K  # noqa: E402


def _mats(rng, shape, header, mb):
    """Random matrices of one layout, mb megabytes in all, each written in place."""
    src = rng.integers(0, 64, shape, dtype=np.uint8)
    header(src)
    mats = []
    for i in range(max(1, int(mb * 1e6 // src.nbytes))):
        m = np.empty_like(src)
        m[:] = np.roll(src, i, axis=1)
        mats.append(m)
    return mats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8192x2048")
    ap.add_argument("--t", type=int, nargs="+", default=[1, 4, 64])
    ap.add_argument("--mb", type=float, default=600.0, help="megabytes of matrices swept per timing")
    ap.add_argument("--repeats", type=int, default=6)
    a = ap.parse_args()
    rows, cols = map(int, a.shape.split("x"))
    ng, nb = rows // 32, cols // 32
    rng = np.random.default_rng(0)
    h = np.frombuffer(np.full(32, 0.01, np.float16).tobytes(), np.uint8)

    def q41_header(s):
        s[..., 512:640] = np.concatenate([h, h])

    def q4k_header(s):
        s[..., 0:K_HDR] = np.concatenate([h, h])
    blocks = {"640": _mats(rng, (ng, nb, 640), q41_header, a.mb),
              "q4k": _mats(rng, (ng, nb // 8, SB4K), q4k_header, a.mb)}
    acc = np.zeros((ng, 32), np.int16)
    print(f"{rows}x{cols}, {a.mb:.0f} MB swept, threads {os.environ['NUMBA_NUM_THREADS']}")
    for t_n in a.t:
        x = rng.standard_normal((t_n, cols)).astype(np.float32)
        qa, sa, xs = (np.zeros((t_n, cols), np.int8), np.zeros((t_n, nb), np.float32),
                      np.zeros((t_n, 3 * nb), np.float32))
        fast.quantize_rows(qa, sa, xs, x)
        out = np.zeros((t_n, rows), np.float32)
        run = {"640": lambda m: fast.mm_q4(out, qa, sa, xs, m, acc), "q4k": lambda m: q4k.mm(out, qa, sa, xs, m)}
        times = {k: [] for k in run}
        for k in run:
            run[k](blocks[k][0])
        for r in range(a.repeats):
            for k in ("640", "q4k") if r % 2 == 0 else ("q4k", "640"):
                t0 = time.perf_counter()
                for m in blocks[k]:
                    run[k](m)
                times[k].append((time.perf_counter() - t0) / len(blocks[k]))
        for k in run:
            t0 = time.perf_counter()
            for _ in range(30):
                run[k](blocks[k][0])
            hot = (time.perf_counter() - t0) / 30
            best, med = min(times[k]), sorted(times[k])[len(times[k]) // 2]
            print(f"  T={t_n:<3} {k:>4}: {best * 1e6:8.1f} us best, {med * 1e6:8.1f} median, "
                  f"{blocks[k][0].nbytes / best / 1e9:5.1f} GB/s; hot {hot * 1e6:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
