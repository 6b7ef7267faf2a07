"""Prefill attention over an f16 KV cache: a tile of query rows per work item (numba, the fused CPU step).

Why a kernel of its own: decode attention's work item is one row's chunk of positions (attn), so in a
256-row prefill chunk every row reads and converts its own copy of the K and V rows it sees, from L2, and
its four chunks are merged after the phase on one thread. scripts/step_phases.py --rows 256 at context
256: attention 136 ms of a 430 ms chunk, its serial merge 21 ms more.

Here a work item is (a tile of TILE rows, one KV head): the K and V rows of PB positions at a time are
converted to f32 once (L1) and serve every query of the tile, TILE rows x the group's heads; each query
keeps a running max, sum and weighted V sum over the blocks (the online softmax of flash attention), so a
row's positions are done in one item and written out directly: no chunks, no merge. The inner loops are
attn_avx2's kdot / vsum over f32 rows where the target has them (attn.VECTOR_ATTN), numba loops
otherwise.

Only for passes of at least MIN_ROWS rows (a prompt): its sums run in another order than a one-row step's,
while a speculative verify pass (at most 16 rows) must give exactly the rows T decode steps give
(attn.attention_f16_split keeps that). Results agree with those steps to float rounding.
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

import numpy as np
from numba import njit

from .attn import VECTOR_ATTN, exp_fast, h2f
from .attn_avx2 import kdot8_f32, vsum_f32

F32 = np.float32
TILE = 16  # query rows per work item (x the group's heads: 48 queries for SmolLM2)
PB = 32  # cache positions per block: their K and V rows in f32 are 2 x 8 KiB at hd 64
MIN_ROWS = 32  # passes of this many rows use the tiles (above any verify pass: --draft-tokens <= 15)


def n_tiles(t_n, n_kv):
    """Work items of a pass of t_n rows: (row tile, KV head) pairs (Python; n_items in numba)."""
    return (t_n + TILE - 1) // TILE * n_kv


n_items = njit(cache=True, nogil=True, inline="always")(n_tiles)


def prompt_pass(t_n):
    """Whether a pass of t_n rows is a prompt's (never a verify pass): its attention in row tiles (f16
    cache). Python; `wide` in numba. (The step shares its tails out by rows from step.SPLIT_TAILS rows on.)"""
    return t_n >= MIN_ROWS


wide = njit(cache=True, nogil=True, inline="always")(prompt_pass)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _scores_vec(s, q, k32, n, scale):
    """s[:n] <- scale * q . k32[j, 0] (rows n.. of a block of 8 are computed too, and ignored)."""
    for j in range(0, n, 8):
        kdot8_f32(s, j, q, k32, j, 0, scale)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _scores_loops(s, q, k32, n, scale):
    for j in range(n):
        a = F32(0.0)
        for d in range(q.shape[0]):
            a += q[d] * k32[j, 0, d]
        s[j] = a * scale


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _vsum_vec(o, s, n, v32):
    vsum_f32(o, s, 0, n, v32, 0, 0)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _vsum_loops(o, s, n, v32):
    for j in range(n):
        w = s[j]
        for d in range(o.shape[0]):
            o[d] += w * v32[j, 0, d]


_scores, _vsum = (_scores_vec, _vsum_vec) if VECTOR_ATTN else (_scores_loops, _vsum_loops)


@njit(cache=True, nogil=True, fastmath=True, inline="always")
def _online_softmax(s, n, st, i, o):
    """Fold a block's scores s[:n] into query i's running state st (max: st[i, 0], sum: st[i, 1]): s[:n] <-
    exp(s - new max) (s[n:PB] <- 0), the sum and the weighted V sum o[i] rescaled to the new max. The loops
    run over all PB entries (a fixed count: vectorized whole, no scalar remainder; -8% per item)."""
    mb = F32(-np.inf)
    for j in range(PB):
        mb = max(mb, s[j] if j < n else F32(-np.inf))
    m_old = st[i, 0]
    mn = max(m_old, mb)
    c = F32(0.0) if m_old == -np.inf else exp_fast(m_old - mn)
    tot = F32(0.0)
    for j in range(PB):
        e = exp_fast(s[j] - mn)
        e = e if j < n else F32(0.0)
        s[j] = e
        tot += e
    st[i, 0] = mn
    st[i, 1] = st[i, 1] * c + tot
    if c != F32(1.0):
        oi = o[i]
        for d in range(oi.shape[0]):
            oi[d] *= c


@njit(cache=True, nogil=True, fastmath=True)
def attn_tile_f16(out, q, kc, vc, it, pos0, scale):
    """Work item it (row tile it // n_kv, KV head it % n_kv; n_items) of causal GQA attention: out[t, h]
    (T, H, hd) f32 for the tile's rows t and the KV head's query heads h, from q (T, H, hd) f32 and the f16
    cache kc, vc (cap, n_kv, hd) uint16, row t seeing positions 0..pos0 + t."""
    t_n, n_head, hd = q.shape
    n_kv = kc.shape[1]
    group = n_head // n_kv
    kh = it % n_kv
    t0 = (it // n_kv) * TILE
    t1 = min(t_n, t0 + TILE)
    nq = (t1 - t0) * group  # query i: row t0 + i // group, head kh * group + i % group
    k32 = np.empty((PB, 1, hd), np.float32)
    v32 = np.empty((PB, 1, hd), np.float32)
    s = np.zeros((nq, PB), np.float32)  # finite where no score is written (the softmax reads all PB)
    st = np.empty((nq, 2), np.float32)
    o = np.zeros((nq, hd), np.float32)
    for i in range(nq):
        st[i, 0] = -np.inf
        st[i, 1] = F32(0.0)
    n_end = pos0 + t1  # the last row sees positions < pos0 + t1
    for p0 in range(0, n_end, PB):
        n = min(PB, n_end - p0)
        for j in range(n):
            for d in range(hd):
                k32[j, 0, d] = h2f(kc[p0 + j, kh, d])
                v32[j, 0, d] = h2f(vc[p0 + j, kh, d])
        for i in range(nq):
            nv = min(n, pos0 + t0 + i // group + 1 - p0)  # positions of this block the row sees
            if nv <= 0:
                continue
            si = s[i]
            _scores(si, q[t0 + i // group, kh * group + i % group], k32, nv, scale)
            _online_softmax(si, nv, st, i, o)
            _vsum(o[i], si, nv, v32)
    for i in range(nq):
        inv = F32(1.0) / st[i, 1]
        oi = out[t0 + i // group, kh * group + i % group]
        for d in range(hd):
            oi[d] = o[i, d] * inv


@njit(cache=True, nogil=True)
def attention_tiles_part(lo, hi, out, q, kc, vc, pos0, scale):
    """Items lo..hi of a pass's tiles on the calling thread (tier's per-kernel form)."""
    for it in range(lo, hi):
        attn_tile_f16(out, q, kc, vc, it, pos0, scale)
