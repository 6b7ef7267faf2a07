"""Every CPU kernel against the numpy reference (engine/kernels/ref.py), with tolerances, on small shapes."""
import os

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import numpy as np
import pytest

from engine.backends.cpu import kernels as cpu
from engine.backends.ref import kernels as ref
from engine.quant import SUPPORTED
from reference_forward import random_qtensor

RNG = np.random.default_rng(1234)


ALL_TYPES = list(SUPPORTED)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("t_n", [1, 5, 8])
def test_matmul(qtype, t_n):
    d, n = 24, 512
    qt = random_qtensor(qtype, d, n, RNG)
    x = RNG.standard_normal((t_n, n)).astype(np.float32)
    want = np.zeros((t_n, d), np.float32)
    ref.matmul(want, x, ref.prepare_weight(qt), ref.new_scratch(t_n, n))
    got = np.full((t_n, d), np.nan, np.float32)
    cpu.matmul(got, x, cpu.prepare_weight(qt), cpu.new_scratch(8, n))
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_embed(qtype):
    qt = random_qtensor(qtype, 50, 256, RNG)
    tokens = np.array([3, 0, 49, 3], np.int32)
    want = np.zeros((4, 256), np.float32)
    ref.embed(want, ref.prepare_weight(qt), tokens)
    got = np.zeros((4, 256), np.float32)
    cpu.embed(got, cpu.prepare_weight(qt), tokens)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_elementwise():
    x = RNG.standard_normal((3, 64)).astype(np.float32)
    y = RNG.standard_normal((3, 64)).astype(np.float32)
    w = RNG.standard_normal(64).astype(np.float32)
    for name, args in [("rmsnorm", (x, w, 1e-5)), ("swiglu", (x, y))]:
        want, got = np.zeros_like(x), np.zeros_like(x)
        getattr(ref, name)(want, *args)
        getattr(cpu, name)(got, *args)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    z = RNG.standard_normal((2, 67)).astype(np.float32)  # a row length that is not a multiple of 8
    want, got = np.zeros_like(z), np.zeros_like(z)
    ref.rmsnorm(want, z, w[:1].repeat(67), 1e-5)
    cpu.rmsnorm(got, z, w[:1].repeat(67), 1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg="rmsnorm n=67")
    for name, arg in [("residual_add", y), ("bias_add", w)]:
        want, got = x.copy(), x.copy()
        getattr(ref, name)(want, arg)
        getattr(cpu, name)(got, arg)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)
    logits = RNG.standard_normal((3, 1000)).astype(np.float32)
    want, got = np.zeros(3, np.int32), np.full(3, -1, np.int32)
    ref.argmax(want, logits)
    cpu.argmax(got, logits)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("pos0", [0, 37])
def test_rope(neox, pos0):
    hd = 16
    x = RNG.standard_normal((4, 3, hd)).astype(np.float32)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    want, got = x.copy(), x.copy()
    ref.rope(want, pos0, inv_freq, neox)
    cpu.rope(got, pos0, inv_freq, neox)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got[1:], x[1:])  # it did rotate
    # the fused step's form: the angles' cos/sin once per pass, applied to q and k of every layer; same bits
    cs = np.zeros((4, hd // 2, 2), np.float64)
    cpu.rope_table(cs, pos0, inv_freq)
    table = x.copy()
    cpu.rope_apply(table, cs, neox)
    np.testing.assert_array_equal(table, got)


def test_rope_pairs_layout():
    # position 1, one pair rotated by 1 rad: check which elements form the pair in each mode
    x = np.zeros((1, 1, 4), np.float32)
    x[0, 0, 0] = 1.0
    inv = np.array([1.0, 0.0], np.float32)
    a, b = x.copy(), x.copy()
    cpu.rope(a, 1, inv, False)  # adjacent: (x0, x1)
    cpu.rope(b, 1, inv, True)  # halves: (x0, x2)
    np.testing.assert_allclose(a[0, 0], [np.cos(1), np.sin(1), 0, 0], atol=1e-6)
    np.testing.assert_allclose(b[0, 0], [np.cos(1), 0, np.sin(1), 0], atol=1e-6)


def _fill_cache(mod, kv_dtype, cap, n_kv, hd, n_pos):
    k = RNG.standard_normal((n_pos, n_kv, hd)).astype(np.float32)
    v = RNG.standard_normal((n_pos, n_kv, hd)).astype(np.float32)
    if kv_dtype == "f16":
        kc, vc = np.zeros((cap, n_kv, hd), np.float16), np.zeros((cap, n_kv, hd), np.float16)
        mod.kv_store_f16(kc, vc, k, v, 0)
        return (kc, vc)
    g = ref.kv_group(hd)
    kq, vq = np.zeros((cap, n_kv, hd), np.int8), np.zeros((cap, n_kv, hd), np.int8)
    ks, vs = np.zeros((cap, n_kv, hd // g), np.float32), np.zeros((cap, n_kv, hd // g), np.float32)
    # store in two calls (positions 0..2, then the rest) to exercise pos0
    mod.kv_store_int8(kq, ks, vq, vs, k[:3], v[:3], 0)
    mod.kv_store_int8(kq, ks, vq, vs, k[3:], v[3:], 3)
    return (kq, ks, vq, vs)


def test_kv_store_int8_matches_ref():
    a = _fill_cache(ref, "int8", 12, 2, 64, 10)
    k = RNG.standard_normal((5, 2, 64)).astype(np.float32)
    v = RNG.standard_normal((5, 2, 64)).astype(np.float32)
    bufs_r = [np.zeros_like(b) for b in a]
    bufs_c = [np.zeros_like(b) for b in a]
    ref.kv_store_int8(*bufs_r, k, v, 2)
    cpu.kv_store_int8(*bufs_c, k, v, 2)
    for r, c in zip(bufs_r, bufs_c):
        assert np.abs(r.astype(np.float64) - c.astype(np.float64)).max() <= (1 if r.dtype == np.int8 else 1e-7)
    deq = ref.dequantize_kv_int8(bufs_r[0][2:7], bufs_r[1][2:7])
    assert np.abs(deq - k).max() < np.abs(k).max() / 127  # the int8 cache is close to the values


@pytest.mark.parametrize("hd,group", [(64, 32), (128, 32), (64, 64), (48, 16), (40, 40), (12, 12)])
def test_int8_store_is_refs_quantization_bit_for_bit(hd, group):
    """cpu._quant_rows (the KV store of every CPU path): 16-lane vectors where the groups are multiples of 16
    values (cpu_attn_int8_avx2.quantize_rows_q8), the loop otherwise; both give ref.quantize_kv_int8's bits,
    at halves (x / scale = +-0.5, 126.5), a zero group, a -0.0 and a group's largest value."""
    rng = np.random.default_rng(hd + group)
    x = (rng.standard_normal((4, 3, hd)) * rng.choice([1e-3, 1.0, 60.0], size=(4, 3, 1))).astype(np.float32)
    x[0, 0, :group] = 0
    x[1, 1, :group] = np.linspace(-1, 1, group, dtype=np.float32)
    x[1, 1, :4] = [0.5 / 127, -0.5 / 127, -0.0, 126.5 / 127]
    q = np.full((9, 3, hd), 99, np.int8)
    s = np.full((9, 3, hd // group), np.nan, np.float32)
    cpu._quant_rows(q, s, x, 5)
    want_q, want_s = ref.quantize_kv_int8(x, group)
    assert np.array_equal(q[5:], want_q) and np.array_equal(s[5:], want_s)
    assert (q[:5] == 99).all() and np.isnan(s[:5]).all()


@pytest.mark.parametrize("kv_dtype", ["f16", "int8"])
@pytest.mark.parametrize("pos0,t_n", [(0, 1), (0, 5), (6, 1), (9, 3)])
def test_attention(kv_dtype, pos0, t_n):
    cap, n_head, n_kv, hd = 16, 6, 2, 64
    cache = _fill_cache(ref, kv_dtype, cap, n_kv, hd, pos0 + t_n)
    q = RNG.standard_normal((t_n, n_head, hd)).astype(np.float32)
    scale = 1.0 / np.sqrt(hd)
    want, got = np.zeros_like(q), np.full_like(q, np.nan)
    getattr(ref, f"attention_{kv_dtype}")(want, q, *cache, pos0, scale)
    getattr(cpu, f"attention_{kv_dtype}")(got, q, *cache, pos0, scale)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # causality: changing a cache position beyond the last query must not change anything
    cache[0][pos0 + t_n:] = 1
    again = np.zeros_like(q)
    getattr(cpu, f"attention_{kv_dtype}")(again, q, *cache, pos0, scale)
    np.testing.assert_array_equal(again, got)


def test_kv_int8_attention_close_to_f16():
    cap, n_head, n_kv, hd = 16, 4, 2, 64
    k = RNG.standard_normal((cap, n_kv, hd)).astype(np.float32)
    v = RNG.standard_normal((cap, n_kv, hd)).astype(np.float32)
    q = RNG.standard_normal((1, n_head, hd)).astype(np.float32)
    kc, vc = np.zeros((cap, n_kv, hd), np.float16), np.zeros((cap, n_kv, hd), np.float16)
    cpu.kv_store_f16(kc, vc, k, v, 0)
    g = ref.kv_group(hd)
    bufs = [np.zeros((cap, n_kv, hd), np.int8), np.zeros((cap, n_kv, hd // g), np.float32)] * 2
    bufs = [b.copy() for b in bufs]
    cpu.kv_store_int8(*bufs, k, v, 0)
    a, b = np.zeros_like(q), np.zeros_like(q)
    cpu.attention_f16(a, q, kc, vc, cap - 1, 0.125)
    cpu.attention_int8(b, q, *bufs, cap - 1, 0.125)
    assert np.abs(a - b).max() < 0.05


def test_backend_seam():
    from engine.backends.kernels import KERNELS, get_kernels
    from engine.errors import BackendUnavailable, ConfigError
    for name in ("cpu", "ref"):
        be = get_kernels(name)
        assert all(callable(getattr(be, k)) for k in KERNELS)
        buf = be.zeros((2, 3), "float32")
        be.upload(buf, np.ones((2, 3), np.float32))
        assert be.to_host(buf).sum() == 6
    with pytest.raises(ConfigError, match="not one of"):
        get_kernels("tpu")
    try:  # on a machine without a GPU this must be the one-line error, never another exception
        get_kernels("cuda")
    except BackendUnavailable as e:
        assert "--backend cpu" in str(e)
