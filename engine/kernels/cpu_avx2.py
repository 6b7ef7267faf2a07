"""AVX2 block kernels for the interleaved 4-bit layout of cpu_fast.py, written as LLVM IR (numba intrinsics).

Why IR: the int8 x 4-bit dot wants vpmaddubsw (32 multiply-adds per instruction, u8 x s8 -> s16 pair
sums); LLVM does not form it from numba's scalar code, which ends at vpmullw + vpaddw (16 per two
instructions) plus a zero-extension and a -8 per nibble. Here the nibbles stay unsigned (0..15):
    sum_j (q_j - 8) a_j = sum_j q_j a_j - 8 * sum_j a_j,
both integers exact, so every block sum equals cpu_fast's generic kernels' and the float tail below is the
same expression in the same order: results are bit-identical to the generic path (tests compare).

Layout of one block of a 32-row group (cpu_fast.FastWeight): qs[j, r], j < 16, low nibble = value j of
row r, high nibble = value j + 16. Bytes of two consecutive j are interleaved in registers (vpunpck*bw)
so each 16-bit lane holds (value j, value j+1) of one row, multiplied by the broadcast activation pair.
A 16-bit accumulator takes 8 pairs (|sum| <= 8 * 2 * 15 * 127 = 30480): one for the low nibbles
(values 0..15) and one for the high (16..31), widened to int32 once per block.
vpunpck works per 128-bit lane: register A holds rows 0-7 and 16-23, register B rows 8-15 and 24-31.

Only used when the host has AVX2 (cpu_fast.HAVE_AVX2); cpu_fast's generic kernels serve the others.
"""
from __future__ import annotations

from .. import numba_env  # noqa: F401  (flags before numba)

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

G = 32
I8, I16, I32, I64, F = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
V32I8, V16I16, V8I32, V16I32 = ir.VectorType(I8, 32), ir.VectorType(I16, 16), ir.VectorType(I32, 8), ir.VectorType(I32, 16)
V32I32, V32F = ir.VectorType(I32, 32), ir.VectorType(F, 32)
UNBUF = 1024  # bytes of one unpacked block: 8 pairs x (lo A, lo B, hi A, hi B) x 32 bytes

# per 128-bit lane: bytes 0-7 of x0 and x1 interleaved (punpcklbw), resp. bytes 8-15 (punpckhbw)
_LO = [i for half in (0, 16) for k in range(8) for i in (half + k, 32 + half + k)]
_HI = [i for half in (8, 24) for k in range(8) for i in (half + k, 32 + half + k)]
# A = rows [0..7, 16..23], B = rows [8..15, 24..31] (as int32 lanes after widening) -> rows 0..31
_ROWS = list(range(0, 8)) + list(range(16, 24)) + list(range(8, 16)) + list(range(24, 32))


def _const(vt, vals):
    return ir.Constant(vt, vals if isinstance(vals, list) else [vals] * vt.count)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _ptr(context, builder, arrty, arr, off):
    """Pointer to element `off` (an intp value) of the array's data (flat, C order)."""
    a = context.make_array(arrty)(context, builder, arr)
    return builder.gep(a.data, [off])


def _vload(builder, p, vt):
    return builder.load(builder.bitcast(p, vt.as_pointer()), align=1)


def _splat(builder, x, vt):
    v = builder.insert_element(ir.Constant(vt, None), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, None), _const(ir.VectorType(I32, vt.count), 0))


def _nibbles(builder, x0, x1):
    """Bytes of rows for j and j+1 -> (lo A, lo B, hi A, hi B): u8 pairs (value j, value j+1) resp.
    (value j+16, value j+17) of the rows of register A / B."""
    mask, four = _const(V32I8, 15), _const(V32I8, 4)
    out = []
    for sel in (_LO, _HI):
        u = builder.shuffle_vector(x0, x1, _const(ir.VectorType(I32, 32), sel))
        out.append((builder.and_(u, mask), builder.and_(builder.lshr(u, four), mask)))
    (la, ha), (lb, hb) = out
    return la, lb, ha, hb


def _dot_tail(builder, nib_of, a, o, d, m8, sb, xsb):
    """The shared part: nib_of(jp) -> 4 nibble vectors of pair jp; a = activation pointer (i8*, 32);
    o += d * (sb * isum) + m8 * xsb over the 32 rows (o, d, m8 float* to 32 contiguous rows)."""
    madd = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [V32I8, V32I8])
    pmaddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16])
    radd = _fn(builder, "llvm.vector.reduce.add.v8i32", I32, [V8I32])
    a16 = builder.bitcast(a, I16.as_pointer())
    zero = _const(V16I16, 0)
    acc = [zero] * 4  # lo A, lo B, hi A, hi B
    for jp in range(8):
        al = builder.bitcast(_splat(builder, builder.load(builder.gep(a16, [ir.Constant(I64, jp)]), align=1), V16I16), V32I8)
        ah = builder.bitcast(_splat(builder, builder.load(builder.gep(a16, [ir.Constant(I64, 8 + jp)]), align=1), V16I16), V32I8)
        nib = nib_of(jp)
        for i in range(4):
            acc[i] = builder.add(acc[i], builder.call(madd, [nib[i], al if i < 2 else ah]))
    # 8 * sum(a): pair sums of 8 * a (|.| <= 2032), then int32
    s8 = builder.call(madd, [_const(V32I8, 8), _vload(builder, a, V32I8)])
    asum8 = builder.call(radd, [builder.call(pmaddwd, [s8, _const(V16I16, 1)])])
    sa_ = builder.add(builder.sext(acc[0], V16I32), builder.sext(acc[2], V16I32))
    sb_ = builder.add(builder.sext(acc[1], V16I32), builder.sext(acc[3], V16I32))
    isum = builder.shuffle_vector(sa_, sb_, _const(ir.VectorType(I32, 32), _ROWS))
    isum = builder.sub(isum, _splat(builder, asum8, V32I32))
    # same expression and order as the generic kernels: o + (d * (sb * f(isum)) + m8 * xsb)
    t = builder.fmul(_splat(builder, sb, V32F), builder.sitofp(isum, V32F))
    t = builder.fmul(_vload(builder, d, V32F), t)
    u = builder.fmul(_vload(builder, m8, V32F), _splat(builder, xsb, V32F))
    t = builder.fadd(t, u)
    op = builder.bitcast(o, V32F.as_pointer())
    builder.store(builder.fadd(builder.load(op, align=4), t), op, align=4)


@intrinsic
def blk_q4(typingctx, o, o_off, qs, qs_off, qa, qa_off, d, dm_off, m8, sb, xsb):
    """o[o_off : o_off + 32] += one block's contribution for 32 rows: qs[qs_off:] the block's 512 bytes,
    qa[qa_off:] its 32 int8 activations, d/m8[dm_off:] the rows' scales, sb/xsb f32 (see _dot_tail)."""
    sig = types.void(o, o_off, qs, qs_off, qa, qa_off, d, dm_off, m8, sb, xsb)

    def codegen(context, builder, signature, args):
        o_, oo, qs_, qo, qa_, ao, d_, do, m8_, sb_, xsb_ = args
        ty = signature.args
        q = _ptr(context, builder, ty[2], qs_, qo)

        def nib_of(jp):
            x0 = _vload(builder, builder.gep(q, [ir.Constant(I64, 64 * jp)]), V32I8)
            x1 = _vload(builder, builder.gep(q, [ir.Constant(I64, 64 * jp + 32)]), V32I8)
            return _nibbles(builder, x0, x1)
        _dot_tail(builder, nib_of, _ptr(context, builder, ty[4], qa_, ao), _ptr(context, builder, ty[0], o_, oo),
                  _ptr(context, builder, ty[6], d_, do), _ptr(context, builder, ty[8], m8_, do), sb_, xsb_)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def unpack_q4(typingctx, buf, qs, qs_off):
    """buf[0:UNBUF] (uint8) <- the nibble vectors of the block at qs[qs_off:], as blk_q4u reads them: for a
    multi-row matmul each block is unpacked once and used by every activation row."""
    sig = types.void(buf, qs, qs_off)

    def codegen(context, builder, signature, args):
        buf_, qs_, qo = args
        q = _ptr(context, builder, signature.args[1], qs_, qo)
        b = _ptr(context, builder, signature.args[0], buf_, ir.Constant(I64, 0))
        for jp in range(8):
            x0 = _vload(builder, builder.gep(q, [ir.Constant(I64, 64 * jp)]), V32I8)
            x1 = _vload(builder, builder.gep(q, [ir.Constant(I64, 64 * jp + 32)]), V32I8)
            for i, v in enumerate(_nibbles(builder, x0, x1)):
                p = builder.bitcast(builder.gep(b, [ir.Constant(I64, 128 * jp + 32 * i)]), V32I8.as_pointer())
                builder.store(v, p, align=1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def blk_q4u(typingctx, o, o_off, buf, qa, qa_off, d, dm_off, m8, sb, xsb):
    """blk_q4 from a block unpacked by unpack_q4 into buf."""
    sig = types.void(o, o_off, buf, qa, qa_off, d, dm_off, m8, sb, xsb)

    def codegen(context, builder, signature, args):
        o_, oo, buf_, qa_, ao, d_, do, m8_, sb_, xsb_ = args
        ty = signature.args
        b = _ptr(context, builder, ty[2], buf_, ir.Constant(I64, 0))

        def nib_of(jp):
            return [builder.load(builder.bitcast(builder.gep(b, [ir.Constant(I64, 128 * jp + 32 * i)]),
                                                 V32I8.as_pointer()), align=1) for i in range(4)]
        _dot_tail(builder, nib_of, _ptr(context, builder, ty[3], qa_, ao), _ptr(context, builder, ty[0], o_, oo),
                  _ptr(context, builder, ty[5], d_, do), _ptr(context, builder, ty[7], m8_, do), sb_, xsb_)
        return context.get_dummy_value()
    return sig, codegen


# ------------------------------------------------------------------------------------------------ Q8_0
# Layout (cpu_fast.FastWeight 'q8'): qs[jp, 2r + i] = value 2 jp + i of row r, int8. Sign-extended to int16,
# vpmaddwd against the broadcast pair (a[2 jp], a[2 jp + 1]) gives one int32 per row, rows in order.
V64I8, V64I16 = ir.VectorType(I8, 64), ir.VectorType(I16, 64)
UNBUF8 = 2048  # bytes of one sign-extended Q8_0 block: 16 pairs x 64 int16


def _q8_tail(builder, w_of, a, o, d, sb):
    """w_of(jp) -> <64 x i16> weights of pair jp; o += d * (sb * isum) over 32 rows (q8_group's order)."""
    pmaddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16])
    acc = [_const(V8I32, 0)] * 4  # rows 0-7, 8-15, 16-23, 24-31
    a16 = ir.VectorType(I16, 2)
    for jp in range(8 * 2):
        pair = builder.sext(_vload(builder, builder.gep(a, [ir.Constant(I64, 2 * jp)]), ir.VectorType(I8, 2)), a16)
        av = builder.bitcast(_splat(builder, builder.bitcast(pair, I32), V8I32), V16I16)
        w = w_of(jp)
        for i in range(4):
            part = builder.shuffle_vector(w, w, _const(ir.VectorType(I32, 16), list(range(16 * i, 16 * i + 16))))
            acc[i] = builder.add(acc[i], builder.call(pmaddwd, [part, av]))
    isum = builder.shuffle_vector(builder.shuffle_vector(acc[0], acc[1], _const(ir.VectorType(I32, 16), list(range(16)))),
                                  builder.shuffle_vector(acc[2], acc[3], _const(ir.VectorType(I32, 16), list(range(16)))),
                                  _const(ir.VectorType(I32, 32), list(range(32))))
    t = builder.fmul(_splat(builder, sb, V32F), builder.sitofp(isum, V32F))
    t = builder.fmul(_vload(builder, d, V32F), t)
    op = builder.bitcast(o, V32F.as_pointer())
    builder.store(builder.fadd(builder.load(op, align=4), t), op, align=4)


@intrinsic
def blk_q8(typingctx, o, o_off, qs, qs_off, qa, qa_off, d, d_off, sb):
    """o[o_off : o_off + 32] += d * (sb * sum_j w_j a_j) for one Q8_0 block of 32 rows (1 KiB at qs[qs_off:])."""
    sig = types.void(o, o_off, qs, qs_off, qa, qa_off, d, d_off, sb)

    def codegen(context, builder, signature, args):
        o_, oo, qs_, qo, qa_, ao, d_, do, sb_ = args
        ty = signature.args
        q = _ptr(context, builder, ty[2], qs_, qo)

        def w_of(jp):
            return builder.sext(_vload(builder, builder.gep(q, [ir.Constant(I64, 64 * jp)]), V64I8), V64I16)
        _q8_tail(builder, w_of, _ptr(context, builder, ty[4], qa_, ao), _ptr(context, builder, ty[0], o_, oo),
                 _ptr(context, builder, ty[6], d_, do), sb_)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def unpack_q8(typingctx, buf, qs, qs_off):
    """buf[0:UNBUF8] (uint8) <- the Q8_0 block at qs[qs_off:] sign-extended to int16 (for blk_q8u)."""
    sig = types.void(buf, qs, qs_off)

    def codegen(context, builder, signature, args):
        buf_, qs_, qo = args
        q = _ptr(context, builder, signature.args[1], qs_, qo)
        b = builder.bitcast(_ptr(context, builder, signature.args[0], buf_, ir.Constant(I64, 0)), V64I16.as_pointer())
        for jp in range(16):
            w = builder.sext(_vload(builder, builder.gep(q, [ir.Constant(I64, 64 * jp)]), V64I8), V64I16)
            builder.store(w, builder.gep(b, [ir.Constant(I64, jp)]), align=1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def blk_q8u(typingctx, o, o_off, buf, qa, qa_off, d, d_off, sb):
    """blk_q8 from a block unpacked by unpack_q8 into buf."""
    sig = types.void(o, o_off, buf, qa, qa_off, d, d_off, sb)

    def codegen(context, builder, signature, args):
        o_, oo, buf_, qa_, ao, d_, do, sb_ = args
        ty = signature.args
        b = builder.bitcast(_ptr(context, builder, ty[2], buf_, ir.Constant(I64, 0)), V64I16.as_pointer())

        def w_of(jp):
            return builder.load(builder.gep(b, [ir.Constant(I64, jp)]), align=1)
        _q8_tail(builder, w_of, _ptr(context, builder, ty[3], qa_, ao), _ptr(context, builder, ty[0], o_, oo),
                 _ptr(context, builder, ty[5], d_, do), sb_)
        return context.get_dummy_value()
    return sig, codegen
