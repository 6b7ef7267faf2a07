"""The fused step's matmul phases (step.py): row groups of a layer's matrices in whichever layout the file
gave each one, and the head's.

A matmul phase's items are the row groups of up to three matrices of the same input (q/k/v, gate/up; o and
down alone): part 0 of each matrix in turn, then part 1, ... (fast.prepare_layers' parts: thread p's items
are its matmuls' parts p, one after another in memory). A role comes as step_weights' table, one numba type
for every mix of layouts, and an item looks up its layer's layout (a load and a branch, against 1-2 us of
a row group's work). Each item runs the kernel the plain walk runs for that row group (engine.model over
fast.matmul / kquant.matmul) on the same quantized input, so the step's bits are the plain walk's, whichever
thread runs the item.

Layouts: Q4 (fast's 4-bit blocks: Q4_0, Q4_1), Q4K (fast's 'q4k' blocks: Q4_K, q4k.py), Q8 (fast's Q8_0), Q5
(kquant's: Q5_0, Q5_1, Q5_K), Q6 (kquant's: Q6_K). Role table w (step_weights.role_table):
    w[0] q4 (L4, P, h, nb, BLK4) u8   the role's 4-bit layers in P parts of h row groups (L4 may be 0:
                                      its shape still gives P and h)
    w[1] acc16 (P h, G) i16           4-bit kernel scratch (a decode row's padded last group)
    w[2] kind (L,) i64                layer l's layout, w[3] at (L,) i64: its slot in that layout's stack
    w[4] q8 (L8, P h, nb, BLK8) i8, w[5] acc32 (P h, G) i32, w[6] q5 (L5, P h, nb, BLK5) u8,
    w[7] q6 (L6, P h, nb/8, SB6) u8   the other layouts' stacks, whole matrices (group p h + j is part
                                      p's group j)
    w[8] q4k (LK, P, h, nsb, SB4K) u8 the role's Q4_K layers in P parts (as w[0])
An embedding or head table (step_weights.table): (layout, blocks u8 (ng, nb, BLK) if Q4 / Q5 / Q6 (ng, nsb,
SB4K if Q4K), blocks i8 if Q8, acc16, acc32).

Two sets of argument types, so that each model compiles only the kernels it has: a model whose layer matrices
are all fast 4-bit blocks and whose embedding and head are Q4 / Q8 (the default model) passes each role as
(q4 stack, acc16) and 5-tuple tables, and the step is the one it was before the other layouts came in; any
other model passes the 9-tuple role tables above and 6-tuple embedding / head tables (a sixth element marks
them), and compiles a step of its own with every layout's kernels (the dispatch below is on the arguments'
types: numba overloads). One function for both made the default model's first compile 1.77x longer (145 ->
256 s, bench/results-kquant.md).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

import numpy as np
from numba import njit, types
from numba.extending import overload

from ...quant import QK
from . import kquant, q4k
from .fast import XS, BATCHED_MIN_T, G, _q4, _q8, embed_q4, embed_q8, q8_group_batched
from .sync import finish, grab

Q4, Q8, Q5, Q6 = 0, 1, 2, 3  # a matrix's layout (module constants: compiled in as literals)
GIVEN = 4  # an embedding table's layout when the caller writes the pass's input rows (engine/spec/mtp.py)
Q4K = 5
AHEAD = 512  # cache lines of its next items a waiting thread asks for (step._ahead): 32 KiB (64 KiB measured the same)


def _mixed(t) -> bool:
    """A table type of the mixed set: 9-tuple role tables, 4-tuple embedding and 6-tuple head tables (plain:
    2, 3 and 5)."""
    return isinstance(t, types.BaseTuple) and len(t) in (4, 6, 9)


def _embed(x, tokens, emb):
    """x (T, d) <- rows tokens of the embedding table emb = (layout, u8 blocks, i8 blocks[, marker]); layout
    GIVEN: the caller wrote x, the tokens only count the rows."""
    raise NotImplementedError  # numba-only, see the overload below


@overload(_embed, inline="always")
def _embed_impl(x, tokens, emb):
    if not _mixed(emb):
        def plain(x, tokens, emb):
            if emb[0] == Q4:
                embed_q4(x, emb[1], tokens)
            elif emb[0] == Q8:
                embed_q8(x, emb[2], tokens)
        return plain

    def mixed(x, tokens, emb):
        if emb[0] == Q4:
            embed_q4(x, emb[1], tokens)
        elif emb[0] == Q8:
            embed_q8(x, emb[2], tokens)
        elif emb[0] == Q4K:
            q4k.embed(x, emb[1], tokens)
        elif emb[0] != GIVEN:
            kquant.embed_rows(x, emb[1], tokens, 5 if emb[0] == Q5 else 6)
    return mixed


@njit(cache=True, nogil=True, inline="always")
def _q8_item(o, qa, sa, xs, blk, acc, g):
    # group g of a Q8_0 matrix: fast.matmul's forms (mm_q8_batched from BATCHED_MIN_T rows, else mm_q8)
    if o.shape[0] >= BATCHED_MIN_T:
        q8_group_batched(o, qa, sa, xs, blk, g)
    else:
        _q8(o, qa, sa, blk, acc, g)


@njit(cache=True, nogil=True, inline="always")
def _k_item(o, qa, sa, xs, blk, g, bits):
    # group g of a q5 / q6 matrix: kquant.group, a decode row's full group in the caller's code (see fast._q4:
    # a call costs its array arguments' reference counts)
    if kquant.HAVE_AVX2 and o.shape[0] == 1 and (g + 1) * G <= o.shape[1]:
        kquant._grp(o, g * G, qa, sa, xs, blk, g, 0, bits)
    else:
        kquant.group(o, qa, sa, xs, blk, g, bits)


def _n_layers(w):
    """The layers of a role table."""
    raise NotImplementedError  # numba-only, see the overload below


@overload(_n_layers, inline="always")
def _n_layers_impl(w):
    if not _mixed(w):
        return lambda w: w[0].shape[0]
    return lambda w: w[2].shape[0]  # the per-layer layouts


def _mm_item(o, qa, sa, xs, w, l, p, j, h):
    """Row group j of part p (h groups a part) of layer l's matrix of role table w into o (T, rows)."""
    raise NotImplementedError  # numba-only, see the overload below


@overload(_mm_item, inline="always")
def _mm_item_impl(o, qa, sa, xs, w, l, p, j, h):
    if not _mixed(w):  # (q4 stack (L, P, h, nb, BLK4), acc16)
        return lambda o, qa, sa, xs, w, l, p, j, h: _q4(o, qa, sa, xs, w[0][l, p], w[1][p * h + j], j, p * h + j)

    def mixed(o, qa, sa, xs, w, l, p, j, h):
        kind, at, g = w[2][l], w[3][l], p * h + j
        if kind == Q4:
            _q4(o, qa, sa, xs, w[0][at, p], w[1][g], j, g)
        elif kind == Q4K:
            q4k.item(o, qa, sa, xs, w[8][at, p], j, g)
        elif kind == Q8:
            _q8_item(o, qa, sa, xs, w[4][at], w[5][g], g)
        else:  # one kernel site for both: the q5 and q6 stacks are the same numba type
            _k_item(o, qa, sa, xs, w[6][at] if kind == Q5 else w[7][at], g, 5 if kind == Q5 else 6)
    return mixed


@njit(cache=True, nogil=True, inline="always")
def _mm_groups(w1, w2, w3, nw):
    """(groups per part of w1, of w2, of the nw matmuls together; parts): a matmul phase's items are part 0
    of each matmul in turn, then part 1 of each, ..."""
    h1 = w1[0].shape[2]
    h2 = w2[0].shape[2] if nw >= 2 else 0
    return h1, h2, h1 + h2 + (w3[0].shape[2] if nw >= 3 else 0), w1[0].shape[1]


@njit(cache=True, nogil=True, inline="always")
def _mm_phase(sync, ph, tid, nt, o1, o2, o3, n_in, qa, sa, xs, w1, w2, w3, l, nw):
    """Phase ph: the row groups of up to three matmuls of the quantized input (qa, sa, xs; n_in columns)
    with layer l of the role tables w1..w3 (nw of them used; items as _mm_groups says). True for the
    finisher."""
    t_n = o1.shape[0]
    nb = n_in // QK
    qa_, sa_, xs_ = qa[:t_n, :n_in], sa[:t_n, :nb], xs[:t_n, :XS * nb]
    h1, h2, h, parts = _mm_groups(w1, w2, w3, nw)
    n = h * parts
    done = 0
    k = 0
    while True:
        k, lo, hi = grab(sync, ph, tid, nt, n, k)
        if lo >= hi:
            break
        for i in range(lo, hi):
            p, j = i // h, i % h
            if j < h1:
                _mm_item(o1, qa_, sa_, xs_, w1, l, p, j, h1)
            elif j < h1 + h2:
                _mm_item(o2, qa_, sa_, xs_, w2, l, p, j - h1, h2)
            else:
                _mm_item(o3, qa_, sa_, xs_, w3, l, p, j - h1 - h2, h - h1 - h2)
        done += hi - lo
    return finish(sync, ph, done, n)


@njit(cache=True, nogil=True, inline="always")
def _head_groups(h):
    """The head's row groups (the head phase's items)."""
    return h[2].shape[0] if h[0] == Q8 else h[1].shape[0]


@njit(cache=True, nogil=True, inline="always")
def _head_phase(sync, ph, tid, nt, logits, n_in, qa, sa, xs, h):
    """Phase ph: the head's row groups (h: an embedding / head table), input n_in columns. True for the
    finisher."""
    t_n = logits.shape[0]
    nb = n_in // QK
    qa_, sa_, xs_ = qa[:t_n, :n_in], sa[:t_n, :nb], xs[:t_n, :XS * nb]
    n = _head_groups(h)
    done = 0
    k = 0
    while True:
        k, lo, hi = grab(sync, ph, tid, nt, n, k)
        if lo >= hi:
            break
        for g in range(lo, hi):
            _head_item(logits, qa_, sa_, xs_, h, g)
        done += hi - lo
    return finish(sync, ph, done, n)


def _head_item(logits, qa, sa, xs, h, g):
    """Row group g of the head table h."""
    raise NotImplementedError  # numba-only, see the overload below


@overload(_head_item, inline="always")
def _head_item_impl(logits, qa, sa, xs, h, g):
    if not _mixed(h):
        def plain(logits, qa, sa, xs, h, g):
            if h[0] == Q4:
                _q4(logits, qa, sa, xs, h[1], h[3][g], g, g)
            else:
                _q8_item(logits, qa, sa, xs, h[2], h[4][g], g)
        return plain

    def mixed(logits, qa, sa, xs, h, g):
        if h[0] == Q4:
            _q4(logits, qa, sa, xs, h[1], h[3][g], g, g)
        elif h[0] == Q8:
            _q8_item(logits, qa, sa, xs, h[2], h[4][g], g)
        elif h[0] == Q4K:
            q4k.item(logits, qa, sa, xs, h[1], g, g)
        else:
            _k_item(logits, qa, sa, xs, h[1], g, 5 if h[0] == Q5 else 6)
    return mixed


# -------------------------------------------------------------------------- where a thread's items start
@njit(cache=True, nogil=True, inline="always")
def _mm_ahead(tid, nt, w1, w2, w3, l, nw):
    """step._ahead of a phase of the matmuls w1..w3 of layer l (nw used; _mm_phase's items): thread tid's
    part starts at item tid * n // nt."""
    h1, h2, h, parts = _mm_groups(w1, w2, w3, nw)
    i = tid * h * parts // nt
    p, j = i // h, i % h
    if j < h1:
        return _item_ahead(w1, l, p, j, h1)
    if j < h1 + h2:
        return _item_ahead(w2, l, p, j - h1, h2)
    return _item_ahead(w3, l, p, j - h1 - h2, h - h1 - h2)


def _item_ahead(w, l, p, j, h):
    """_mm_item's blocks from row group j of part p on."""
    raise NotImplementedError  # numba-only, see the overload below


@overload(_item_ahead, inline="always")
def _item_ahead_impl(w, l, p, j, h):
    if not _mixed(w):
        return lambda w, l, p, j, h: _blocks_ahead(w[0][l, p], j)

    def mixed(w, l, p, j, h):
        kind, at = w[2][l], w[3][l]
        if kind == Q4:
            return _blocks_ahead(w[0][at, p], j)
        if kind == Q4K:
            return _blocks_ahead(w[8][at, p], j)
        if kind == Q8:
            return _blocks_ahead(w[4][at], p * h + j)
        return _blocks_ahead(w[6][at] if kind == Q5 else w[7][at], p * h + j)
    return mixed


@njit(cache=True, nogil=True, inline="always")
def _head_ahead(h, g):
    """step._ahead of the head from row group g on."""
    if h[0] == Q8:
        return _blocks_ahead(h[2], g)
    return _blocks_ahead(h[1], g)


@njit(cache=True, nogil=True, inline="always")
def _blocks_ahead(blk, g):
    """step._ahead of row groups blk[g:] (one stream: the scales are in the blocks)."""
    q0 = blk.strides[0] * g
    return np.int64(blk.ctypes.data) + q0, min(AHEAD, (blk.nbytes - q0) // 64), np.int64(0)
