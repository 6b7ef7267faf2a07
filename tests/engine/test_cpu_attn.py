"""cpu_attn: half -> float conversion and the split decode attention at a real model's shapes."""
import numba
import numpy as np
import pytest

from engine.kernels import cpu_attn, ref


def _convert_all(h2f):
    @numba.njit
    def run(out, bits):
        for i in range(bits.shape[0]):
            out[i] = h2f(bits[i])
    return run


@pytest.mark.parametrize("kind", ["soft", "hw"])
def test_h2f_matches_numpy_on_every_finite_half(kind):
    if kind == "hw" and not cpu_attn.HAS_F16C:
        pytest.skip("no F16C on this CPU")
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    bits = bits[np.isfinite(bits.view(np.float16))]
    out = np.empty(bits.shape[0], np.float32)
    _convert_all(cpu_attn.h2f_soft if kind == "soft" else cpu_attn.h2f_hw)(out, bits)
    np.testing.assert_array_equal(out.view(np.uint32), bits.view(np.float16).astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("pos0,t_n", [(597, 3), (61, 1), (2, 2)])  # uneven chunks, 4-position tails
def test_split_attention_matches_reference_at_model_shapes(pos0, t_n):
    rng = np.random.default_rng(pos0)
    cap, n_kv, hd, n_head = 640, 3, 64, 9  # SmolLM2-135M: 9 query heads over 3 KV heads of 64
    k = (rng.standard_normal((cap, n_kv, hd)) * 2).astype(np.float16)
    v = rng.standard_normal((cap, n_kv, hd)).astype(np.float16)
    q = rng.standard_normal((t_n, n_head, hd)).astype(np.float32)
    want = np.zeros_like(q)
    ref.attention_f16(want, q, k, v, pos0, 0.125)
    got = np.zeros_like(q)
    nt = numba.config.NUMBA_NUM_THREADS
    part = np.full((t_n + 2, n_kv, cpu_attn.SPLITS, n_head // n_kv, hd + 2), np.nan, np.float32)  # unused rows
    cpu_attn.attention_f16_split(got, q, k.view(np.uint16), v.view(np.uint16), pos0, np.float32(0.125),
                                 np.zeros((nt, n_head // n_kv, cap), np.float32), np.zeros((nt, hd), np.float32),
                                 part)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pos0,t_n", [(597, 3), (2, 2)])
def test_split_int8_attention_matches_reference(pos0, t_n):
    rng = np.random.default_rng(pos0 + 1)
    cap, n_kv, hd, n_head = 640, 3, 64, 9
    group = ref.kv_group(hd)
    k = (rng.standard_normal((cap, n_kv, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((cap, n_kv, hd)).astype(np.float32)
    kq, ks = ref.quantize_kv_int8(k, group)
    vq, vs = ref.quantize_kv_int8(v, group)
    q = rng.standard_normal((t_n, n_head, hd)).astype(np.float32)
    want = np.zeros_like(q)
    ref.attention_int8(want, q, kq, ks, vq, vs, pos0, 0.125)
    got = np.zeros_like(q)
    nt = numba.config.NUMBA_NUM_THREADS
    cpu_attn.attention_int8_split(got, q, kq, ks, vq, vs, pos0, np.float32(0.125),
                                  np.zeros((nt, n_head // n_kv, cap), np.float32), np.zeros((nt, hd), np.float32),
                                  np.zeros((t_n, n_kv, cpu_attn.SPLITS, n_head // n_kv, hd + 2), np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
