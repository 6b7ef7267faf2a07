"""The 512-bit vpdpbusd peak of this machine: instructions per second on 1 and 2 threads (12 independent chains
of 4, no memory), the ceiling the integer sums of the 4-bit / Q8_0 multi-row forms run against.

    .venv/bin/python probes/dp_peak.py

2026-12-06, the AVX-512/AMX Xeon (2 vCPUs): 7.35 G a second on one thread (two a cycle), 14.7 on two (the two
vCPUs are separate cores). A T=8 verify pass of SmolLM2-135M needs ~16.8 M of them (4-bit layers 106 M weights
x 8 rows / 64, the Q8_0 head 28 M x 8 / 64): 1.1 ms at this peak, where its matmul phases take ~3.7 ms
(probes/step_phases.py --rows 8): the rest is the block terms, splits and broadcasts (bench/results-verify.md).
"""
from __future__ import annotations

import os
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import numba  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

I32 = ir.IntType(32)
V16 = ir.VectorType(I32, 16)
CHAINS, DEPTH = 12, 4


@intrinsic
def dp_loop(typingctx, n):
    """n iterations of CHAINS x DEPTH vpdpbusd (zmm) on register operands; returns a lane (kept live)."""
    sig = types.int64(n)

    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16, [V16, V16, V16]),
                                            "llvm.x86.avx512.vpdpbusd.512")
        accs = [cgutils.alloca_once_value(builder, ir.Constant(V16, [i] * 16)) for i in range(CHAINS)]
        a, b = ir.Constant(V16, [0x01020304] * 16), ir.Constant(V16, [0x05060708] * 16)
        with cgutils.for_range(builder, args[0]):
            vals = [builder.load(p) for p in accs]
            for _ in range(DEPTH):
                vals = [builder.call(fn, [v, a, b]) for v in vals]
            for p, v in zip(accs, vals):
                builder.store(v, p)
        return builder.sext(builder.extract_element(builder.load(accs[0]), ir.Constant(I32, 0)), ir.IntType(64))
    return sig, codegen


@njit(parallel=True)
def run(n, nt):
    s = 0
    for _ in prange(nt):
        s += dp_loop(n)
    return s


def main() -> int:
    from engine.backends.cpu.target import target_has
    if not (target_has("avx512vnni") and target_has("avx512f")):
        print("this target has no AVX512-VNNI")
        return 0
    n = 2_000_000
    for nt in (1, 2):
        numba.set_num_threads(nt)
        run(10, nt)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            run(n, nt)
            best = min(best, time.perf_counter() - t0)
        k = n * CHAINS * DEPTH * nt
        print(f"{nt} thread(s): {k / best / 1e9:.2f} G vpdpbusd (zmm) a second, {k * 64 / best / 1e9:.0f} G int8 "
              "multiply-adds")
    return 0


if __name__ == "__main__":
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
