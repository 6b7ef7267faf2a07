"""cpu_attn: half -> float conversion and the split decode attention at a real model's shapes."""
import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("pos0,t_n", [(597, 3), (61, 1), (2, 2)])  # uneven chunks, 8- and 4-position tails
@pytest.mark.parametrize("n_kv,hd,n_head", [(3, 64, 9), (2, 128, 4)])  # SmolLM2-135M; a 128-wide head (Qwen)
def test_split_attention_matches_reference_at_model_shapes(pos0, t_n, n_kv, hd, n_head):
    rng = np.random.default_rng(pos0)
    cap = 640
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


@numba.njit(fastmath=True)
def _inner_loops(which, s, acc, qg, kc, vc, kh, lo, hi):
    if which == 0:
        cpu_attn._scores_loops(s, qg, kc, kh, lo, hi, np.float32(0.125))
        cpu_attn._weighted_sum_loops(acc, s, vc, kh, lo, hi)
    else:
        cpu_attn._scores_vec(s, qg, kc, kh, lo, hi, np.float32(0.125))
        cpu_attn._weighted_sum_vec(acc, s, vc, kh, lo, hi)


@pytest.mark.parametrize("hd", [64, 128, 16, 40, 42, 8])  # 16, 40: 8-lane parts; 42: a masked last block
def test_vector_inner_loops_match_numba_loops_and_numpy(hd):
    """cpu_attn_avx2's scores and weighted sum (8 + 4 + single positions; 32-, 8- and masked lanes) against the
    numba loops that other CPUs run and against numpy, over chunk lengths that exercise every tail."""
    if not cpu_attn.VECTOR_ATTN:
        pytest.skip("target without AVX2/FMA/F16C (or NINFER_CPU_GENERIC set)")
    rng = np.random.default_rng(hd)
    cap, n_kv, group = 64, 3, 3
    kc = rng.standard_normal((cap, n_kv, hd)).astype(np.float16)
    vc = rng.standard_normal((cap, n_kv, hd)).astype(np.float16)
    qg = rng.standard_normal((group, hd)).astype(np.float32)
    for lo, hi in [(0, 1), (3, 7), (5, 13), (0, 12), (9, 24), (1, 28), (7, 64)]:
        kh = hi % n_kv
        got = []
        for which in (0, 1):
            s = np.full((group, cap), np.nan, np.float32)
            acc0 = rng.standard_normal((group, hd + 2)).astype(np.float32)
            acc = acc0.copy()
            _inner_loops(which, s, acc, qg, kc.view(np.uint16), vc.view(np.uint16), kh, lo, hi)
            got.append((s[:, :hi - lo], acc - acc0))
        k = kc[lo:hi, kh].astype(np.float64)
        v = vc[lo:hi, kh].astype(np.float64)
        want_s = 0.125 * qg @ k.T
        for s, acc in got:
            np.testing.assert_allclose(s, want_s, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(acc[:, :hd], s @ v, rtol=1e-5, atol=1e-5)  # added to what was there
            assert not acc[:, hd:].any()  # the max/sum slots are not touched


def test_generic_env_selects_the_numba_loops():
    """NINFER_CPU_GENERIC=1 (what a CPU without AVX2 runs) takes cpu_attn's numba loops (tested above)."""
    root = Path(__file__).resolve().parents[2]
    code = ("from engine.kernels import cpu_attn as A; "
            "print(A.VECTOR_ATTN, A._scores is A._scores_loops, A._weighted_sum is A._weighted_sum_loops)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(root), timeout=300,
                       env=dict(os.environ, NINFER_CPU_GENERIC="1", PYTHONPATH=str(root)))
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False", "True", "True"]
