"""Decode attention's softmax over one row of a work item's scores, written as LLVM IR (numba intrinsic).

`softmax_row(s, n)`: s[:n] <- exp(s[:n] - max) in place, returning (max, sum). A row is one query head's
scores over a work item's chunk of positions (~20-150 at chat and long context). Through numba the two loops
(max, then exp and sum) had a runtime bound, so LLVM vectorized them 32 scores per iteration and left up to
31 of a row to a scalar exp: at 600 positions that took 6.9-7.1 of a layer's 27.5 us (one thread,
cache-hot; history file). Here every score goes through LANES-wide vectors (attn_avx2.LANES: 16
with AVX-512, else 8): whole vectors, then the rest of the row in one masked load and store (the lanes past
n are neither read nor written), the exp as attn.exp_fast computes it (clamp, 2^n by the exponent
bits, a degree-6 polynomial in r = x - n ln2), and the max and the sum kept per lane, then reduced across
the lanes once per row.

The sum's order is the lanes' (lane j adds scores j, j + LANES, ...), not the numba loop's, so the results
agree with attn's loops to float rounding; every caller of attn._softmax_rows on a target takes the
same path, so decode steps and verification passes (both per-row work items) stay bit-identical.
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .attn_avx2 import LANES, _shuf
from .avx2 import _const, _fn, _splat

I1, I32, I64, F = ir.IntType(1), ir.IntType(32), ir.IntType(64), ir.FloatType()
VF, VI = ir.VectorType(F, LANES), ir.VectorType(I32, LANES)
VB = ir.VectorType(I1, LANES)

# The exp's constants, here and in attn.exp_fast (the scalar form): ln 2 split in a high part exact in
# float32 and the rest; the degree-6 polynomial's coefficients, highest first.
EXP_LOG2E, EXP_LN2_HI, EXP_LN2_LO = 1.4426950408889634, 0.693145751953125, 1.428606765330187e-06
EXP_POLY = (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0)


def _c(x):
    return _const(VF, float(x))


def _fma(builder, a, b, c):
    return builder.call(_fn(builder, f"llvm.fma.v{LANES}f32", VF, [VF, VF, VF]), [a, b, c])


def _max(builder, a, b):
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _exp(builder, x):
    """exp_fast over a vector: exact to ~2 ulp on [-87, 88], the clamped value's exp outside."""
    x = _max(builder, x, _c(-87.0))
    x = builder.select(builder.fcmp_ordered("<", x, _c(88.0)), x, _c(88.0))
    floor = _fn(builder, f"llvm.floor.v{LANES}f32", VF, [VF])
    n = builder.call(floor, [_fma(builder, x, _c(EXP_LOG2E), _c(0.5))])
    r = builder.fsub(builder.fsub(x, builder.fmul(n, _c(EXP_LN2_HI))), builder.fmul(n, _c(EXP_LN2_LO)))
    p = _c(EXP_POLY[0])
    for k in EXP_POLY[1:]:
        p = _fma(builder, p, r, _c(k))
    bits = builder.shl(builder.add(builder.fptosi(n, VI), _const(VI, 127)), _const(VI, 23))
    return builder.fmul(p, builder.bitcast(bits, VF))


def _across(builder, v, op):
    """One float: op folded over v's lanes (halving shuffles)."""
    k = LANES
    while k > 1:
        k //= 2
        hi = _shuf(builder, v, v, [k + (i % k) for i in range(LANES)])
        v = op(builder, v, hi)
    return builder.extract_element(v, ir.Constant(I32, 0))


def _masked(builder, p, mask, passthru):
    fn = _fn(builder, f"llvm.masked.load.v{LANES}f32.p0v{LANES}f32", VF, [VF.as_pointer(), I32, VB, VF])
    return builder.call(fn, [p, ir.Constant(I32, 4), mask, passthru])


def _masked_store(builder, v, p, mask):
    fn = _fn(builder, f"llvm.masked.store.v{LANES}f32.p0v{LANES}f32", ir.VoidType(), [VF, VF.as_pointer(), I32, VB])
    builder.call(fn, [v, p, ir.Constant(I32, 4), mask])


@intrinsic
def softmax_row(typingctx, s, n):
    """s[:n] <- exp(s[:n] - m) in place for a contiguous 1-d float32 s, n >= 1; returns (m, sum) with m the
    largest of s[:n]. Lanes past n are not touched."""
    if not (isinstance(s, types.Array) and s.ndim == 1 and s.dtype == types.float32 and s.layout == "C"
            and isinstance(n, types.Integer)):
        return None
    sig = types.UniTuple(types.float32, 2)(s, n)

    def codegen(context, builder, signature, args):
        s_, n_ = args
        arr = context.make_array(signature.args[0])(context, builder, s_)
        base = arr.data
        n = context.cast(builder, n_, signature.args[1], types.int64)
        full = builder.udiv(n, ir.Constant(I64, LANES))
        rest = builder.trunc(builder.urem(n, ir.Constant(I64, LANES)), I32)
        tail = builder.bitcast(builder.gep(base, [builder.mul(full, ir.Constant(I64, LANES))]), VF.as_pointer())
        mask = builder.icmp_unsigned("<", _const(VI, list(range(LANES))), _splat(builder, rest, VI))

        def vec(i):
            return builder.bitcast(builder.gep(base, [builder.mul(i, ir.Constant(I64, LANES))]), VF.as_pointer())

        neg = _c(float("-inf"))
        acc = cgutils.alloca_once_value(builder, neg)
        with cgutils.for_range(builder, full) as loop:
            builder.store(_max(builder, builder.load(acc), builder.load(vec(loop.index), align=4)), acc)
        tv = _masked(builder, tail, mask, neg)
        m = _across(builder, _max(builder, builder.load(acc), tv), _max)

        ms = _splat(builder, m, VF)
        tot = cgutils.alloca_once_value(builder, _c(0.0))
        with cgutils.for_range(builder, full) as loop:
            p = vec(loop.index)
            e = _exp(builder, builder.fsub(builder.load(p, align=4), ms))
            builder.store(e, p, align=4)
            builder.store(builder.fadd(builder.load(tot), e), tot)
        e = _exp(builder, builder.fsub(_masked(builder, tail, mask, ms), ms))
        _masked_store(builder, e, tail, mask)
        last = builder.fadd(builder.load(tot), builder.select(mask, e, _c(0.0)))
        total = _across(builder, last, lambda b, x, y: b.fadd(x, y))
        return context.make_tuple(builder, signature.return_type, [m, total])
    return sig, codegen
