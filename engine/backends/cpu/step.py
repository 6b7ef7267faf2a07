"""One jitted call per forward pass (all layers) for llama-style models on the fast CPU layout.

Why: a decode step of a 30-layer model is ~450 small kernel calls; at a few microseconds of Python and
numba dispatch each that alone is 2-3 ms per token, as much as the matmuls. `FusedForward` stacks the
per-layer weights by role at build time and runs embedding -> layers -> head inside numba, so Python touches
each step once, and the whole pass is ONE parallel region: the threads share each phase's work (a matmul's
row groups, attention's chunks) through atomic counters (sync.py), instead of a fork/join of numba's thread
pool per matmul and attention (~150 per token, ~2.2 us each).

This is engine.forward's layer walk generated as one function (numba cannot call back into Python): its
phase loop runs over `forward.N_LAYER_PHASES` with the phase kinds `forward.QKV .. DOWN`, `_tail` is each
phase's tail of `forward.LAYER_PHASES`, and the weight stacks come in `forward.MATRIX_ROLES` order. The
attention kernel, `exp_fast` and the f16 store live in attn.py.

Supported: llama / qwen2 / qwen3 shapes where every matrix (layers, embedding, head) is in one of the fast
layouts, any mix per role and per layer (fast's 4-bit and Q8_0 blocks, kquant's 5- and 6-bit ones: a
Q4_K_M file's mix): step_weights.py stacks them by layout, step_mm.py runs the matmul phases over those
stacks. Anything else returns None from `build()` and the runner keeps the plain walk. Every pass equals
`Model.forward`'s bits (tests/engine/test_runners.py, test_step_mixed.py).
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from ...forward import ATTENTION, DOWN, GATE_UP, MATRIX_ROLES, N_LAYER_PHASES, O, QKV
from ...quant import QK
from . import kernels as cpu
from . import attn as A
from . import attn_int8 as A8
from . import attn_prefill as AP
from .attn import SPLITS, store_f16
from .avx2 import XS
from .fast import quantize_rows, swiglu as swiglu_fast  # noqa: F401  (tier, probes: the step's name)
from ...sampling_fast import argmax_choice, block_choice
from ...triggers import gram_key
from .guard import ContentionGuard
from .step_mm import AHEAD, _embed, _n_layers, _head_ahead, _head_groups, _head_phase, _mm_ahead, _mm_phase
from .step_weights import layout, plain, role_stacks as _role_stacks, role_tables, table  # noqa: F401  (tests)
from .sync import finish, grab, is_open, new_sync, open_phase, reset_rows, wait_fetching, wait_open

F32 = np.float32
# Passes of this many rows (a verify pass of 4+, a prompt's) run each tail as a phase of its own shared out by
# rows: one more wait per phase, but on one thread the tails of a T=8 verify pass were 1.2 of its 7.1 ms
# (probes/step_phases.py --rows 8, 200 positions): 7.13 -> 6.70 ms, T=4 4.96-5.33 -> 4.79-5.17 (same logits).
SPLIT_TAILS = 4


@njit(cache=True, nogil=True, inline="always")
def _split_tails(t_n):
    """Whether a pass of t_n rows runs its tails as phases of their own (SPLIT_TAILS)."""
    return t_n >= SPLIT_TAILS
BLOCK = 8  # the most tokens one call chooses (FusedForward.block): the UI gets them 8 at a time


# ------------------------------------------------------------------------------------------- fused step
# The whole forward pass runs in ONE parallel region (sync: phases, claimed chunks, the finisher does
# the serial tail). Each item is computed by the same kernel, on the same inputs, as the per-kernel form
# (the matmuls' row groups: step_mm; attention_*_split's items; tier.LeafForward calls those), so the
# results are bit-identical whichever thread runs it. Helpers are inlined into _step_thread (numba IR);
# the kernels they call are not, and keep their own flags (attention's fastmath: attn.attn_item_f16).
@njit(cache=True, nogil=True, inline="always")
def _quant_at(qa, sa, xs, xin, lo):
    """_quant of xin's rows into rows lo.. of the activation buffers."""
    t_n, n = xin.shape
    nb = n // QK
    quantize_rows(qa[lo:lo + t_n, :n], sa[lo:lo + t_n, :nb], xs[lo:lo + t_n, :XS * nb], xin)


@njit(cache=True, nogil=True, inline="always")
def _quant(qa, sa, xs, xin):
    _quant_at(qa, sa, xs, xin, 0)


@njit(cache=True, nogil=True, inline="always")
def _wait_next(sync, ph, tid, nt, kind, l, wq, wk, wv, wo, wg, wu, wd, head, kv, pos0, t_n):
    """Wait for phase ph, which ends layer l's phase `kind` (kind 4 of layer -1: the embedding, or a decode
    block's choice). A thread that has to wait asks meanwhile for the first cache lines it reads in the next
    phase (_ahead): the finisher is running the phase's serial tail, which leaves the memory bus idle, and
    the waiting thread's first items of the next phase then find their weights (or KV rows) in its cache."""
    if not is_open(sync, ph):
        _wait_ahead(sync, ph, tid, nt, kind, l, wq, wk, wv, wo, wg, wu, wd, head, kv, pos0, t_n)


@njit(cache=True, nogil=True)
def _wait_ahead(sync, ph, tid, nt, kind, l, wq, wk, wv, wo, wg, wu, wd, head, kv, pos0, t_n):
    """_wait_next's wait. A function of its own: compiled once, where inlined at the step's four waits it
    made the step's compile +33%; only a thread that has to wait calls it."""
    a, lines, b = _ahead(tid, nt, kind, l, wq, wk, wv, wo, wg, wu, wd, head, kv, pos0, t_n)
    wait_fetching(sync, ph, a, lines, b)


@njit(cache=True, nogil=True, inline="always")
def _ahead(tid, nt, kind, l, wq, wk, wv, wo, wg, wu, wd, head, kv, pos0, t_n):
    """What thread tid of nt reads first in the phase after layer l's phase `kind`, as sync.wait_fetching's
    (a, lines, b): the start of its part of the items (sync.grab hands a thread its own part first), at
    most AHEAD lines. After q/k/v, a decode step's attention: the K rows of its first item's positions (a)
    and their V rows (b); after attention o's row groups (one stream: the scales are in the blocks; b = 0),
    after o gate/up, after gate/up down, after down the next layer's q/k/v or the head. Nothing (lines 0)
    before a prompt's attention."""
    if kind == QKV:
        if t_n != 1:
            return np.int64(0), np.int64(0), np.int64(0)
        t, c, lo, hi = A._work_item(tid * SPLITS // nt, pos0)
        kc, vc = _kv_values(kv)
        off = kc.strides[0] * l + kc.strides[1] * lo
        return (np.int64(kc.ctypes.data) + off, min(AHEAD, max(0, (kc.strides[1] * (hi - lo) + 63) // 64)),
                np.int64(vc.ctypes.data) + off)
    if kind == ATTENTION:
        return _mm_ahead(tid, nt, wo, wo, wo, l, 1)
    if kind == O:
        return _mm_ahead(tid, nt, wg, wu, wu, l, 2)
    if kind == GATE_UP:
        return _mm_ahead(tid, nt, wd, wd, wd, l, 1)
    if l + 1 < _n_layers(wq):
        return _mm_ahead(tid, nt, wq, wk, wv, l + 1, 3)
    return _head_ahead(head, tid * _head_groups(head) // nt)


def _kv_values(kv):
    """The cache's K and V values (L, cap, n_kv, hd): f16 bits, or int8 (their scales apart)."""
    raise NotImplementedError  # numba-only, see the overload below


@overload(_kv_values, inline="always")
def _kv_values_impl(kv):
    if isinstance(kv, types.UniTuple) and kv.count == 2:
        return lambda kv: (kv[0], kv[1])
    return lambda kv: (kv[0], kv[2])


def _kv_store(kv, l, k3, v3, pos0):
    """Rows k3, v3 (T, n_kv, hd) into layer l of the cache at pos0 (f16 or int8, by kv's type)."""
    raise NotImplementedError  # numba-only, see the overload below


@overload(_kv_store, inline="always")
def _kv_store_impl(kv, l, k3, v3, pos0):
    if isinstance(kv, types.UniTuple) and kv.count == 2:
        def f16(kv, l, k3, v3, pos0):
            store_f16(kv[0][l], k3, pos0)
            store_f16(kv[1][l], v3, pos0)
        return f16

    def int8(kv, l, k3, v3, pos0):
        cpu._quant_rows(kv[0][l], kv[1][l], k3, pos0)
        cpu._quant_rows(kv[2][l], kv[3][l], v3, pos0)
    return int8


def _attn_item(kv, l, it, q3, pos0, scale, sc, part):
    """One work item (row, chunk) of attn.attention_f16_split / attn_int8.attention_int8_split
    into part."""
    raise NotImplementedError  # numba-only, see the overload below


@overload(_attn_item, inline="always")
def _attn_item_impl(kv, l, it, q3, pos0, scale, sc, part):
    if isinstance(kv, types.UniTuple) and kv.count == 2:
        def f16(kv, l, it, q3, pos0, scale, sc, part):
            A.attn_item_f16(part, sc, q3, kv[0][l], kv[1][l], it, pos0, scale)
        return f16

    def int8(kv, l, it, q3, pos0, scale, sc, part):
        A8.attn_item_int8(part, sc, q3, kv[0][l], kv[1][l], kv[2][l], kv[3][l], it, pos0, scale)
    return int8


def _tiles(kv, t_n):
    """Whether a pass of t_n rows runs attention as attn_prefill's row tiles (an f16 cache, a prompt)."""
    raise NotImplementedError  # numba-only, see the overload below


@overload(_tiles, inline="always")
def _tiles_impl(kv, t_n):
    if isinstance(kv, types.UniTuple) and kv.count == 2:
        return lambda kv, t_n: AP.wide(t_n)
    return lambda kv, t_n: False


def _tile_item(kv, l, it, q3, a3, pos0, scale):
    """One work item (row tile, KV head) of attn_prefill into a3 (f16 cache only: see _tiles)."""
    raise NotImplementedError  # numba-only, see the overload below


@overload(_tile_item, inline="always")
def _tile_item_impl(kv, l, it, q3, a3, pos0, scale):
    if isinstance(kv, types.UniTuple) and kv.count == 2:
        def f16(kv, l, it, q3, a3, pos0, scale):
            AP.attn_tile_f16(a3, q3, kv[0][l], kv[1][l], it, pos0, scale)
        return f16
    return lambda kv, l, it, q3, a3, pos0, scale: None


@njit(cache=True, nogil=True, inline="always")
def _attn_phase(sync, ph, tid, nt, kv, l, q3, a3, pos0, scale, sc, part):
    """Phase ph: attention's work items of layer l, (row, chunk) into part, or for a prompt (_tiles) (row
    tile, KV head) straight into a3; True for the finisher."""
    t_n = q3.shape[0]
    tiles = _tiles(kv, t_n)
    n = AP.n_items(t_n, kv[0].shape[2]) if tiles else t_n * SPLITS
    done = 0
    h = 0
    while True:
        h, lo, hi = grab(sync, ph, tid, nt, n, h)
        if lo >= hi:
            break
        for it in range(lo, hi):
            if tiles:
                _tile_item(kv, l, it, q3, a3, pos0, scale)
            else:
                _attn_item(kv, l, it, q3, pos0, scale, sc, part)
        done += hi - lo
    return finish(sync, ph, done, n)


@njit(cache=True, nogil=True, inline="always")
def _tail(kind, lo, hi, l, t_n, pos0, bufs, norms, rope_p, bias, qk_norm, kv, part):
    """The serial work after a phase of layer l, for rows lo:hi of the pass: kind 0 after q/k/v (bias,
    q/k norms, rope, the KV store), 1 after attention (the merge, unless row tiles wrote the rows; the
    activations' quantization), 2 after o (residual, norm), 3 after gate/up (swiglu), 4 after down
    (residual, the next layer's norm). Row by row throughout: rows split between threads (_tail_phase) give
    the bits one thread doing them all gives."""
    x, xb, q, k, v, att, proj, gate, up, hb, qa, sa, xs, logits, cs = bufs
    attn_norm, ffn_norm, out_norm, eps = norms
    inv_freq, neox, n_head, n_kv, hd, scale = rope_p
    r = hi - lo
    if kind == QKV:
        qr, kr, vr = q[lo:hi], k[lo:hi], v[lo:hi]
        if bias[0]:
            cpu.bias_add(qr, bias[1][l])
            cpu.bias_add(kr, bias[2][l])
            cpu.bias_add(vr, bias[3][l])
        if qk_norm[0]:
            qh = qr.reshape(r * n_head, hd)
            kh = kr.reshape(r * n_kv, hd)
            cpu.rmsnorm(qh, qh, qk_norm[1][l], eps)
            cpu.rmsnorm(kh, kh, qk_norm[2][l], eps)
        k3 = kr.reshape(r, n_kv, hd)
        cpu.rope_apply(qr.reshape(r, n_head, hd), cs[lo:hi], neox)
        cpu.rope_apply(k3, cs[lo:hi], neox)
        _kv_store(kv, l, k3, vr.reshape(r, n_kv, hd), pos0 + lo)
    elif kind == ATTENTION:
        if not _tiles(kv, t_n):
            A.merge_parts(att[lo:hi].reshape(r, n_head, hd), part[lo:hi])
        _quant_at(qa, sa, xs, att[lo:hi], lo)
    elif kind == O:
        cpu.residual_add(x[lo:hi], proj[lo:hi])
        cpu.rmsnorm(xb[lo:hi], x[lo:hi], ffn_norm[l], eps)
        _quant_at(qa, sa, xs, xb[lo:hi], lo)
    elif kind == GATE_UP:
        swiglu_fast(hb[lo:hi], gate[lo:hi], up[lo:hi])
        _quant_at(qa, sa, xs, hb[lo:hi], lo)
    else:
        cpu.residual_add(x[lo:hi], proj[lo:hi])
        if l + 1 < attn_norm.shape[0]:
            cpu.rmsnorm(xb[lo:hi], x[lo:hi], attn_norm[l + 1], eps)
            _quant_at(qa, sa, xs, xb[lo:hi], lo)


@njit(cache=True, nogil=True)
def _tail_call(kind, lo, hi, l, t_n, pos0, bufs, norms, rope_p, bias, qk_norm, kv, part):
    """_tail as a function of its own for the tail phases: inlined there too, the five kinds made the step's
    compile +37% (step_phases' uncached copies, 196 -> 268 s); a call per decode tail instead cost ~0.6 us
    each (+86 us per token at 600 context: the arrays' reference counts), so the decode tails inline it."""
    _tail(kind, lo, hi, l, t_n, pos0, bufs, norms, rope_p, bias, qk_norm, kv, part)


@njit(cache=True, nogil=True, inline="always")
def _tail_phase(sync, ph, tid, nt, kind, l, t_n, pos0, bufs, norms, rope_p, bias, qk_norm, kv, part):
    """Phase ph of a pass of SPLIT_TAILS+ rows (wide): the tail of kind `kind` shared out by rows, which on one thread
    cost ~14% of a 256-row pass (scripts/step_phases.py --rows 256). True for the finisher."""
    done = 0
    h = 0
    while True:
        h, lo, hi = grab(sync, ph, tid, nt, t_n, h)
        if lo >= hi:
            break
        _tail_call(kind, lo, hi, l, t_n, pos0, bufs, norms, rope_p, bias, qk_norm, kv, part)
        done += hi - lo
    return finish(sync, ph, done, t_n)


@njit(cache=True, nogil=True)
def _step_thread(tid, nt, sync, ph0, tokens, pos0, rows_out, bufs, emb, head, norms, rope_p, wq, wk, wv, wo, wg,
                 wu, wd, bias, qk_norm, kv, attn_scr):
    """Thread tid's share of the forward pass (see fused_forward): phase by phase, the same operations in
    the same order as the per-kernel form. Every thread runs this; each phase's tail (_tail) runs on the
    phase's finisher, or from SPLIT_TAILS rows on (wide) as a phase of its own shared out by rows. Its
    phases are ph0 .. ph0 + n_phases(L, wide) - 1 of sync."""
    x, xb, q, k, v, att, proj, gate, up, hb, qa, sa, xs, logits, cs = bufs
    attn_norm, eps = norms[0], norms[3]
    inv_freq, n_head, hd, scale = rope_p[0], rope_p[2], rope_p[4], rope_p[5]
    t_n = tokens.shape[0]
    wide = _split_tails(t_n)
    n_layer = attn_norm.shape[0]
    xt, xbt = x[:t_n], xb[:t_n]
    qt, kt, vt, at = q[:t_n], k[:t_n], v[:t_n], att[:t_n]
    q3 = qt.reshape(t_n, n_head, hd)
    a3 = at.reshape(t_n, n_head, hd)
    sc, part = attn_scr[0][tid], attn_scr[1]
    ph = ph0
    h, lo, hi = grab(sync, ph, tid, nt, 1, 0)  # phase 0, one item: the embedding and the first norm
    if lo < hi:
        _embed(xt, tokens, emb)
        cpu.rope_table(cs[:t_n], pos0, inv_freq)
        cpu.rmsnorm(xbt, xt, attn_norm[0], eps)
        _quant(qa, sa, xs, xbt)
        open_phase(sync, ph)
    _wait_next(sync, ph, tid, nt, np.int64(DOWN), np.int64(-1), wq, wk, wv, wo, wg, wu, wd, head, kv, pos0, t_n)
    for l in range(n_layer):
        for kind in range(N_LAYER_PHASES):
            ph += 1
            if kind == QKV:
                f_ = _mm_phase(sync, ph, tid, nt, qt, kt, vt, xbt.shape[1], qa, sa, xs, wq, wk, wv, l, 3)
            elif kind == ATTENTION:
                f_ = _attn_phase(sync, ph, tid, nt, kv, l, q3, a3, pos0, scale, sc, part)
            elif kind == O:
                f_ = _mm_phase(sync, ph, tid, nt, proj[:t_n], proj[:t_n], proj[:t_n], at.shape[1], qa, sa, xs, wo, wo,
                               wo, l, 1)
            elif kind == GATE_UP:
                f_ = _mm_phase(sync, ph, tid, nt, gate[:t_n], up[:t_n], up[:t_n], xbt.shape[1], qa, sa, xs, wg, wu,
                               wu, l, 2)
            else:
                f_ = _mm_phase(sync, ph, tid, nt, proj[:t_n], proj[:t_n], proj[:t_n], hb.shape[1], qa, sa, xs, wd, wd,
                               wd, l, 1)
            last = kind == DOWN and l + 1 == n_layer  # then also the final norm of the rows_out rows
            if f_:
                if not wide:
                    _tail(kind, 0, t_n, l, t_n, pos0, bufs, norms, rope_p, bias, qk_norm, kv, part)
                    if last:
                        _final_norm(rows_out, t_n, bufs, norms)
                open_phase(sync, ph)
            if not wide:
                _wait_next(sync, ph, tid, nt, kind, l, wq, wk, wv, wo, wg, wu, wd, head, kv, pos0, t_n)
            else:
                wait_open(sync, ph)
                ph += 1
                if _tail_phase(sync, ph, tid, nt, kind, l, t_n, pos0, bufs, norms, rope_p, bias, qk_norm, kv, part):
                    if last:
                        _final_norm(rows_out, t_n, bufs, norms)
                    open_phase(sync, ph)
                _wait_next(sync, ph, tid, nt, kind, l, wq, wk, wv, wo, wg, wu, wd, head, kv, pos0, t_n)
    ph += 1
    if _head_phase(sync, ph, tid, nt, logits[:rows_out], xb.shape[1], qa, sa, xs, head):
        open_phase(sync, ph)
    wait_open(sync, ph)


@njit(cache=True, nogil=True, inline="always")
def _final_norm(rows_out, t_n, bufs, norms):
    """The output norm of the pass's last rows_out rows into xb[:rows_out], quantized for the head."""
    x, xb, qa, sa, xs = bufs[0], bufs[1], bufs[10], bufs[11], bufs[12]
    cpu.rmsnorm(xb[:rows_out], x[t_n - rows_out:t_n], norms[2], norms[3])
    _quant(qa, sa, xs, xb[:rows_out])


@njit(cache=True, nogil=True, inline="always")
def n_phases(n_layer, wide=False):
    """Phases of one fused step: the embedding, five per layer (qkv, attention, o, gate/up, down; for a
    pass of SPLIT_TAILS+ rows ten: each tail a phase of its own), the head."""
    return (2 * N_LAYER_PHASES if wide else N_LAYER_PHASES) * n_layer + 2


@njit(cache=True, nogil=True, inline="always")
def _choose(x, choice, s):
    """Pass s's token from its logits x: the argmax (mode 0) or a sampled choice (engine.sampling_fast
    .block_choice with the pass's uniform); either counts it into the chooser's penalty state."""
    # a BlockChoice's fields, in order: it comes in as a plain tuple (call_args), as a NamedTuple argument cost
    # numba's dispatcher ~210 bytes of Python memory per call that were never freed (measured, numba 0.68)
    mode, temperature, top_k, top_p, min_p, presence, frequency, pen, counts, uniforms, work, ids, vals, p = choice
    if mode == 0:
        tok = cpu.argmax_row(x)
        if counts.shape[0] > 0:
            counts[tok] += 1
        return tok
    return block_choice(x, pen, counts, temperature, top_k, top_p, min_p, presence, frequency, uniforms[s], work,
                        ids, vals, p)


@njit(cache=True, nogil=True, inline="always")
def _passes(tid, nt, sync, tokens, pos0, rows_out, bufs, emb, head, norms, rope_p, wq, wk, wv, wo, wg, wu, wd,
            bias, qk_norm, kv, attn_scr, chain, stops, choice):
    """Thread tid's share of fused_forward: one pass over tokens, or (chain holding n > 0 tokens after the
    first) a block of passes, each followed by a one-item phase on one thread that appends the pass's
    chosen token to the chain and keeps the pass's last hidden row (x[0], before the final norm) in x[1 + s]
    (rows a one-token pass leaves alone; FusedForward sizes x for them): a drafter is fed those rows
    (FusedForward.block_hidden); all threads stop after a token in stops (or -1: nothing to choose)."""
    n = chain.shape[0] - 1
    if n == 0:
        _step_thread(tid, nt, sync, np.int64(0), tokens, pos0, rows_out, bufs, emb, head, norms, rope_p, wq, wk, wv,
                     wo, wg, wu, wd, bias, qk_norm, kv, attn_scr)
        return
    per = n_phases(norms[0].shape[0]) + 1
    for s in range(n):
        _step_thread(tid, nt, sync, s * per, chain[s:s + 1], pos0 + s, np.int64(1), bufs, emb, head, norms, rope_p,
                     wq, wk, wv, wo, wg, wu, wd, bias, qk_norm, kv, attn_scr)
        ph = s * per + per - 1
        h, lo, hi = grab(sync, ph, tid, nt, 1, 0)
        if lo < hi:
            chain[s + 1] = _choose(bufs[13][0], choice, s)
            if s + 1 < bufs[0].shape[0]:
                bufs[0][s + 1] = bufs[0][0]
            open_phase(sync, ph)
        _wait_next(sync, ph, tid, nt, np.int64(DOWN), np.int64(-1), wq, wk, wv, wo, wg, wu, wd, head, kv, pos0,
                   np.int64(1))
        if _ends(chain, s, stops):
            return


_gram_key = njit(cache=True, nogil=True, inline="always")(gram_key)  # the key engine.triggers packs


@njit(cache=True, nogil=True, inline="always")
def _ends(chain, s, stops):
    """A block ends after its token chain[s + 1]: -1 (no token could be chosen), a stop token, or a trigger: the
    last three tokens, chain[s - 1], chain[s], chain[s + 1] (chain[-1] being stops' prev), pack (gram_key) to one
    of the sorted keys (where a prompt-lookup drafter would match them: engine.spec.lookup.block_triggers).
    stops = (stop ids (S,) int32, trigger keys (G,) int64 sorted, prev int64: the token before chain[0], or -1)."""
    ids, keys, prev = stops
    token = chain[s + 1]
    if token < 0:
        return True
    for i in range(ids.shape[0]):
        if ids[i] == token:
            return True
    if keys.shape[0] == 0:
        return False
    a = np.int64(chain[s - 1]) if s > 0 else prev
    if a < 0:
        return False
    key = _gram_key(a, np.int64(chain[s]), np.int64(token))
    i = np.searchsorted(keys, key)
    return i < keys.shape[0] and keys[i] == key


@njit(cache=True, nogil=True, parallel=True)
def fused_forward(tokens, pos0, rows_out, bufs, emb, head, norms, rope_p, wq, wk, wv, wo, wg, wu, wd, bias,
                  qk_norm, kv, attn_scr, sync, nt, chain, stops, choice):
    """Embedding -> all layers -> final norm -> head for tokens (T,) at positions pos0.., in one call and
    ONE parallel region (sync): each of the nt threads runs _step_thread; they share each phase's
    items and wait only for phases to complete.

    bufs = (x, xb, q, k, v, att, proj, gate, up, hb (max_t, ...) f32, qa int8, sa, xs (fast.quantize_rows),
    logits (max_t, vocab),
    cs (max_t, hd / 2, 2) f64: rope's cos and sin for the pass, rope_table);
    norms = (attn_norm (L, d), ffn_norm (L, d), out_norm (d,), eps); rope_p = (inv_freq, neox, n_head,
    n_kv, hd, attn_scale); w* = per role its table of per-layout stacks (step_weights.role_tables, step_mm's
    docstring); emb, head = step_weights.table's;
    bias = (has, bq (L, q_dim), bk, bv); qk_norm = (has, qn (L, hd), kn (L, hd)); kv = (k16, v16) (L, cap,
    n_kv, hd) uint16 f16 bits, or (k_q, k_s, v_q, v_s) for an int8 cache; attn_scr = (sbuf (threads, n_head,
    chunk_cap(cap)), part) attention scratch; sync = sync.new_sync(n, threads) with n the larger
    of BLOCK * (n_phases(L) + 1) and n_phases(L, True) + 1;
    nt = the caller's numba.get_num_threads() (called in here, it would keep numba from caching this
    function). Writes logits rows for the last `rows_out` positions into bufs[13][:rows_out].

    chain (n + 1,) int32, stops (_ends: stop ids, trigger keys, prev), choice (a sampling_fast.BlockChoice as a
    plain tuple): with n = 0,
    the one pass above (chain and choice unused). With n > 0, a decode block (tokens unused): chain[0] is
    forwarded at pos0, the token chosen from its logits (the argmax, np.argmax's choice, or a sampled one:
    _choose) becomes chain[1] and is forwarded at pos0 + 1, and so on, until n tokens are chosen or one ends the
    block (_ends: a stop token, -1 when nothing could be chosen, or a trigger). Returns the number of tokens
    chosen (0 for a plain pass): that many positions from pos0 now hold KV rows, the last chosen token's not yet.
    One call for n tokens saves n - 1 calls into numba (~140 us each after a step's weight stream) and the Python
    of n - 1 rounds (logits copy, choice)."""
    n = chain.shape[0] - 1
    reset_rows(sync, max(n, 1) * (n_phases(norms[0].shape[0], n == 0 and _split_tails(tokens.shape[0])) + 1))
    # One signature for _step_thread (compiled once, ~50-65 s on this machine): prange's index is uint64 in the
    # gufunc but int64 where numba types the loop, and a literal argument (0, 1) is a type of its own; as they
    # were, the step compiled _passes twice and _step_thread four times. _passes is inlined here: as a function
    # of its own it was one more final link, all of the step optimized and code-generated again (the step's
    # cold compile 121-123 -> 105-112 s, scripts/compile_times.py).
    for tid in prange(nt):
        _passes(np.int64(tid), nt, sync, tokens, pos0, rows_out, bufs, emb, head, norms, rope_p, wq, wk, wv, wo, wg,
                wu, wd, bias, qk_norm, kv, attn_scr, chain, stops, choice)
    for s in range(n):
        if _ends(chain, s, stops):
            return s + 1
    return n


# ------------------------------------------------------------------------------------------------ builder
_ROLES = MATRIX_ROLES  # the layer matrices, in the phase list's order (engine.forward)


def _z(dtype, ndim):
    return np.zeros((1,) * ndim, dtype)


class FusedForward:
    """`model.forward` in one numba call. Build with `build(model)`; call like Model.forward."""

    def __init__(self, model):
        a = model.args
        self.model, self.args = model, a
        layers = model.layers
        # per role: its layers' blocks as one table of per-layout stacks (step_weights; a tuple of per-layer
        # arrays made numba compile a 30-way switch per access: 10x the compile time and ~500 MB more memory)
        self.mixed = not plain(model)  # step_mm: the plain argument types, or the mixed ones
        self.roles = role_tables(layers, self.mixed)
        self.emb = table(model.tok_embd, self.mixed)[:3] + ((True,) if self.mixed else ())
        self.head = table(model.output, self.mixed)
        f32 = np.float32
        self.norms = (np.stack([np.asarray(lw.attn_norm, f32) for lw in layers]),
                      np.stack([np.asarray(lw.ffn_norm, f32) for lw in layers]),
                      np.asarray(model.output_norm, f32), float(a.rms_eps))
        self.rope = (np.asarray(model.inv_freq, f32), bool(a.rope_neox), a.n_head, a.n_kv_head, a.head_dim,
                     np.float32(model.attn_scale))
        if layers[0].bq is not None:
            self.bias = (True, *(np.stack([np.asarray(getattr(lw, b), f32) for lw in layers])
                                 for b in ("bq", "bk", "bv")))
        else:
            self.bias = (False, _z(f32, 2), _z(f32, 2), _z(f32, 2))
        if layers[0].q_norm is not None:
            self.qk_norm = (True, np.stack([np.asarray(lw.q_norm, f32) for lw in layers]),
                            np.stack([np.asarray(lw.k_norm, f32) for lw in layers]))
        else:
            self.qk_norm = (False, _z(f32, 2), _z(f32, 2))
        # Launch numba's thread pool now: fused_forward is not itself parallel, so when it (or a kernel) is
        # loaded from the on-disk cache nothing launches the pool before its parallel regions run (seen: a
        # warm start without --threads segfaulted in the first step; with set_num_threads it did not).
        numba.get_num_threads()
        self.guard = ContentionGuard()
        self.max_t = 0
        self.logit_rows = 0
        self.bufs = None
        self.attn_cap = 0
        self.attn_scr = (None, np.zeros((0,)))
        n_l = len(layers)  # a decode block of BLOCK passes, or a prompt's pass with its tail phases
        self.sync = new_sync(max(BLOCK * (n_phases(n_l) + 1), n_phases(n_l, True) + 1),
                             numba.config.NUMBA_NUM_THREADS)
        self.chain = np.zeros(BLOCK + 1, np.int32)  # a decode block's tokens (fused_forward)
        self._stops = (frozenset(), np.zeros(0, np.int32))  # the last stop set and its array
        self._no_keys = np.zeros(0, np.int64)  # a block without triggers
        self.argmax = tuple(argmax_choice())  # a block's choice when the caller gives none (plain argmax)
        self._alloc(max(BLOCK + 1, model.state.max_t), 1)  # x has a row per pass of a block (_passes)

    def _alloc(self, max_t: int, logit_rows: int):
        """(Re)allocate the run buffers for up to max_t tokens and logit_rows output rows (grow only)."""
        a = self.args
        max_t, logit_rows = max(max_t, self.max_t), max(logit_rows, self.logit_rows, 1)
        if max_t == self.max_t and logit_rows == self.logit_rows:
            return
        f = np.float32
        max_n = max(a.d_model, a.q_dim, a.d_ff)
        self.bufs = (np.zeros((max_t, a.d_model), f), np.zeros((max_t, a.d_model), f),  # x, xb
                     np.zeros((max_t, a.q_dim), f), np.zeros((max_t, a.kv_dim), f), np.zeros((max_t, a.kv_dim), f),
                     np.zeros((max_t, a.q_dim), f), np.zeros((max_t, a.d_model), f),  # att, proj
                     np.zeros((max_t, a.d_ff), f), np.zeros((max_t, a.d_ff), f), np.zeros((max_t, a.d_ff), f),
                     np.zeros((max_t, max_n), np.int8), np.zeros((max_t, max_n // QK), f),
                     np.zeros((max_t, XS * (max_n // QK)), f), np.zeros((logit_rows, a.vocab_size), f),
                     np.zeros((max_t, a.head_dim // 2, 2), np.float64))  # cs: rope's cos and sin
        self.max_t, self.logit_rows = max_t, logit_rows

    def input_rows(self, t_n: int, rows_out: int = 1) -> np.ndarray:
        """The next pass's input rows x (t_n, d), for a caller that gives them (embedding kind GIVEN: the MTP
        block): written before run(), which then reallocates nothing (the buffers are sized here)."""
        self._alloc(t_n, rows_out)
        return self.bufs[0][:t_n]

    def hidden(self, t_n: int) -> np.ndarray:
        """The last pass's output rows x (t_n, d) before the final norm (a view: copy to keep)."""
        return self.bufs[0][:t_n]

    def block_hidden(self, n: int) -> np.ndarray:
        """The last decode block's first n passes' output rows (n, d) before the final norm, as hidden(1) after
        each of them (a view: copy to keep)."""
        return self.bufs[0][1:1 + n]

    def _attn_scratch(self, capacity: int):
        """(sbuf (threads, n_head, A.chunk_cap(capacity)), part (max_t, n_kv, SPLITS, group, hd + 2))."""
        if capacity > self.attn_cap or self.attn_scr[1].shape[0] < self.max_t:
            a = self.args
            nt = numba.config.NUMBA_NUM_THREADS
            self.attn_scr = (np.zeros((nt, a.n_head, A.chunk_cap(capacity)), np.float32),
                             np.zeros((self.max_t, a.n_kv_head, SPLITS, a.group, a.head_dim + 2), np.float32))
            self.attn_cap = capacity
        return self.attn_scr

    def kv_tuple(self, cache):
        """The cache arrays in the fused step's argument form (views, no copies)."""
        if cache.kv_dtype == "f16":
            return (cache.k.view(np.uint16), cache.v.view(np.uint16))
        return (cache.k_q, cache.k_s, cache.v_q, cache.v_s)

    def call_args(self, tokens, pos0: int, rows_out: int, kv, scratch, nt: int, chain=None, stops=None,
                  choice=None) -> tuple:
        """fused_forward's arguments for this model (run, block; tier.fused_signature; the scripts);
        without chain, one pass."""
        r = self.roles
        return (tokens, pos0, rows_out, self.bufs, self.emb, self.head, self.norms, self.rope,
                *(r[name] for name in _ROLES), self.bias, self.qk_norm, kv, scratch,
                self.sync, nt, self.chain[:1] if chain is None else chain,
                (self._stops[1], self._no_keys, np.int64(-1)) if stops is None else stops,
                self.argmax if choice is None else tuple(choice))

    def run(self, tokens: np.ndarray, pos0: int, cache, rows_out: int) -> np.ndarray:
        """The jitted step only (no checks, no copy): logits (rows_out, vocab) view of the internal buffer."""
        def step(kv, scratch):
            fused_forward(*self.call_args(tokens, pos0, rows_out, kv, scratch, numba.get_num_threads()))
        return self.guarded(tokens.shape[0], pos0, cache, rows_out, step)

    def block(self, token: int, pos0: int, cache, n: int, stop_ids, choice=None, triggers=None) -> list[int]:
        """Up to n (<= BLOCK) tokens after `token` at pos0 in one call (fused_forward's block), each chosen
        from the previous pass's logits by `choice` (a BlockChoice; None: the argmax) and
        forwarded next; stops after a token in stop_ids (returned last), -1 (nothing to choose), or where the
        last three tokens pack to one of `triggers` = (sorted keys (G,) int64, the token before `token`) (_ends).
        The cache then holds pos0 + len(result) positions. A probe of the contention guard runs one."""
        n = max(1, min(n, BLOCK, self.guard.block_limit()))
        if self._stops[0] != stop_ids:
            self._stops = (stop_ids, np.array(sorted(stop_ids), np.int32))
        keys, prev = triggers if triggers is not None else (self._no_keys, -1)
        stops = (self._stops[1], keys, np.int64(prev))
        chain = self.chain[:n + 1]
        chain[0] = token
        self.guarded(1, pos0, cache, 1, lambda kv, scratch: fused_forward(
            *self.call_args(chain[:1], pos0, 1, kv, scratch, numba.get_num_threads(), chain, stops, choice)))
        return chain[1:cache.length - pos0 + 1].tolist()  # guarded set the length: pos0 + tokens chosen

    def guarded(self, t_n: int, pos0: int, cache, rows_out: int, step) -> np.ndarray:
        """Buffers sized, the decode thread guard around `step(kv, attention scratch)` (one-token steps and
        decode blocks; a prefill / verify pass gets all threads, whatever the guard chose), the cache length
        set to pos0 + the positions written: t_n, or what step returns (a decode block's tokens). Shared by
        this step and the tiered start's kernel-by-kernel step (backends/cpu/tier.py)."""
        if t_n > self.max_t or rows_out > self.logit_rows:
            self._alloc(t_n, rows_out)
        guard = self.guard if t_n == 1 else None
        if guard is not None:
            guard.before()
        else:
            self.guard.full_threads()
        done = step(self.kv_tuple(cache), self._attn_scratch(cache.capacity)) or t_n
        if guard is not None:
            guard.after(done)
        cache.length = pos0 + done
        return self.bufs[13][:rows_out]

    def __call__(self, tokens, pos0: int, cache, *, all_logits: bool = False) -> np.ndarray:
        """Same contract as Model.forward (validated there); returns a host copy of the logits."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        return self.run(tokens, pos0, cache, tokens.shape[0] if all_logits else 1).copy()


def build(model):
    """A FusedForward for `model` if all its matrices are in layouts the step takes (step_weights.layout),
    else None."""
    ws = [getattr(lw, role) for lw in model.layers for role in _ROLES] + [model.tok_embd, model.output]
    if any(layout(w) is None for w in ws):
        return None
    return FusedForward(model)
