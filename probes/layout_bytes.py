"""Would a Q4_K layout that keeps the file's 6-bit scales stream faster? Two 4-bit decode forms over matrices
swept from DRAM in one harness, alternated:

    PYTHONPATH=. .venv/bin/python probes/layout_bytes.py [--mb 600] [--shape 8192x2048] [--repeats 6]

  640  avx2.grp_q4 as the engine runs Q4_K today (Q4_1 blocks: f16 d and m per row and 32 values, 640 bytes a
       block of 32 rows x 32 values; the file holds 576 a block)
  592  the same body over 592-byte blocks: u8 scales and mins per row and block, f16 d and dmin per row and
       superblock (read here in every block, more than a real layout would), f16(d sc) and f16(dmin mn)
       formed in the kernel (cvt, multiply, vcvtps2ph / vcvtph2ps): what such a layout's kernel would do
Its outputs are not a model's numbers (the bytes are random, the scales a constant); the work per block and
the bytes streamed are the point. Printed: us per matrix (best and median of the sweeps), GB/s of its bytes,
and the same with one matrix hot (in L3).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange  # noqa: E402
from numba.core import cgutils, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from engine import numba_env  # noqa: E402,F401  (flags before numba)
from engine.backends.cpu import avx2 as A  # noqa: E402

B592 = 592


def _scaled(builder, dsb, p):
    """f16(dsb * u8[p : p + 32]) as <32 x float>."""
    f = builder.uitofp(A._vload(builder, p, A.V32I8), A.V32F)
    return builder.fpext(builder.fptrunc(builder.fmul(dsb, f), A.V32H), A.V32F)


@intrinsic
def grp_592(typingctx, o, o_off, blk, blk_off, qa, qa_off, sa, xs, s_off, x_off, nb):
    sig = types.void(o, o_off, blk, blk_off, qa, qa_off, sa, xs, s_off, x_off, nb)

    def codegen(context, builder, signature, args):
        o_, oo, blk_, bo, qa_, ao, sa_, xs_, so, xo, nb_ = args
        ty = signature.args
        q0 = A._ptr(context, builder, ty[2], blk_, bo)
        a0 = A._ptr(context, builder, ty[4], qa_, ao)
        sp, xp = A._ptr(context, builder, ty[6], sa_, so), A._ptr(context, builder, ty[7], xs_, xo)
        accp = cgutils.alloca_once_value(builder, A._const(A.V32F, 0.0))
        with cgutils.for_range(builder, nb_) as loop:
            b = loop.index
            q = builder.gep(q0, [builder.mul(b, ir.Constant(b.type, B592))])
            sb0 = builder.gep(q0, [builder.mul(builder.udiv(b, ir.Constant(b.type, 8)), ir.Constant(b.type, 8 * B592))])

            def nib_of(v):
                return A._split(builder, A._vload(builder, builder.gep(q, [ir.Constant(A.I64, 32 * v)]), A.V32I8))
            with A.spread_prefetch(builder, A._bytes_at(builder, q, A.PREFETCH), 10):
                ab = builder.gep(a0, [builder.mul(b, ir.Constant(b.type, 32))])
                isum = A._isum(builder, nib_of, ab, A.VNNI)
                dv = _scaled(builder, A._halves(builder, A._i16_at(builder, sb0, 512)), A._bytes_at(builder, q, 512))
                mv = _scaled(builder, A._halves(builder, A._i16_at(builder, sb0, 528)), A._bytes_at(builder, q, 544))
                m8 = builder.fadd(mv, builder.fmul(A._const(A.V32F, 8.0), dv))
                term = A._block_term(builder, isum, A._asum_times(builder, ab, 8), dv, m8,
                                     builder.load(builder.gep(sp, [b])), A._xs_at(builder, xp, b, A.XS_SCALED))
            builder.store(builder.fadd(builder.load(accp), term), accp)
        op = builder.bitcast(A._ptr(context, builder, ty[0], o_, oo), A.V32F.as_pointer())
        builder.store(builder.load(accp), op, align=4)
        return context.get_dummy_value()
    return sig, codegen


@njit(parallel=True, nogil=True)
def mm640(out, qa, sa, xs, blk):
    for g in prange(blk.shape[0]):
        A.grp_q4(out, g * 32, blk, g * blk.strides[0], qa, 0, sa, xs, 0, 0, blk.shape[1] // 640)


@njit(parallel=True, nogil=True)
def mm592(out, qa, sa, xs, blk):
    for g in prange(blk.shape[0]):
        grp_592(out, g * 32, blk, g * blk.strides[0], qa, 0, sa, xs, 0, 0, blk.shape[1] // B592)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="8192x2048")
    ap.add_argument("--mb", type=float, default=600.0, help="megabytes of matrices swept per timing")
    ap.add_argument("--repeats", type=int, default=6)
    a = ap.parse_args()
    rows, cols = map(int, a.shape.split("x"))
    ng, nb = rows // 32, cols // 32
    rng = np.random.default_rng(0)
    qa = rng.integers(-100, 100, (1, cols)).astype(np.int8)
    sa, xs, out = np.ones((1, nb), np.float32), np.ones((1, 3 * nb), np.float32), np.zeros((1, rows), np.float32)
    scales = np.frombuffer(np.full(64, 0.01, np.float16).tobytes(), np.uint8)  # random bytes: subnormals, NaNs
    forms = {}
    for stride, fn in ((640, mm640), (B592, mm592)):
        src = rng.integers(0, 256, (ng, nb, stride), dtype=np.uint8)
        src[..., 512:640 if stride == 640 else 592] = scales[:stride - 512]
        src = src.reshape(ng, -1)
        mats = []
        for i in range(max(1, int(a.mb * 1e6 // src.nbytes))):
            m = np.empty_like(src)  # written in place: numpy's fresh arrays from rng streamed 2.7x slower here
            m[:] = np.roll(src, i, axis=1)
            mats.append(m)
        fn(out, qa, sa, xs, mats[0])
        forms[stride] = (fn, mats)
    times = {s: [] for s in forms}
    for r in range(a.repeats):
        for s in (640, B592) if r % 2 == 0 else (B592, 640):
            fn, mats = forms[s]
            t0 = time.perf_counter()
            for m in mats:
                fn(out, qa, sa, xs, m)
            times[s].append((time.perf_counter() - t0) / len(mats))
    print(f"{rows}x{cols}, {a.mb:.0f} MB swept, threads {os.environ['NUMBA_NUM_THREADS']}")
    for s, (fn, mats) in forms.items():
        fn(out, qa, sa, xs, mats[0])
        t0 = time.perf_counter()
        for _ in range(50):
            fn(out, qa, sa, xs, mats[0])
        hot = (time.perf_counter() - t0) / 50
        best, med = min(times[s]), sorted(times[s])[len(times[s]) // 2]
        print(f"  {s} bytes a block: {best * 1e6:7.1f} us best, {med * 1e6:7.1f} median, "
              f"{mats[0].nbytes / best / 1e9:5.1f} GB/s; hot {hot * 1e6:6.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
