"""Decode attention's scores over an int8 KV cache in integer dot products (AVX512-VNNI), as LLVM IR.

llama.cpp scores a q8_0 K cache by quantizing the query to q8_0 too (int8 per 32 values and a scale) and
multiplying the blocks in integers. Here `scores_q8_vnni` does the same with a finer query, for a work
item's positions lo:lo + n and every query head:
- the item's query rows are quantized once into a buffer on the stack, per 32 values in 16 bits as two int8
  parts: hi = round(x / d) with d = max|x| / 127 (ref.quantize_kv_int8's rounding), lo = round(256 (x / d -
  hi)); with each group's scale d / 256 and 128 x its sum of 256 hi + lo;
- per 8 positions and KV head, each K row block of 64 int8 (one 512-bit vector) is read once and made
  unsigned (xor 0x80: k + 128); per query head vpdpbusd multiplies it by the 64 hi quants (4 products a lane),
  the sums are shifted up 8 bits and a second vpdpbusd adds the lo quants' products: sum (k + 128)(256 hi +
  lo), under 2^31, from which the group's 128 sum (256 hi + lo) is subtracted;
- one transposing reduction turns the 8 positions' 16-lane sums into 16 group sums (lane 2r + j: position
  r, group j of the block), converted to float and multiplied by the query's and the positions' scales
  (the K scales of the 8 positions in one gather).
A query in 8 bits (llama.cpp's q8_0) cost the teacher-forced agreement with llama.cpp 0.3 points (95.77%
against the float query's 96.07%, one token per pass); in 16 bits it reads 96.36%, and the scores are
within ~1e-4 of the float query's. Per (position, KV head): one load and xor, and per query head two
vpdpbusd, a shift and ~2.6 shuffles / adds, where attn_int8_avx2's kdot_q8 sign-extends and converts
every 8 values and reduces per group of 32: scores at 600 positions 11.9 -> 7.7 us per layer, one thread,
cache-hot (2026-12-03). The same loop asks for each line of the K rows as it reads the line ROWS_AHEAD positions
before it; the V sums (attn_int8_avx2's vsum_q8 forms) ask for their lines the same way.

The scores are ref.attention_int8_q16's. Needs hd % 64 == 0 and 32-value scale groups, at most GMAX query
heads per KV head and the buffers' sizes (usable(): attn_int8 runs the other kernels otherwise).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .attn_avx2 import F, I8, I32, I64, _shuf
from .attn_fetch import ROWS_AHEAD
from .attn_int8_avx2 import group_scale, round_away
from .avx2 import PREFETCH_LOCALITY, _const, _fn, _prefetch, _splat
from .target import target_has

VNNI512 = target_has("avx512vnni") and target_has("avx512bw")
QBYTES = 8192  # query values on the stack (two bytes each): heads * head_dim at most (64 heads of 128)
QGROUPS = 256  # query groups (scale, correction): heads * head_dim / 32 at most
GMAX = 8  # query heads per KV head at most
# K rows: each 64-byte line asked for as the one attn_fetch.ROWS_AHEAD positions before it is read (bursts of a
# block's rows stall the core while the memory queue drains them), the item's first ones and the scales (a line or
# two a position) in bursts, into L2 (avx2.PREFETCH_LOCALITY; they went to L1 before, holding its few fill buffers
# for a DRAM round trip)

V16F, V16I = ir.VectorType(F, 16), ir.VectorType(I32, 16)


@njit(cache=True, nogil=True, inline="always")
def usable(n_head, n_kv, hd, n_g):
    """Whether scores_q8_vnni serves this shape (the CPU's AVX512-VNNI is VNNI512's to check)."""
    return (hd % 64 == 0 and n_g * 32 == hd and n_head % n_kv == 0 and n_head // n_kv <= GMAX
            and n_head * hd <= QBYTES and n_head * n_g <= QGROUPS)


def _i(x):
    return ir.Constant(I64, x)


def _reduce_halves(builder, d):
    """8 vectors <16 x i32> (positions r) -> one <16 x i32> whose lane 2r + j is the sum of d[r]'s lanes
    8j..8j + 7 (group j of a 64-value block): three levels of pairwise shuffle + add (7 adds in all)."""
    lo1 = [0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27]
    b = [builder.add(_shuf(builder, d[2 * k], d[2 * k + 1], lo1),
                     _shuf(builder, d[2 * k], d[2 * k + 1], [i + 4 for i in lo1])) for k in range(4)]
    # b[k]: 4-lane segments of (2k, group 0), (2k + 1, 0), (2k, 1), (2k + 1, 1)
    lo2 = [0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29]
    c = [builder.add(_shuf(builder, b[2 * k], b[2 * k + 1], lo2),
                     _shuf(builder, b[2 * k], b[2 * k + 1], [i + 2 for i in lo2])) for k in range(2)]
    # c[k]: 2-lane segments of positions 4k + (0, 2, 1, 3) in group 0, then the same in group 1
    seg = {0: 0, 2: 1, 1: 2, 3: 3}
    first = [(16 if r >= 4 else 0) + 2 * (4 * j + seg[r % 4]) for r in range(8) for j in range(2)]
    return builder.add(_shuf(builder, c[0], c[1], first), _shuf(builder, c[0], c[1], [i + 1 for i in first]))


def _prefetch_rows(builder, base, row_bytes, p0, p1):
    """Ask for the bytes of rows p0:p1 (row_bytes apart, from byte pointer base), a line at a time."""
    pf = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    start = builder.mul(p0, row_bytes)
    lines = builder.udiv(builder.add(builder.mul(builder.sub(p1, p0), row_bytes), _i(63)), _i(64))
    with cgutils.for_range(builder, lines) as ln:
        at = builder.gep(base, [builder.add(start, builder.mul(ln.index, _i(64)))])
        builder.call(pf, [at, ir.Constant(I32, 0), ir.Constant(I32, PREFETCH_LOCALITY), ir.Constant(I32, 1)])


def _quantize_queries(builder, qrow, n_q, hd, n_g, qbuf, qsc, qcor):
    """Query h's values in 16 bits per 32-value group g as two int8 parts (hi = round(x / d) with d = max|x| /
    127, ref.quantize_kv_int8's rounding; lo = round(256 (x / d - hi)), clipped to +-127):
    qbuf[h * 2 hd + 128 b + 32 j + i] <- hi of value i of group 2b + j, 64 bytes on the lo; qsc[h * n_g + g]
    <- d / 256 (exact), qcor[...] <- 128 x the group's sum of 256 hi + lo. qrow(h) is a float* to row h."""
    hadd = _fn(builder, "llvm.vector.reduce.add.v16i32", I32, [V16I])
    smin = _fn(builder, "llvm.smin.v16i32", V16I, [V16I, V16I])
    smax = _fn(builder, "llvm.smax.v16i32", V16I, [V16I, V16I])
    with cgutils.for_range(builder, n_q) as hl:
        h = hl.index
        with cgutils.for_range(builder, n_g) as gl:
            g = gl.index
            src = builder.gep(qrow(h), [builder.mul(g, _i(32))])
            x = [builder.load(builder.bitcast(builder.gep(src, [_i(16 * j)]), V16F.as_pointer()), align=4)
                 for j in range(2)]
            d, inv = group_scale(builder, x)
            at = builder.add(builder.add(builder.mul(h, builder.mul(hd, _i(2))),
                                         builder.mul(builder.udiv(g, _i(2)), _i(128))),
                             builder.mul(builder.urem(g, _i(2)), _i(32)))
            total = _const(V16I, 0)
            for j in range(2):
                y = builder.fmul(x[j], _splat(builder, inv, V16F))
                hi = round_away(builder, y)
                lo = round_away(builder, builder.fmul(builder.fsub(y, builder.sitofp(hi, V16F)), _const(V16F, 256.0)))
                lo = builder.call(smax, [builder.call(smin, [lo, _const(V16I, 127)]), _const(V16I, -127)])
                total = builder.add(total, builder.add(builder.shl(hi, _const(V16I, 8)), lo))
                for part, off in ((hi, 0), (lo, 64)):
                    dst = builder.gep(qbuf, [builder.add(at, _i(16 * j + off))])
                    builder.store(builder.trunc(part, ir.VectorType(I8, 16)),
                                  builder.bitcast(dst, ir.VectorType(I8, 16).as_pointer()), align=1)
            gi = builder.add(builder.mul(h, n_g), g)
            builder.store(builder.fmul(d, ir.Constant(F, 1.0 / 256)), builder.gep(qsc, [gi]))
            builder.store(builder.mul(builder.call(hadd, [total]), ir.Constant(I32, 128)), builder.gep(qcor, [gi]))


def _pair(builder, ptr, at, et):
    """<16 x et>: ptr[at], ptr[at + 1] repeated (lane 2r + j: group j of a block)."""
    two = builder.load(builder.bitcast(builder.gep(ptr, [at]), ir.VectorType(et, 2).as_pointer()), align=4)
    return _shuf(builder, two, two, [0, 1] * 8)


def _gather_scales(builder, sbase, sst, rows, kh, b):
    """<16 x float>: lane 2r + j the scale of group 2b + j of K row (rows[r], kh) (vgather)."""
    vi = ir.VectorType(I64, 16)
    row = _const(vi, 0)
    for r in range(8):
        for j in range(2):
            row = builder.insert_element(row, rows[r], ir.Constant(I32, 2 * r + j))
    at = builder.add(builder.mul(kh, sst[1]), builder.mul(builder.mul(b, _i(2)), sst[2]))
    off = builder.add(builder.mul(row, _splat(builder, sst[0], vi)), _splat(builder, at, vi))
    off = builder.add(off, builder.mul(_const(vi, [0, 1] * 8), _splat(builder, sst[2], vi)))
    ptrs = builder.inttoptr(builder.add(off, _splat(builder, builder.ptrtoint(sbase, I64), vi)),
                            ir.VectorType(F.as_pointer(), 16))
    gather = _fn(builder, "llvm.masked.gather.v16f32.v16p0f32", V16F,
                 [ir.VectorType(F.as_pointer(), 16), I32, ir.VectorType(ir.IntType(1), 16), V16F])
    return builder.call(gather, [ptrs, ir.Constant(I32, 4), _const(ir.VectorType(ir.IntType(1), 16), 1),
                                 _const(V16F, 0.0)])


class _Args:
    """The arrays' pointers, shapes and strides (in bytes) that the code below reads."""

    def __init__(self, context, builder, signature, args):
        s_, q_, kq_, ks_, self.lo, self.n, self.scale = args
        sa, qa, kqa, ksa = (context.make_array(t)(context, builder, a)
                            for t, a in zip(signature.args, (s_, q_, kq_, ks_)))
        self.n_q, self.hd = cgutils.unpack_tuple(builder, qa.shape, 2)
        self.n_kv = builder.extract_value(kqa.shape, 1)
        self.n_g = builder.extract_value(ksa.shape, 2)
        self.group = builder.udiv(self.n_q, self.n_kv)
        self.kst = cgutils.unpack_tuple(builder, kqa.strides, 3)
        self.sst = cgutils.unpack_tuple(builder, ksa.strides, 3)
        self.q_row = builder.extract_value(qa.strides, 0)
        self.s_row = builder.extract_value(sa.strides, 0)
        self.s, self.q, self.k, self.ks = (builder.bitcast(a.data, I8.as_pointer()) for a in (sa, qa, kqa, ksa))


def _group_sums(builder, x, qbuf, hq, hd, b):
    """Query head hq's block b against 8 K vectors x (k + 128): sum (k + 128)(256 hi + lo) per group as
    _reduce_halves' <16 x i32>. Under 2^31: |256 hi + lo| <= 32639, 32 values of k + 128 <= 255."""
    dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", V16I, [V16I, V16I, V16I])
    qp = builder.gep(qbuf, [builder.add(builder.mul(hq, builder.mul(hd, _i(2))), builder.mul(b, _i(128)))])
    qh, ql = (builder.load(builder.bitcast(builder.gep(qp, [_i(off)]), V16I.as_pointer()), align=1) for off in (0, 64))
    eight, zero = _const(V16I, 8), _const(V16I, 0)
    return _reduce_halves(builder, [builder.call(dp, [builder.shl(builder.call(dp, [zero, k, qh]), eight), k, ql])
                                    for k in x])


def _store8(builder, a, tot, hq, o, p, hi):
    """s[hq, o : o + 8] <- scale * (tot's even + odd lanes) (the two groups of each position); only the
    positions below hi in the last block."""
    s8 = builder.fmul(builder.fadd(_shuf(builder, tot, tot, list(range(0, 16, 2))),
                                   _shuf(builder, tot, tot, list(range(1, 16, 2)))),
                      _splat(builder, a.scale, ir.VectorType(F, 8)))
    dst = builder.gep(a.s, [builder.add(builder.mul(hq, a.s_row), builder.mul(o, _i(4)))])
    with builder.if_else(builder.icmp_signed("<=", builder.add(p, _i(8)), hi)) as (whole, part):
        with whole:
            builder.store(s8, builder.bitcast(dst, ir.VectorType(F, 8).as_pointer()), align=4)
        with part:
            fp = builder.bitcast(dst, F.as_pointer())
            with cgutils.for_range(builder, builder.sub(hi, p)) as rl:
                builder.store(builder.extract_element(s8, builder.trunc(rl.index, I32)), builder.gep(fp, [rl.index]))


def _stack(builder, ty, n):
    """n values of ty on the stack (in the entry block), not initialised: every one is written before it is read.
    numba's cgutils.alloca_once stores a zero aggregate there, which LLVM's InstCombine unpacks value by value
    (the query buffer's 16384 one-byte stores: ~33 s of one core to compile this kernel, 0.4 s without)."""
    with builder.goto_entry_block():
        return builder.alloca(ty, size=_i(n))


def _codegen(context, builder, signature, args):
    a = _Args(context, builder, signature, args)
    qbuf, qsc, qcor = _stack(builder, I8, 2 * QBYTES), _stack(builder, F, QGROUPS), _stack(builder, I32, QGROUPS)
    tot = _stack(builder, V16F, GMAX)
    _quantize_queries(builder, lambda h: builder.bitcast(builder.gep(a.q, [builder.mul(h, a.q_row)]), F.as_pointer()),
                      a.n_q, a.hd, a.n_g, qbuf, qsc, qcor)
    hi = builder.add(a.lo, a.n)
    flip = _const(V16I, -0x7f7f7f80)  # 0x80808080: each byte's sign bit
    k_ahead = builder.mul(a.kst[0], _i(ROWS_AHEAD))

    def clamp(x):
        return builder.select(builder.icmp_signed("<", x, hi), x, hi)

    def fetch(p0, p1, scales_only=False):  # attn_fetch.fetch_kv's requests for K rows and their scales
        for base, row in ((a.k, a.kst[0]), (a.ks, a.sst[0]))[scales_only:]:
            _prefetch_rows(builder, base, row, p0, p1)
    fetch(a.lo, clamp(builder.add(a.lo, _i(ROWS_AHEAD))))
    with cgutils.for_range(builder, builder.udiv(builder.add(a.n, _i(7)), _i(8))) as bl:
        o = builder.mul(bl.index, _i(8))
        p = builder.add(a.lo, o)
        ahead = clamp(builder.add(p, _i(ROWS_AHEAD)))
        fetch(ahead, clamp(builder.add(ahead, _i(8))), scales_only=True)  # the K rows' lines: asked as read
        # the last block's rows past hi repeat its last position (their scores are not stored)
        rows = [builder.select(builder.icmp_signed("<", builder.add(p, _i(r)), hi), builder.add(p, _i(r)),
                               builder.sub(hi, _i(1))) for r in range(8)]
        with cgutils.for_range(builder, a.n_kv) as kl:
            kh = kl.index
            with cgutils.for_range(builder, a.group) as hl:
                builder.store(_const(V16F, 0.0), builder.gep(tot, [hl.index]))
            with cgutils.for_range(builder, builder.udiv(a.hd, _i(64))) as blk:
                b = blk.index
                kx = []
                for r in range(8):
                    at = builder.add(builder.add(builder.mul(rows[r], a.kst[0]), builder.mul(kh, a.kst[1])),
                                     builder.mul(b, _i(64)))
                    _prefetch(builder, builder.gep(a.k, [builder.add(at, k_ahead)]), 1)  # the line ROWS_AHEAD on
                    kx.append(builder.xor(builder.load(builder.bitcast(builder.gep(a.k, [at]), V16I.as_pointer()),
                                                       align=1), flip))
                ksv = _gather_scales(builder, a.ks, a.sst, rows, kh, b)
                with cgutils.for_range(builder, a.group) as hl:
                    hq = builder.add(builder.mul(kh, a.group), hl.index)
                    gi = builder.add(builder.mul(hq, a.n_g), builder.mul(b, _i(2)))
                    sums = builder.sub(_group_sums(builder, kx, qbuf, hq, a.hd, b), _pair(builder, qcor, gi, I32))
                    term = builder.fmul(builder.sitofp(sums, V16F), builder.fmul(_pair(builder, qsc, gi, F), ksv))
                    tp = builder.gep(tot, [hl.index])
                    builder.store(builder.fadd(builder.load(tp), term), tp)
            with cgutils.for_range(builder, a.group) as hl:
                _store8(builder, a, builder.load(builder.gep(tot, [hl.index])),
                        builder.add(builder.mul(kh, a.group), hl.index), o, p, hi)
    return context.get_dummy_value()


@intrinsic
def scores_q8_vnni(typingctx, s, q, kq, ks, lo, n, scale):
    """s[h, i] <- scale * q16(q[h]) . K[lo + i, h // group] for i < n and every query head h (group = heads
    per KV head; q16: ref.quantize_query_q16): s (H, >= n) f32 (rows by stride), q (H, hd) f32, kq (cap, n_kv,
    hd) int8, ks (cap, n_kv, hd // 32) f32, q, kq and ks C-contiguous. usable() must hold."""
    arr = (s, q, kq, ks)
    want = ((2, types.float32), (2, types.float32), (3, types.int8), (3, types.float32))
    if not all(isinstance(a, types.Array) and (a.ndim, a.dtype) == w for a, w in zip(arr, want)):
        return None
    if not all(a.layout == "C" for a in (q, kq, ks)):
        return None
    return types.void(s, q, kq, ks, lo, n, scale), _codegen
