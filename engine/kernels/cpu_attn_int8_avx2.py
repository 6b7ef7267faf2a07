"""Decode attention's two inner loops over an int8 KV cache, written as LLVM IR (numba intrinsics).

The int8 cache holds, per (position, KV head), hd int8 values and hd // gs float32 scales, one per gs values
(ref.quantize_kv_int8). The loops here are cpu_attn_avx2's kdot / vsum with the f16 load swapped for an
int8 one (vpmovsxbd + vcvtdq2ps: 8 values to 8 floats) and the group scales applied:
- `kdot8_q8` / `kdot4_q8`: R positions' dot products with one query row, group by group: R accumulators in
  registers over the group's values, one transposing reduction (cpu_attn_avx2._reduce8) per group, and the
  R partial sums multiplied by the R positions' scales of that group into the running total.
- `vsum_q8`: the weighted sum over n positions, 32 lanes (or 8) of one group in registers over all
  positions; a position's weight is its score times its scale for the group.
- `kdot8_q8_heads` / `kdot4_q8_heads` / `vsum_q8_heads`: the same for the GROUP_HEADS query heads that share
  a KV head, each K / V vector dequantized once (as cpu_attn_avx2's *_heads forms; the same bits).
A cache row is 72 bytes per (position, head) at hd 64 instead of f16's 128, but the dequantizing loads
(sign-extend, convert) and a reduction per group cost more instructions than F16C's one conversion: at
512-640 context the step decodes about as fast as over an f16 cache (bench/results-cpu.md).

Both need gs % 8 == 0 (every block of 8 values inside one group): cpu_attn_int8 runs them (through
cpu_attn's positions-outer item) only then, and its numba loops otherwise. The sums run in another order
than those loops: results agree to float rounding, not bit for bit.
"""
from __future__ import annotations

from .. import numba_env  # noqa: F401  (flags before numba)

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .cpu_attn_avx2 import (F, GROUP_HEADS, I8, I32, V8F, ZERO, _elem_ptr, _fma8, _floats8, _i, _reduce8,
                             _store_scores)
from .cpu_avx2 import _fn, _splat

V8I8, V8I32 = ir.VectorType(I8, 8), ir.VectorType(I32, 8)


def _bytes8(builder, p, off):
    """8 int8 at p[off] (i8*) -> <8 x float>."""
    v = builder.load(builder.bitcast(builder.gep(p, [off]), V8I8.as_pointer()), align=1)
    return builder.sitofp(builder.sext(v, V8I32), V8F)


def _q8_ok(s, q, kq, ks):
    return (isinstance(kq, types.Array) and kq.ndim == 3 and kq.dtype == types.int8
            and isinstance(ks, types.Array) and ks.ndim == 3 and ks.dtype == types.float32
            and all(isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32 for a in (s, q)))


def _q8_heads_ok(s, q, kq, ks):
    return (isinstance(kq, types.Array) and kq.ndim == 3 and kq.dtype == types.int8
            and isinstance(ks, types.Array) and ks.ndim == 3 and ks.dtype == types.float32
            and all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32 for a in (s, q)))


def _float_row(builder, base, row_bytes, i):
    """float* to the row i of a scales array whose row (position) stride is row_bytes, from base (i8*)."""
    return builder.bitcast(builder.gep(base, [builder.mul(i, row_bytes)]), F.as_pointer())


def _make_kdot(rows):
    @intrinsic
    def kdot(typingctx, s, o, q, kq, ks, p, kh, scale):
        """s[o + r] <- scale * q . dequant(K[p + r, kh]) for r < R: s (>= o + R,) f32, q (hd,) f32
        contiguous, kq (cap, n_kv, hd) int8, ks (cap, n_kv, hd // gs) f32 with gs % 8 == 0."""
        if not _q8_ok(s, q, kq, ks):
            return None
        sig = types.void(s, o, q, kq, ks, p, kh, scale)

        def codegen(context, builder, signature, args):
            s_, o_, q_, kq_, ks_, p_, kh_, sc = args
            ty = signature.args
            qa = context.make_array(ty[2])(context, builder, q_)
            hd = builder.extract_value(qa.shape, 0)
            n_g = builder.extract_value(context.make_array(ty[4])(context, builder, ks_).shape, 2)
            gs = builder.udiv(hd, n_g)
            krow = [builder.bitcast(_elem_ptr(context, builder, ty[3], kq_, [builder.add(p_, _i(r)), kh_]),
                                    I8.as_pointer()) for r in range(rows)]
            srow = [_elem_ptr(context, builder, ty[4], ks_, [builder.add(p_, _i(r)), kh_]) for r in range(rows)]
            acc = [cgutils.alloca_once(builder, V8F) for _ in range(rows)]
            tot = cgutils.alloca_once_value(builder, ZERO)
            fmuladd = _fn(builder, "llvm.fmuladd.v8f32", V8F, [V8F, V8F, V8F])
            with cgutils.for_range(builder, n_g) as grp:
                g = grp.index
                for a in acc:
                    builder.store(ZERO, a)
                with cgutils.for_range(builder, builder.udiv(gs, _i(8))) as blk:
                    off = builder.add(builder.mul(g, gs), builder.mul(blk.index, _i(8)))
                    qv = _floats8(builder, qa.data, off)
                    for r in range(rows):
                        _fma8(builder, _bytes8(builder, krow[r], off), qv, acc[r])
                sums = _reduce8(builder, [builder.load(a) for a in acc] + [ZERO] * (8 - rows))
                scales = ZERO
                for r in range(rows):
                    scales = builder.insert_element(scales, builder.load(builder.gep(srow[r], [g])),
                                                    ir.Constant(I32, r))
                builder.store(builder.call(fmuladd, [sums, scales, builder.load(tot)]), tot)
            _store_scores(context, builder, ty[0], s_, o_, builder.load(tot), sc, rows)
            return context.get_dummy_value()
        return sig, codegen
    return kdot


kdot8_q8 = _make_kdot(8)
kdot4_q8 = _make_kdot(4)


def _make_kdot_heads(rows, heads=GROUP_HEADS):
    @intrinsic
    def kdot_heads(typingctx, s, o, q, kq, ks, p, kh, scale):
        """s[h, o + r] <- scale * q[h] . dequant(K[p + r, kh]) for h < GROUP_HEADS (query heads that share KV
        head kh), r < R: s (>= H, >= o + R) and q (>= H, hd) f32, rows by stride, kq / ks as for kdot. Each K
        vector is dequantized once for the H heads; every (head, position) keeps kdot's chain and
        reductions, so the scores are the same bits as H calls of kdot. Positions in fours (4 x H
        accumulators in registers)."""
        if not _q8_heads_ok(s, q, kq, ks):
            return None
        sig = types.void(s, o, q, kq, ks, p, kh, scale)

        def codegen(context, builder, signature, args):
            s_, o_, q_, kq_, ks_, p_, kh_, sc = args
            ty = signature.args
            hd = builder.extract_value(context.make_array(ty[2])(context, builder, q_).shape, 1)
            n_g = builder.extract_value(context.make_array(ty[4])(context, builder, ks_).shape, 2)
            gs = builder.udiv(hd, n_g)
            qrow = [_elem_ptr(context, builder, ty[2], q_, [_i(h)]) for h in range(heads)]
            krow = [builder.bitcast(_elem_ptr(context, builder, ty[3], kq_, [builder.add(p_, _i(r)), kh_]),
                                    I8.as_pointer()) for r in range(rows)]
            srow = [_elem_ptr(context, builder, ty[4], ks_, [builder.add(p_, _i(r)), kh_]) for r in range(rows)]
            acc = [[cgutils.alloca_once(builder, V8F) for _ in range(heads)] for _ in range(4)]
            tot = [cgutils.alloca_once_value(builder, ZERO) for _ in range(heads)]
            fmuladd = _fn(builder, "llvm.fmuladd.v8f32", V8F, [V8F, V8F, V8F])
            with cgutils.for_range(builder, n_g) as grp:
                g = grp.index
                sums = [[] for _ in range(heads)]
                for four in range(rows // 4):
                    for a in acc:
                        for x in a:
                            builder.store(ZERO, x)
                    with cgutils.for_range(builder, builder.udiv(gs, _i(8))) as blk:
                        off = builder.add(builder.mul(g, gs), builder.mul(blk.index, _i(8)))
                        qv = [_floats8(builder, qrow[h], off) for h in range(heads)]
                        for r in range(4):
                            kv = _bytes8(builder, krow[4 * four + r], off)
                            for h in range(heads):
                                _fma8(builder, kv, qv[h], acc[r][h])
                    for h in range(heads):
                        sums[h] += [builder.load(acc[r][h]) for r in range(4)]
                scales = ZERO
                for r in range(rows):
                    scales = builder.insert_element(scales, builder.load(builder.gep(srow[r], [g])),
                                                    ir.Constant(I32, r))
                for h in range(heads):
                    red = _reduce8(builder, sums[h] + [ZERO] * (8 - rows))
                    builder.store(builder.call(fmuladd, [red, scales, builder.load(tot[h])]), tot[h])
            for h in range(heads):
                _store_scores(context, builder, ty[0], s_, o_, builder.load(tot[h]), sc, rows, _i(h))
            return context.get_dummy_value()
        return sig, codegen
    return kdot_heads


kdot8_q8_heads = _make_kdot_heads(8)
kdot4_q8_heads = _make_kdot_heads(4)


@intrinsic
def vsum_q8(typingctx, acc, s, o, n, vq, vs, p, kh):
    """acc[:hd] += sum over i < n of s[o + i] * dequant(V[p + i, kh]): acc (>= hd,) f32, s (>= o + n,) f32,
    vq (cap, n_kv, hd) int8, vs (cap, n_kv, hd // gs) f32 with gs % 8 == 0. Per group, 32 lanes at a time
    (then 8) in registers over all n positions, one load and store of acc at the end."""
    if not _q8_ok(acc, s, vq, vs):
        return None
    sig = types.void(acc, s, o, n, vq, vs, p, kh)

    def codegen(context, builder, signature, args):
        a_, s_, o_, n_, vq_, vs_, p_, kh_ = args
        ty = signature.args
        va = context.make_array(ty[4])(context, builder, vq_)
        sa = context.make_array(ty[5])(context, builder, vs_)
        hd = builder.extract_value(va.shape, 2)
        n_g = builder.extract_value(sa.shape, 2)
        gs = builder.udiv(hd, n_g)
        row_bytes = builder.extract_value(va.strides, 0)
        srow_bytes = builder.extract_value(sa.strides, 0)
        arow = context.make_array(ty[0])(context, builder, a_).data
        wrow = _elem_ptr(context, builder, ty[1], s_, [o_])
        v0 = _elem_ptr(context, builder, ty[4], vq_, [p_, kh_])
        s0 = builder.bitcast(_elem_ptr(context, builder, ty[5], vs_, [p_, kh_]), I8.as_pointer())
        regs = [cgutils.alloca_once(builder, V8F) for _ in range(4)]

        def lanes(g, base, width):
            """acc[base : base + 8 * width] (inside group g) += the weighted sum."""
            for r in regs[:width]:
                builder.store(ZERO, r)
            with cgutils.for_range(builder, n_) as loop:
                i = loop.index
                vrow = builder.gep(v0, [builder.mul(i, row_bytes)])
                scale = builder.load(builder.gep(_float_row(builder, s0, srow_bytes, i), [g]))
                w = _splat(builder, builder.fmul(builder.load(builder.gep(wrow, [i])), scale), V8F)
                for c, r in enumerate(regs[:width]):
                    _fma8(builder, _bytes8(builder, vrow, builder.add(base, _i(8 * c))), w, r)
            for c, r in enumerate(regs[:width]):
                dst = builder.bitcast(builder.gep(arow, [builder.add(base, _i(8 * c))]), V8F.as_pointer())
                builder.store(builder.fadd(builder.load(dst, align=4), builder.load(r)), dst, align=4)
        with cgutils.for_range(builder, n_g) as grp:
            g = grp.index
            g0 = builder.mul(g, gs)
            with cgutils.for_range(builder, builder.udiv(gs, _i(32))) as part:
                lanes(g, builder.add(g0, builder.mul(part.index, _i(32))), 4)
            full32 = builder.mul(builder.udiv(gs, _i(32)), _i(32))
            with cgutils.for_range(builder, builder.udiv(builder.urem(gs, _i(32)), _i(8))) as part:
                lanes(g, builder.add(g0, builder.add(full32, builder.mul(part.index, _i(8)))), 1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def vsum_q8_heads(typingctx, acc, s, o, n, vq, vs, p, kh):
    """acc[h, :hd] += sum over i < n of s[h, o + i] * dequant(V[p + i, kh]) for h < GROUP_HEADS: acc (>= H,
    >= hd) and s (>= H, >= o + n) f32, rows by stride, vq / vs as for vsum_q8. Each V vector is dequantized
    once for the H heads; every lane keeps vsum_q8's chain (a position's weight: its score times its
    scale), so the sums are the same bits as H calls of vsum_q8."""
    if not _q8_heads_ok(acc, s, vq, vs):
        return None
    sig = types.void(acc, s, o, n, vq, vs, p, kh)
    heads = GROUP_HEADS

    def codegen(context, builder, signature, args):
        a_, s_, o_, n_, vq_, vs_, p_, kh_ = args
        ty = signature.args
        va = context.make_array(ty[4])(context, builder, vq_)
        sa = context.make_array(ty[5])(context, builder, vs_)
        hd = builder.extract_value(va.shape, 2)
        n_g = builder.extract_value(sa.shape, 2)
        gs = builder.udiv(hd, n_g)
        row_bytes = builder.extract_value(va.strides, 0)
        srow_bytes = builder.extract_value(sa.strides, 0)
        arow = [_elem_ptr(context, builder, ty[0], a_, [_i(h)]) for h in range(heads)]
        wrow = [_elem_ptr(context, builder, ty[1], s_, [_i(h), o_]) for h in range(heads)]
        v0 = _elem_ptr(context, builder, ty[4], vq_, [p_, kh_])
        s0 = builder.bitcast(_elem_ptr(context, builder, ty[5], vs_, [p_, kh_]), I8.as_pointer())
        regs = [[cgutils.alloca_once(builder, V8F) for _ in range(4)] for _ in range(heads)]

        def lanes(g, base, width):
            for rh in regs:
                for r in rh[:width]:
                    builder.store(ZERO, r)
            with cgutils.for_range(builder, n_) as loop:
                i = loop.index
                vrow = builder.gep(v0, [builder.mul(i, row_bytes)])
                scale = builder.load(builder.gep(_float_row(builder, s0, srow_bytes, i), [g]))
                w = [_splat(builder, builder.fmul(builder.load(builder.gep(wrow[h], [i])), scale), V8F)
                     for h in range(heads)]
                for c in range(width):
                    vv = _bytes8(builder, vrow, builder.add(base, _i(8 * c)))
                    for h in range(heads):
                        _fma8(builder, vv, w[h], regs[h][c])
            for h in range(heads):
                for c, r in enumerate(regs[h][:width]):
                    dst = builder.bitcast(builder.gep(arow[h], [builder.add(base, _i(8 * c))]), V8F.as_pointer())
                    builder.store(builder.fadd(builder.load(dst, align=4), builder.load(r)), dst, align=4)
        with cgutils.for_range(builder, n_g) as grp:
            g = grp.index
            g0 = builder.mul(g, gs)
            with cgutils.for_range(builder, builder.udiv(gs, _i(32))) as part:
                lanes(g, builder.add(g0, builder.mul(part.index, _i(32))), 4)
            full32 = builder.mul(builder.udiv(gs, _i(32)), _i(32))
            with cgutils.for_range(builder, builder.udiv(builder.urem(gs, _i(32)), _i(8))) as part:
                lanes(g, builder.add(g0, builder.add(full32, builder.mul(part.index, _i(8)))), 1)
        return context.get_dummy_value()
    return sig, codegen
