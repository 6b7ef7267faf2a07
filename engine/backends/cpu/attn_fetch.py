"""How decode attention's work items (attn._item_heads_vec, attn.softmax_and_sums) ask for the cache lines they
read next, by the cache's kind: an f16 cache (kc, vc) or an int8 one (kq, ks, vq, vs).

The kernels stream each work item's K rows, then its V rows, from DRAM (a step's weight stream evicts them), and
each item is a short stream the hardware prefetcher meets anew. What asks, and when, is below with its
measurements: the f16 kernels and the int8 cache's VNNI scores and V sums ask for one line ROWS_AHEAD positions
on per line they read (the address: k_ahead / v_ahead); an item's first rows, the int8 scale rows and the int8
scores without VNNI ask in bursts (fetch_kv, burst_kv, burst_v_scales).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

import numpy as np
from numba import njit, types
from numba.extending import overload

from .sync import prefetch


def is_f16(kv):
    """Whether a cache tuple's type is the f16 cache's (kc, vc), not the int8 one's (kq, ks, vq, vs) (typing)."""
    return isinstance(kv, types.UniTuple) and kv.count == 2


# Decode attention reads the cache rows from DRAM (a step's weight stream evicts them), and each work item
# is a short stream that the hardware prefetcher meets anew: the items ask for K rows this many positions
# ahead of the scores, and for each block of V rows as the weighted sums of the block before it run.
# scripts/step_phases.py --with attn: attention 199 -> 178 us per token at 60-99 positions, 764 -> 725 at
# 600-639 (logits identical). The V rows were asked for with their K rows until 2026-12-06: the scores then
# waited on twice the bytes and the sums on none; one layer at 1024 positions from DRAM (ad hoc, alternated
# twice, the AVX-512 Xeon) 16 / 8 KV heads x 128 (Qwen3-0.6B / 1.7B) 244-262 -> 228-230 us, 24 / 8 x 128
# (Llama-3.2-3B) 266 -> 248-254, 32 / 8 x 64 169-171 -> 163-166, SmolLM2's 9 / 3 x 64 the same within noise.
FETCH_AHEAD = 16
# An f16 cache's kernels ask for each line as they read one (attn_avx2's `ahead`): the line at the same place
# ROWS_AHEAD positions on in the item's stream, its K rows then its V rows then the next chunk's K rows (the
# chunk a thread's part of the items gives it next: sync.grab). Bursts of a block's rows (what the int8 cache's
# scale rows and its scores without VNNI still do) stall the core while the memory queue drains them, so the sums
# and the stream took turns:
# one layer at 1024 positions from DRAM took about its cache-hot time plus a plain read of its rows. The same
# layer (ad hoc harness: 700 MB of caches swept, two threads, alternated twice, the AVX-512 Xeon, 2026-12-06):
# 16 / 8 KV heads x 128 (Qwen3-0.6B) 231-241 -> 185-200 us, 32 / 8 x 64 (Llama-3.2-1B) 154-160 -> 115-127, 15 / 5
# x 64 (SmolLM2-360M) 81-86 -> 63-69, 9 / 3 x 64 (SmolLM2) 49-52 -> 41-49; cache-hot the same or faster. Tried:
# 16, 24, 48 and 64 positions on (32 best), a line asked for at every 32-byte block read (the same), no rows
# asked for before an item's first (slower). The int8 cache's V sums ask the same way for their values' lines
# (2026-12-07; its VNNI scores since af34d7e): --kv-dtype int8, ninfer-bench against the tree before, three runs
# each, the same sha256: qwen3-0.6b Q4_K_M 1024 + 48 49.1 -> 50.1 tok/s, SmolLM2 1000 + 128 252.7 -> 262.1.
ROWS_AHEAD = 32


@njit(cache=True, nogil=True, inline="always")
def _fetch_rows(a, p0, p1):
    """Ask for rows p0:p1 of a (positions first: every head's values of a position side by side)."""
    if p0 < p1:
        base = np.int64(a.ctypes.data) + a.strides[0] * p0
        for off in range(0, a.strides[0] * (p1 - p0), 64):
            prefetch(base + off)


def fetch_kv(kv, k0, k1, v0, v1):
    """Ask for K rows k0:k1 and V rows v0:v1 of the cache (f16, or int8 and its scales; numba only)."""
    raise NotImplementedError


@overload(fetch_kv, inline="always")
def fetch_kv_impl(kv, k0, k1, v0, v1):
    if is_f16(kv):
        def f16(kv, k0, k1, v0, v1):
            _fetch_rows(kv[0], k0, k1)
            _fetch_rows(kv[1], v0, v1)
        return f16

    def int8(kv, k0, k1, v0, v1):
        _fetch_rows(kv[0], k0, k1)
        _fetch_rows(kv[1], k0, k1)
        _fetch_rows(kv[2], v0, v1)
        _fetch_rows(kv[3], v0, v1)
    return int8


def burst_kv(kv, k0, k1, v0, v1):
    """fetch_kv where the cache is int8 (an item's first block of V rows, which its scores do not run on into, and
    the K rows of scores that do not ask as they read: the forms without VNNI), else nothing."""
    raise NotImplementedError


@overload(burst_kv, inline="always")
def burst_kv_impl(kv, k0, k1, v0, v1):
    if is_f16(kv):
        return lambda kv, k0, k1, v0, v1: None
    return lambda kv, k0, k1, v0, v1: fetch_kv(kv, k0, k1, v0, v1)


@njit(cache=True, nogil=True, inline="always")
def burst_k_ahead(kv, p, hi):
    """While the scores read K rows p:p + 8: burst_kv of the 8 rows FETCH_AHEAD positions on (K rows only: the V
    rows are asked for a block ahead of their sums)."""
    a = min(hi, p + FETCH_AHEAD)
    burst_kv(kv, a, min(hi, a + 8), p, p)


def burst_v_scales(kv, v0, v1):
    """Ask for the V scale rows v0:v1 of an int8 cache (whose V sums ask for the values' lines as they read,
    not for the scales'); an f16 cache has none (numba only)."""
    raise NotImplementedError


@overload(burst_v_scales, inline="always")
def burst_v_scales_impl(kv, v0, v1):
    if is_f16(kv):
        return lambda kv, v0, v1: None
    return lambda kv, v0, v1: _fetch_rows(kv[3], v0, v1)


def _row_address(kv, v, p):
    """The address of row p of the cache's K (v = 0) or V (v = 1) values (numba only)."""
    raise NotImplementedError


@overload(_row_address, inline="always")
def _row_address_impl(kv, v, p):
    if is_f16(kv):
        def f16(kv, v, p):
            a = kv[0] if v == 0 else kv[1]
            return np.int64(a.ctypes.data) + a.strides[0] * p
        return f16

    def int8(kv, v, p):
        a = kv[0] if v == 0 else kv[2]
        return np.int64(a.ctypes.data) + a.strides[0] * p
    return int8


def first_rows(kv):
    """How many K rows an item asks for before its first: ROWS_AHEAD where the kernels then ask as they
    read (f16), else FETCH_AHEAD (numba only)."""
    raise NotImplementedError


@overload(first_rows, inline="always")
def first_rows_impl(kv):
    n = ROWS_AHEAD if is_f16(kv) else FETCH_AHEAD
    return lambda kv: n


@njit(cache=True, nogil=True, inline="always")
def k_ahead(kv, p, lo, hi):
    """The row asked for while the scores read K row p: ROWS_AHEAD on, past the chunk's K its V rows."""
    a = p + ROWS_AHEAD
    return _row_address(kv, 0, a) if a < hi else _row_address(kv, 1, lo + a - hi)


@njit(cache=True, nogil=True, inline="always")
def v_ahead(kv, p, hi):
    """The row asked for while the sums read V row p: ROWS_AHEAD on, past the chunk's V the next chunk's K."""
    a = p + ROWS_AHEAD
    return _row_address(kv, 1, a) if a < hi else _row_address(kv, 0, a)
