"""AVX2 block kernels for the interleaved 4-bit layout of fast.py, written as LLVM IR (numba intrinsics).

Why IR: the int8 x 4-bit dot wants vpmaddubsw (32 multiply-adds per instruction, u8 x s8 -> s16 pair
sums); LLVM does not form it from numba's scalar code. Here the nibbles stay unsigned (0..15), as in the
file, and a block's integer sum S = sum_j q_j a_j is exact, so every kernel here and fast's generic ones
compute the same S and then the same float expression in the same order: results are bit-identical
(tests compare). The float expression: _block_term.

Layout of one 640-byte block of a 32-row group (fast.FastWeight 'q4', written by repack): its
nibbles, 16 vectors of 32 bytes, then the 32 rows' f16 scales (bytes 512-575, D_OFF) and mins (576-639,
M_OFF). Vector 2k + h (k < 8: values 4k..4k+3; h: rows 16h..16h+15): byte 4r + e of it holds value 4k + e
of row 16h + r in its low nibble and of row 16h + 8 + r in its high nibble. So `x & 15` and `x >> 4 & 15`
are each 8 rows x 4 values; vpmaddubsw against the broadcast activations a[4k..4k+3] gives two 16-bit
lanes per row, and one vpmaddwd by 1 at the end of the block turns them into the row's int32 sum, rows
already in order: no byte shuffles and no widening. A 16-bit lane takes the 8 quads of a block
(|sum| <= 8 * 2 * 15 * 128 = 30720). Per block and row: 16 bytes of nibbles + f16 scale + f16 min = the
file's 20 bytes. The scales sit after their nibbles so that a thread reads one stream of weights, not
three (nibbles, scales and mins apart): the decode kernel streamed 6-7% faster on two threads (ad hoc,
Zen 5, four alternations: 42.6 / 40.1 / 39.7 / 39.8 -> 45.3 / 42.8 / 42.7 / 42.4 GB/s).

The decode form (grp_q4) runs all blocks of a group in one call with the 32 outputs in registers; the
batched form unpacks each block once (unpack_q4: its nibbles and its rows' float scale terms, 1.25 KiB in
L1) and every activation row reuses it (blk_q4u). Where the target has AVX-VNNI (VNNI), the decode form
sums a block with vpdpbusd instead (_isum_vnni: 32 instructions where vpmaddubsw, its adds and vpmaddwd take
68; the same integers, so the same bits; grp_q4_madd keeps vpmaddubsw for the tests' comparison). Zen 5, one
thread, ad hoc: a matrix streamed from DRAM 32-35 -> 34-38 GB/s, hot in L2 7.9 -> 6.6 us; the batched form
measured slower with it (4.9-7.9 -> 6.9-9.9 ns per (row, block)), so it keeps vpmaddubsw. Where the target
has AVX512-VNNI (VNNI512), the multi-row form (grp_q4_rows: verify blocks, short chunks) sums with 512-bit
vpdpbusd (_rows_isum_vnni512: one 64-byte load is block vectors 2k and 2k + 1, 16 instructions per row and
block) and every Q8_0 form with 512-bit vpdpwssd (_q8_isums); on a Xeon with AVX-512 (2026-12-06, one thread)
a 1536x576 Q4_1 matmul of 4 / 8 rows took 68.2 / 129.0 -> 30.1 / 52.5 us (T = 1: 22.6), the default model's
verify pass of 4 / 8 rows -25% / -30% (bench/results-verify.md).
The 'q4k' layout (Q4_K with its 6-bit scales, layout.py) runs the same forms: the block addresses and scale terms
come from a layout object (_Blocks: 'q4', Blocks4K: 'q4k', which forms f16(d sc) and f16(-dmin mn) per block).
Only used when the host has AVX2 (fast.HAVE_AVX2); fast's generic kernels serve the others. The Q8_0 forms are in
avx2_q8.py (on this module's IR helpers).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

import os
from contextlib import contextmanager

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .target import target_has

G = 32
BLK4 = 640  # bytes of one block of a 32-row group in the 4-bit layout: 512 of nibbles, 32 f16 scales, 32 f16 mins
D_OFF, M_OFF = 512, 576  # where a block's scales and mins start
# A Q8_0 block of a 32-row group (layout 'q8', written by repack): byte 64 jp + 2r + i = value 2 jp + i of row
# r, int8, then the 32 rows' f16 scales (D8_OFF; one stream per thread, as the 4-bit layout: ad hoc, two threads,
# 42.1-43.5 -> 44.1-45.1 GB/s). Its kernels: avx2_q8.py.
BLK8, D8_OFF = 1088, 1024
# The 'q4k' layout (layout.py): super-blocks of 8 blocks, SB4K bytes: the rows' f16 d and dmin (K_HDR bytes),
# then 8 blocks of K_BLK: nibbles as above, the rows' u8 scales (K_SC) and u8 mins (K_MN)
SB4K, K_HDR, K_BLK, K_SC, K_MN = 4736, 128, 576, 512, 544
I8, I16, I32, I64, F = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
V32I8, V16I16 = ir.VectorType(I8, 32), ir.VectorType(I16, 16)
V8I32, V16I32 = ir.VectorType(I32, 8), ir.VectorType(I32, 16)
V32I32, V32F = ir.VectorType(I32, 32), ir.VectorType(F, 32)
V32I16, V32H = ir.VectorType(I16, 32), ir.VectorType(ir.HalfType(), 32)
V64I8 = ir.VectorType(I8, 64)
NIBBLES = 1024  # bytes of one block's unpacked nibbles: 16 vectors x (low, high nibbles) x 32 bytes
UNBUF = NIBBLES + 256  # and its 32 rows' d and m + 8 d as f32 (unpack_q4)
# Software prefetch distance of the decode kernels, in bytes of the weight stream (2 KiB: 4 Q4 / 2 Q8 blocks
# ahead). A decode step has ~150 short parallel regions (a few hundred KB per thread each); the hardware
# prefetcher ramps up anew in every one. Measured on a Zen 3 host at two threads (SmolLM2 shapes, random
# weights, runs alternated): layers 18-19 -> 22-29 GB/s, one long matrix 22-27 -> 28-35 GB/s; 1 and 3 KiB
# did less. On a Zen 5 host (AVX-512; a core streams twice the bytes) 2 KiB left a core's decode matvec at
# ~24 GB/s streamed against 46 GB/s with the matrix in L2; 4 / 8 / 16 KiB: 29 / 27-40 / 34-40 GB/s (one
# thread, ad hoc), and the chat workload decoded +7% with 4 KiB (ninfer-bench, 8 alternated pairs; 4, 8 and
# 16 KiB the same). With the layer weights in a region per thread (fast.prepare_layers) a thread's
# stream runs on from one matrix and phase to the next, and 8 KiB now gained where it had not with a stack
# per role (the lines past a part were the other thread's): scripts/step_phases.py --with avx2 --with
# fast, 4 against 8 KiB alternated, 60-99 positions 3.111 -> 2.872, 3.253 -> 3.198, 2.857 -> 2.690 ms
# (16 KiB 2.687), 600-639 positions 3.214 -> 3.141 ms, the head -5 to -13% each time. So 8 KiB where the
# target has AVX-512, else 2 KiB (the Zen 3 figures above).
PREFETCH = 8192 if target_has("avx512f") else 2048
# Where the prefetched lines go: llvm.prefetch's locality 3 is prefetcht0 (into L1), 2 is prefetcht1 (into
# L2). On the AVX-512 Xeon guest of 2026-12-06 a matrix streamed from DRAM (probes/kquant_bench.py, 600 MB of
# 3072x1024 matrices, T = 1) read 8.8-9.3 GB/s on one thread with prefetcht0 at 8 KiB, 9.6-10.6 with the
# prefetch at the block itself (none ahead), 12.0-12.6 with prefetcht1 at 8-64 KiB; two threads 16.5-17.2 ->
# 21.7-23.6 GB/s (Q4_K and Q4_1; Q6_K 16.6-16.9 -> 18.1-21.4), where the probe's reader streams 18.7 / 38.5:
# each prefetcht0 holds one of the core's few L1 fill buffers for a whole DRAM round trip, so they capped the
# lines in flight; prefetcht1's go to the L2's larger queue. So prefetcht1 where the target has AVX-512 (the
# hosts measured), prefetcht0 elsewhere (the Zen 3 figures above were taken with it).
PREFETCH_LOCALITY = 2 if target_has("avx512f") else 3
# vpdpbusd for the 4-bit decode form's integer sums where the target has it (AVX-VNNI, or AVX512-VNNI with VL:
# the 256-bit form); NINFER_NO_VNNI=1 keeps vpmaddubsw (with a fresh NUMBA_CACHE_DIR: numba's cache does not
# see it)
VNNI = ((target_has("avxvnni") or (target_has("avx512vnni") and target_has("avx512vl")))
        and os.environ.get("NINFER_NO_VNNI", "") in ("", "0"))
# 512-bit vpdpbusd where the target has AVX512-VNNI (and BW): the 4-bit multi-row forms (_rows_isum_vnni512),
# the Q8_0 decode and multi-row forms (_q8_isums_busd); vpdpwssd in the unpacked Q8_0 form (_q8_isums), which
# such targets no longer run (fast.ROWS_UNPACKED_Q8). NINFER_NO_VNNI=1 keeps vpmaddubsw / vpmaddwd.
VNNI512 = (target_has("avx512vnni") and target_has("avx512bw")
           and os.environ.get("NINFER_NO_VNNI", "") in ("", "0"))


def _const(vt, vals):
    return ir.Constant(vt, vals if isinstance(vals, list) else [vals] * vt.count)


def _fn(builder, name, ret, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)


def _ptr(context, builder, arrty, arr, off):
    """Pointer to element `off` (an intp value) of the array's data (flat, C order)."""
    a = context.make_array(arrty)(context, builder, arr)
    return builder.gep(a.data, [off])


def _prefetch(builder, p, lines):
    """Prefetch `lines` cache lines starting at byte pointer p (read, into the level PREFETCH_LOCALITY says)."""
    pf = _fn(builder, "llvm.prefetch.p0i8", ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    for i in range(lines):
        builder.call(pf, [builder.gep(p, [ir.Constant(I64, 64 * i)]), ir.Constant(I32, 0),
                          ir.Constant(I32, PREFETCH_LOCALITY), ir.Constant(I32, 1)])


class spread_prefetch:
    """`with spread_prefetch(builder, p, lines):` around a decode form's block body: its `lines` lines at p are
    prefetched one before each of the body's vector loads (`_vload`, in the body's own basic block) instead of
    all at its start, the rest when the body ends (a body with fewer loads than lines, or loads in loops of its
    own). A burst of ten prefetches per block (a 4-bit block is 10 lines) stalled the loads behind it: an ad hoc
    loop streaming 600 MiB on one thread read 10.1-10.3 GB/s with ten prefetches every ten lines, 15.8-16.0 with
    one a line; kquant_bench's matrices swept from DRAM (8192x2048, two threads) Q4_K 24.5 -> 28.6 GB/s, Q4_1
    22.6 -> 28.3 (bench/results-models.md Run 7). The multi-row forms keep their bursts (T = 4 the same)."""
    active: list = []  # the open bodies, innermost last (codegen runs under numba's compiler lock)

    def __init__(self, builder, p, lines):
        self.builder, self.block = builder, builder.block
        self.lines = [builder.gep(p, [ir.Constant(I64, 64 * i)]) for i in range(lines)]

    def emit(self, n=1):
        """The next n lines' prefetches, each followed by a single-thread fence: a compiler barrier (no
        instruction on x86) that keeps LLVM from sinking them below the loads (it had moved Q6_K's fourteen to
        the body's end: kquant_bench Q6_K 8192x2048 two threads 20.6-21.2 -> 23.5-26.7 GB/s with the fence,
        the other types the same)."""
        for _ in range(min(n, len(self.lines))):
            _prefetch(self.builder, self.lines.pop(0), 1)
            self.builder.fence("acq_rel", "singlethread")

    def __enter__(self):
        spread_prefetch.active.append(self)
        return self

    def __exit__(self, *exc):
        spread_prefetch.active.remove(self)
        self.emit(len(self.lines))
        return False


def _bytes_at(builder, p, nbytes):
    """i8* nbytes past pointer p (any element type)."""
    return builder.gep(builder.bitcast(p, I8.as_pointer()), [ir.Constant(I64, nbytes)])


def _i16_at(builder, p, nbytes):
    """i16* nbytes past pointer p."""
    return builder.bitcast(_bytes_at(builder, p, nbytes), I16.as_pointer())


def _vload(builder, p, vt):
    for sp in reversed(spread_prefetch.active):  # the innermost body of this builder's block gives one line
        if sp.builder is builder and sp.block is builder.block:
            sp.emit()
            break
    return builder.load(builder.bitcast(p, vt.as_pointer()), align=1)


def _splat(builder, x, vt):
    v = builder.insert_element(ir.Constant(vt, None), x, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(vt, None), _const(ir.VectorType(I32, vt.count), 0))


def _halves(builder, p):
    """32 f16 bit patterns at p (i16*) -> <32 x float> (vcvtph2ps with F16C)."""
    return builder.fpext(builder.bitcast(_vload(builder, p, V32I16), V32H), V32F)


def _split(builder, x):
    """Block vector bytes (32, or 64: two vectors) -> (low nibbles, high nibbles), as many unsigned bytes."""
    mask = _const(x.type, 15)
    return builder.and_(x, mask), builder.and_(builder.lshr(x, _const(x.type, 4)), mask)


def _isum(builder, nib_of, a, vnni=False):
    """<32 x i32> S of the 32 rows in order: nib_of(v) -> (low, high) nibbles of block vector v (< 16);
    a = the block's 32 int8 activations (i8*). vnni: vpdpbusd (_isum_vnni), the same integers."""
    if vnni:
        return _isum_vnni(builder, nib_of, a)
    madd = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [V32I8, V32I8])
    pmaddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16])
    a32 = builder.bitcast(a, I32.as_pointer())
    acc = [_const(V16I16, 0)] * 4  # rows 0-7, 8-15, 16-23, 24-31 (two lanes per row)
    for k in range(8):
        a4 = builder.load(builder.gep(a32, [ir.Constant(I64, k)]), align=1)
        av = builder.bitcast(_splat(builder, a4, V8I32), V32I8)
        for h in range(2):
            lo, hi = nib_of(2 * k + h)
            acc[2 * h] = builder.add(acc[2 * h], builder.call(madd, [lo, av]))
            acc[2 * h + 1] = builder.add(acc[2 * h + 1], builder.call(madd, [hi, av]))
    return _rows32(builder, [builder.call(pmaddwd, [x, _const(V16I16, 1)]) for x in acc])


def _rows32(builder, parts):
    """Four <8 x i32> (rows 0-7, 8-15, 16-23, 24-31) -> one <32 x i32> in row order."""
    lo16 = builder.shuffle_vector(parts[0], parts[1], _const(ir.VectorType(I32, 16), list(range(16))))
    hi16 = builder.shuffle_vector(parts[2], parts[3], _const(ir.VectorType(I32, 16), list(range(16))))
    return builder.shuffle_vector(lo16, hi16, _const(ir.VectorType(I32, 32), list(range(32))))


def _isum_vnni(builder, nib_of, a):
    """_isum with vpdpbusd (AVX-VNNI or AVX512-VNNI): a row's four unsigned nibbles times the four broadcast
    activations, summed straight into its int32 lane, so the block takes 32 instructions where vpmaddubsw,
    its 16-bit adds and the closing vpmaddwd take 68. The same exact integer sums."""
    dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.256", V8I32, [V8I32, V8I32, V8I32])
    a32 = builder.bitcast(a, I32.as_pointer())
    # rows 0-7, 8-15, 16-23, 24-31, each in two chains (even and odd k) so that fewer wait on vpdpbusd's latency
    acc = [[_const(V8I32, 0)] * 2 for _ in range(4)]
    for k in range(8):
        av = _splat(builder, builder.load(builder.gep(a32, [ir.Constant(I64, k)]), align=1), V8I32)
        for h in range(2):
            for i, x in enumerate(nib_of(2 * k + h)):
                acc[2 * h + i][k % 2] = builder.call(dp, [acc[2 * h + i][k % 2], builder.bitcast(x, V8I32), av])
    return _rows32(builder, [builder.add(x, y) for x, y in acc])


def _dm8(builder, d, m):
    """d, m i16* to the 32 rows' f16 scales and mins -> (d, m + 8 d) as <32 x float> (8 d exact)."""
    dv = _halves(builder, d)
    return dv, builder.fadd(_halves(builder, m), builder.fmul(_const(V32F, 8.0), dv))


def _block_sum_times(builder, a_sum, k):
    """k A as i32 from A, the block's integer activation sum as the quantizer stored it (an exact f32)."""
    return builder.mul(builder.fptosi(a_sum, I32), ir.Constant(I32, k))


def _asum_times(builder, a, k):
    """k A as i32 summed from the block's activations (a: i8*; k <= 128: the pair sums k (a_i + a_j) fit
    int16): the decode forms' way (one row: the sum costs about what loading the stored one does, and the
    loads of a are already there)."""
    madd = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [V32I8, V32I8])
    pmaddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16])
    radd = _fn(builder, "llvm.vector.reduce.add.v8i32", I32, [V8I32])
    sk = builder.call(madd, [_const(V32I8, k), _vload(builder, a, V32I8)])
    return builder.call(radd, [builder.call(pmaddwd, [sk, _const(V16I16, 1)])])


# A row's block sums as fast.quantize_rows stores them in xs: XS floats per block, at XS b + these offsets.
XS = 3
XS_SCALED = 0  # f16(d * A): the scaled sum (the min term of Q4_1 / Q5_1 / Q5_K)
XS_A = 1  # A, the sum of the block's 32 int8 activations (exact in f32)
XS_A0 = 2  # A0, the sum of its first 16 (Q6_K's scale groups are 16 values: A1 = A - A0)


def _xs_at(builder, xp, b, k):
    """Sum k (XS_SCALED, XS_A or XS_A0) of block b from a row's xs (float*)."""
    i = builder.add(builder.mul(b, ir.Constant(b.type, XS)), ir.Constant(b.type, k))
    return builder.load(builder.gep(xp, [i]))


def _block_term(builder, isum, asum8, dv, m8, sb, xsb):
    """(d * sb) * (S - 8 A) + (m + 8 d) * xsb over the 32 rows (<32 x float>); asum8 = 8 A (i32), A the sum of
    the block's int8 activations (the multi-row forms read it where the quantizer stored it beside xsb,
    _xs_at, instead of summing the block again for every row group: ~4-6% of a T = 4-8 pass; the decode
    form sums it, _asum_times), dv, m8 the rows' d and m + 8 d (_dm8); the generic kernels' expression and order
    (fast._q4_term). Mathematically d sb S + m xs (llama.cpp's Q4_1 x Q8_1 formula), but xs is an f16
    rounding of sb A: written with (m + 8 d), which is small for most blocks, the rounding error of xs
    nearly cancels (6x smaller rms error than m * xs on SmolLM2's weights, measured against the exact dot
    product with the quantized activations). d * sb is exact (f16 x f16)."""
    signed = builder.sub(isum, _splat(builder, asum8, V32I32))
    t = builder.fmul(builder.fmul(dv, _splat(builder, sb, V32F)), builder.sitofp(signed, V32F))
    u = builder.fmul(m8, _splat(builder, xsb, V32F))
    return builder.fadd(t, u)


def _check_blocks(a):
    return isinstance(a, types.Array) and a.dtype == types.uint8


def _scales_at(builder, q):
    """(d, m) i16* of the block at q (i8*): its rows' f16 scales and mins."""
    return _i16_at(builder, q, D_OFF), _i16_at(builder, q, M_OFF)


class _Blocks:
    """Where a 4-bit form finds block b of a group and its rows' scale terms: the 'q4' layout (BLK4-byte blocks,
    f16 scales and mins in each). Blocks4K: the 'q4k' layout's. The forms below take one of the two."""
    lines = BLK4 // 64  # cache lines a block's body prefetches

    def at(self, builder, q0, b):
        """(block, its super-block or None, where its prefetch starts): i8* of block b (an index value) of the
        group's blocks at q0."""
        q = builder.gep(q0, [builder.mul(b, ir.Constant(b.type, BLK4))])
        return q, None, _bytes_at(builder, q, PREFETCH)

    def scales(self, builder, q, sb):
        """(d, m + 8 d) <32 x float> of the block's rows (_dm8)."""
        return _dm8(builder, *_scales_at(builder, q))

    @contextmanager
    def each(self, builder, q0, nb):
        """`with lay.each(builder, q0, nb) as (b, q, sb, pf):` a loop over the group's nb blocks (at's values)."""
        with cgutils.for_range(builder, nb) as loop:
            yield (loop.index,) + self.at(builder, q0, loop.index)


def super_block_at(builder, q0, b, sb_bytes, hdr_bytes, blk_bytes):
    """(block b's i8*, its super-block's i8*, where its prefetch starts) in a group of super-blocks of 8 blocks
    (a header of hdr_bytes, then the blocks of blk_bytes; sb_bytes in all): the 'q4k' and kquant's q6 layouts."""
    sb = builder.gep(q0, [builder.mul(builder.lshr(b, ir.Constant(b.type, 3)), ir.Constant(b.type, sb_bytes))])
    return _in_super_block(builder, sb, builder.and_(b, ir.Constant(b.type, 7)), sb_bytes, hdr_bytes, blk_bytes)


def _in_super_block(builder, sb, j, sb_bytes, hdr_bytes, blk_bytes):
    i64 = j.type
    q = builder.gep(sb, [builder.add(builder.mul(j, ir.Constant(i64, blk_bytes)), ir.Constant(i64, hdr_bytes))])
    pf = builder.gep(sb, [builder.add(builder.mul(j, ir.Constant(i64, sb_bytes // 8)), ir.Constant(i64, PREFETCH))])
    return q, sb, pf


@contextmanager
def each_super_block(builder, q0, nb, sb_bytes, hdr_bytes, blk_bytes, header):
    """`with each_super_block(...) as (b, q, hdr, pf):` the loop over a group's nb blocks as two, super-blocks
    (header(builder, sb) computed once for each: its rows' scales) and their 8 blocks."""
    i64 = nb.type
    with cgutils.for_range(builder, builder.lshr(nb, ir.Constant(i64, 3))) as outer:
        sbp = builder.gep(q0, [builder.mul(outer.index, ir.Constant(i64, sb_bytes))])
        hdr = header(builder, sbp)
        with cgutils.for_range(builder, ir.Constant(i64, 8)) as inner:
            b = builder.add(builder.mul(outer.index, ir.Constant(i64, 8)), inner.index)
            q, _, pf = _in_super_block(builder, sbp, inner.index, sb_bytes, hdr_bytes, blk_bytes)
            yield b, q, hdr, pf


class Blocks4K(_Blocks):
    """The 'q4k' layout: block b is block b % 8 of super-block b // 8; d = f16(d_sb sc), m = f16(-(dmin_sb mn)),
    rounded once from exact f32 products (fptrunc: vcvtps2ph, to nearest even), as kquant's numpy rounded them
    for the 'q4' blocks this layout replaces: the same d and m + 8 d, so the same bits."""
    lines = (SB4K // 8 + 63) // 64  # a block's share of its super-block, header included

    def at(self, builder, q0, b):
        return super_block_at(builder, q0, b, SB4K, K_HDR, K_BLK)

    def scales(self, builder, q, sb):
        """sb: the super-block's i8*, or its rows' (d, dmin) as <32 x float> already (each)."""
        def rounded(x, p):  # f16(x * u8[p : p + 32]) as <32 x float>
            f = builder.uitofp(_vload(builder, _bytes_at(builder, q, p), V32I8), V32F)
            return builder.fpext(builder.fptrunc(builder.fmul(x, f), V32H), V32F)
        d, dmin = sb if isinstance(sb, tuple) else self.header(builder, sb)
        dv = rounded(d, K_SC)
        mv = builder.fneg(rounded(dmin, K_MN))
        return dv, builder.fadd(mv, builder.fmul(_const(V32F, 8.0), dv))

    @staticmethod
    def header(builder, sb):
        """The super-block's rows' (d, dmin) as <32 x float>."""
        return _halves(builder, _i16_at(builder, sb, 0)), _halves(builder, _i16_at(builder, sb, 2 * G))

    def each(self, builder, q0, nb):
        """The loop over blocks as two: super-blocks, their header converted once, then their 8 blocks (sb is
        the header's (d, dmin))."""
        return each_super_block(builder, q0, nb, SB4K, K_HDR, K_BLK, self.header)


BLOCKS, BLOCKS_4K = _Blocks(), Blocks4K()


def _make_grp_q4(vnni, lay=BLOCKS):
    @intrinsic
    def grp_q4(typingctx, o, o_off, blk, blk_off, qa, qa_off, sa, xs, s_off, x_off, nb):
        """o[o_off : o_off + 32] <- the 32 rows' dot products with one activation row over nb blocks:
        blk[blk_off:] the group's blocks (BLK4 bytes each: nibbles, scales, mins), qa[qa_off:] the int8
        activations (32 per block), sa[s_off:] their block scales (f32, one per block), xs[x_off:] their scaled
        and integer sums (f32, XS per block: _xs_at). The outputs stay in registers across blocks; summed in
        block order."""
        if not _check_blocks(blk):
            return None
        sig = types.void(o, o_off, blk, blk_off, qa, qa_off, sa, xs, s_off, x_off, nb)

        def codegen(context, builder, signature, args):
            o_, oo, blk_, bo, qa_, ao, sa_, xs_, so, xo, nb_ = args
            ty = signature.args
            q0 = _ptr(context, builder, ty[2], blk_, bo)
            a0 = _ptr(context, builder, ty[4], qa_, ao)
            sp, xp = _ptr(context, builder, ty[6], sa_, so), _ptr(context, builder, ty[7], xs_, xo)
            accp = cgutils.alloca_once_value(builder, _const(V32F, 0.0))
            with lay.each(builder, q0, nb_) as (b, q, sb, pf):
                def nib_of(v):
                    return _split(builder, _vload(builder, builder.gep(q, [ir.Constant(I64, 32 * v)]), V32I8))
                with spread_prefetch(builder, pf, lay.lines):  # PREFETCH bytes ahead
                    ab = builder.gep(a0, [builder.mul(b, ir.Constant(b.type, 32))])
                    isum = _isum(builder, nib_of, ab, vnni)
                    dv, m8 = lay.scales(builder, q, sb)
                    term = _block_term(builder, isum, _asum_times(builder, ab, 8), dv, m8,
                                       builder.load(builder.gep(sp, [b])), _xs_at(builder, xp, b, XS_SCALED))
                builder.store(builder.fadd(builder.load(accp), term), accp)
            op = builder.bitcast(_ptr(context, builder, ty[0], o_, oo), V32F.as_pointer())
            builder.store(builder.load(accp), op, align=4)
            return context.get_dummy_value()
        return sig, codegen
    return grp_q4


grp_q4 = _make_grp_q4(VNNI)
grp_q4_madd = _make_grp_q4(False)  # vpmaddubsw on any AVX2 CPU (tests compare the VNNI form with it)
grp_q4k = _make_grp_q4(VNNI, BLOCKS_4K)  # the 'q4k' layout's (blk: a group's super-blocks)


def _rows_isum_madd(builder, q, ab):
    """The 32 rows' integer sums S (<32 x i32>) of one block (q: its i8*) with each of the activation rows ab
    (i8* to their block's 32 int8 values): each block vector is loaded and split once for all rows, then
    vpmaddubsw per row into 16-bit lanes and one vpmaddwd by 1 (_isum's integers)."""
    madd = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [V32I8, V32I8])
    pmaddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16])
    acc = [[_const(V16I16, 0)] * 4 for _ in ab]  # per row: rows 0-7, 8-15, 16-23, 24-31
    for k in range(8):
        av = [builder.bitcast(_splat(builder, _a4(builder, a, k), V8I32), V32I8) for a in ab]
        for h in range(2):
            lo, hi = _split(builder, _vload(builder, builder.gep(q, [ir.Constant(I64, 32 * (2 * k + h))]), V32I8))
            for i in range(len(ab)):
                acc[i][2 * h] = builder.add(acc[i][2 * h], builder.call(madd, [lo, av[i]]))
                acc[i][2 * h + 1] = builder.add(acc[i][2 * h + 1], builder.call(madd, [hi, av[i]]))
    return [_rows32(builder, [builder.call(pmaddwd, [x, _const(V16I16, 1)]) for x in a]) for a in acc]


def _rows_isum_vnni512(builder, q, ab):
    """_rows_isum_madd's sums with 512-bit vpdpbusd (AVX512-VNNI): one 64-byte load holds block vectors 2k and
    2k + 1 (values 4k..4k+3 of all 32 rows), and each row's four unsigned nibbles times its four broadcast
    activations go straight into its int32 lane: 16 instructions per row and block where vpmaddubsw, its
    16-bit adds and vpmaddwd take 68. Exact integer sums, so the same bits."""
    dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", V16I32, [V16I32, V16I32, V16I32])
    # per row: [low nibbles: rows 0-7 | 16-23, high nibbles: rows 8-15 | 24-31], in two chains (even / odd k)
    # when few rows run (vpdpbusd's latency; more rows give the core independent chains anyway)
    chains = 2 if len(ab) <= 2 else 1
    acc = [[[_const(V16I32, 0)] * chains for _ in range(2)] for _ in ab]
    for k in range(8):
        x = _vload(builder, builder.gep(q, [ir.Constant(I64, 64 * k)]), V64I8)
        nib = [builder.bitcast(v, V16I32) for v in _split(builder, x)]
        for i, a in enumerate(ab):
            av = _splat(builder, _a4(builder, a, k), V16I32)
            for n in range(2):
                acc[i][n][k % chains] = builder.call(dp, [acc[i][n][k % chains], nib[n], av])
    order = list(range(8)) + list(range(16, 24)) + list(range(8, 16)) + list(range(24, 32))
    out = []
    for lo, hi in acc:
        lo, hi = (c[0] if chains == 1 else builder.add(c[0], c[1]) for c in (lo, hi))
        out.append(builder.shuffle_vector(lo, hi, _const(ir.VectorType(I32, 32), order)))
    return out


def _a4(builder, a, k):
    """Activations 4k..4k+3 of a block (a: i8*) as one i32 (to broadcast)."""
    return builder.load(builder.gep(builder.bitcast(a, I32.as_pointer()), [ir.Constant(I64, k)]), align=1)


def _rows_setup(context, builder, ty, args, nt):
    """The multi-row forms' arguments (o, o_off, o_st, blk, blk_off, qa, qa_off, qa_st, sa, xs, s_off, s_st,
    x_off, x_st, nb) -> (q0, a0, sp, xp, accp): the group's first block, per row i < nt pointers to its
    activations (qa_off + i qa_st), block scales (s_off + i s_st) and block sums (x_off + i x_st), and a
    <32 x float> accumulator from 0 (_store_rows writes them out). grp_q4_rows, avx2_q8's and kquant_avx2's."""
    blk_, bo, qa_, ao, ast, sa_, xs_, so, sst, xo, xst = args[3:14]

    def at(i, base, st):
        return builder.add(base, builder.mul(st, ir.Constant(st.type, i)))
    q0 = _ptr(context, builder, ty[3], blk_, bo)
    a0 = [_ptr(context, builder, ty[5], qa_, at(i, ao, ast)) for i in range(nt)]
    sp = [_ptr(context, builder, ty[8], sa_, at(i, so, sst)) for i in range(nt)]
    xp = [_ptr(context, builder, ty[9], xs_, at(i, xo, xst)) for i in range(nt)]
    accp = [cgutils.alloca_once_value(builder, _const(V32F, 0.0)) for _ in range(nt)]
    return q0, a0, sp, xp, accp


def _store_rows(context, builder, ty, args, accp):
    """o[o_off + i o_st : ... + 32] <- accumulator i (_rows_setup) for every row i."""
    o_, oo, ost = args[:3]
    for i, acc in enumerate(accp):
        off = builder.add(oo, builder.mul(ost, ir.Constant(ost.type, i)))
        builder.store(builder.load(acc), builder.bitcast(_ptr(context, builder, ty[0], o_, off), V32F.as_pointer()),
                      align=4)


def _make_grp_q4_rows(nt, vnni, lay=BLOCKS):
    @intrinsic
    def grp_q4_rows(typingctx, o, o_off, o_st, blk, blk_off, qa, qa_off, qa_st, sa, xs, s_off, s_st, x_off, x_st, nb):
        """grp_q4 for nt activation rows at once (a verify block, a short prompt chunk): each block vector is
        loaded and split into its nibbles once, and the nt rows' dot products run on it from registers
        (_rows_isum_madd, or _rows_isum_vnni512 where the target has AVX512-VNNI: VNNI512), so the weights
        stream once with no unpacked copy (unpack_q4 wrote and re-read 1.25 KiB per block, which cost a
        T = 2 pass 1.7x a decode row's time). Row i's data sit at o_off + i o_st (outputs), qa_off + i qa_st,
        s_off + i s_st, x_off + i x_st (elements). Per row the same integer sums, the same _block_term and the
        same block-order accumulation from 0 as grp_q4: each row equals a one-row call bit for bit."""
        if not _check_blocks(blk):
            return None
        sig = types.void(o, o_off, o_st, blk, blk_off, qa, qa_off, qa_st, sa, xs, s_off, s_st, x_off, x_st, nb)

        def codegen(context, builder, signature, args):
            ty, nb_ = signature.args, args[14]
            q0, a0, sp, xp, accp = _rows_setup(context, builder, ty, args, nt)
            with lay.each(builder, q0, nb_) as (b, q, sb, pf):
                _prefetch(builder, pf, lay.lines)
                ab = [builder.gep(a, [builder.mul(b, ir.Constant(b.type, 32))]) for a in a0]
                isums = (_rows_isum_vnni512 if vnni else _rows_isum_madd)(builder, q, ab)
                dv, m8 = lay.scales(builder, q, sb)
                for i in range(nt):
                    a_sum = _xs_at(builder, xp[i], b, XS_A)
                    term = _block_term(builder, isums[i], _block_sum_times(builder, a_sum, 8), dv, m8,
                                       builder.load(builder.gep(sp[i], [b])), _xs_at(builder, xp[i], b, XS_SCALED))
                    builder.store(builder.fadd(builder.load(accp[i]), term), accp[i])
            _store_rows(context, builder, ty, args, accp)
            return context.get_dummy_value()
        return sig, codegen
    return grp_q4_rows


ROWS_MAX = 4  # the most activation rows one grp_q4_rows call takes (registers: 4 int16 accumulators per row)
grp_q4_rows1, grp_q4_rows2, grp_q4_rows3, grp_q4_rows4 = (_make_grp_q4_rows(n, VNNI512) for n in range(1, 5))
grp_q4_rows4_madd = _make_grp_q4_rows(4, False)  # vpmaddubsw on any AVX2 CPU (tests compare)
grp_q4k_rows1, grp_q4k_rows2, grp_q4k_rows3, grp_q4k_rows4 = (_make_grp_q4_rows(n, VNNI512, BLOCKS_4K)
                                                              for n in range(1, 5))


def _unpacked_scales(builder, b, i):
    """<32 x float>* to an unpacked block's d (i = 0) or m + 8 d (i = 1), in the buffer at b (i8*)."""
    return builder.bitcast(builder.gep(b, [ir.Constant(I64, NIBBLES + 128 * i)]), V32F.as_pointer())


def _unpack_into(builder, b, q, sb, lay):
    """The block at q (i8*; its super-block sb) into the buffer at b (i8*) as blk_q4u reads it."""
    for v in range(16):
        for i, x in enumerate(_split(builder, _vload(builder, builder.gep(q, [ir.Constant(I64, 32 * v)]), V32I8))):
            p = builder.bitcast(builder.gep(b, [ir.Constant(I64, 64 * v + 32 * i)]), V32I8.as_pointer())
            builder.store(x, p, align=1)
    for i, x in enumerate(lay.scales(builder, q, sb)):
        builder.store(x, _unpacked_scales(builder, b, i), align=1)


@intrinsic
def unpack_q4(typingctx, buf, blk, blk_off):
    """buf[0:UNBUF] (uint8) <- the block at blk[blk_off:] as blk_q4u reads it: its low and high nibbles
    (1 KiB), then the rows' d and m + 8 d (32 f32 each, _dm8). For a multi-row matmul each block is unpacked
    and its scales converted once, and every activation row uses them."""
    if not _check_blocks(blk):
        return None
    sig = types.void(buf, blk, blk_off)

    def codegen(context, builder, signature, args):
        buf_, blk_, bo = args
        ty = signature.args
        q = _ptr(context, builder, ty[1], blk_, bo)
        _unpack_into(builder, _ptr(context, builder, ty[0], buf_, ir.Constant(I64, 0)), q, None, BLOCKS)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def unpack_q4k(typingctx, buf, blk, grp_off, b):
    """unpack_q4 for block b (an int64) of the 'q4k' group whose super-blocks start at blk[grp_off:]: the same
    buffer (its d and m + 8 d formed as Blocks4K.scales forms them)."""
    if not _check_blocks(blk):
        return None
    sig = types.void(buf, blk, grp_off, b)

    def codegen(context, builder, signature, args):
        buf_, blk_, go, b_ = args
        ty = signature.args
        q, sb, _ = BLOCKS_4K.at(builder, _ptr(context, builder, ty[1], blk_, go), b_)
        _unpack_into(builder, _ptr(context, builder, ty[0], buf_, ir.Constant(I64, 0)), q, sb, BLOCKS_4K)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def expand_q4k(typingctx, dst, blk, grp_off, nb):
    """dst[0 : nb BLK4] (uint8) <- the 'q4k' group whose super-blocks start at blk[grp_off:] as nb blocks of the
    'q4' layout: each block's nibbles as they are, its rows' f16(d sc) and f16(-(dmin mn)) bits (Blocks4K's
    roundings) as the scales and mins. The multi-row form then runs on it from L1 / L2 with its own f16 loads
    (grp_q4_rows), where forming the scales again in every call of four rows cost a T = 64 matmul ~20%."""
    if not _check_blocks(blk):
        return None
    sig = types.void(dst, blk, grp_off, nb)

    def codegen(context, builder, signature, args):
        dst_, blk_, go, nb_ = args
        ty = signature.args
        q0 = _ptr(context, builder, ty[1], blk_, go)
        d0 = _ptr(context, builder, ty[0], dst_, ir.Constant(I64, 0))
        with cgutils.for_range(builder, nb_) as loop:
            b = loop.index
            q, sb, _ = BLOCKS_4K.at(builder, q0, b)
            d = builder.gep(d0, [builder.mul(b, ir.Constant(b.type, BLK4))])
            for k in range(8):
                x = _vload(builder, builder.gep(q, [ir.Constant(I64, 64 * k)]), V64I8)
                builder.store(x, builder.bitcast(builder.gep(d, [ir.Constant(I64, 64 * k)]), V64I8.as_pointer()),
                              align=1)
            for off, hoff, p, neg in ((D_OFF, 0, K_SC, False), (M_OFF, 2 * G, K_MN, True)):
                f = builder.uitofp(_vload(builder, _bytes_at(builder, q, p), V32I8), V32F)
                h = builder.fptrunc(builder.fmul(_halves(builder, _i16_at(builder, sb, hoff)), f), V32H)
                builder.store(builder.fneg(h) if neg else h,
                              builder.bitcast(_bytes_at(builder, d, off), V32H.as_pointer()), align=1)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def blk_q4u(typingctx, o, o_off, buf, qa, qa_off, sb, xsb, a_sum):
    """o[o_off : o_off + 32] += one block's term (_block_term) for 32 rows, from a block unpacked by unpack_q4
    into buf; qa[qa_off:] the block's 32 int8 activations, sb / xsb / a_sum their scale, scaled and integer
    sums."""
    sig = types.void(o, o_off, buf, qa, qa_off, sb, xsb, a_sum)

    def codegen(context, builder, signature, args):
        o_, oo, buf_, qa_, ao, sb_, xsb_, asum_ = args
        ty = signature.args
        b = _ptr(context, builder, ty[2], buf_, ir.Constant(I64, 0))

        def nib_of(v):
            return [_vload(builder, builder.gep(b, [ir.Constant(I64, 64 * v + 32 * i)]), V32I8) for i in range(2)]
        a = _ptr(context, builder, ty[3], qa_, ao)
        dv, m8 = (builder.load(_unpacked_scales(builder, b, i), align=1) for i in range(2))
        term = _block_term(builder, _isum(builder, nib_of, a), _block_sum_times(builder, asum_, 8), dv, m8, sb_,
                           xsb_)
        op = builder.bitcast(_ptr(context, builder, ty[0], o_, oo), V32F.as_pointer())
        builder.store(builder.fadd(builder.load(op, align=4), term), op, align=4)
        return context.get_dummy_value()
    return sig, codegen


# ------------------------------------------------------------------------------------ activation quant
# fast.quantize_rows_avx2 quantizes a 32-block in two calls: absmax32, then (the scale's inverse
# computed between them in numba, as the generic loop does) quant32. The same operations per value as the
# generic loop (|x|, a max, one f32 multiply, round half to even, the int8 value and the block's int32
# sums), as <32 x ...> vectors: the generic loop stayed scalar (~2.7 cycles per value: numba's max() and
# np.rint in it keep LLVM's vectorizer off), these take ~0.3.
@intrinsic
def absmax32(typingctx, x, x_off):
    """max |x[x_off : x_off + 32]| (f32): the block's scale before / 127 (exact in any order)."""
    sig = types.float32(x, x_off)

    def codegen(context, builder, signature, args):
        v = _vload(builder, _ptr(context, builder, signature.args[0], args[0], args[1]), V32F)
        a = builder.call(_fn(builder, "llvm.fabs.v32f32", V32F, [V32F]), [v])
        # nnan: a plain vmaxps tree (x holds no NaN: the generic loop's max() would not keep one either)
        return builder.call(_fn(builder, "llvm.vector.reduce.fmax.v32f32", F, [V32F]), [a], fastmath=("nnan",))
    return sig, codegen


@intrinsic
def quant32(typingctx, qa, qa_off, x, x_off, inv):
    """qa[qa_off : qa_off + 32] (int8) <- round-half-even(x[x_off : x_off + 32] * inv); returns the sums
    (int32) of the first 16 and of the last 16. |x * inv| <= 127 by the caller's inv (127 / the block's
    absmax, or 0)."""
    sig = types.UniTuple(types.int32, 2)(qa, qa_off, x, x_off, inv)

    def codegen(context, builder, signature, args):
        qa_, ao, x_, xo, inv_ = args
        ty = signature.args
        v = builder.fmul(_vload(builder, _ptr(context, builder, ty[2], x_, xo), V32F), _splat(builder, inv_, V32F))
        r = builder.call(_fn(builder, "llvm.roundeven.v32f32", V32F, [V32F]), [v])
        q = builder.fptosi(r, V32I32)
        p = builder.bitcast(_ptr(context, builder, ty[0], qa_, ao), V32I8.as_pointer())
        builder.store(builder.trunc(q, V32I8), p, align=1)
        v16 = ir.VectorType(I32, 16)
        radd = _fn(builder, "llvm.vector.reduce.add.v16i32", I32, [v16])
        halves = [builder.call(radd, [builder.shuffle_vector(q, q, _const(v16, list(range(h, h + 16))))])
                  for h in (0, 16)]
        return context.make_tuple(builder, signature.return_type, halves)
    return sig, codegen
