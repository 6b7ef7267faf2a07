"""What a verify pass would gain from converting the f16 KV cache to f32 once for all its rows.

A verify pass of T rows at context n runs T rows of decode attention; each converts the same K and V rows
from f16 (vcvtph2ps) inside its score and weighted-sum loops. Converted once into an f32 copy, every row
could read f32 rows with the same loops (attn_avx2's f32 forms: the conversion is exact, so the bits stay a
decode step's). This times one row's scores and weighted V sums over every KV head (SmolLM2's 3 KV heads of
64, 3 query heads each: the grouped *_heads forms), cache-hot, one thread, from f16 rows and from f32 rows,
alternating, and checks that both give the same bits. The gain per row bounds what sharing the conversion
could save (before paying for the conversion itself once per pass).

    NUMBA_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python probes/attn_f32_rows.py [--positions 224] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine import numba_env  # noqa: E402,F401  (flags before numba)

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from engine.backends.cpu import attn_avx2 as X  # noqa: E402

KDOT_F16, VSUM_F16 = X._make_kdot(8, heads=X.GROUP_HEADS), X._make_vsum(heads=X.GROUP_HEADS)  # no `ahead` asks
KDOT_F32, VSUM_F32 = X._make_kdot(8, f32=True, heads=X.GROUP_HEADS), X._make_vsum(f32=True, heads=X.GROUP_HEADS)
V_BLOCK = 32


def _row_loop(kdot, vsum):
    """One row's scores and weighted V sums over every KV head, reps times, through these kernels."""
    @njit
    def row(sc, q, kc, vc, acc, n, reps):
        for _ in range(reps):
            for kh in range(kc.shape[1]):
                for p in range(0, n, 8):
                    kdot(sc, p, q, kc, p, kh, np.float32(0.125))
                for b in range(0, n, V_BLOCK):
                    vsum(acc, sc, b, V_BLOCK, vc, b, kh)
    return row


_row_f16, _row_f32 = _row_loop(KDOT_F16, VSUM_F16), _row_loop(KDOT_F32, VSUM_F32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--positions", type=int, default=224, help="context positions (a multiple of 32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args()
    n = a.positions // V_BLOCK * V_BLOCK
    rng = np.random.default_rng(0)
    k16 = rng.standard_normal((n, 3, 64)).astype(np.float16).view(np.uint16)
    v16 = rng.standard_normal((n, 3, 64)).astype(np.float16).view(np.uint16)
    k32, v32 = k16.view(np.float16).astype(np.float32), v16.view(np.float16).astype(np.float32)
    q = rng.standard_normal((3, 64)).astype(np.float32)
    out = {}
    for name, f, k, v in (("f16", _row_f16, k16, v16), ("f32", _row_f32, k32, v32)):
        sc, acc = np.zeros((3, n), np.float32), np.zeros((3, 66), np.float32)
        f(sc, q, k, v, acc, n, 1)
        out[name] = (sc, acc)
    same = all(np.array_equal(x, y) for x, y in zip(out["f16"], out["f32"]))
    print(f"{n} positions, 3 KV heads x 3 query heads of 64, one thread, cache-hot; same bits: {same}")
    sc, acc = np.zeros((3, n), np.float32), np.zeros((3, 66), np.float32)
    for r in range(a.rounds):
        line = []
        for name, f, k, v in (("f16", _row_f16, k16, v16), ("f32", _row_f32, k32, v32)):
            t = time.perf_counter()
            f(sc, q, k, v, acc, n, a.reps)
            line.append(f"{name} {(time.perf_counter() - t) / a.reps * 1e6:6.2f} us")
        print(f"round {r + 1}: " + ", ".join(line) + " per row and layer (scores + weighted V sums)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
