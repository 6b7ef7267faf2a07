"""Decode attention's two inner loops over an int8 KV cache, written as LLVM IR (numba intrinsics).

The int8 cache holds, per (position, KV head), hd int8 values and hd // gs float32 scales, one per gs values
(ref.quantize_kv_int8). The loops here are attn_avx2's kdot / vsum with the f16 load swapped for an
int8 one (vpmovsxbd + vcvtdq2ps: 8 values to 8 floats) and the group scales applied:
- `kdot8_q8` / `kdot4_q8`: R positions' dot products with one query row, group by group: R accumulators in
  registers over the group's values, one transposing reduction (attn_avx2._reduce8) per group, and the
  R partial sums multiplied by the R positions' scales of that group into the running total.
- `vsum_q8`: the weighted sum over n positions, 32 lanes (or 8) of one group in registers over all
  positions, in 16-lane vectors where the target has AVX-512 (attn_avx2.LANES: half the conversions,
  the same bits; at 600 positions 8 -> 16 lanes took a layer's items from 24.5 to 22.1 us, one thread,
  cache-hot); a position's weight is its score times its scale for the group.
- `kdot8_q8_heads` / `kdot4_q8_heads` / `vsum_q8_heads`: the same for the GROUP_HEADS query heads that share
  a KV head, each K / V vector dequantized once (as attn_avx2's *_heads forms; the same bits); the *_pairs
  forms for two heads a call (GQA groups of 2 and 4, as attn_avx2's pair forms).
A cache row is 72 bytes per (position, head) at hd 64 instead of f16's 128, but the dequantizing loads
(sign-extend, convert) and a reduction per group cost more instructions than F16C's one conversion: at
512-640 context the step decodes about as fast as over an f16 cache (bench/results-cpu.md).

Both need gs % 8 == 0 (every block of 8 values inside one group): attn_int8 runs them (through
attn's positions-outer item) only then, and its numba loops otherwise. The sums run in another order
than those loops: results agree to float rounding, not bit for bit.
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .attn_avx2 import (LANES, F, GROUP_HEADS, I8, I32, V8F, ZERO, _elem_ptr, _fma, _head_rows, _i, _load_floats,
                             _ask_at, _reduce8, _store_scores, _vf, _weighted_lanes)
from .avx2 import _fn, _splat


def _load_int8(builder, p, off, n=8):
    """n int8 at p[off] (i8*) -> <n x float>."""
    v = builder.load(builder.bitcast(builder.gep(p, [off]), ir.VectorType(I8, n).as_pointer()), align=1)
    return builder.sitofp(builder.sext(v, ir.VectorType(I32, n)), ir.VectorType(F, n))


def _q8_ok(s, q, kq, ks, ndim=1):
    """Types of a call: kq (cap, n_kv, hd) int8, ks (cap, n_kv, hd // gs) f32, the two f32 operands 1-d for
    one head, 2-d (a row per head) for the *_heads forms."""
    return (isinstance(kq, types.Array) and kq.ndim == 3 and kq.dtype == types.int8
            and isinstance(ks, types.Array) and ks.ndim == 3 and ks.dtype == types.float32
            and all(isinstance(a, types.Array) and a.ndim == ndim and a.dtype == types.float32 for a in (s, q)))


def _float_row(builder, base, row_bytes, i):
    """float* to the row i of a scales array whose row (position) stride is row_bytes, from base (i8*)."""
    return builder.bitcast(builder.gep(base, [builder.mul(i, row_bytes)]), F.as_pointer())


def _kdot_codegen(rows, heads):
    """kdot's code for `heads` query rows (1: q and s 1-d) over R = rows positions, group by group: per
    position and head a chain of multiply-adds over the group's values, _reduce8 per head, and the R
    positions' group scales multiplied into each head's running total. Positions in passes of 8 for one
    head, 4 for three (attn_avx2._kdot_codegen); each K vector dequantized once for every head."""
    per = min(rows, 8 if heads == 1 else 4)

    def codegen(context, builder, signature, args):
        s_, o_, q_, kq_, ks_, p_, kh_, sc = args
        ty = signature.args
        hd = builder.extract_value(context.make_array(ty[2])(context, builder, q_).shape, ty[2].ndim - 1)
        n_g = builder.extract_value(context.make_array(ty[4])(context, builder, ks_).shape, 2)
        gs = builder.udiv(hd, n_g)
        qrow = _head_rows(context, builder, ty[2], q_, heads)
        krow = [builder.bitcast(_elem_ptr(context, builder, ty[3], kq_, [builder.add(p_, _i(r)), kh_]),
                                I8.as_pointer()) for r in range(rows)]
        srow = [_elem_ptr(context, builder, ty[4], ks_, [builder.add(p_, _i(r)), kh_]) for r in range(rows)]
        acc = [[cgutils.alloca_once(builder, V8F) for _ in range(heads)] for _ in range(per)]
        tot = [cgutils.alloca_once_value(builder, ZERO) for _ in range(heads)]
        fmuladd = _fn(builder, "llvm.fmuladd.v8f32", V8F, [V8F, V8F, V8F])
        with cgutils.for_range(builder, n_g) as grp:
            g = grp.index
            sums = [[] for _ in range(heads)]
            for first in range(0, rows, per):
                for a in acc:
                    for x in a:
                        builder.store(ZERO, x)
                with cgutils.for_range(builder, builder.udiv(gs, _i(8))) as blk:
                    off = builder.add(builder.mul(g, gs), builder.mul(blk.index, _i(8)))
                    qv = [_load_floats(builder, qrow[h], off) for h in range(heads)]
                    for r in range(per):
                        kv = _load_int8(builder, krow[first + r], off)
                        for h in range(heads):
                            _fma(builder, kv, qv[h], acc[r][h])
                for h in range(heads):
                    sums[h] += [builder.load(acc[r][h]) for r in range(per)]
            scales = ZERO
            for r in range(rows):
                scales = builder.insert_element(scales, builder.load(builder.gep(srow[r], [g])), ir.Constant(I32, r))
            for h in range(heads):
                red = _reduce8(builder, sums[h] + [ZERO] * (8 - rows))
                builder.store(builder.call(fmuladd, [red, scales, builder.load(tot[h])]), tot[h])
        for h in range(heads):
            row = None if heads == 1 else _i(h)
            _store_scores(context, builder, ty[0], s_, o_, builder.load(tot[h]), sc, rows, row)
        return context.get_dummy_value()
    return codegen


def _make_kdot(rows, heads=1):
    @intrinsic
    def kdot(typingctx, s, o, q, kq, ks, p, kh, scale):
        """s[o + r] <- scale * q . dequant(K[p + r, kh]) for r < R: s (>= o + R,) f32, q (hd,) f32
        contiguous, kq (cap, n_kv, hd) int8, ks (cap, n_kv, hd // gs) f32 with gs % 8 == 0. The *_heads
        forms: s[h, o + r] and q[h] for the GROUP_HEADS query heads that share KV head kh (2-d, rows by
        stride), the same bits as one call per head."""
        if not _q8_ok(s, q, kq, ks, 1 if heads == 1 else 2):
            return None
        return types.void(s, o, q, kq, ks, p, kh, scale), _kdot_codegen(rows, heads)
    return kdot


kdot8_q8 = _make_kdot(8)
kdot4_q8 = _make_kdot(4)
kdot8_q8_heads = _make_kdot(8, GROUP_HEADS)
kdot4_q8_heads = _make_kdot(4, GROUP_HEADS)
kdot8_q8_pairs = _make_kdot(8, 2)  # groups of 2 and 4 (Qwen3-0.6B / 1.7B / 4B, Llama-3.2-1B): two heads a call
kdot4_q8_pairs = _make_kdot(4, 2)


def _make_vsum(heads=1):
    @intrinsic
    def vsum(typingctx, acc, s, o, n, vq, vs, p, kh, ahead):
        """acc[:hd] += sum over i < n of s[o + i] * dequant(V[p + i, kh]): acc (>= hd,) f32, s (>= o + n,) f32,
        vq (cap, n_kv, hd) int8, vs (cap, n_kv, hd // gs) f32 with gs % 8 == 0. Per group, 32 lanes at a time
        (then 8) in registers over all n positions, one load and store of acc at the end. The *_heads form:
        acc[h] and s[h] for the GROUP_HEADS query heads that share KV head kh (2-d, rows by stride), each V
        vector dequantized once for them; the same bits as one call per head. `ahead` (int64): the address of
        the vq row (KV head 0) whose lines are asked for while row p's are read, as attn_avx2's f16 V sums take
        it (row p + i's stand-in at ahead + i row strides; each line by the pass that reads its first value)."""
        if not _q8_ok(acc, s, vq, vs, 1 if heads == 1 else 2) or not isinstance(ahead, types.Integer):
            return None
        return types.void(acc, s, o, n, vq, vs, p, kh, ahead), _vsum_codegen(heads)
    return vsum


def _vsum_codegen(heads):
    def codegen(context, builder, signature, args):
        a_, s_, o_, n_, vq_, vs_, p_, kh_, ahead = args
        ty = signature.args
        va = context.make_array(ty[4])(context, builder, vq_)
        sa = context.make_array(ty[5])(context, builder, vs_)
        hd = builder.extract_value(va.shape, 2)
        n_g = builder.extract_value(sa.shape, 2)
        gs = builder.udiv(hd, n_g)
        row_bytes = builder.extract_value(va.strides, 0)
        srow_bytes = builder.extract_value(sa.strides, 0)
        arow = _head_rows(context, builder, ty[0], a_, heads)
        wrow = _head_rows(context, builder, ty[1], s_, heads, o_)
        v0 = _elem_ptr(context, builder, ty[4], vq_, [p_, kh_])
        s0 = builder.bitcast(_elem_ptr(context, builder, ty[5], vs_, [p_, kh_]), I8.as_pointer())
        fetch0 = builder.add(ahead, builder.mul(kh_, builder.extract_value(va.strides, 1)))
        regs = [[cgutils.alloca_once(builder, V8F) for _ in range(4)] for _ in range(heads)]
        wide = [[cgutils.alloca_once(builder, _vf(LANES)) for _ in range(32 // LANES)] for _ in range(heads)]

        def lanes(g, base, width, n=8):
            """acc[base : base + n * width] (inside group g) += the weighted sum, in vectors of n lanes."""
            def weights(i):  # a position's score times its scale for the group
                scale = builder.load(builder.gep(_float_row(builder, s0, srow_bytes, i), [g]))
                return [builder.fmul(builder.load(builder.gep(r, [i])), scale) for r in wrow]
            starts_line = builder.icmp_unsigned("==", builder.and_(base, _i(63)), _i(0))

            def ask(i):  # the line of the row standing for position p + i whose first value this pass reads
                with builder.if_then(starts_line):
                    _ask_at(builder, fetch0, builder.add(builder.mul(i, row_bytes), base))
            _weighted_lanes(builder, n_, lambda i: builder.gep(v0, [builder.mul(i, row_bytes)]), weights, _load_int8,
                            arow, wide if n > 8 else regs, base, width, lanes=n, ask=ask)
        with cgutils.for_range(builder, n_g) as grp:
            g = grp.index
            g0 = builder.mul(g, gs)
            with cgutils.for_range(builder, builder.udiv(gs, _i(32))) as part:
                lanes(g, builder.add(g0, builder.mul(part.index, _i(32))), 32 // LANES, LANES)
            full32 = builder.mul(builder.udiv(gs, _i(32)), _i(32))
            with cgutils.for_range(builder, builder.udiv(builder.urem(gs, _i(32)), _i(8))) as part:
                lanes(g, builder.add(g0, builder.add(full32, builder.mul(part.index, _i(8)))), 1)
        return context.get_dummy_value()
    return codegen


vsum_q8 = _make_vsum()
vsum_q8_heads = _make_vsum(GROUP_HEADS)
vsum_q8_pairs = _make_vsum(2)


def group_scale(builder, chunks):
    """(d, 1 / d or 0) of a group whose values are the <16 x float> chunks: d = max|x| / 127 in float32, as
    ref.quantize_kv_int8 (and cpu._quant_rows' loop) compute it, to the bit."""
    v16 = ir.VectorType(F, 16)
    fabs = _fn(builder, "llvm.fabs.v16f32", v16, [v16])
    fmax = _fn(builder, "llvm.maxnum.v16f32", v16, [v16, v16])
    hmax = _fn(builder, "llvm.vector.reduce.fmax.v16f32", F, [v16])
    m = ir.Constant(v16, [0.0] * 16)
    for c in chunks:
        m = builder.call(fmax, [m, builder.call(fabs, [c])])
    d = builder.fdiv(builder.call(hmax, [m]), ir.Constant(F, 127.0))
    pos = builder.fcmp_ordered(">", d, ir.Constant(F, 0.0))
    return d, builder.select(pos, builder.fdiv(ir.Constant(F, 1.0), builder.select(pos, d, ir.Constant(F, 1.0))),
                             ir.Constant(F, 0.0))


def round_away(builder, y):
    """<16 x float> y -> <16 x i32> rounded half away from zero (ref.quantize_kv_int8's rounding)."""
    v16 = ir.VectorType(F, 16)
    copysign = _fn(builder, "llvm.copysign.v16f32", v16, [v16, v16])
    return builder.fptosi(builder.fadd(y, builder.call(copysign, [ir.Constant(v16, [0.5] * 16), y])),
                          ir.VectorType(I32, 16))


def _quantize_rows_codegen(context, builder, signature, args):
    q_, s_, x_, pos0 = args
    qa, sa, xa = (context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:3], (q_, s_, x_)))
    t_n, n_kv, hd = cgutils.unpack_tuple(builder, xa.shape, 3)
    n_g = builder.extract_value(sa.shape, 2)
    gs = builder.udiv(hd, n_g)
    qst, sst, xst = (cgutils.unpack_tuple(builder, a.strides, 3) for a in (qa, sa, xa))
    qb, sb, xb = (builder.bitcast(a.data, I8.as_pointer()) for a in (qa, sa, xa))
    v16 = ir.VectorType(F, 16)
    with cgutils.for_range(builder, t_n) as tl, cgutils.for_range(builder, n_kv) as hl:
        t, h = tl.index, hl.index
        x_row = builder.add(builder.mul(t, xst[0]), builder.mul(h, xst[1]))
        p = builder.add(pos0, t)
        q_row = builder.add(builder.mul(p, qst[0]), builder.mul(h, qst[1]))
        s_row = builder.add(builder.mul(p, sst[0]), builder.mul(h, sst[1]))
        with cgutils.for_range(builder, n_g) as gl:
            g0 = builder.mul(gl.index, gs)

            def chunk(c):  # x's 16 values at g0 + 16 c
                at = builder.add(x_row, builder.mul(builder.add(g0, builder.mul(c, _i(16))), _i(4)))
                return builder.load(builder.bitcast(builder.gep(xb, [at]), v16.as_pointer()), align=4)
            amax = cgutils.alloca_once_value(builder, ir.Constant(v16, [0.0] * 16))  # the group's max|x| lanes
            fabs = _fn(builder, "llvm.fabs.v16f32", v16, [v16])
            with cgutils.for_range(builder, builder.udiv(gs, _i(16))) as cl:
                builder.store(builder.call(_fn(builder, "llvm.maxnum.v16f32", v16, [v16, v16]),
                                           [builder.load(amax), builder.call(fabs, [chunk(cl.index)])]), amax)
            sc, inv = group_scale(builder, [builder.load(amax)])
            builder.store(sc, builder.bitcast(builder.gep(sb, [builder.add(s_row, builder.mul(gl.index, sst[2]))]),
                                              F.as_pointer()))
            with cgutils.for_range(builder, builder.udiv(gs, _i(16))) as cl:
                # |x| / d <= 127 up to rounding, so the clip to +-127 of the loop is a clip of the integers
                r = round_away(builder, builder.fmul(chunk(cl.index), _splat(builder, inv, v16)))
                lim = ir.Constant(ir.VectorType(I32, 16), [127] * 16)
                r = builder.select(builder.icmp_signed(">", r, lim), lim, r)
                r = builder.select(builder.icmp_signed("<", r, builder.neg(lim)), builder.neg(lim), r)
                qi = builder.trunc(r, ir.VectorType(I8, 16))
                at = builder.add(q_row, builder.add(g0, builder.mul(cl.index, _i(16))))
                builder.store(qi, builder.bitcast(builder.gep(qb, [at]), ir.VectorType(I8, 16).as_pointer()), align=1)
    return context.get_dummy_value()


@intrinsic
def quantize_rows_q8(typingctx, q, s, x, pos0):
    """q (cap, n_kv, hd) int8, s (cap, n_kv, hd // gs) f32 [pos0 + t] <- x (T, n_kv, hd) f32 quantized per gs
    values (ref.quantize_kv_int8, the same bits as cpu._quant_rows' loop) in 16-lane vectors: generic LLVM
    vector code (two 8-lane halves on AVX2). Needs gs % 16 == 0 and every last axis contiguous (the caller
    checks)."""
    ok = (isinstance(q, types.Array) and q.ndim == 3 and q.dtype == types.int8
          and isinstance(s, types.Array) and s.ndim == 3 and s.dtype == types.float32
          and isinstance(x, types.Array) and x.ndim == 3 and x.dtype == types.float32
          and isinstance(pos0, types.Integer))
    if not ok:
        return None
    return types.void(q, s, x, types.int64), _quantize_rows_codegen
