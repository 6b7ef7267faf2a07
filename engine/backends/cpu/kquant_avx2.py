"""AVX2 block kernels of kquant.py's 5- and 6-bit layouts (Q5_0, Q5_1, Q5_K, Q6_K), as LLVM IR (numba
intrinsics) on avx2.py's helpers.

A block of a 32-row group (kquant.KWeight) starts as avx2's 4-bit block: the values' low 4 bits, vector 2k + h
(k < 8: values 4k..4k+3; h: rows 16h..16h+15), byte 4r + e = value 4k + e of row 16h + r (low nibble) and of
row 16h + 8 + r (high nibble). After _split the block has 32 "value vectors" (k, h, n) (n = 0 low, 1 high:
rows 16h + 8n + r at byte 4r + e). Their high bits follow at P_OFF, a plane: value vector vv = 4k + 2h + n
  q5: 1 bit, bit vv % 8 of byte i of plane vector vv // 8 (4 vectors, 128 bytes)
  q6: 2 bits, bits 2 (vv % 4) .. of byte i of plane vector k (8 vectors, 256 bytes)
so one shift and one mask per value vector put the bits at 16 (32), ORed into the nibbles: the file's value,
unsigned (0..31 / 0..63), the bytes of the file (5.5 / 6.6 bits a value) plus the per-row scales:
  q5 (BLK5 = 768): f16 d (Q5_D), f16 m (Q5_M)                      y = d q + m
      (Q5_0's blocks end at Q5_M, BLK5Z = 704 bytes, the file's 5.5 bits a value: its m is -16 d, so the
      forms take m + 16 d as 0 where a block has no m: the blocks' size says, from the array's last axis)
  q6 (K6_BLK = 832): int8 scale of values 0-15 (Q6_SC0), of 16-31 (Q6_SC1)    y = d sc (q - 32)
q6 blocks come in super-blocks of 8 (the file's 256 values, SB6 = 6720 bytes): the 32 rows' f16 d (the file's one
per row and super-block, K6_HDR bytes) first, then the 8 blocks: 840 bytes a block, the file's own 6.5625 bits a
value, where a copy of d in every block took 896 (7 bits).
vpmaddubsw of a value vector against the broadcast a[4k..4k+3] gives two 16-bit pair sums per row (q5: up to
2 * 31 * 128, so four k's fit int16; q6: 2 * 63 * 128, two k's), vpmaddwd by 1 turns them into the row's int32
lane, rows in order (as avx2._isum). The block terms, integers exact, floats in this order:
  q5  (d * sb) * (S - 16 A) + (m + 16 d) * xsb          avx2._block_term's form with 16 for 8 (Q5_0: m = -16 d,
                                                         so the second product is 0)
  q6  (d * sb) * (sc0 (S0 - 32 A0) + sc1 (S1 - 32 A1))  S0 / S1, A0 / A1 over values 0-15 / 16-31
kquant's generic kernels compute the same. The decode form (grp5 / grp6) keeps a group's 32 outputs in
registers over all its blocks, and for up to 4 activation rows at once (grp5_rows* / grp6_rows*: a verify block,
a short chunk) merges each value vector once in registers for all of them; the batched form for longer chunks
merges each block's bits once (unpack: 1 KiB of value vectors + its scale bytes, in L1) and every activation
row reuses it (blku5 / blku6).
Where the target has AVX512-VNNI and GFNI (GF512), the decode and multi-row forms merge value vectors (k, 0, n)
and (k, 1, n) together in 512 bits (_merged_pairs: one vgf2p8affineqb moves each half's plane bits into place),
as the 512-bit sums take them. On the AVX-512 Xeon (2026-12-06, probes/kquant_bench.py 3072x1024, two threads,
matrices in L3, alternated twice) Q6_K / Q5_0 at T = 64 1439-1560 / 1102-1196 -> 1274-1306 / 970-985 us; T = 1
streamed from DRAM the same (the stream, not the arithmetic, bounds it there).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

from contextlib import contextmanager

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .avx2 import (I8, I32, I64, PREFETCH, V8I32, V16I16, V16I32, V32F, V32I8, V32I32, V64I8, VNNI512, XS_A, XS_A0,
                   XS_SCALED, _a4, _block_sum_times, _bytes_at, _const, _fn, _halves, _i16_at, _prefetch, _ptr, _rows32,
                   _rows_setup, _split, _splat, _store_rows, _vload, _xs_at, each_super_block, spread_prefetch,
                   super_block_at)
from .target import target_has

G = 32
P_OFF = 512  # the high-bit plane, after the 512 bytes of nibbles
Q5_D, Q5_M, BLK5 = 640, 704, 768
BLK5Z = Q5_M  # a q5 block without m (Q5_0's: m = -16 d)
Q6_SC0, Q6_SC1, K6_BLK = 768, 800, 832
K6_HDR = 64  # a q6 super-block's rows' f16 d
SB6 = K6_HDR + 8 * K6_BLK
META = {5: Q5_D, 6: Q6_SC0}  # where a block's per-row scales start (q5: d, m; q6: sc0, sc1)
VALS = 1024  # an unpacked block: 32 value vectors of 32 bytes (vv order), then the block's 128 scale bytes
UNBUF = VALS + 128
V8I8, V4I32 = ir.VectorType(I8, 8), ir.VectorType(I32, 4)
# Where the 512-bit sums run (VNNI512) and the target has GFNI: a value vector pair merged in 512 bits
# (_merged_pairs) instead of two 256-bit merges and a concatenation.
GF512 = VNNI512 and target_has("gfni")


class _Flat:
    """Where a form finds block b of a group of q5 blocks (and the q6 d: none here): BLK5 bytes each, or as many
    as `size` (an i64 value: the blocks array's last axis, BLK5 or BLK5Z) says."""
    lines = BLK5 // 64

    def __init__(self, size=None):
        self.size = size

    def sized(self, context, builder, arrty, arr):
        """This layout for the blocks of array arr (its last axis: the bytes of a block)."""
        a = context.make_array(arrty)(context, builder, arr)
        return _Flat(builder.extract_value(a.shape, arrty.ndim - 1))

    def has_m(self, builder):
        """An i1: the blocks carry their m (BLK5 bytes), or None where they always do."""
        return None if self.size is None else builder.icmp_unsigned("==", self.size, ir.Constant(I64, BLK5))

    def at(self, builder, q0, b):
        """(block i8*, the rows' d as <32 x float> for q6, else None)."""
        size = ir.Constant(b.type, BLK5) if self.size is None else self.size
        return builder.gep(q0, [builder.mul(b, size)]), None

    @contextmanager
    def each(self, builder, q0, nb):
        """`with lay.each(builder, q0, nb) as (b, q, dv, pf):` a loop over the group's nb blocks."""
        with cgutils.for_range(builder, nb) as loop:
            q, dv = self.at(builder, q0, loop.index)
            yield loop.index, q, dv, _bytes_at(builder, q, PREFETCH)


class _Super6(_Flat):
    """q6 super-blocks: block b is block b % 8 of super-block b // 8, its rows' d in the super-block's header."""
    lines = (SB6 // 8 + 63) // 64

    def at(self, builder, q0, b):
        q, sb = self.block_and_header(builder, q0, b)
        return q, _halves(builder, _i16_at(builder, sb, 0))

    @staticmethod
    def block_and_header(builder, q0, b):
        """(block b's i8*, its super-block's i8*: the header)."""
        return super_block_at(builder, q0, b, SB6, K6_HDR, K6_BLK)[:2]

    def sized(self, context, builder, arrty, arr):
        return self

    def has_m(self, builder):
        return None

    def each(self, builder, q0, nb):
        """Super-blocks, their header (the rows' d) converted once, then their 8 blocks."""
        return each_super_block(builder, q0, nb, SB6, K6_HDR, K6_BLK, lambda bld, sb: _halves(bld, _i16_at(bld, sb, 0)))


LAYOUT = {5: _Flat(), 6: _Super6()}


def _vv(k, h, n):
    return 4 * k + 2 * h + n


class _Values:
    """A block's value vectors as the sums read them: vec(k, h, n) -> <32 x i8>, and pair(k, n) -> <64 x i8>
    vectors (k, 0, n) and (k, 1, n) side by side (the 512-bit sums' operand): merged in 512 bits where the block
    has that form (_merged_pairs), else the two 256-bit vectors concatenated."""

    def __init__(self, builder, vec, pair=None):
        self.builder, self.vec, self._pair = builder, vec, pair

    def pair(self, k, n):
        if self._pair is not None:
            return self._pair(k, n)
        return self.builder.shuffle_vector(self.vec(k, 0, n), self.vec(k, 1, n),
                                           _const(ir.VectorType(I32, 64), list(range(64))))


def _merged(builder, q, bits):
    """_Values of the block at q (i8*): vector (k, h, n) its nibbles with their high bits from the plane (and
    the pairs merged in 512 bits where the target has GF512)."""
    nib, planes = {}, {}

    def val_of(k, h, n):
        if (k, h) not in nib:
            nib[(k, h)] = _split(builder, _vload(builder, builder.gep(q, [ir.Constant(I64, 32 * (2 * k + h))]), V32I8))
        vv = _vv(k, h, n)
        p, sh, mask = (vv // 8, 4 - vv % 8, 0x10) if bits == 5 else (k, 4 - 2 * (vv % 4), 0x30)
        if p not in planes:
            planes[p] = _vload(builder, builder.gep(q, [ir.Constant(I64, P_OFF + 32 * p)]), V32I8)
        y = planes[p]
        if sh > 0:
            y = builder.shl(y, _const(V32I8, sh))
        elif sh < 0:
            y = builder.lshr(y, _const(V32I8, -sh))
        return builder.or_(nib[(k, h)][n], builder.and_(y, _const(V32I8, mask)))
    return _Values(builder, val_of, _merged_pairs(builder, q, bits) if GF512 else None)


def _gf_bits(builder, x, picks):
    """vgf2p8affineqb (GFNI): every byte of x (<64 x i8>) -> its bits picks[h][i] at bit 4 + i, all other bits 0
    (h: the 32-byte half; the instruction's matrix is per 64-bit lane). One instruction for a shift and a mask."""
    gf = _fn(builder, "llvm.x86.vgf2p8affineqb.512", V64I8, [V64I8, V64I8, I8])
    rows = []
    for h in range(2):
        q = [0] * 8  # q[7 - t]: the input bits that make output bit t (their parity)
        for i, s in enumerate(picks[h]):
            q[7 - (4 + i)] = 1 << s
        rows += q * 4
    return builder.call(gf, [x, _const(V64I8, [v - 256 if v > 127 else v for v in rows]), ir.Constant(I8, 0)])


def _merged_pairs(builder, q, bits):
    """pair_of(k, n) -> <64 x i8> value vectors (k, 0, n) and (k, 1, n) side by side (as _isums_vnni512 sums
    them), merged in 512 bits: one 64-byte load of nibble vectors 2k and 2k + 1, the plane vector broadcast to
    both halves and its bits for each half moved into place by one vgf2p8affineqb, one OR. Per k 7 operations
    where _merged's two 256-bit halves and their concatenation took ~19. The same bytes."""
    nib, planes = {}, {}

    def pair_of(k, n):
        if k not in nib:
            nib[k] = _split(builder, _vload(builder, builder.gep(q, [ir.Constant(I64, 64 * k)]), V64I8))
        p = k // 2 if bits == 5 else k
        if p not in planes:
            y = _vload(builder, builder.gep(q, [ir.Constant(I64, P_OFF + 32 * p)]), V32I8)
            planes[p] = builder.shuffle_vector(y, y, _const(ir.VectorType(I32, 64), list(range(32)) * 2))
        vvs = [_vv(k, h, n) for h in range(2)]
        picks = [[vv % 8] if bits == 5 else [2 * (vv % 4), 2 * (vv % 4) + 1] for vv in vvs]
        return builder.or_(nib[k][n], _gf_bits(builder, planes[p], picks))
    return pair_of


def _stored(builder, b):
    """_Values of a block unpacked into the buffer at b (i8*)."""
    def val_of(k, h, n):
        return _vload(builder, builder.gep(b, [ir.Constant(I64, 32 * _vv(k, h, n))]), V32I8)
    return _Values(builder, val_of)


def _act_splats(builder, a):
    """The 8 broadcasts of a block's activations a[4k..4k+3] (a: i8* to its 32 int8 values): <32 x i8> for
    vpmaddubsw, <16 x i32> for the 512-bit vpdpbusd (VNNI512)."""
    words = [_a4(builder, a, k) for k in range(8)]
    if VNNI512:
        return [_splat(builder, w, V16I32) for w in words]
    return [builder.bitcast(_splat(builder, w, V8I32), V32I8) for w in words]


def _sums_a(builder, a):
    """(A0, A1): the sums of the block's activations 0..15 and 16..31 (i32)."""
    madd = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [V32I8, V32I8])
    pmaddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16])
    radd = _fn(builder, "llvm.vector.reduce.add.v4i32", I32, [V4I32])
    s = builder.call(pmaddwd, [builder.call(madd, [_const(V32I8, 1), _vload(builder, a, V32I8)]), _const(V16I16, 1)])
    return tuple(builder.call(radd, [builder.shuffle_vector(s, s, _const(V4I32, list(range(4 * i, 4 * i + 4))))])
                 for i in range(2))


def _isums(builder, vals, avs, ks, flush):
    """Per activation row (avs: its 8 broadcasts, _act_splats) four <8 x i32> (rows 0-7, 8-15, 16-23, 24-31):
    sum over k in ks of the weight rows' values times a[4k..4k+3], summed in int16 over `flush` k's at a time,
    then in int32 (or _isums_vnni512's). Each value vector is merged once for all the activation rows."""
    if VNNI512:
        return _isums_vnni512(builder, vals, avs, ks)
    madd = _fn(builder, "llvm.x86.avx2.pmadd.ub.sw", V16I16, [V32I8, V32I8])
    pmaddwd = _fn(builder, "llvm.x86.avx2.pmadd.wd", V8I32, [V16I16, V16I16])
    acc32 = [[None] * 4 for _ in avs]
    for c in range(0, len(ks), flush):
        acc16 = [[None] * 4 for _ in avs]
        for k in ks[c:c + flush]:
            for h in range(2):
                for n in range(2):
                    v = vals.vec(k, h, n)
                    for r, av in enumerate(avs):
                        m = builder.call(madd, [v, av[k]])
                        x = acc16[r][2 * h + n]
                        acc16[r][2 * h + n] = m if x is None else builder.add(x, m)
        for r in range(len(avs)):
            for i in range(4):
                x = builder.call(pmaddwd, [acc16[r][i], _const(V16I16, 1)])
                acc32[r][i] = x if acc32[r][i] is None else builder.add(acc32[r][i], x)
    return acc32


def _isums_vnni512(builder, vals, avs, ks):
    """_isums with 512-bit vpdpbusd (AVX512-VNNI): value vectors (k, 0, n) and (k, 1, n) side by side in one
    register (rows 8n..8n+7 and 16+8n..16+8n+7, four values each), times the broadcast a[4k..4k+3], straight
    into int32 lanes: 16 instructions per row and block where vpmaddubsw, its 16-bit adds and vpmaddwd took
    40-48. The same exact integers."""
    dp = _fn(builder, "llvm.x86.avx512.vpdpbusd.512", V16I32, [V16I32, V16I32, V16I32])
    chains = 2 if len(avs) <= 2 else 1  # (vpdpbusd's latency when few rows give independent chains)
    acc = [[[_const(V16I32, 0)] * chains for _ in range(2)] for _ in avs]
    for j, k in enumerate(ks):
        for n in range(2):
            z = builder.bitcast(vals.pair(k, n), V16I32)
            for r, av in enumerate(avs):
                acc[r][n][j % chains] = builder.call(dp, [acc[r][n][j % chains], z, av[k]])
    out = []
    for ar in acc:
        lo, hi = (c[0] if chains == 1 else builder.add(c[0], c[1]) for c in ar)  # n = 0, 1
        out.append([builder.shuffle_vector(x, x, _const(ir.VectorType(I32, 8), list(range(8 * h, 8 * h + 8))))
                    for h in range(2) for x in (lo, hi)])  # index 2h + n: rows 0-7, 8-15, 16-23, 24-31
    return out


def _terms(builder, bits, vals, acts, meta, sbs, xsbs, a_sums=None, dv=None, has_m=None):
    """<32 x float> block terms (module docstring) of the 32 rows, one per activation row: acts i8* to each
    row's 32 activations of the block, sbs / xsbs their scales and scaled sums (float); meta: i8* to the block's
    128 scale bytes. a_sums (the multi-row and batched forms): per row (A, A0), the block's sum and its first
    half's as the quantizer stored them (exact floats, avx2._xs_at), instead of summing the block again for
    every row group (q5 reads A; q6 A0 and A1 = A - A0); None: the decode form sums them itself. dv: q6's rows'
    d (<32 x float>, from the super-block's header); None: at meta + 64 (an unpacked block's copy). has_m (q5):
    an i1, false for a block without m (BLK5Z: m + 16 d taken as 0, what a stored m = -16 d gave); None: it has."""
    avs = [_act_splats(builder, a) for a in acts]
    if dv is None:
        dv = _halves(builder, _i16_at(builder, meta, 64 if bits == 6 else 0))
    out = []
    if bits == 5:
        if a_sums is None:
            a_16 = [builder.mul(builder.add(*_sums_a(builder, a)), ir.Constant(I32, 16)) for a in acts]
        else:
            a_16 = [_block_sum_times(builder, a, 16) for a, _ in a_sums]
        if has_m is None:
            m16 = builder.fadd(_halves(builder, _i16_at(builder, meta, 64)), builder.fmul(_const(V32F, 16.0), dv))
        else:  # m read only where the block has it (else the d bytes, a load that stays in the block)
            m_at = builder.select(has_m, _bytes_at(builder, meta, 64), _bytes_at(builder, meta, 0))
            m = _halves(builder, builder.bitcast(m_at, ir.IntType(16).as_pointer()))
            m16 = builder.select(has_m, builder.fadd(m, builder.fmul(_const(V32F, 16.0), dv)), _const(V32F, 0.0))
        for acc, a16, sb, xsb in zip(_isums(builder, vals, avs, list(range(8)), 4), a_16, sbs, xsbs):
            centred = builder.sub(_rows32(builder, acc), _splat(builder, a16, V32I32))
            out.append(builder.fadd(builder.fmul(builder.fmul(dv, _splat(builder, sb, V32F)),
                                                 builder.sitofp(centred, V32F)),
                                    builder.fmul(m16, _splat(builder, xsb, V32F))))
        return out
    if a_sums is None:
        sums = [_sums_a(builder, a) for a in acts]
    else:
        sums = []
        for a, a0 in a_sums:
            h0 = builder.fptosi(a0, I32)
            sums.append((h0, builder.sub(builder.fptosi(a, I32), h0)))
    scs = [[builder.sext(_vload(builder, _bytes_at(builder, meta, 32 * half + 8 * i), V8I8), V8I32) for i in range(4)]
           for half in range(2)]
    halves = [_isums(builder, vals, avs, list(range(4 * half, 4 * half + 4)), 2) for half in range(2)]
    for r, ((a0, a1), sb) in enumerate(zip(sums, sbs)):
        parts = [None] * 4
        for half, ah in ((0, a0), (1, a1)):
            off = _splat(builder, builder.mul(ah, ir.Constant(I32, 32)), V8I32)
            for i in range(4):
                t = builder.mul(scs[half][i], builder.sub(halves[half][r][i], off))
                parts[i] = t if parts[i] is None else builder.add(parts[i], t)
        out.append(builder.fmul(builder.fmul(dv, _splat(builder, sb, V32F)),
                                builder.sitofp(_rows32(builder, parts), V32F)))
    return out


def _term(builder, bits, vals, a, meta, sb, xsb, a_sums=None, dv=None, has_m=None):
    """_terms of one activation row (a_sums: its (A, A0), or None)."""
    return _terms(builder, bits, vals, [a], meta, [sb], [xsb], None if a_sums is None else [a_sums], dv, has_m)[0]


def _check_blocks(a):
    return isinstance(a, types.Array) and a.dtype == types.uint8


def _make(bits):
    lay = LAYOUT[bits]

    @intrinsic
    def grp(typingctx, o, o_off, blk, blk_off, qa, qa_off, sa, xs, s_off, x_off, nb):
        """o[o_off : o_off + 32] <- the 32 rows' dot products with one activation row over nb blocks:
        blk[blk_off:] the group's blocks, qa[qa_off:] the int8 activations (32 per block), sa[s_off:] /
        xs[x_off:] their block scales and sums (avx2._xs_at: the scaled sum; the decode form sums the
        integers itself). Outputs in registers across
        blocks, summed in block order."""
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
            bl = lay.sized(context, builder, ty[2], blk_)
            has_m = bl.has_m(builder)
            with bl.each(builder, q0, nb_) as (b, q, dv, pf):
                with spread_prefetch(builder, pf, lay.lines):
                    ab = builder.gep(a0, [builder.mul(b, ir.Constant(b.type, 32))])
                    term = _term(builder, bits, _merged(builder, q, bits), ab, _bytes_at(builder, q, META[bits]),
                                 builder.load(builder.gep(sp, [b])), _xs_at(builder, xp, b, XS_SCALED), dv=dv,
                                 has_m=has_m)
                builder.store(builder.fadd(builder.load(accp), term), accp)
            op = builder.bitcast(_ptr(context, builder, ty[0], o_, oo), V32F.as_pointer())
            builder.store(builder.load(accp), op, align=4)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def unpack(typingctx, buf, blk, grp_off, bi):
        """buf[0:UNBUF] (uint8) <- block bi (an int64) of the group whose blocks start at blk[grp_off:], as blku
        reads it: its 32 value vectors with the high bits merged in (vv order), then its 128 bytes of row scales
        as they are (q6: sc0, sc1, then the super-block's d)."""
        if not _check_blocks(blk):
            return None
        sig = types.void(buf, blk, grp_off, bi)

        def codegen(context, builder, signature, args):
            buf_, blk_, go, bi_ = args
            q0 = _ptr(context, builder, signature.args[1], blk_, go)
            if bits == 6:
                q, sb = _Super6.block_and_header(builder, q0, bi_)
                scales = [_bytes_at(builder, q, Q6_SC0), _bytes_at(builder, q, Q6_SC1), sb, _bytes_at(builder, sb, 32)]
            else:
                bl = lay.sized(context, builder, signature.args[1], blk_)
                q = bl.at(builder, q0, bi_)[0]
                scales = [_bytes_at(builder, q, META[bits] + 32 * i) for i in range(4)]
                has_m = bl.has_m(builder)
            b = _ptr(context, builder, signature.args[0], buf_, ir.Constant(I64, 0))
            vals = _merged(builder, q, bits)
            for k in range(8):
                for h in range(2):
                    for n in range(2):
                        p = builder.bitcast(builder.gep(b, [ir.Constant(I64, 32 * _vv(k, h, n))]), V32I8.as_pointer())
                        builder.store(vals.vec(k, h, n), p, align=1)
            for i, src in enumerate(scales):
                if bits == 5 and i >= 2:  # m: where the block has none, f16(-16 d) (exact), what its copy held
                    src = builder.select(has_m, src, scales[i - 2])
                x = _vload(builder, src, V32I8)
                if bits == 5 and i >= 2:
                    h, f = ir.VectorType(ir.HalfType(), 16), ir.VectorType(ir.FloatType(), 16)
                    d = builder.fpext(builder.bitcast(x, h), f)
                    m = builder.bitcast(builder.fptrunc(builder.fmul(d, _const(f, -16.0)), h), V32I8)
                    x = builder.select(has_m, x, m)
                builder.store(x, builder.bitcast(_bytes_at(builder, b, VALS + 32 * i), V32I8.as_pointer()), align=1)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def blku(typingctx, o, o_off, buf, qa, qa_off, sb, xsb, a_sum, a_half):
        """o[o_off : o_off + 32] += one block's term for 32 rows from a block unpacked into buf; qa[qa_off:] its
        32 int8 activations, sb / xsb their scale and scaled sum, a_sum / a_half the integer sums of all 32 and
        of the first 16 (avx2.XS_A, XS_A0)."""
        sig = types.void(o, o_off, buf, qa, qa_off, sb, xsb, a_sum, a_half)

        def codegen(context, builder, signature, args):
            o_, oo, buf_, qa_, ao, sb_, xsb_, asum_, ahalf_ = args
            ty = signature.args
            b = _ptr(context, builder, ty[2], buf_, ir.Constant(I64, 0))
            term = _term(builder, bits, _stored(builder, b), _ptr(context, builder, ty[3], qa_, ao),
                         _bytes_at(builder, b, VALS), sb_, xsb_, (asum_, ahalf_))
            op = builder.bitcast(_ptr(context, builder, ty[0], o_, oo), V32F.as_pointer())
            builder.store(builder.fadd(builder.load(op, align=4), term), op, align=4)
            return context.get_dummy_value()
        return sig, codegen
    return grp, unpack, blku


def _make_rows(bits, nt):
    lay = LAYOUT[bits]

    @intrinsic
    def grp_rows(typingctx, o, o_off, o_st, blk, blk_off, qa, qa_off, qa_st, sa, xs, s_off, s_st, x_off, x_st, nb):
        """grp for nt activation rows at once (a verify block, a short prompt chunk; avx2.grp_q4_rows' form):
        each value vector is loaded and merged once and the nt rows' vpmaddubsw run on it from registers. Row
        i's data sit at o_off + i o_st, qa_off + i qa_st, s_off + i s_st, x_off + i x_st (elements). Per row
        the same integer sums, block term and block-order accumulation from 0 as grp: bit for bit a one-row
        call."""
        if not _check_blocks(blk):
            return None
        sig = types.void(o, o_off, o_st, blk, blk_off, qa, qa_off, qa_st, sa, xs, s_off, s_st, x_off, x_st, nb)

        def codegen(context, builder, signature, args):
            ty, nb_ = signature.args, args[14]
            q0, a0, sp, xp, accp = _rows_setup(context, builder, ty, args, nt)
            bl = lay.sized(context, builder, ty[3], args[3])
            has_m = bl.has_m(builder)
            with bl.each(builder, q0, nb_) as (b, q, dv, pf):
                _prefetch(builder, pf, lay.lines)
                acts = [builder.gep(a, [builder.mul(b, ir.Constant(b.type, 32))]) for a in a0]
                terms = _terms(builder, bits, _merged(builder, q, bits), acts, _bytes_at(builder, q, META[bits]),
                               [builder.load(builder.gep(p, [b])) for p in sp],
                               [_xs_at(builder, p, b, XS_SCALED) for p in xp],
                               [(_xs_at(builder, p, b, XS_A), _xs_at(builder, p, b, XS_A0)) for p in xp], dv, has_m)
                for i in range(nt):
                    builder.store(builder.fadd(builder.load(accp[i]), terms[i]), accp[i])
            _store_rows(context, builder, ty, args, accp)
            return context.get_dummy_value()
        return sig, codegen
    return grp_rows


grp5, unpack5, blku5 = _make(5)
grp6, unpack6, blku6 = _make(6)
ROWS_MAX = 4  # activation rows of one grp_rows call (as avx2.ROWS_MAX: int16 accumulators in registers)
grp5_rows2, grp5_rows3, grp5_rows4 = (_make_rows(5, n) for n in range(2, 5))
grp6_rows2, grp6_rows3, grp6_rows4 = (_make_rows(6, n) for n in range(2, 5))
