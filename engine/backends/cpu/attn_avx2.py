"""Decode attention's two inner loops over an f16 KV cache, written as LLVM IR (numba intrinsics).

Why IR: numba's scalar loops left attention at ~14 cycles per (position, head) for the scores and ~15 for
the weighted V sum (64-wide heads, 600 positions, one thread). The score loop vectorized over the head
dimension, so every position ended in a horizontal sum plus loop setup; the V loop loaded and stored the
accumulator row every few positions. Here:
- `kdot8` / `kdot4`: R positions' dot products with one query row. R accumulators of 8 lanes (16 where the
  target has AVX-512: SCORE_LANES) stay in registers over the head dimension, and one transposing
  reduction (shuffles + adds) turns them into the R scores at once: no per-position horizontal sum.
- `vsum`: the weighted sum over n positions of one head, 32 lanes of the accumulator row in registers
  over all positions (a loop in IR), written back once; 64 lanes in 16-lane vectors where the target has
  AVX-512 (LANES: half the conversions and FMAs, the same bits).
Both read the f16 bits with vcvtph2ps (F16C) and multiply-add with llvm.fmuladd (FMA where the CPU has it),
and take any head_dim >= 8: a last partial block of 8 is read ending at the row's end, the lanes already
counted masked off (so no second, scalar form has to be compiled next to them: that cost 5 s of compile).
Measured on the 2-core dev host (scripts/attn_parts.py): ~7-8.5 and ~6-7 cycles per (position, head).
That is vcvtph2ps' rate (one per cycle here, one per 8 multiply-adds), not the FMA units' (two per cycle):
- `kdot8_heads` / `kdot4_heads` / `vsum_heads`: the same loops for the GROUP_HEADS query heads that share a
  KV head, each K / V vector converted once and used three times; every (head, position) or lane keeps its
  own chain of multiply-adds in the one-head order, so the results are the same bits. (A 2026-11-30 try
  with 8 positions x 3 heads of accumulators spilled and was slower on AVX2's 16 registers; 4 positions x
  3 heads fit. AVX-512's 32 registers hold 8 x 3 of 16 lanes.)
  On the Xeon host of 2026-12-02 the grouped scores were bound by ports 0 and 5 (FMAs, the two uops of each
  vcvtph2ps, the reduction's shuffles), not by memory: 16 lanes and _reduce16 (no fold of each 16-lane
  accumulator to 8 before the 8-lane reduction: 16 shuffles and 8 adds per 8 scores instead of 23 and 15)
  took scores at 600 positions from 9.1 to 8.1 us per layer (one thread, cache-hot), the step's
  attention at 600-639 positions from 722 to 674 us per token (history file).
`kdot8_f32` / `vsum_f32` are the same loops over rows already converted to f32 (a prompt's blocks in
attn_prefill, where every row serves a tile of queries); vsum_f32 keeps 64 lanes (8 chains of
multiply-adds) in registers, since there the loop is compute-bound, not waiting on memory.

Used by attn when the target has AVX2, FMA and F16C (attn.VECTOR_ATTN); attn's numba loops serve
the others. The sums run in another order than those loops: results agree to float rounding, not bit for bit.
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .avx2 import _const, _fn, _prefetch, _splat
from .target import target_has

I8, I16, I32, I64, F = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _vf(n):
    return ir.VectorType(F, n)


def _zero(n):
    return ir.Constant(_vf(n), [0.0] * n)


V8F, ZERO = _vf(8), _zero(8)
# Lanes per vector of the V sums' (vsum, vsum_heads, vsum_f32) main loop: 16 where the target has AVX-512
# (one vcvtph2ps and one FMA per 16 values; the 8-lane loops were bound by the conversions, one per cycle),
# else 8; the rest of a row (hd % 16) in 8 lanes. The same bits either way: a lane is one output value's
# chain over the positions.
LANES = 16 if target_has("avx512f") else 8
# Lanes of the scores' (kdot*) chains: 16 where the target has AVX-512 (one vcvtph2ps and one FMA per 16 K
# values, and 32 registers for 8 positions x 3 heads of accumulators), else 8. Unlike the V sums' lanes
# this changes the order of a dot product's sums, so the bits differ between the two targets (each
# target's grouped and one-head forms still agree bit for bit).
SCORE_LANES = 16 if target_has("avx512f") else 8
GROUP_HEADS = 3  # query heads per call of the *_heads forms (SmolLM2's GQA group; see _kdot_codegen)


def _i(x):
    return ir.Constant(I64, x)


def _shuf(builder, x, y, idx):
    return builder.shuffle_vector(x, y, _const(ir.VectorType(I32, len(idx)), idx))


def _reduce8(builder, a):
    """8 vectors <8 x float> -> one vector whose lane r is the sum of a[r]'s lanes (3 levels of pairwise
    shuffle + add: 7 adds for 8 sums)."""
    b = [builder.fadd(_shuf(builder, a[2 * k], a[2 * k + 1], [0, 1, 2, 3, 8, 9, 10, 11]),
                      _shuf(builder, a[2 * k], a[2 * k + 1], [4, 5, 6, 7, 12, 13, 14, 15])) for k in range(4)]
    # b[k]: lanes 0-3 partial sums of row 2k, lanes 4-7 of row 2k + 1
    c = [builder.fadd(_shuf(builder, b[2 * k], b[2 * k + 1], [0, 1, 8, 9, 4, 5, 12, 13]),
                      _shuf(builder, b[2 * k], b[2 * k + 1], [2, 3, 10, 11, 6, 7, 14, 15])) for k in range(2)]
    # c[k]: two lanes each of rows 4k, 4k + 2, 4k + 1, 4k + 3
    d = builder.fadd(_shuf(builder, c[0], c[1], [0, 8, 2, 10, 4, 12, 6, 14]),
                     _shuf(builder, c[0], c[1], [1, 9, 3, 11, 5, 13, 7, 15]))
    return _shuf(builder, d, d, [0, 4, 2, 6, 1, 5, 3, 7])  # d's lanes hold rows 0, 4, 2, 6, 1, 5, 3, 7


def _reduce16(builder, a):
    """8 vectors <16 x float> -> one <8 x float> whose lane r is the sum of a[r]'s lanes: _reduce8's pairwise
    shuffle + add over 16 lanes (4 levels, 15 adds for 8 sums), without first folding each vector to 8."""
    b = [builder.fadd(_shuf(builder, a[2 * k], a[2 * k + 1], list(range(8)) + list(range(16, 24))),
                      _shuf(builder, a[2 * k], a[2 * k + 1], list(range(8, 16)) + list(range(24, 32))))
         for k in range(4)]
    # b[k]: lanes 0-7 partial sums of row 2k, 8-15 of row 2k + 1
    lo2 = [0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27]
    c = [builder.fadd(_shuf(builder, b[2 * k], b[2 * k + 1], lo2), _shuf(builder, b[2 * k], b[2 * k + 1],
                                                                          [i + 4 for i in lo2])) for k in range(2)]
    # c[k]: four lanes each of rows 4k, 4k + 2, 4k + 1, 4k + 3
    lo3 = [0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29]
    d = builder.fadd(_shuf(builder, c[0], c[1], lo3), _shuf(builder, c[0], c[1], [i + 2 for i in lo3]))
    # d: lane pairs of rows 0, 4, 2, 6, 1, 5, 3, 7; the last level adds each pair and puts the rows in order
    order = [0, 4, 2, 6, 1, 5, 3, 7]
    return builder.fadd(_shuf(builder, d, d, [2 * order[r] for r in range(8)]),
                        _shuf(builder, d, d, [2 * order[r] + 1 for r in range(8)]))


def _elem_ptr(context, builder, arrty, arr, idx):
    """Pointer to arr[idx..., 0] (as many leading indices as given; the last axis contiguous), by strides."""
    a = context.make_array(arrty)(context, builder, arr)
    strides = cgutils.unpack_tuple(builder, a.strides, arrty.ndim)
    off = _i(0)
    for i, s in zip(idx, strides):
        off = builder.add(off, builder.mul(i, s))
    return builder.bitcast(builder.gep(builder.bitcast(a.data, I8.as_pointer()), [off]), a.data.type)


def _load_halves(builder, p, off, n=8):
    """n f16 bit patterns at p[off] (i16*) -> <n x float> (vcvtph2ps)."""
    v = builder.load(builder.bitcast(builder.gep(p, [off]), ir.VectorType(I16, n).as_pointer()), align=2)
    return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), n)), _vf(n))


def _load_floats(builder, p, off, n=8):
    return builder.load(builder.bitcast(builder.gep(p, [off]), _vf(n).as_pointer()), align=4)


def _fma(builder, a, b, acc_ptr):
    """*acc_ptr <- a * b + *acc_ptr (<8 x float>, or as wide as a; one FMA where the CPU has it)."""
    vt = a.type
    fmuladd = _fn(builder, f"llvm.fmuladd.v{vt.count}f32", vt, [vt, vt, vt])
    builder.store(builder.call(fmuladd, [a, b, builder.load(acc_ptr)]), acc_ptr)


def _kv_ok(s, q, k, kdt=types.uint16, ndim=1):
    """Types of a kdot / vsum call: K or V (cap, n_kv, hd) of kdt; the two f32 operands (s and q, or acc and
    s) 1-d for one head, 2-d (a row per head) for the *_heads forms."""
    return (isinstance(k, types.Array) and k.ndim == 3 and k.dtype == kdt
            and all(isinstance(a, types.Array) and a.ndim == ndim and a.dtype == types.float32 for a in (s, q)))


def _head_rows(context, builder, arrty, arr, heads, col=None):
    """Pointers to element col (default 0) of each head's row: the array itself for one head (1-d), its rows
    h < heads for the *_heads forms (2-d, by stride)."""
    if heads == 1:
        return [_elem_ptr(context, builder, arrty, arr, [] if col is None else [col])]
    return [_elem_ptr(context, builder, arrty, arr, [_i(h)] + ([] if col is None else [col])) for h in range(heads)]


def _row_loader(f32):
    """(pointer type, load of 8 values at an offset as <8 x float>) for a cache row of f16 bits or f32."""
    return (F.as_pointer(), _load_floats) if f32 else (I16.as_pointer(), _load_halves)


def _tail_mask(builder, hd):
    """<8 x i1> for the last 8 values of a row of hd (>= 8): lanes 8 - hd % 8 and up are the values the full
    blocks of 8 did not cover (none when hd is a multiple of 8)."""
    r = builder.trunc(builder.urem(hd, _i(8)), I32)
    first = _splat(builder, builder.sub(ir.Constant(I32, 8), r), ir.VectorType(I32, 8))
    return builder.icmp_unsigned(">=", _const(ir.VectorType(I32, 8), list(range(8))), first)


def _store_scores(context, builder, sty, s, o, tot, scale, rows, head=None):
    """s[o : o + rows] (s[head, o : o + rows] for a 2-d s) <- scale * the first rows lanes of tot (<8 x float>):
    a kdot's R scores."""
    tot = builder.fmul(tot, _splat(builder, scale, V8F))
    if rows < 8:
        tot = _shuf(builder, tot, tot, list(range(rows)))
    dst = _elem_ptr(context, builder, sty, s, [o] if head is None else [head, o])
    builder.store(tot, builder.bitcast(dst, ir.VectorType(F, rows).as_pointer()), align=4)


def _ask_at(builder, base, off):
    """Ask for the cache line at byte address base (i64) + off (avx2's prefetch: prefetcht1 on AVX-512)."""
    _prefetch(builder, builder.inttoptr(builder.add(base, off), I8.as_pointer()), 1)


def _kdot_codegen(load, rows, heads, fetch=False):
    """kdot's code for `heads` query rows (1: q and s 1-d) over R = rows positions: per position and head
    one chain of multiply-adds over the head dimension (SCORE_LANES lanes; a row's last hd % SCORE_LANES
    values in 8 lanes widened with zeros), then _reduce16 (_reduce8 for 8 lanes) per head. Positions
    in passes of `per`: 8 for one head (8 independent chains hide the FMA latency); for three, 4 in 16
    registers (AVX2) or 8 in 32 (AVX-512: 24 accumulators, 3 query vectors and a K vector); each K vector
    is converted once and serves every head."""
    lanes = SCORE_LANES
    per = min(rows, 8 if heads == 1 or lanes == 16 else 4)
    zero = _zero(lanes)

    def codegen(context, builder, signature, args):
        s_, o_, q_, k_, p_, kh_, sc = args[:7]
        ty = signature.args
        if fetch:  # the row standing for row p: ask for its lines as row p's are read (one per block read)
            ka = context.make_array(ty[3])(context, builder, k_)
            kstride = builder.extract_value(ka.strides, 0)
            fetch0 = builder.add(args[7], builder.mul(kh_, builder.extract_value(ka.strides, 1)))
        hd = builder.extract_value(context.make_array(ty[2])(context, builder, q_).shape, ty[2].ndim - 1)
        qrow = _head_rows(context, builder, ty[2], q_, heads)
        sums = [[] for _ in range(heads)]

        def wide(x, n):
            return x if n == lanes else _shuf(builder, x, ZERO, list(range(lanes)))
        for first in range(0, rows, per):
            krow = [_elem_ptr(context, builder, ty[3], k_, [builder.add(p_, _i(first + r)), kh_]) for r in range(per)]
            acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(heads)] for _ in range(per)]

            def block(off, n, mask=None):
                qv = [_load_floats(builder, qrow[h], off, n) for h in range(heads)]
                if mask is not None:
                    qv = [builder.select(mask, x, ZERO) for x in qv]
                qv = [wide(x, n) for x in qv]
                new_line = None
                if fetch and n == lanes:  # the blocks that start a line of the row
                    new_line = builder.icmp_unsigned("==", builder.and_(builder.mul(off, _i(2)), _i(63)), _i(0))
                for r in range(per):
                    if new_line is not None:
                        with builder.if_then(new_line):
                            _ask_at(builder, fetch0, builder.add(builder.mul(kstride, _i(first + r)),
                                                                 builder.mul(off, _i(2))))
                    kv = wide(load(builder, krow[r], off, n), n)
                    for h in range(heads):
                        _fma(builder, kv, qv[h], acc[r][h])
            with cgutils.for_range(builder, builder.udiv(hd, _i(lanes))) as loop:
                block(builder.mul(loop.index, _i(lanes)), lanes)
            if lanes > 8:
                base = builder.mul(builder.udiv(hd, _i(lanes)), _i(lanes))
                with cgutils.for_range(builder, builder.udiv(builder.urem(hd, _i(lanes)), _i(8))) as loop:
                    block(builder.add(base, builder.mul(loop.index, _i(8))), 8)
            with cgutils.if_unlikely(builder, builder.icmp_unsigned("!=", builder.urem(hd, _i(8)), _i(0))):
                block(builder.sub(hd, _i(8)), 8, _tail_mask(builder, hd))
            for h in range(heads):
                sums[h] += [builder.load(acc[r][h]) for r in range(per)]
        reduce = _reduce16 if lanes > 8 else _reduce8
        for h in range(heads):
            tot = reduce(builder, sums[h] + [zero] * (8 - rows))
            _store_scores(context, builder, ty[0], s_, o_, tot, sc, rows, None if heads == 1 else _i(h))
        return context.get_dummy_value()
    return codegen


def _make_kdot(rows, f32=False, heads=1, fetch=False):
    _, load = _row_loader(f32)
    kdt = types.float32 if f32 else types.uint16

    def typer(s, o, q, k, p, kh, scale, *ahead):
        """s[o + r] <- scale * q . K[p + r, kh] for r < R: s (>= o + R,) f32, q (hd,) f32 contiguous, K (cap,
        n_kv, hd) f16 bits (f32 values for the f32 form), hd >= 8 (ModelArgs checks); a last partial block of
        8 is read from hd - 8 with the values already counted masked off. The *_heads forms: s[h, o + r] and
        q[h] for the GROUP_HEADS query heads h that share KV head kh (2-d, rows by stride), each K vector
        converted once for them; every (head, position) keeps the one-head chain and reduction, so the
        scores are the same bits as one call per head."""
        if not _kv_ok(s, q, k, kdt, 1 if heads == 1 else 2):
            return None
        return types.void(s, o, q, k, p, kh, scale, *ahead), _kdot_codegen(load, rows, heads, fetch)
    return _form(typer, fetch)


def _form(typer, fetch):
    """The intrinsic of a kdot / vsum typer (seven arguments), with `ahead` after them where fetch."""
    if fetch:
        def form(typingctx, a0, a1, a2, a3, a4, a5, a6, ahead):
            return typer(a0, a1, a2, a3, a4, a5, a6, ahead)
    else:
        def form(typingctx, a0, a1, a2, a3, a4, a5, a6):
            return typer(a0, a1, a2, a3, a4, a5, a6)
    form.__doc__ = typer.__doc__ + (_FETCH_DOC if fetch else "")
    return intrinsic(form)


_FETCH_DOC = """
        The f16 forms' last argument `ahead` (int64): the address of the cache row (KV head 0) whose lines
        are asked for while row p's are read (row p + r's stand-in at ahead + r row strides; the V sums' the
        same for their positions): each line asked for as one is read, so the requests run with the sums
        at the rate they consume (attn_fetch.ROWS_AHEAD)."""


kdot8 = _make_kdot(8, fetch=True)
kdot4 = _make_kdot(4, fetch=True)
kdot8_heads = _make_kdot(8, heads=GROUP_HEADS, fetch=True)
kdot4_heads = _make_kdot(4, heads=GROUP_HEADS, fetch=True)
# groups of 2 and 4 (Qwen3-0.6B / 1.7B, Llama-3.2-1B, Qwen3-4B): two heads a call
kdot8_pairs = _make_kdot(8, heads=2, fetch=True)
kdot4_pairs = _make_kdot(4, heads=2, fetch=True)
kdot8_f32 = _make_kdot(8, f32=True)  # over rows already converted to f32 (attn_prefill's blocks)
kdot4_f32 = _make_kdot(4, f32=True)


def _make_vsum(f32=False, width=4, heads=1, fetch=False):
    ptr_ty, load = _row_loader(f32)
    kdt = types.float32 if f32 else types.uint16

    def typer(acc, s, o, n, v, p, kh, *ahead):
        """acc[:hd] += sum over i < n of s[o + i] * V[p + i, kh]: acc (>= hd,) f32, s (>= o + n,) f32, V (cap,
        n_kv, hd) f16 bits (f32 values for the f32 form), hd >= 8. Per LANES * width lanes of acc (then per 8,
        then a masked last 8): registers carried over all n positions, one load and store of acc at the end.
        The *_heads form: acc[h] and s[h] for the GROUP_HEADS query heads that share KV head kh (2-d, rows
        by stride), each V vector converted once for them; every lane keeps the one-head chain (the same
        bits as one call per head)."""
        if not _kv_ok(acc, s, v, kdt, 1 if heads == 1 else 2):
            return None
        return types.void(acc, s, o, n, v, p, kh, *ahead), _vsum_codegen(ptr_ty, load, width, heads, fetch)
    return _form(typer, fetch)


def _weighted_lanes(builder, n, row_at, weights_at, load, arow, regs, base, w, mask=None, lanes=8, ask=None):
    """The V sums' inner loop (f16, f32 or int8 rows): regs[h][c] (<lanes x float> allocas) <- the sum over
    i < n of weights_at(i)[h] (a float, splat to lanes once per position) * load(builder, row_at(i), base +
    lanes c) for c < w, each loaded vector serving every head h; then arow[h][base + lanes c : + lanes] +=
    regs[h][c] (lanes off in mask left as they are). A lane is one output value's chain over the positions,
    whatever `lanes`. ask(i), where given, asks for the lines standing for position i's (before they are read)."""
    vt = _vf(lanes)
    for rh in regs:
        for r in rh[:w]:
            builder.store(_zero(lanes), r)
    with cgutils.for_range(builder, n) as loop:
        i = loop.index
        vrow = row_at(i)
        wt = [_splat(builder, x, vt) for x in weights_at(i)]
        if ask is not None:
            ask(i)
        for c in range(w):
            vv = load(builder, vrow, builder.add(base, _i(lanes * c)), lanes)
            for h, rh in enumerate(regs):
                _fma(builder, vv, wt[h], rh[c])
    for h, rh in enumerate(regs):
        for c, r in enumerate(rh[:w]):
            dst = builder.bitcast(builder.gep(arow[h], [builder.add(base, _i(lanes * c))]), vt.as_pointer())
            add = builder.load(r) if mask is None else builder.select(mask, builder.load(r), _zero(lanes))
            builder.store(builder.fadd(builder.load(dst, align=4), add), dst, align=4)


def _vsum_codegen(ptr_ty, load, width, heads, fetch=False):
    """vsum's code, reading V rows through (ptr_ty, load) (_row_loader), width vectors of 8 lanes at a time,
    for `heads` rows of acc and s (1: 1-d)."""
    def codegen(context, builder, signature, args):
        a_, s_, o_, n_, v_, p_, kh_ = args[:7]
        ty = signature.args
        va = context.make_array(ty[4])(context, builder, v_)
        hd = builder.extract_value(va.shape, 2)
        row_bytes = builder.extract_value(va.strides, 0)
        arow = _head_rows(context, builder, ty[0], a_, heads)
        srow = _head_rows(context, builder, ty[1], s_, heads, o_)
        v0 = builder.bitcast(_elem_ptr(context, builder, ty[4], v_, [p_, kh_]), I8.as_pointer())
        regs = [[cgutils.alloca_once(builder, V8F) for _ in range(width)] for _ in range(heads)]
        wide = [[cgutils.alloca_once(builder, _vf(LANES)) for _ in range(width)] for _ in range(heads)] \
            if LANES > 8 else regs

        if fetch:
            fetch0 = builder.add(args[7], builder.mul(kh_, builder.extract_value(va.strides, 1)))

        def lanes(base, w, mask=None, n=8):
            """acc[base : base + n * w] += the weighted sum (lanes off in mask are left as they are)."""
            def row_at(i):
                return builder.bitcast(builder.gep(v0, [builder.mul(i, row_bytes)]), ptr_ty)

            def ask(i):  # the lines of this pass' values in the row standing for position p + i
                at = builder.add(builder.mul(i, row_bytes), builder.mul(base, _i(2)))
                for j in range(0, 2 * n * w, 64):
                    _ask_at(builder, fetch0, builder.add(at, _i(j)))
            _weighted_lanes(builder, n_, row_at, lambda i: [builder.load(builder.gep(r, [i])) for r in srow],
                            load, arow, wide if n > 8 else regs, base, w, mask, n, ask if fetch and n > 8 else None)
        span = LANES * width
        with cgutils.for_range(builder, builder.udiv(hd, _i(span))) as part:
            lanes(builder.mul(part.index, _i(span)), width, n=LANES)
        full8 = builder.udiv(builder.urem(hd, _i(span)), _i(8))
        with cgutils.for_range(builder, full8) as part:
            lanes(builder.add(builder.mul(builder.udiv(hd, _i(span)), _i(span)), builder.mul(part.index, _i(8))), 1)
        with cgutils.if_unlikely(builder, builder.icmp_unsigned("!=", builder.urem(hd, _i(8)), _i(0))):
            lanes(builder.sub(hd, _i(8)), 1, _tail_mask(builder, hd))
        return context.get_dummy_value()
    return codegen


vsum = _make_vsum(fetch=True)
vsum_heads = _make_vsum(heads=GROUP_HEADS, fetch=True)
vsum_pairs = _make_vsum(heads=2, fetch=True)
vsum_f32 = _make_vsum(f32=True, width=64 // LANES)  # 64 lanes, 8 chains of 8 or 4 of 16: prefill is compute-bound
