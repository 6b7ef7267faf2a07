"""Decode attention at 600 context, one thread: a layer's four work items (cpu_attn.attn_item_f16, and
cpu_attn_int8.attn_item_int8 over the same values quantized), with the KV of one layer (cache-hot) or of 30
layers (not in L2). Prints us per layer. In the decode step the KV comes from DRAM after the weight stream,
so these are lower bounds (probes/step_phases.py --with-attn measures attention in the step)."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import numba_env  # noqa: E402,F401  (flags before numba)

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

from engine.backends.ref import kernels as ref  # noqa: E402
from engine.backends.cpu.attn import SPLITS, attn_item_f16  # noqa: E402
from engine.backends.cpu.attn_int8 import attn_item_int8  # noqa: E402

F32 = np.float32
L, cap, n_kv, hd, group = 30, 2048, 3, 64, 3
rng = np.random.default_rng(0)
kf = rng.standard_normal((L, cap, n_kv, hd)).astype(np.float32)
vf = rng.standard_normal((L, cap, n_kv, hd)).astype(np.float32)
kc, vc = kf.astype(np.float16).view(np.uint16), vf.astype(np.float16).view(np.uint16)


def _int8(x):
    """(L, cap, n_kv, hd) f32 -> the int8 cache's (quants, scales), layer by layer."""
    qs, ss = zip(*(ref.quantize_kv_int8(x[i], ref.kv_group(hd)) for i in range(L)))
    return np.stack(qs), np.stack(ss)


kq, ks = _int8(kf)
vq, vs = _int8(vf)
q = rng.standard_normal((1, n_kv * group, hd)).astype(np.float32)
part = np.zeros((1, n_kv, SPLITS, group, hd + 2), np.float32)
sc = np.zeros((n_kv * group, cap), np.float32)


@njit(fastmath=True, nogil=True)
def run(kv16, kv8, q, part, sc, pos0, reps, int8, layers):
    kc, vc = kv16
    kq, ks, vq, vs = kv8
    for _ in range(reps):
        for l in range(layers):
            for it in range(SPLITS):
                if int8:
                    attn_item_int8(part, sc, q, kq[l], ks[l], vq[l], vs[l], it, pos0, F32(0.125))
                else:
                    attn_item_f16(part, sc, q, kc[l], vc[l], it, pos0, F32(0.125))


for layers, label in ((1, "one layer (cache-hot)"), (30, "30 layers (KV not in L2)")):
    for int8, name in ((False, "f16 cache"), (True, "int8 cache")):
        args = ((kc, vc), (kq, ks, vq, vs), q, part, sc, 600)
        run(*args, 1, int8, layers)
        best = 1e9
        for _ in range(5):
            t = time.perf_counter()
            run(*args, 20, int8, layers)
            best = min(best, time.perf_counter() - t)
        print(f"{label:28s} {name:10s} {best / 20 / layers * 1e6:7.1f} us per layer ({SPLITS} items, one thread)")
