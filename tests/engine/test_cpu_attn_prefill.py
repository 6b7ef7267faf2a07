"""cpu_attn_prefill: a prompt's attention in (row tile, KV head) items, against numpy and its own parts."""
import numba
import numpy as np
import pytest

from engine.backends.cpu import attn as cpu_attn
from engine.backends.cpu import attn_prefill as AP
from engine.backends.ref import kernels as ref


@numba.njit(parallel=True)
def _tiles(out, q, kc, vc, pos0, scale):
    for it in numba.prange(AP.n_items(q.shape[0], kc.shape[1])):
        AP.attn_tile_f16(out, q, kc, vc, it, pos0, scale)


# (pos0, rows): a first chunk with a partial last tile; a second chunk (blocks the first rows of a tile do not
# see); one row in the last tile (an odd number of queries: the single-query path); PB-aligned ends
@pytest.mark.parametrize("pos0,t_n", [(0, 40), (256, 64), (5, 33), (32, 32)])
@pytest.mark.parametrize("n_kv,hd,n_head", [(3, 64, 9), (2, 128, 4), (1, 42, 3), (2, 8, 2)])  # 42: masked lanes
def test_tiles_match_reference(pos0, t_n, n_kv, hd, n_head):
    rng = np.random.default_rng(pos0 + t_n + hd)
    cap = pos0 + t_n + 7
    k = (rng.standard_normal((cap, n_kv, hd)) * 2).astype(np.float16)
    v = rng.standard_normal((cap, n_kv, hd)).astype(np.float16)
    q = rng.standard_normal((t_n, n_head, hd)).astype(np.float32)
    want = np.zeros_like(q)
    ref.attention_f16(want, q, k, v, pos0, 0.125)
    got = np.full_like(q, np.nan)
    AP.attention_tiles_part(0, AP.n_items(t_n, n_kv), got, q, k.view(np.uint16), v.view(np.uint16), pos0,
                            np.float32(0.125))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
    par = np.full_like(q, np.nan)  # the items in any order, on any thread: the same bits
    _tiles(par, q, k.view(np.uint16), v.view(np.uint16), pos0, np.float32(0.125))
    np.testing.assert_array_equal(par, got)


def test_tiles_agree_with_the_decode_split():
    """A 256-row prompt chunk at context 256, SmolLM2's shapes: the tiles and the per-row decode items (whose
    rows a verify pass must reproduce exactly) agree to float rounding."""
    rng = np.random.default_rng(7)
    t_n, pos0, cap, n_kv, n_head, hd = 256, 256, 600, 3, 9, 64
    kc = rng.standard_normal((cap, n_kv, hd)).astype(np.float16).view(np.uint16)
    vc = rng.standard_normal((cap, n_kv, hd)).astype(np.float16).view(np.uint16)
    q = (rng.standard_normal((t_n, n_head, hd)) * 2).astype(np.float32)
    split = np.zeros_like(q)
    nt = numba.config.NUMBA_NUM_THREADS
    cpu_attn.attention_f16_split(split, q, kc, vc, pos0, np.float32(0.125),
                                 np.zeros((nt, n_head, cpu_attn.chunk_cap(cap)), np.float32),
                                 np.zeros((t_n, n_kv, cpu_attn.SPLITS, n_head // n_kv, hd + 2), np.float32))
    tiles = np.zeros_like(q)
    _tiles(tiles, q, kc, vc, pos0, np.float32(0.125))
    np.testing.assert_allclose(tiles, split, rtol=1e-4, atol=1e-5)


@numba.njit(fastmath=True)
def _scores_both(which, s, q, k32, n):
    for i in range(q.shape[0]):
        if which == 0:
            AP._scores_loops(s[i], q[i], k32, n, np.float32(0.125))
        else:
            AP._scores_vec(s[i], q[i], k32, n, np.float32(0.125))


@numba.njit(fastmath=True)
def _vsum_both(which, o, s, n, v32):
    if which == 0:
        AP._vsum_loops(o, s, n, v32)
    else:
        AP._vsum_vec(o, s, n, v32)


@pytest.mark.parametrize("hd", [64, 128, 40, 42, 8])
def test_block_helpers_vector_and_loops_agree_with_numpy(hd):
    """The IR forms (kdot8_f32, vsum_f32 over 8 vectors) and the numba loops that CPUs without AVX2 run,
    on one block of f32 K and V rows."""
    if not cpu_attn.VECTOR_ATTN:
        pytest.skip("target without AVX2/FMA/F16C (or NINFER_CPU_GENERIC set)")
    rng = np.random.default_rng(hd)
    k32 = rng.standard_normal((AP.PB, 1, hd)).astype(np.float32)
    v32 = rng.standard_normal((AP.PB, 1, hd)).astype(np.float32)
    q = rng.standard_normal((2, hd)).astype(np.float32)
    for n in (1, 5, 8, 13, AP.PB):
        want_s = 0.125 * q.astype(np.float64) @ k32[:n, 0].T.astype(np.float64)
        w = rng.random(n).astype(np.float32)
        want_o = 1.0 + w.astype(np.float64) @ v32[:n, 0]
        for which in (0, 1):
            s = np.zeros((2, AP.PB), np.float32)
            _scores_both(which, s, q, k32, n)
            np.testing.assert_allclose(s[:, :n], want_s, rtol=1e-5, atol=1e-5)
            o = np.ones(hd, np.float32)
            _vsum_both(which, o, w, n, v32)
            np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)

