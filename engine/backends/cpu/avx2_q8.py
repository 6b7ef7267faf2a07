"""AVX2 / AVX-512 block kernels for the Q8_0 layer of fast.py's interleaved layout ('q8', avx2.BLK8 bytes a block
of a 32-row group), written as LLVM IR (numba intrinsics) as avx2.py's 4-bit ones, with its IR helpers.

The model's Q8_0 matrices are its head (SmolLM2's tied embedding) and, in some files, a layer matrix here and
there. Sign-extended to int16, vpmaddwd against the broadcast activation pair (a[2 jp], a[2 jp + 1]) gives one
int32 per row, rows in order; where the target has AVX512-VNNI the decode and multi-row forms sum with
vpdpbusd over the block's bytes flipped to unsigned (_q8_isums_busd), the unpacked form with vpdpwssd
(_q8_isums). Exact integers in every form, then the same float expression as fast's generic q8 kernels: the same
bits (tests compare).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .avx2 import (BLK8, D8_OFF, I8, I16, I32, I64, PREFETCH, ROWS_MAX, V8I32, V16I16, V16I32, V32F, V32I16, V64I8,
                   VNNI512, XS_A, _a4, _asum_times, _bytes_at, _const, _fn, _halves, _i16_at, _prefetch, _ptr,
                   _rows32, _rows_setup, _splat, _store_rows, _vload, _xs_at,
                   spread_prefetch)

V64I16 = ir.VectorType(I16, 64)
VALS8 = 2048  # bytes of one sign-extended Q8_0 block: 16 pairs x 64 int16
UNBUF8 = VALS8 + 64  # and then its rows' f16 scales (unpack_q8)


def _q8_isums(builder, w_of, rows, vnni):
    """The 32 rows' int32 sums (<32 x i32>, rows in order) of one Q8_0 block with each activation row of
    `rows` (i8* to the block's 32 int8 values): w_of(jp) -> <64 x i16> weights of pair jp (32 rows x values
    2 jp, 2 jp + 1), computed once for all rows. vpmaddwd against the broadcast pair, or where the target has
    AVX512-VNNI (vnni) 512-bit vpdpwssd, which adds the pair products straight into the int32 lanes: 2
    instructions per row and pair where vpmaddwd and its adds take 8. Exact integers either way."""
    a16 = ir.VectorType(I16, 2)

    def pair(a, jp):  # values 2 jp, 2 jp + 1 of a row as one i32 of two i16
        return builder.bitcast(builder.sext(_vload(builder, builder.gep(a, [ir.Constant(I64, 2 * jp)]),
                                                   ir.VectorType(I8, 2)), a16), I32)
    if vnni:
        dp = _fn(builder, "llvm.x86.avx512.vpdpwssd.512", V16I32, [V16I32, V16I32, V16I32])
        chains = 2 if len(rows) <= 2 else 1  # (vpdpwssd's latency when few rows give independent chains)
        acc = [[[_const(V16I32, 0)] * chains for _ in range(2)] for _ in rows]  # rows 0-15, 16-31
        for jp in range(16):
            w = w_of(jp)
            parts = [builder.bitcast(builder.shuffle_vector(w, w, _const(ir.VectorType(I32, 32),
                                                                         list(range(32 * j, 32 * j + 32)))), V16I32)
                     for j in range(2)]
            for i, a in enumerate(rows):
                av = _splat(builder, pair(a, jp), V16I32)
                for j in range(2):
                    acc[i][j][jp % chains] = builder.call(dp, [acc[i][j][jp % chains], parts[j], av])
        out = []
        for ai in acc:
            lo, hi = (c[0] if chains == 1 else builder.add(c[0], c[1]) for c in ai)
            out.append(builder.shuffle_vector(lo, hi, _const(ir.VectorType(I32, 32), list(range(32)))))
        return out
    pmaddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16])
    acc = [[_const(V8I32, 0)] * 4 for _ in rows]  # per row: rows 0-7, 8-15, 16-23, 24-31
    for jp in range(16):
        w = w_of(jp)
        parts = [builder.shuffle_vector(w, w, _const(ir.VectorType(I32, 16), list(range(16 * j, 16 * j + 16))))
                 for j in range(4)]
        for i, a in enumerate(rows):
            av = builder.bitcast(_splat(builder, pair(a, jp), V8I32), V16I16)
            for j in range(4):
                acc[i][j] = builder.add(acc[i][j], builder.call(pmaddwd, [parts[j], av]))
    return [_rows32(builder, ai) for ai in acc]


# 128-bit lanes of two <32 x i16> vectors interleaved word by word (vpunpcklwd / vpunpckhwd, 512-bit)
_UNPACK_W = [[8 * lane + j + 32 * v for lane in range(4) for j in range(half, half + 4) for v in (0, 1)]
             for half in (0, 4)]
# the rows behind the int32 lanes of (unpacklo, unpackhi) of the pair vectors, back in row order
_QUAD_ORDER = [(4 * (r // 8) + r % 8) if r % 8 < 4 else (16 + 4 * (r // 8) + r % 8 - 4) for r in range(32)]


def _q8_isums_busd(builder, q, rows, a_sums):
    """_q8_isums' sums with 512-bit vpdpbusd (AVX512-VNNI), which multiplies unsigned by signed bytes four
    at a time: the block's pair vectors 2k and 2k + 1 (q: i8* to its values) interleaved word by word hold
    values 4k..4k+3 of 16 rows per vector, and w + 128 (the sign bit flipped) is the unsigned operand, so a
    row's lanes sum (w + 128) a and 128 A (a_sums: each row's A, the block's activation sum as i32) comes
    off once. Half the multiply-add instructions of vpdpwssd's pairs, no sign extension; exact integers, so
    the same sums (products <= 255 * 127, four to an int32 lane: no saturation, vpdpbusd does not
    saturate)."""
    dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", V16I32, [V16I32, V16I32, V16I32])
    flip = _const(V64I8, -128)
    chains = 2 if len(rows) <= 2 else 1
    acc = [[[_const(V16I32, 0)] * chains for _ in range(2)] for _ in rows]  # per row: (unpacklo, unpackhi) lanes
    for k in range(8):
        p = [builder.bitcast(builder.xor(_vload(builder, builder.gep(q, [ir.Constant(I64, 64 * (2 * k + j))]),
                                               V64I8), flip), V32I16) for j in range(2)]
        quads = [builder.bitcast(builder.shuffle_vector(p[0], p[1], _const(ir.VectorType(I32, 32), m)), V16I32)
                 for m in _UNPACK_W]
        for i, a in enumerate(rows):
            av = _splat(builder, _a4(builder, a, k), V16I32)
            for j in range(2):
                acc[i][j][k % chains] = builder.call(dp, [acc[i][j][k % chains], quads[j], av])
    out = []
    for ai, s in zip(acc, a_sums):
        c = _splat(builder, builder.shl(s, ir.Constant(I32, 7)), V16I32)
        lo, hi = (builder.sub(x[0] if chains == 1 else builder.add(x[0], x[1]), c) for x in ai)
        out.append(builder.shuffle_vector(lo, hi, _const(ir.VectorType(I32, 32), _QUAD_ORDER)))
    return out


def _q8_tail(builder, w_of, a, o, d, sb, q=None):
    """w_of(jp) -> <64 x i16> weights of pair jp; o += (d * sb) * isum over 32 rows (q8_group's order);
    d i16* to the rows' f16 scale bits. With q (i8* to the block's values) where the target has
    AVX512-VNNI: _q8_isums_busd's sums instead (the same integers)."""
    if q is not None and VNNI512:
        isum, = _q8_isums_busd(builder, q, [a], [_asum_times(builder, a, 1)])
    else:
        isum, = _q8_isums(builder, w_of, [a], VNNI512)
    t = builder.fmul(builder.fmul(_halves(builder, d), _splat(builder, sb, V32F)), builder.sitofp(isum, V32F))
    op = builder.bitcast(o, V32F.as_pointer())
    builder.store(builder.fadd(builder.load(op, align=4), t), op, align=4)


@intrinsic
def blk_q8(typingctx, o, o_off, blk, blk_off, qa, qa_off, sb):
    """o[o_off : o_off + 32] += (d * sb) * sum_j w_j a_j for one Q8_0 block of 32 rows (BLK8 bytes at
    blk[blk_off:]: its values, then the rows' scales d)."""
    sig = types.void(o, o_off, blk, blk_off, qa, qa_off, sb)

    def codegen(context, builder, signature, args):
        o_, oo, blk_, bo, qa_, ao, sb_ = args
        ty = signature.args
        q = _ptr(context, builder, ty[2], blk_, bo)

        def w_of(jp):
            return builder.sext(_vload(builder, builder.gep(q, [ir.Constant(I64, 64 * jp)]), V64I8), V64I16)
        with spread_prefetch(builder, _bytes_at(builder, q, PREFETCH), BLK8 // 64):  # the block PREFETCH bytes on
            _q8_tail(builder, w_of, _ptr(context, builder, ty[4], qa_, ao), _ptr(context, builder, ty[0], o_, oo),
                     _i16_at(builder, q, D8_OFF), sb_, q)
        return context.get_dummy_value()
    return sig, codegen


def _make_grp_q8_rows(nt, vnni):
    @intrinsic
    def grp_q8_rows(typingctx, o, o_off, o_st, blk, blk_off, qa, qa_off, qa_st, sa, xs, s_off, s_st, x_off, x_st,
                    nb):
        """o[o_off + i o_st : ... + 32] <- the 32 rows' dot products with activation rows i < nt over nb Q8_0
        blocks of a group (blk[blk_off:]): each block's values are sign-extended once, in registers, for the
        nt rows (grp_q4_rows' reasoning; unpack_q8 stored and re-read 2 KiB per block). Per row the same
        int32 sums and float expression as blk_q8, accumulated from 0 in block order: bit-identical to
        q8_group. Where vnni: _q8_isums_busd's sums, with each row's A from xs (row i's at x_off + i x_st)."""
        sig = types.void(o, o_off, o_st, blk, blk_off, qa, qa_off, qa_st, sa, xs, s_off, s_st, x_off, x_st, nb)

        def codegen(context, builder, signature, args):
            ty, nb_ = signature.args, args[14]
            q0, a0, sp, xp, accp = _rows_setup(context, builder, ty, args, nt)
            with cgutils.for_range(builder, nb_) as loop:
                b = loop.index
                q = builder.gep(q0, [builder.mul(b, ir.Constant(b.type, BLK8))])
                _prefetch(builder, _bytes_at(builder, q, PREFETCH), BLK8 // 64)
                ab = [builder.gep(a, [builder.mul(b, ir.Constant(b.type, 32))]) for a in a0]

                def w_of(jp):
                    return builder.sext(_vload(builder, builder.gep(q, [ir.Constant(I64, 64 * jp)]), V64I8), V64I16)
                if vnni:
                    isums = _q8_isums_busd(builder, q, ab, [builder.fptosi(_xs_at(builder, x, b, XS_A), I32)
                                                            for x in xp])
                else:
                    isums = _q8_isums(builder, w_of, ab, False)
                d = _halves(builder, _i16_at(builder, q, D8_OFF))
                for i in range(nt):
                    t = builder.fmul(builder.fmul(d, _splat(builder, builder.load(builder.gep(sp[i], [b])), V32F)),
                                     builder.sitofp(isums[i], V32F))
                    builder.store(builder.fadd(builder.load(accp[i]), t), accp[i])
            _store_rows(context, builder, ty, args, accp)
            return context.get_dummy_value()
        return sig, codegen
    return grp_q8_rows


grp_q8_rows1, grp_q8_rows2, grp_q8_rows3, grp_q8_rows4 = (_make_grp_q8_rows(n, VNNI512) for n in range(1, 5))
# 8 rows a call where the target has AVX512-VNNI (32 registers: 16 accumulators, the block's two quad vectors):
# each block's bytes flipped and interleaved once for a T=8 verify pass's 8 rows instead of twice
ROWS_MAX_Q8 = 8 if VNNI512 else ROWS_MAX
grp_q8_rows8 = _make_grp_q8_rows(8, VNNI512)
grp_q8_rows4_madd = _make_grp_q8_rows(4, False)  # vpmaddwd on any AVX2 CPU (tests compare)


@intrinsic
def unpack_q8(typingctx, buf, blk, blk_off):
    """buf[0:UNBUF8] (uint8) <- the Q8_0 block at blk[blk_off:] sign-extended to int16, then its rows' 32 f16
    scales (for blk_q8u)."""
    sig = types.void(buf, blk, blk_off)

    def codegen(context, builder, signature, args):
        buf_, blk_, bo = args
        q = _ptr(context, builder, signature.args[1], blk_, bo)
        b0 = _ptr(context, builder, signature.args[0], buf_, ir.Constant(I64, 0))
        b = builder.bitcast(b0, V64I16.as_pointer())
        for jp in range(16):
            w = builder.sext(_vload(builder, builder.gep(q, [ir.Constant(I64, 64 * jp)]), V64I8), V64I16)
            builder.store(w, builder.gep(b, [ir.Constant(I64, jp)]), align=1)
        dp = builder.bitcast(_bytes_at(builder, b0, VALS8), V32I16.as_pointer())
        builder.store(_vload(builder, _bytes_at(builder, q, D8_OFF), V32I16), dp, align=1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def blk_q8u(typingctx, o, o_off, buf, qa, qa_off, sb):
    """blk_q8 from a block unpacked by unpack_q8 into buf."""
    sig = types.void(o, o_off, buf, qa, qa_off, sb)

    def codegen(context, builder, signature, args):
        o_, oo, buf_, qa_, ao, sb_ = args
        ty = signature.args
        b0 = _ptr(context, builder, ty[2], buf_, ir.Constant(I64, 0))
        b = builder.bitcast(b0, V64I16.as_pointer())

        def w_of(jp):
            return builder.load(builder.gep(b, [ir.Constant(I64, jp)]), align=1)
        _q8_tail(builder, w_of, _ptr(context, builder, ty[3], qa_, ao), _ptr(context, builder, ty[0], o_, oo),
                 _i16_at(builder, b0, VALS8), sb_)
        return context.get_dummy_value()
    return sig, codegen
