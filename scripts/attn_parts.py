"""Decode attention at 600 context, one thread: the whole work item and its parts (scores, softmax, weighted
sum) timed apart, with the KV of one layer (cache-hot) or of 30 layers (not in L2). Prints us per layer."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import numba_env  # noqa: E402,F401  (flags before numba)

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from engine.kernels.cpu_attn import _work_item, _clear_part, _scores, _softmax_rows, _weighted_sum, attn_item_f16
F32 = np.float32
L, cap, n_kv, hd, group = 30, 2048, 3, 64, 3
rng = np.random.default_rng(0)
kc = (rng.standard_normal((L, cap, n_kv, hd)).astype(np.float16)).view(np.uint16)
vc = (rng.standard_normal((L, cap, n_kv, hd)).astype(np.float16)).view(np.uint16)
q = rng.standard_normal((1, 9, 64)).astype(np.float32)
part = np.zeros((1, n_kv, 4, group, hd + 2), np.float32); sc = np.zeros((group, cap), np.float32)

@njit(fastmath=True, nogil=True)
def run(kc, vc, q, part, sc, pos0, reps, which, layers):
    for r in range(reps):
        for l in range(layers):
            for it in range(4):
                if which == 0:
                    attn_item_f16(part, sc, q, kc[l], vc[l], it, pos0, F32(0.125))
                    continue
                t, c, lo, hi = _work_item(it, pos0)
                for kh in range(n_kv):
                    pc = part[t, kh, c]
                    if which == 1:
                        _scores(sc, q[t, kh * group:(kh + 1) * group], kc[l], kh, lo, hi, F32(0.125))
                    elif which == 2:
                        _softmax_rows(pc, sc, hi - lo)
                    else:
                        _weighted_sum(pc, sc, vc[l], kh, lo, hi)
for layers, label in ((1, "one layer (cache-hot)"), (30, "30 layers (KV not in L2)")):
    for which, name in ((0, "whole item"), (1, "scores"), (2, "softmax"), (3, "weighted sum")):
        run(kc, vc, q, part, sc, 600, 1, which, layers)
        best = 1e9
        for _ in range(5):
            t = time.perf_counter(); run(kc, vc, q, part, sc, 600, 20, which, layers); best = min(best, time.perf_counter() - t)
        print(f"{label:28s} {name:13s} {best / 20 / layers * 1e6:7.1f} us per layer (4 items x 3 KV heads, one thread)")
