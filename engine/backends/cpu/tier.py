"""Tier 0 of the fast CPU forward: `fused_forward`'s kernels called one by one from Python.

Why: on a cold start (empty numba cache) a large part of the one-call fused step's compile time (about a
quarter, measured) is its final link, where numba optimizes and codegens every kernel it calls once more.
The same kernels called from Python skip that link, and each is cached on its own, so half of them can be
compiled by a helper process (compile_bg.py) while this process compiles the other half.

None of them is a numba parallel region: parallel lowering costs the same kind of final link (mm_q4x3
took 10.6 s to compile with its group kernels already cached, its item loop alone 2.1 s). A pass of several
rows (the prompt) shares its items between two Python threads (the kernels release the GIL); a decode step
runs on one, next to the helper, which compiles the fused step on the other core meanwhile. Measured: the
first token 18.6 / 20.7 -> 12.1 / 12.2 s after an empty cache (ninfer-bench cold runs alternated with the
previous tree), and the first reply decoding at ~100 tok/s instead of ~10 (two-thread regions had been
fighting the helper for a core).

The result is bit-identical to `fused_forward`: the same per-group matmul kernels and per-item attention
kernels, on the same inputs, in the same order of phases (tests/engine/test_compile_bg.py), so the engine
can switch to the fused step between any two steps once it is in the cache.

`LeafForward` is engine.forward's layer walk over the fused step's kernels and buffers (the fused step is
the same walk generated as one numba function). Each call site is compiled for the exact types numba infers
there (the int8 activation slices qa/sa/xs are non-contiguous 'A' arrays).
Costs ~12 Python->numba calls per layer (about 1-2 ms per decode step on a 30-layer model): only until
the fused step is ready. f16 KV cache only (the int8 cache compiles the fused step in the foreground).
Nothing here is jitted (numba_env.NOT_JITTED: editing it does not invalidate the numba cache).
"""
from __future__ import annotations

import time

import numba
import numpy as np

from ...forward import ATTENTION, GATE_UP, O, QKV, walk
from . import kernels as cpu
from .attn import SPLITS, attention_f16_part, merge_parts, store_f16
from .attn_prefill import attention_tiles_part, n_tiles, prompt_pass
from .fast import XS, BATCHED_MIN_T, G, embed_q4, embed_q8, mm_q4x3_part, mm_q8_batched, mm_q8_part, quantize_rows
from .kquant import embed_rows, mm_part
from . import q4k
from .step import swiglu_fast
from .step_mm import GIVEN, Q4, Q4K, Q5, Q8

# kernels the helper process compiles (the rest, and the sampling chain, are compiled here meanwhile): about
# half the work each after the helper's own start-up. Measured in a fresh cache: this process's kernels 7.6 s
# while the helper took 2.6 s to start and 4.4 s to compile attention and the head; with merge_parts and
# swiglu_fast moved to the helper, 5.1 s here and "leaves" 7.1 s after the start (the load 10.3 -> 7.8 s).
CHILD_KERNELS = (attention_f16_part, attention_tiles_part, mm_q8_part, merge_parts, swiglu_fast)
HELPER_WAIT_S = 600.0  # a helper alive but stuck this long: compile its kernels here


def _sig(args, a_idx):
    """numba argument types of a call; positions in a_idx as layout 'A' (slices numba types so)."""
    tys = [numba.typeof(a) for a in args]
    for i in a_idx:
        tys[i] = tys[i].copy(layout="A")
    return tuple(tys)


class LeafForward:
    """`fused_forward` as Python calls of its kernels over a FusedForward's buffers and weights."""

    def __init__(self, ff):
        self.ff = ff
        self.eps = {}  # call site -> compiled entry point
        self.record = None  # list of (dispatcher, signature) while planning
        self.two = False  # this pass's items are shared with a second thread

    def _entry(self, site, disp, args, a_idx):
        """The compiled entry point for this call site (None while planning: the call is recorded)."""
        if self.record is not None:
            sig = _sig(args, a_idx)
            if (disp, sig) not in self.record:
                self.record.append((disp, sig))
            return None
        ep = self.eps.get(site)
        if ep is None:  # first call at this site: a cache hit when the helper process compiled it
            ep = self.eps[site] = disp.compile(_sig(args, a_idx))
        return ep

    def _call(self, site, disp, args, a_idx=()):
        ep = self._entry(site, disp, args, a_idx)
        if ep is not None:
            ep(*args)

    def _split(self, site, disp, n, args, a_idx=(), args2=None):
        """disp(lo, hi, *args) over items 0..n. A pass of several rows (prefill, verify) runs the first
        half on a second Python thread (with args2 when given) and the rest here: the kernels release the
        GIL. A decode step stays on this thread: the helper process compiles on the other core meanwhile."""
        ep = self._entry(site, disp, (0, n) + args, tuple(i + 2 for i in a_idx))
        if ep is None:
            return
        if self.two and n > 1:
            mid = n // 2
            half = _pool().submit(ep, 0, mid, *(args2 or args))
            try:
                ep(mid, n, *args)
            finally:  # never leave the other half writing into the buffers after this returns or raises
                half.result()
        else:
            ep(0, n, *args)

    def plan(self, kv) -> list:
        """[(dispatcher, signature)] of every kernel call of a forward over the cache arrays kv, in order,
        without compiling or running anything."""
        self.record = []
        try:
            ff = self.ff
            tok = ff.bufs[0][:1, 0].astype("int32")
            self.forward(tok, 0, kv, 1, ff._attn_scratch(1))
            return self.record
        finally:
            self.record = None

    def compile(self, kv, skip=()) -> None:
        """Compile (or load from the cache) every kernel of a forward except the dispatchers in skip."""
        for disp, sig in self.plan(kv):
            if disp not in skip:
                disp.compile(sig)

    def forward(self, tokens, pos0, kv, rows_out, attn_scr, cache=None) -> None:
        """One pass over the cache arrays kv (FusedForward.kv_tuple) into the step's buffers: engine.forward's
        walk over this object's phases. cache: the KVCache whose length the pass sets (None: planning)."""
        self.kv, self.attn_scr = kv, attn_scr
        walk(self, tokens, pos0, cache if cache is not None else _Unbound(), rows_out)

    # ---- engine.forward.LayerOps: the fused step's kernels, each called from Python
    @property
    def n_layer(self) -> int:
        return self.ff.norms[0].shape[0]

    def begin(self, tokens, pos0, cache) -> None:
        t_n = tokens.shape[0]
        self.tokens, self.pos0, self.t_n = tokens, pos0, t_n
        self.two = t_n > 1 and numba.get_num_threads() > 1 and self.attn_scr[0].shape[0] > 1

    def embed(self) -> None:
        ff, c, t_n = self.ff, self._call, self.t_n
        x, xb, cs, emb = ff.bufs[0][:t_n], ff.bufs[1][:t_n], ff.bufs[14][:t_n], ff.emb
        if emb[0] == Q4:
            c("embed_q4", embed_q4, (x, emb[1], self.tokens))
        elif emb[0] == Q8:
            c("embed_q8", embed_q8, (x, emb[2], self.tokens))
        elif emb[0] == Q4K:
            c("embed_q4k", q4k.embed, (x, emb[1], self.tokens))
        elif emb[0] != GIVEN:
            c("embed_k", embed_rows, (x, emb[1], self.tokens, 5 if emb[0] == Q5 else 6))
        c("rope_table", cpu.rope_table, (cs, self.pos0, ff.rope[0]))
        c("norm1", cpu.rmsnorm, (xb, x, ff.norms[0][0], ff.norms[3]))

    def phase(self, ph, l: int) -> None:
        ff, t_n = self.ff, self.t_n
        x, xb, q, k, v, att, proj, gate, up, hb = (b[:t_n] for b in ff.bufs[:10])
        r = ff.roles
        if ph.kind == QKV:
            self._mm("qkv", q, k, v, xb, r["wq"], r["wk"], r["wv"], l)
        elif ph.kind == ATTENTION:
            _, _, n_head, n_kv, hd, scale = ff.rope
            q3, a3 = q.reshape(t_n, n_head, hd), att.reshape(t_n, n_head, hd)
            kv, (sbuf, part), pos0 = self.kv, self.attn_scr, self.pos0
            if prompt_pass(t_n) or self.record is not None:  # a prompt: row tiles (planned with the rest)
                self._split("attn_tiles", attention_tiles_part, n_tiles(t_n, n_kv),
                            (a3, q3, kv[0][l], kv[1][l], pos0, scale))
            if not prompt_pass(t_n):
                args = (part, sbuf[0], q3, kv[0][l], kv[1][l], pos0, scale)
                other = (part, sbuf[1], *args[2:]) if self.two else None  # its own scores scratch
                self._split("attn", attention_f16_part, t_n * SPLITS, args, (), other)
        elif ph.kind == O:
            self._mm("o", proj, None, None, att, r["wo"], None, None, l)
        elif ph.kind == GATE_UP:
            self._mm("gu", gate, up, None, xb, r["w_gate"], r["w_up"], None, l)
        else:
            self._mm("down", proj, None, None, hb, r["w_down"], None, None, l)

    def tail(self, ph, l: int) -> None:
        ff, c, t_n = self.ff, self._call, self.t_n
        x, xb, q, k, v, att, proj, gate, up, hb = (b[:t_n] for b in ff.bufs[:10])
        attn_norm, ffn_norm, _, eps = ff.norms
        _, neox, n_head, n_kv, hd, _ = ff.rope
        if ph.kind == QKV:
            bias, qk_norm, cs, kv = ff.bias, ff.qk_norm, ff.bufs[14][:t_n], self.kv
            if bias[0]:
                c("bias_q", cpu.bias_add, (q, bias[1][l]))
                c("bias_k", cpu.bias_add, (k, bias[2][l]))
                c("bias_v", cpu.bias_add, (v, bias[3][l]))
            if qk_norm[0]:
                qh = q.reshape(t_n * n_head, hd)
                kh = k.reshape(t_n * n_kv, hd)
                c("qnorm", cpu.rmsnorm, (qh, qh, qk_norm[1][l], eps))
                c("knorm", cpu.rmsnorm, (kh, kh, qk_norm[2][l], eps))
            q3, k3, v3 = q.reshape(t_n, n_head, hd), k.reshape(t_n, n_kv, hd), v.reshape(t_n, n_kv, hd)
            c("rope_q", cpu.rope_apply, (q3, cs, neox))
            c("rope_k", cpu.rope_apply, (k3, cs, neox))
            c("store_k", store_f16, (kv[0][l], k3, self.pos0))  # the fused step's _kv_store, f16 cache
            c("store_v", store_f16, (kv[1][l], v3, self.pos0))
        elif ph.kind == ATTENTION:
            if not prompt_pass(t_n):
                c("attn_merge", merge_parts, (att.reshape(t_n, n_head, hd), self.attn_scr[1][:t_n]))
        elif ph.kind == O:
            c("resid1", cpu.residual_add, (x, proj))
            c("norm2", cpu.rmsnorm, (xb, x, ffn_norm[l], eps))
        elif ph.kind == GATE_UP:
            c("swiglu", swiglu_fast, (hb, gate, up))
        else:
            c("resid2", cpu.residual_add, (x, proj))
            if l + 1 < self.n_layer:
                c("norm1", cpu.rmsnorm, (xb, x, attn_norm[l + 1], eps))

    def capture(self, layer: int) -> None:
        raise AssertionError("a pass that captures hidden states runs the plain walk (CpuRunner.forward)")

    def head(self, rows_out: int):
        ff, t_n = self.ff, self.t_n
        x, xb, logits = ff.bufs[0], ff.bufs[1], ff.bufs[13]
        self._call("norm_out", cpu.rmsnorm, (xb[:rows_out], x[t_n - rows_out:t_n], ff.norms[2], ff.norms[3]))
        self._head(logits[:rows_out], xb[:rows_out], ff.head)
        return logits[:rows_out]

    def _quant(self, site, xin):
        ff = self.ff
        qa, sa, xs = ff.bufs[10], ff.bufs[11], ff.bufs[12]
        t_n, n = xin.shape
        nb = n // 32
        args = (qa[:t_n, :n], sa[:t_n, :nb], xs[:t_n, :XS * nb])
        self._call("quant_" + site, quantize_rows, (*args, xin), (0, 1, 2))
        return args

    def _mm(self, site, o1, o2, o3, xin, w1, w2, w3, l):
        """Up to three matmuls of xin (a matmul phase of the fused step): those of layer l in 4-bit blocks as
        one mm_q4x3 call, the others one by one (step_mm's role tables)."""
        qa, sa, xs = self._quant(site, xin)
        used = [(w, o) for w, o in ((w1, o1), (w2, o2), (w3, o3)) if w is not None]
        q4 = [(w, o) for w, o in used if _kind_at(w, l)[0] == Q4]
        if q4:
            self._mm_q4("mm_" + site + "".join(f":{id(w)}" for w, _ in q4), q4, qa, sa, xs, l)  # a site per table mix
        for i, (w, o) in enumerate(used):
            kind, at = _kind_at(w, l)
            if kind == Q8:
                self._split(f"mm_{site}{i}_q8", mm_q8_part, w[4][at].shape[0], (o, qa, sa, w[4][at], w[5]), (1, 2))
            elif kind == Q4K:
                blk = w[8][at]
                self._split(f"mm_{site}{i}_q4k", q4k.mm_part, blk.shape[0] * blk.shape[1], (o, qa, sa, xs, blk),
                            (1, 2, 3))
            elif kind != Q4:
                blk = w[6][at] if kind == Q5 else w[7][at]
                self._split(f"mm_{site}{i}_k", mm_part, blk.shape[0], (o, qa, sa, xs, blk, 5 if kind == Q5 else 6),
                            (1, 2, 3))

    def _mm_q4(self, site, used, qa, sa, xs, l):
        """The 4-bit matmuls of a phase as one mm_q4x3 call per part (step_mm._mm_groups' order)."""
        for p in range(used[0][0][0].shape[1]):
            ws, os_ = [], []
            for w, o in used:
                h = w[0].shape[2]
                ws.append((w[0][_kind_at(w, l)[1], p], w[1][p * h:]))
                os_.append(o[:, p * h * G:])
            while len(ws) < 3:  # empty weights, as in _mm / _mm2
                ws.append(tuple(a[:0] for a in ws[-1]))
                os_.append(os_[-1])
            n = sum(w[0].shape[0] for w in ws)
            self._split(site, mm_q4x3_part, n, (*os_, qa, sa, xs, *ws[0], *ws[1], *ws[2]), (0, 1, 2, 3, 4, 5))

    def _head(self, logits, xin, h):
        qa, sa, xs = self._quant("head", xin)
        if h[0] == Q4:
            w = (h[1], h[3])
            e = tuple(a[:0] for a in w)
            self._split("mm_head", mm_q4x3_part, w[0].shape[0], (logits, logits, logits, qa, sa, xs, *w, *e, *e),
                        (3, 4, 5))
        elif h[0] == Q4K:
            blk = h[1][None]  # one part
            self._split("head_q4k", q4k.mm_part, blk.shape[1], (logits, qa, sa, xs, blk), (1, 2, 3))
        elif h[0] != Q8:
            self._split("head_k", mm_part, h[1].shape[0], (logits, qa, sa, xs, h[1], 5 if h[0] == Q5 else 6),
                        (1, 2, 3))
        elif logits.shape[0] >= BATCHED_MIN_T:  # a verify pass's logits: compiled at its first use
            self._call("head_q8_batched", mm_q8_batched, (logits, qa, sa, xs, h[2]), (1, 2, 3))
        else:
            self._split("head_q8", mm_q8_part, h[2].shape[0], (logits, qa, sa, h[2], h[4]), (1, 2))


class _Unbound:
    """The cache of a planned pass (LeafForward.plan): only its length is set."""

    length = 0


_POOL = []


def _pool():
    """The start-up step's second thread (created at its first multi-row pass)."""
    if not _POOL:
        from concurrent.futures import ThreadPoolExecutor
        _POOL.append(ThreadPoolExecutor(1, thread_name_prefix="ninfer-tier0"))
    return _POOL[0]


def sampler_plan(vocab: int) -> list:
    """The sampling chain's jitted functions for the usual settings (top-k sampling as config.toml and the
    benchmark workloads use it; greedy with penalties): ~1 s of compiling that the first token would wait
    for, done while the helper compiles its kernels. Other settings compile at their first use."""
    from ...sampling_fast import compile_plan
    return compile_plan(False, 40, vocab) + compile_plan(True, 0, vocab)


def fused_signature(ff, kv, rows_out: int = 1) -> tuple:
    """The argument types `FusedForward.run` calls `fused_forward` with (the same for every T)."""
    args = ff.call_args(np.zeros(1, np.int32), 0, rows_out, kv, ff._attn_scratch(1), 1)
    return tuple(numba.typeof(a) for a in args)



class TieredForward:
    """`FusedForward.run` while the fused step is compiled elsewhere: the kernel-by-kernel step until the
    helper (engine/compile_bg.Helper) reports the fused step cached, then the fused step, switched between
    two calls. Same results either way (bit-identical), same ContentionGuard."""

    def __init__(self, ff, kv, helper):
        self.ff, self.helper = ff, helper
        self.leaf = LeafForward(ff)
        self.sig = fused_signature(ff, kv)
        self.fused_ready = False
        self.note: str | None = None  # why the fused step stays off (helper failed), once
        self.steps = {"kernels": 0, "fused": 0}
        self.timings: dict[str, float] = {}  # start-up phases (s), for benchmarks and reports
        self._t0 = time.perf_counter()

    def _switch(self) -> None:
        from .compile_bg import load_cached, log
        from .step import fused_forward
        h = self.helper
        if h.fused_done.is_set():
            t = time.perf_counter()
            if load_cached(fused_forward, self.sig) is not None:
                self.fused_ready = True
                self.timings.update(switch_after_s=t - self._t0, fused_load_s=time.perf_counter() - t)
                return
            self.note = "the helper's fused step is not in the numba cache"
        elif h.failure is not None:
            self.note = h.failure
        else:
            return
        log.warning("background compile of the fused decode step failed (%s); this run keeps the "
                    "kernel-by-kernel step (same results, ~10%% slower decode)", self.note)

    def warming(self) -> str | None:
        """While the helper still compiles the fused step: why this step is slower than it will be (None once
        the fused step is cached, or when the helper failed: then this step stays, ~10% slower, and _switch
        says so once)."""
        h = self.helper
        if self.fused_ready or self.note is not None or h.fused_done.is_set() or h.failure is not None:
            return None
        return ("the fast decode step is still compiling in the background (first start only): replies run on "
                "the kernel-by-kernel step until it is ready")

    def _fused(self) -> bool:
        """Whether this step is the fused one (switching to it once the helper has it cached)."""
        if not self.fused_ready and self.note is None:
            self._switch()
        return self.fused_ready

    def run(self, tokens: np.ndarray, pos0: int, cache, rows_out: int) -> np.ndarray:
        ff = self.ff
        if self._fused():
            self.steps["fused"] += 1
            return ff.run(tokens, pos0, cache, rows_out)
        self.steps["kernels"] += 1
        return ff.guarded(tokens.shape[0], pos0, cache, rows_out,
                          lambda kv, scratch: self.leaf.forward(tokens, pos0, kv, rows_out, scratch, cache))

    def block(self, token: int, pos0: int, cache, n: int, stop_ids, choice=None, triggers=None) -> list[int] | None:
        """FusedForward.block once the fused step is in use; None before (the caller runs single steps)."""
        if not self._fused():
            return None
        out = self.ff.block(token, pos0, cache, n, stop_ids, choice, triggers)
        self.steps["fused"] += len(out)
        return out

    def __call__(self, tokens, pos0: int, cache, *, all_logits: bool = False) -> np.ndarray:
        tokens = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)
        return self.run(tokens, pos0, cache, tokens.shape[0] if all_logits else 1).copy()


def start(ff, kv_dtype: str, report=None, argv=None):
    """Prepare `ff` (a FusedForward) for its first step. Returns ff itself when the fused step is in the
    numba cache (warm start) or the cache is int8 (compiled here, as before); else a TieredForward whose
    kernels are compiled (half of them by a helper process, which then compiles the fused step)."""
    from .compile_bg import Helper, install_cache_lock, load_cached
    from .step import fused_forward
    report = report or (lambda msg: None)
    cache = ff.model.new_cache(4, kv_dtype)
    kv = ff.kv_tuple(cache)
    sig = fused_signature(ff, kv)
    if kv_dtype != "f16" or load_cached(fused_forward, sig) is not None:
        return ff
    install_cache_lock()
    leaf = LeafForward(ff)
    plan = leaf.plan(kv)
    child = [(d, s) for d, s in plan if d in CHILD_KERNELS]
    helper = Helper(child, [(fused_forward, sig)], argv=argv)
    report("compiling kernels (first start only: a helper process compiles half of them)")
    t0 = time.perf_counter()
    leaf.compile(kv, skip=CHILD_KERNELS)
    for disp, s in sampler_plan(ff.args.vocab_size):
        disp.compile(s)
    t1 = time.perf_counter()
    helper.leaves_done.wait(HELPER_WAIT_S)  # set on "leaves" or when the helper ended
    tiered = TieredForward(ff, kv, helper)
    tiered.leaf = leaf
    tiered.timings.update(own_kernels_s=t1 - t0, helper_wait_s=time.perf_counter() - t1)
    if helper.failure is None:
        helper.go()
        report("compiling the fast decode step in the background (first start only)")
    else:
        report(f"background compile unavailable ({helper.failure}); compiling the rest here")
    leaf.compile(kv)  # the helper's kernels: loaded from the cache (or compiled here if it failed)
    return tiered


def _kind_at(w, l: int) -> tuple[int, int]:
    """(layout, slot in its stack) of layer l of a role table (step_mm: a plain model's (q4 stack, acc16)
    pairs hold every layer in 4-bit blocks, in layer order)."""
    if len(w) == 2:
        return Q4, l
    return int(w[2][l]), int(w[3][l])
