"""
AMX tiles for the 4-bit multi-row matmul form: an experiment (2026-12-06), kept as a probe, not in the engine.

    PYTHONPATH=. .venv/bin/python probes/amx_q4_tiles.py

Why try: a verify pass of T rows runs every 4-bit block's integer sums once per activation row. With 512-bit
vpdpbusd (avx2.grp_q4_rows) ports 0 and 5 carry ~41 operations a row and block (the loop's assembly at 4 rows:
64 vpdpbusd, 26 vmulps, 18 vaddps, 8 each of and/shift/cvt/sub...), where the multiply-adds alone are 16.
One TDPBSUD computes a block's sums for up to 16 activation rows x 16 weight rows (int8 activations times
unsigned nibbles, exact int32): the block's nibbles are split once into two B tiles, the activations load
straight from qa as the A tile, and each row keeps only its block term (avx2._block_term), the same float
expression in the same order, so the rows are bit-identical to grp_q4_rows' (checked below).

What it measured (1536 x 576, 48 groups x 18 blocks, one thread, an AVX-512/AMX Xeon, cache-hot): equal bits
at every T, but 44-46 us at T = 1-4 against grp_q4_rows' 12-25, 58 against 46 at T = 8; ahead only at T = 16
(80 against 89): slower at every verify size.
Each block is one serial chain: the B tiles are stored and reloaded (tileloadd waits for the stores),
TDPBSUD, tilestored, then vector loads of the sums for the block terms; the tiles are not renamed, so the next
block's chain waits. Taking the unpack out: 50 -> 24 us (T = 1). A pipelined form (two sets of tiles, B
tiles written a block ahead) needs 10 of the 8 tile registers; sharing A or a 16-row C per half might fit.
Linux hands the tile state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM): _granted().
"""
from __future__ import annotations

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))

import ctypes
import os

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.backends.cpu.avx2 import (BLK4, I8, I16, I32, I64, PREFETCH, V32F, V32I32, V64I8, XS_A, XS_SCALED,
                                      _block_sum_times, _block_term, _bytes_at, _check_blocks, _const, _dm8, _fn,
                                      _prefetch, _ptr, _scales_at, _vload, _xs_at)
from engine.backends.cpu.target import target_has

ROWS = 16  # the most activation rows one call takes (a tile's rows)
_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_ARCH_PRCTL = 0x1023, 18, 158


def _granted() -> bool:
    """Ask Linux for the tile data state (x86-64 only); True when granted."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


AMX = (target_has("amx-int8") and target_has("amx-tile") and target_has("avx512bw")
       and os.environ.get("NINFER_NO_AMX", "") in ("", "0") and _granted())

# tiles: C0, C1 (rows x 16 int32: weight rows 0-15, 16-31), A (rows x 32 int8: a block's activations),
# B0, B1 (8 x 64: values 4k..4k+3 of weight rows 0-15, 16-31)
_C0, _C1, _A, _B0, _B1 = range(5)


def _tile_config(builder, nt):
    """The 64-byte tile configuration (palette 1) for nt activation rows (i64), on the stack: i8*."""
    cfg = cgutils.alloca_once(builder, ir.ArrayType(I8, 64))
    builder.store(ir.Constant(ir.ArrayType(I8, 64), None), cfg)
    p = builder.bitcast(cfg, I8.as_pointer())
    builder.store(ir.Constant(I8, 1), p)
    rows = builder.trunc(nt, I8)
    for t, (r, colsb) in enumerate(((rows, 64), (rows, 64), (rows, 32), (ir.Constant(I8, 8), 64),
                                    (ir.Constant(I8, 8), 64))):
        builder.store(ir.Constant(I16, colsb), builder.bitcast(_bytes_at(builder, p, 16 + 2 * t), I16.as_pointer()))
        builder.store(r, _bytes_at(builder, p, 48 + t))
    return p


def _tile(builder, name, *args):
    """Call the tile intrinsic llvm.x86.<name> (tile numbers as i8 constants, then pointers / strides)."""
    vals = [ir.Constant(I8, a) if isinstance(a, int) else a for a in args]
    return builder.call(_fn(builder, f"llvm.x86.{name}", ir.VoidType(), [v.type for v in vals]), vals)


def _b_tiles(builder, q, bbuf):
    """The block at q (i8*) as the two B tiles in bbuf (i8*, 1 KiB): row k of B_h = the low nibbles of block
    vector 2k + h (weight rows 16h..16h+7, values 4k..4k+3 each) then its high nibbles (rows 16h+8..16h+15)."""
    mask = _const(V64I8, 15)
    for k in range(8):
        x = _vload(builder, builder.gep(q, [ir.Constant(I64, 64 * k)]), V64I8)  # vectors 2k, 2k + 1
        lo, hi = builder.and_(x, mask), builder.and_(builder.lshr(x, _const(V64I8, 4)), mask)
        for h in range(2):
            row = builder.shuffle_vector(lo, hi, _const(ir.VectorType(I32, 64), list(range(32 * h, 32 * h + 32))
                                                        + list(range(64 + 32 * h, 64 + 32 * h + 32))))
            dst = builder.bitcast(_bytes_at(builder, bbuf, 512 * h + 64 * k), V64I8.as_pointer())
            builder.store(row, dst, align=1)


@intrinsic
def grp_q4_tiles(typingctx, o, o_off, o_st, blk, blk_off, qa, qa_off, qa_st, sa, xs, s_off, s_st, x_off, x_st, nb,
                 nt):
    """avx2.grp_q4_rows' contract for nt <= ROWS activation rows (a runtime count): o[o_off + i o_st : ... + 32]
    <- the 32 weight rows' dot products with activation row i over the nb blocks of a group (blk[blk_off:]),
    row i's activations, scales and sums at qa_off + i qa_st, s_off + i s_st, x_off + i x_st (elements).
    Per block: the nibbles into two B tiles, the activations as the A tile, two TDPBSUD into the C tiles, and
    per row the block term (avx2._block_term) added to its accumulator, block by block from 0."""
    if not _check_blocks(blk):
        return None
    sig = types.void(o, o_off, o_st, blk, blk_off, qa, qa_off, qa_st, sa, xs, s_off, s_st, x_off, x_st, nb, nt)

    def codegen(context, builder, signature, args):
        o_, oo, ost, blk_, bo, qa_, ao, ast, sa_, xs_, so, sst, xo, xst, nb_, nt_ = args
        ty = signature.args
        q0 = _ptr(context, builder, ty[3], blk_, bo)
        a0 = _ptr(context, builder, ty[5], qa_, ao)
        s0 = _ptr(context, builder, ty[8], sa_, so)
        x0 = _ptr(context, builder, ty[9], xs_, xo)
        bbuf = builder.bitcast(cgutils.alloca_once(builder, ir.ArrayType(V64I8, 16)), I8.as_pointer())
        cbuf = builder.bitcast(cgutils.alloca_once(builder, ir.ArrayType(V32I32, ROWS)), V32I32.as_pointer())
        acc = builder.bitcast(cgutils.alloca_once(builder, ir.ArrayType(V32F, ROWS)), V32F.as_pointer())
        with cgutils.for_range(builder, nt_) as loop:
            builder.store(_const(V32F, 0.0), builder.gep(acc, [loop.index]))
        _tile(builder, "ldtilecfg", _tile_config(builder, nt_))
        with cgutils.for_range(builder, nb_) as loop:
            b = loop.index
            q = builder.gep(q0, [builder.mul(b, ir.Constant(b.type, BLK4))])
            _prefetch(builder, _bytes_at(builder, q, PREFETCH), BLK4 // 64)
            _b_tiles(builder, q, bbuf)
            _tile(builder, "tilezero", _C0)
            _tile(builder, "tilezero", _C1)
            _tile(builder, "tileloadd64", _A, builder.gep(a0, [builder.mul(b, ir.Constant(b.type, 32))]), ast)
            _tile(builder, "tileloadd64", _B0, bbuf, ir.Constant(I64, 64))
            _tile(builder, "tileloadd64", _B1, _bytes_at(builder, bbuf, 512), ir.Constant(I64, 64))
            _tile(builder, "tdpbsud", _C0, _A, _B0)
            _tile(builder, "tdpbsud", _C1, _A, _B1)
            c8 = builder.bitcast(cbuf, I8.as_pointer())
            _tile(builder, "tilestored64", _C0, c8, ir.Constant(I64, 128))
            _tile(builder, "tilestored64", _C1, _bytes_at(builder, c8, 64), ir.Constant(I64, 128))
            dv, m8 = _dm8(builder, *_scales_at(builder, q))
            with cgutils.for_range(builder, nt_) as rows:
                i = rows.index
                sp = builder.gep(s0, [builder.add(builder.mul(i, sst), b)])
                xp = builder.gep(x0, [builder.mul(i, xst)])
                isum = builder.load(builder.gep(cbuf, [i]), align=4)
                term = _block_term(builder, isum, _block_sum_times(builder, _xs_at(builder, xp, b, XS_A), 8), dv, m8,
                                   builder.load(sp), _xs_at(builder, xp, b, XS_SCALED))
                ap = builder.gep(acc, [i])
                builder.store(builder.fadd(builder.load(ap), term), ap)
        _tile(builder, "tilerelease")
        with cgutils.for_range(builder, nt_) as loop:
            i = loop.index
            op = builder.bitcast(_ptr(context, builder, ty[0], o_, builder.add(oo, builder.mul(ost, i))),
                                 V32F.as_pointer())
            builder.store(builder.load(builder.gep(acc, [i])), op, align=4)
        return context.get_dummy_value()
    return sig, codegen


def main() -> int:
    import time

    import numpy as np
    from numba import njit

    from engine.backends.cpu import avx2 as A, fast as F
    if not AMX:
        print("this target has no AMX-INT8 (or the tile state was not granted)")
        return 0

    @njit
    def run_amx(o, blk, qa, sa, xs, nb, nt, ng):
        for g in range(ng):
            grp_q4_tiles(o, g * 32, ng * 32, blk, g * nb * A.BLK4, qa, 0, qa.shape[1], sa, xs, 0, sa.shape[1], 0,
                         xs.shape[1], nb, nt)

    @njit
    def run_rows(o, qa, sa, xs, blk, ng):  # fast.q4_group_batched: avx2.grp_q4_rows, 4 rows a call
        for g in range(ng):
            F.q4_group_batched(o, qa, sa, xs, blk, g)

    rng = np.random.default_rng(0)
    ng, nb = 48, 18  # 1536 x 576
    blk = np.zeros((ng, nb, A.BLK4), np.uint8)
    blk[:, :, :A.D_OFF] = rng.integers(0, 256, (ng, nb, A.D_OFF), dtype=np.uint8)
    blk[:, :, A.D_OFF:A.M_OFF] = (rng.random((ng, nb, 32)) * 0.02).astype(np.float16).view(np.uint8).reshape(ng, nb, 64)
    blk[:, :, A.M_OFF:] = (rng.random((ng, nb, 32)) * -0.02).astype(np.float16).view(np.uint8).reshape(ng, nb, 64)
    for nt in (1, 2, 4, 8, 16):
        x = rng.standard_normal((nt, nb * 32)).astype(np.float32)
        qa = np.zeros((nt, nb * 32), np.int8)
        sa, xs = np.zeros((nt, nb), np.float32), np.zeros((nt, A.XS * nb), np.float32)
        F.quantize_rows(qa, sa, xs, x)
        o1, o2 = np.full((nt, ng * 32), np.nan, np.float32), np.full((nt, ng * 32), np.nan, np.float32)
        run_amx(o1, blk.reshape(-1), qa, sa, xs, nb, nt, ng)
        run_rows(o2, qa, sa, xs, blk, ng)
        times = {}
        for name, f in (("amx", lambda: run_amx(o1, blk.reshape(-1), qa, sa, xs, nb, nt, ng)),
                        ("rows", lambda: run_rows(o2, qa, sa, xs, blk, ng))):
            t0 = time.perf_counter()
            for _ in range(300):
                f()
            times[name] = (time.perf_counter() - t0) / 300 * 1e6
        print(f"T={nt:2d}  same bits: {np.array_equal(o1, o2)}  AMX tiles {times['amx']:6.1f} us   "
              f"grp_q4_rows (fast.q4_group_batched) {times['rows']:6.1f} us")
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
