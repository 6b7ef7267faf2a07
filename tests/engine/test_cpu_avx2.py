"""The AVX2 block kernels (engine/kernels/cpu_avx2.py) against cpu_fast's generic kernels, bit for bit, and
the generic fallback path (NINFER_CPU_GENERIC=1) against the reference.

Bit-identity is the contract that lets a verify pass (T rows, batched kernels) reproduce decode steps
(T = 1 kernels) exactly: both compute the same integer block sums and the same float expression."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT


ROOT = Path(__file__).resolve().parents[2]


def _weight(rng, qtype, rows, cols):
    from engine.backends.cpu import fast as cpu_fast
    from test_speed_guard import _qtensor  # random blocks with sane scales
    return cpu_fast.prepare_weight(_qtensor(rng, qtype, rows, cols))


def _quantized(rng, t_n, cols, extreme):
    from engine.backends.cpu import fast as cpu_fast
    x = rng.standard_normal((t_n, cols)).astype(np.float32)
    if extreme:  # every activation +-127 after quantization: the int16 accumulator bounds
        x = np.sign(x).astype(np.float32)
    nb = cols // 32
    qa, sa = np.zeros((t_n, cols), np.int8), np.zeros((t_n, nb), np.float32)
    xs = np.zeros((t_n, cpu_fast.XS * nb), np.float32)
    cpu_fast.quantize_rows(qa, sa, xs, x)
    return qa, sa, xs


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
@pytest.mark.parametrize("rows, cols", [(64, 96), (45, 128)])  # 45: a padded last row group
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("t_n", [3, 5, 20])  # 3, 5: fast.ROWS_MAX-row calls and a remainder; 20: unpacked
def test_avx2_kernels_equal_generic_bitwise(qtype, rows, cols, extreme, t_n):
    from engine.backends.cpu import fast as F
    if not F.HAVE_AVX2:
        pytest.skip("host without AVX2 (or NINFER_CPU_GENERIC set)")
    rng = np.random.default_rng(rows + cols + extreme)
    w = _weight(rng, qtype, rows, cols)
    if extreme and qtype != QT.Q8_0:
        w.qs[...] = 0xFF if qtype == QT.Q4_1 else 0x00  # nibbles all 15 (largest unsigned) resp. 0 (q - 8 = -8)
    qa, sa, xs = _quantized(rng, t_n, cols, extreme)
    want = np.full((t_n, rows), np.nan, np.float32)
    got1, gotb = want.copy(), want.copy()
    for g in range(w.qs.shape[0]):
        if w.kind == "q4":
            F.q4_group_generic(want, qa, sa, xs, w.blocks, w.acc16[g], g)
            F.q4_group(got1, qa, sa, xs, w.blocks, w.acc16[g], g)
            F.q4_group_batched(gotb, qa, sa, xs, w.blocks, g)
        else:
            F.q8_group_generic(want, qa, sa, w.blocks, w.acc32[g], g)
            F.q8_group(got1, qa, sa, w.blocks, w.acc32[g], g)
            F.q8_group_batched(gotb, qa, sa, xs, w.blocks, g)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got1, want)
    np.testing.assert_array_equal(gotb, want)


def _vnni_and_madd():
    """cpu_avx2's 4-bit kernels in both forms: the decode form and the 4-row form with vpdpbusd (the target's,
    where it has VNNI / AVX512-VNNI) and with vpmaddubsw."""
    import numba
    from engine.backends.cpu import avx2 as A

    @numba.njit
    def run(o1, o2, o4, o4m, blk, qa, sa, xs, nb):
        A.grp_q4(o1, 0, blk, 0, qa, 0, sa, xs, 0, 0, nb)
        A.grp_q4_madd(o2, 0, blk, 0, qa, 0, sa, xs, 0, 0, nb)
        # four activation rows: the block's row and three shifted copies (qa holds nb + 3 blocks)
        A.grp_q4_rows4(o4, 0, 32, blk, 0, qa, 0, 32, sa, xs, 0, 1, 0, A.XS, nb)
        A.grp_q4_rows4_madd(o4m, 0, 32, blk, 0, qa, 0, 32, sa, xs, 0, 1, 0, A.XS, nb)
    return run


@pytest.mark.parametrize("extreme", [False, True])
def test_vnni_block_sums_equal_vpmaddubsw_bitwise(extreme):
    """Where the target has AVX-VNNI / AVX512-VNNI, the 4-bit decode kernel sums each block with vpdpbusd: the
    same exact integers as vpmaddubsw's pair sums, so the same output bits, also at the bounds (every nibble
    15, every activation -128 or 127)."""
    from engine.backends.cpu import avx2 as A
    from engine.backends.cpu import fast as F
    if not F.HAVE_AVX2:
        pytest.skip("host without AVX2 (or NINFER_CPU_GENERIC set)")
    if not (A.VNNI or A.ROWS_VNNI):
        pytest.skip("target without AVX-VNNI (the vpmaddubsw forms are the only ones)")
    rng = np.random.default_rng(7 + extreme)
    nb, na = 9, 12  # blocks of the group; activation blocks (the 4-row form's rows start 0-3 blocks in)
    blk = np.zeros((nb, A.BLK4), np.uint8)  # one row group's blocks: nibbles, scales, mins
    blk[:, :A.D_OFF] = rng.integers(0, 256, (nb, A.D_OFF), dtype=np.uint8)
    qa = rng.integers(-128, 128, na * 32, dtype=np.int8)
    if extreme:
        blk[:, :A.D_OFF] = 0xFF
        qa[:] = np.where(rng.random(na * 32) < 0.5, -128, 127).astype(np.int8)
    sa, xs = rng.random(na, dtype=np.float32), np.zeros(A.XS * na, np.float32)  # xs: each block's sums
    xs[A.XS_SCALED::A.XS] = rng.standard_normal(na)
    xs[A.XS_A::A.XS] = qa.reshape(na, 32).sum(1, dtype=np.int32)
    xs[A.XS_A0::A.XS] = qa.reshape(na, 32)[:, :16].sum(1, dtype=np.int32)
    blk[:, A.D_OFF:A.M_OFF] = (rng.random((nb, 32)) * 0.02).astype(np.float16).view(np.uint8)
    blk[:, A.M_OFF:] = (rng.random((nb, 32)) * -0.02).astype(np.float16).view(np.uint8)
    o1, o2 = np.full(32, np.nan, np.float32), np.zeros(32, np.float32)
    o4, o4m = np.full(4 * 32, np.nan, np.float32), np.zeros(4 * 32, np.float32)
    _vnni_and_madd()(o1, o2, o4, o4m, blk.reshape(-1), qa, sa, xs, nb)
    assert np.isfinite(o1).all() and np.abs(o1).max() > 0
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(o4, o4m)
    np.testing.assert_array_equal(o4[:32], o1)  # the 4-row form's first row is the decode form's row


def _q8_rows_busd_and_madd():
    import numba
    from engine.backends.cpu import avx2 as A, avx2_q8 as A8

    @numba.njit
    def run(o4, o4m, blk, qa, sa, xs, nb):
        A8.grp_q8_rows4(o4, 0, 32, blk, 0, qa, 0, 32, sa, xs, 0, 1, 0, A.XS, nb)
        A8.grp_q8_rows4_madd(o4m, 0, 32, blk, 0, qa, 0, 32, sa, xs, 0, 1, 0, A.XS, nb)
    return run


@pytest.mark.parametrize("extreme", [False, True])
def test_q8_rows_busd_equal_vpmaddwd_bitwise(extreme):
    """Where the target has AVX512-VNNI, the Q8_0 multi-row form sums with vpdpbusd over the weights with their
    sign bit flipped (w + 128) and takes 128 A off: the same exact integers as the sign-extended pairs'
    vpmaddwd, so the same bits, also at the bounds (weights -128 and 127, activations -128 and 127)."""
    from engine.backends.cpu import avx2 as A
    from engine.backends.cpu import fast as F
    if not F.HAVE_AVX2:
        pytest.skip("host without AVX2 (or NINFER_CPU_GENERIC set)")
    if not A.VNNI512:
        pytest.skip("target without AVX512-VNNI (vpmaddwd is the only form)")
    rng = np.random.default_rng(11 + extreme)
    nb, na = 9, 12  # blocks of the group; activation blocks (the 4-row form's rows start 0-3 blocks in)
    blk = np.zeros((nb, A.BLK8), np.uint8)  # one row group's blocks: values (pairs of 32 rows), scales
    blk[:, :A.D8_OFF] = rng.integers(0, 256, (nb, A.D8_OFF), dtype=np.uint8)
    qa = rng.integers(-128, 128, na * 32, dtype=np.int8)
    if extreme:
        blk[:, :A.D8_OFF] = np.where(rng.random((nb, A.D8_OFF)) < 0.5, 0x80, 0x7F).astype(np.uint8)
        qa[:] = np.where(rng.random(na * 32) < 0.5, -128, 127).astype(np.int8)
    sa, xs = rng.random(na, dtype=np.float32), np.zeros(A.XS * na, np.float32)
    xs[A.XS_A::A.XS] = qa.reshape(na, 32).sum(1, dtype=np.int32)
    blk[:, A.D8_OFF:] = (rng.random((nb, 32)) * 0.02).astype(np.float16).view(np.uint8)
    o4, o4m = np.full(4 * 32, np.nan, np.float32), np.zeros(4 * 32, np.float32)
    _q8_rows_busd_and_madd()(o4, o4m, blk.reshape(-1), qa, sa, xs, nb)
    assert np.isfinite(o4).all() and np.abs(o4).max() > 0
    np.testing.assert_array_equal(o4, o4m)


def test_avx2_quantize_rows_equals_generic_bitwise():
    """The activations' quantization (cpu_avx2.absmax32 / quant32) gives the generic loop's int8 values, f16
    scales and block sums: a block of zeros, exact ties at .5 after scaling (round half to even), +-1
    everywhere, the f32 extremes of a row, and rows that are views of wider buffers (as the step passes)."""
    from engine.backends.cpu import fast as F
    if not F.HAVE_AVX2:
        pytest.skip("host without AVX2 (or NINFER_CPU_GENERIC set)")
    rng = np.random.default_rng(7)
    for t_n, n in ((1, 576), (5, 1536), (3, 64)):
        x = np.zeros((t_n, n + 32), np.float32)
        x[:, :n] = rng.standard_normal((t_n, n)) * 10.0 ** rng.integers(-3, 4, (t_n, 1))
        x[0, :32] = 0.0
        ties = np.arange(31) - 15.5  # with a block max of 127 the scale's inverse is 1: x * inv are ties at .5
        x[0, 32], x[0, 33:64] = 127.0, ties
        x[-1, n - 32:n] = np.sign(x[-1, n - 32:n])
        x[-1, 0] = 3e38
        got = [np.full((t_n, w), 99, dt) for w, dt in ((n + 64, np.int8), (n // 32 + 3, np.float32),
                                                        (F.XS * (n // 32) + 3, np.float32))]
        want = [a.copy() for a in got]
        for f, (qa, sa, xs) in ((F.quantize_rows, got), (F.quantize_rows_generic, want)):
            f(qa[:, :n], sa[:, :n // 32], xs[:, :F.XS * (n // 32)], x[:, :n])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        # beside each block's scaled sum, its integer sum and its first half's (what the AVX2 kernels' - 8 A
        # and Q6_K's - 32 A0, - 32 A1 terms read)
        blocks = got[0][:, :n].reshape(t_n, -1, 32)
        np.testing.assert_array_equal(got[2][:, F.XS_A:F.XS * (n // 32):F.XS], blocks.sum(-1, dtype=np.int32))
        np.testing.assert_array_equal(got[2][:, F.XS_A0:F.XS * (n // 32):F.XS],
                                      blocks[..., :16].sum(-1, dtype=np.int32))
        np.testing.assert_array_equal(want[0][0, 33:64], np.rint(ties))  # half to even, as numpy rounds
    xt = np.ascontiguousarray(x[:, :64].T)[:, :3].T  # values 3 apart in memory: the generic loop serves them
    got = [np.zeros((3, 64), np.int8), np.zeros((3, 2), np.float32), np.zeros((3, 2 * F.XS), np.float32)]
    want = [a.copy() for a in got]
    F.quantize_rows(*got, xt)
    F.quantize_rows_generic(*want, np.ascontiguousarray(xt))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


GENERIC = """
import json
import numpy as np
from gguf import GGMLQuantizationType as QT
from engine.backends.cpu import fast as cpu_fast
import test_cpu_avx2 as T
res = {"avx2": cpu_fast.HAVE_AVX2, "out": [], "x": []}
rng = np.random.default_rng(0)
for qtype in (QT.Q4_1, QT.Q8_0):
    for t_n in (1, 3):
        w = T._weight(rng, qtype, 45, 96)
        x = rng.standard_normal((t_n, 96)).astype(np.float32)
        out = np.full((t_n, 45), np.nan, np.float32)
        cpu_fast.matmul(out, x, w, cpu_fast.new_scratch(4, 96))
        res["out"].append(out.tolist())
        res["x"].append(x.tolist())
print(json.dumps(res))
"""


def _generic_job():
    """GENERIC with NINFER_CPU_GENERIC=1 and a cold numba cache, started with the session (tests/background.py;
    imported here: tests/ is not on the path of the GENERIC subprocess, which imports this module)."""
    import background
    return background.python_job("generic:avx2", GENERIC, {"NUMBA_NUM_THREADS": "2", "NINFER_CPU_GENERIC": "1"},
                                 timeout=600, cold_numba=True)


BACKGROUND = [_generic_job]


def test_generic_fallback_path(tmp_path):
    """NINFER_CPU_GENERIC=1 (what a host without AVX2 runs) gives the same matmul results as the AVX2 path."""
    import background
    generic = background.result_json(_generic_job(), "the generic kernels' run")
    assert generic["avx2"] is False
    from engine.backends.cpu import fast as cpu_fast
    rng = np.random.default_rng(0)
    i = 0
    for qtype in (QT.Q4_1, QT.Q8_0):
        for t_n in (1, 3):
            w = _weight(rng, qtype, 45, 96)
            x = rng.standard_normal((t_n, 96)).astype(np.float32)
            np.testing.assert_array_equal(x, np.array(generic["x"][i], np.float32))
            out = np.full((t_n, 45), np.nan, np.float32)
            cpu_fast.matmul(out, x, w, cpu_fast.new_scratch(4, 96))
            np.testing.assert_array_equal(out, np.array(generic["out"][i], np.float32))
            i += 1
