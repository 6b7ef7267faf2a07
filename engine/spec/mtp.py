"""MTP drafter (DeepSeek-V3 / NInfer style multi-token prediction), trained by us for the default model.

One MTP step at position p takes a pair (g, y): g the target's last hidden state h_p (the residual stream after
its last block, before the final norm) for the first draft, or the previous step's output hidden for later
ones; y the token at p+1. It predicts the token at p+2:

    z = W_eh [rmsnorm(E[y], enorm); rmsnorm(g, hnorm)]        (d, 2d) @ (2d,)
    o = block(z)                                               one llama decoder block with its own KV cache
    logits = H rmsnorm(o, target output_norm)                  H: the target's head (all rows, or the hot rows)

E and H are the target's (frozen), the final norm is shared; o is the next step's g. Drafts are recursive: k
drafts = k steps. The block attends to its cache of first-step pairs (true h_p, true x_{p+1}) of every fed
position and to the chain's own steps, as it was trained (train/mtp_train.py). With `--lm-head-draft` the head
is the trained hot vocabulary's rows only (a few thousand of 49,152, held in Q4_1: the draft costs a small share
of a target step); the target always verifies over the full vocabulary, so the output stays lossless.

The block is a one-layer `engine.model.Model` on the cpu backend's kernels (its matrices quantized to Q4_1 at
load, W_eh to Q8_0), with z in place of the embedding: run by the cpu backend's fused step in one call
where the target's step is compiled, else walked phase by phase (engine.forward's layer walk; the same bits).
A round's block passes are its k draft steps: the pairs the target was fed are run with the first one
(MTPDrafter). Weights: a drafter file (engine.spec.drafter_file) keyed by the base model's sha256.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np

from ..forward import LAYER_PHASES
from .base import Features, top_probability
from .drafter_file import DrafterFile, find, kept_network

FORMAT, VERSION = "ninfer-mtp", 1
WEIGHTS = ("enorm", "hnorm", "w_eh", "attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down",
           "hot_ids")
_GGUF_NAMES = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
               "wv": "attn_v.weight", "wo": "attn_output.weight", "ffn_norm": "ffn_norm.weight",
               "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight"}
MAX_ROWS = 64  # rows of one block pass (an observe of more positions runs in chunks)
ROW_CACHE = 16384  # embedding rows a drafter keeps (EmbedRows; 36 MB at SmolLM2's width; emptied when full)
_BLOCKS: dict = {}  # (drafter file, model, head, capacity) -> (MTPBlock, last layer): one reply at a time


class EmbedRows:
    """A drafter's rows of the target's (quantized) embedding table as float32 (d,), each dequantized once
    per token and kept (up to ROW_CACHE, then emptied): a draft round's Python is a large share of its time
    (~50 us a row through quant.dequantize_rows). finish(row (1, d)), where given, runs on a new row in place
    first (MTP: its rmsnorm)."""

    def __init__(self, table, finish=None):
        self.table, self.finish = table, finish
        self.rows: dict[int, np.ndarray] = {}

    def __call__(self, token: int) -> np.ndarray:
        row = self.rows.get(token)
        if row is None:
            from ..quant import dequantize_rows
            if len(self.rows) >= ROW_CACHE:
                self.rows.clear()
            e = dequantize_rows(self.table, token, token + 1)[:1].astype(np.float32)
            if self.finish is not None:
                self.finish(e)
            row = self.rows[token] = e[0]
        return row


def _draft_kernels():
    """The kernels a drafter's block runs: the cpu set (its matmuls and attention share out over numba's
    threads), or with NINFER_DRAFT_SERIAL=1 the calling thread's (_serial_kernels). Measured on a quiet
    2-core machine (bench/results-verify.md): an MTP hot-head draft step 1.42 -> 0.59 ms, a 4-row observe
    1.20 -> 0.75 ms, the same logits bit for bit."""
    if os.environ.get("NINFER_DRAFT_SERIAL") == "1":
        return _serial_kernels()
    from ..backends.kernels import get_kernels
    return get_kernels("cpu")


def _serial_kernels():
    """The cpu kernel set with its matmuls and attention on the calling thread: a draft step is too small to
    share out, and a parallel region per kernel waits for the second core each time (measured under load:
    ~1 ms per matmul of the block, 10 ms a draft, against ~0.5 ms on one thread)."""
    from ..backends.cpu import fast
    from ..backends.kernels import Kernels
    k = Kernels("cpu", fast)
    k.matmul, k.attention_f16 = _matmul_serial, _attention_serial
    return k


def _matmul_serial(out, x, w, scratch):
    """backends/cpu/fast.matmul on one thread for Q8_0 weights (the block's; anything else: fast.matmul)."""
    from ..backends.cpu.fast import XS, FastWeight, matmul, mm_q8_part, quantize_rows
    from ..quant import QK
    if not isinstance(w, FastWeight) or w.kind != "q8":
        matmul(out, x, w, scratch)
        return
    t_n, n = x.shape
    qa, sa, xs = scratch.qa[:t_n, :n], scratch.sa[:t_n, :n // QK], scratch.xs[:t_n, :XS * (n // QK)]
    quantize_rows(qa, sa, xs, x)
    mm_q8_part(0, w.blocks.shape[0], out, qa, sa, w.blocks, w.acc32)


def _attention_serial(out, q, k_cache, v_cache, pos0, scale):
    """backends/cpu/fast.attention_f16 (its split work items, then the merge) on one thread."""
    from ..backends.cpu.attn import SPLITS, attention_f16_part, chunk_cap, merge_parts
    t_n, n_head, hd = q.shape
    cap, n_kv = k_cache.shape[:2]
    sc = np.zeros((n_head, chunk_cap(cap)), np.float32)
    part = np.zeros((t_n, n_kv, SPLITS, n_head // n_kv, hd + 2), np.float32)
    attention_f16_part(0, t_n * SPLITS, part, sc, q, k_cache.view(np.uint16), v_cache.view(np.uint16), pos0,
                       np.float32(scale))
    merge_parts(out, part)


def _q8(name: str, w: np.ndarray):
    """A float matrix (rows, cols) as a Q8_0 QTensor (the block's weights on the fast kernels)."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize

    from ..quant import QTensor
    w = np.ascontiguousarray(w, dtype=np.float32)
    return QTensor(name, QT.Q8_0, tuple(w.shape), quantize(w, QT.Q8_0))


def _q4(name: str, w: np.ndarray):
    """A float matrix (rows, cols) as a Q4_1 QTensor (the block's layer matrices: the fused step's type)."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import quantize

    from ..quant import QTensor
    w = np.ascontiguousarray(w, dtype=np.float32)
    return QTensor(name, QT.Q4_1, tuple(w.shape), quantize(w, QT.Q4_1))


def head_rows(head, hot_ids: np.ndarray | None, q4: bool):
    """The target head's rows a drafter scores (a QTensor): all of them, or the hot vocabulary's (logit j is
    token hot_ids[j]); as the target holds them, or (q4) as a Q4_1 copy."""
    from ..quant import QTensor, dequantize
    rows = head if hot_ids is None else QTensor(head.name, head.qtype, (len(hot_ids), head.shape[1]),
                                                np.ascontiguousarray(head.data[hot_ids]))
    return _q4(rows.name, np.asarray(dequantize(rows), np.float32).reshape(rows.shape)) if q4 else rows


def _f32(name: str, v: np.ndarray):
    from gguf import GGMLQuantizationType as QT

    from ..quant import QTensor
    v = np.ascontiguousarray(v, dtype=np.float32).reshape(-1)
    return QTensor(name, QT.F32, v.shape, v)


class MTPBlock:
    """The drafter's network: `run(tokens, g, pos0, rows_out) -> (logits, hidden)` over T pairs at cache
    positions pos0..

    target: the target's model file (engine.gguf.ModelFile: its embedding, head and output norm);
    hot: the head over the drafter's hot vocabulary (logit j is token hot_ids[j]) instead of all rows, those
    rows requantized to Q4_1 at load (the head is most of what a draft reads: SmolLM2's 8192 rows in Q8_0
    5.0 MB of a pass's 7.2; bench/results-spec-mtp.md "The hot head in 4 bits").

    The block's matrices are quantized to Q4_1 at load and laid out as the target's layers are
    (fast.prepare_layers), so the block is a one-layer model the cpu backend's fused step runs in ONE call
    (step.FusedForward, with the input rows given instead of an embedding): the same compiled function as the
    target's step (the same argument types), never compiled for the drafter. Until the target's step is
    compiled (a cold start's first minutes, tier.py), or where the target has none, the block runs the plain
    walk of the same weights: the same bits (tests/engine/test_mtp.py)."""

    def __init__(self, df: DrafterFile, target, capacity: int, hot: bool):
        from ..model import STACKED_ROLES, Model
        a, w, t = target.args, df.arrays, target.tensors
        self.eps = float(a.rms_eps)
        self.emb = t["token_embd.weight"]  # (vocab, d): rows dequantized per step (a few rows)
        head = t.get("output.weight", self.emb)
        self.hot_ids = np.asarray(w["hot_ids"], np.int64) if hot else None
        rows = head_rows(head, self.hot_ids, q4=self.hot_ids is not None)  # 2.9 MB a draft to read, not 5.0
        margs = dataclasses.replace(a, n_layer=1, vocab_size=rows.shape[0], qkv_bias=False, qk_norm=False,
                                    tied_embeddings=True)
        tensors = {"token_embd.weight": rows, "output_norm.weight": t["output_norm.weight"]}
        for k, gguf_name in _GGUF_NAMES.items():
            arr = w[k]
            name = f"blk.0.{gguf_name}"
            tensors[name] = _f32(name, arr) if arr.ndim == 1 else _q4(name, arr)
        from ..backends.cpu import fast
        # laid out as two layers (the same weights twice; the step reads the first): one layer's stack would
        # be a C-contiguous array, another numba type than a model's stacks (non-contiguous), and the step
        # would compile a second time for the drafter (~1-2 minutes)
        stacked = fast.prepare_layers({r: [tensors[f"blk.0.{r}.weight"]] * 2 for r in STACKED_ROLES})
        self.model = Model(margs, tensors, _draft_kernels(), max_batch=MAX_ROWS, stacked=stacked)  # tied head
        self.w_eh = self.model.be.prepare_weight(_q8("w_eh", w["w_eh"]))  # (d, 2d)
        self.enorm = np.asarray(w["enorm"], np.float32)
        self.hnorm = np.asarray(w["hnorm"], np.float32)
        self.cache = self.model.new_cache(capacity, "f16")
        self.cat = np.zeros((MAX_ROWS, 2 * a.d_model), np.float32)  # (T, 2d) [norm(E[y]); norm(g)]
        self.gn = np.zeros((MAX_ROWS, a.d_model), np.float32)  # (T, d) norm(g)
        # token -> rmsnorm(E[y], enorm) (d,) (in place, as the kernels' callers do)
        self._erow = EmbedRows(self.emb, lambda e: self.model.be.rmsnorm(e, e, self.enorm, self.eps))
        fused = stacked and os.environ.get("NINFER_MTP_FUSED") != "0"  # 0: the plain walk (A-B comparisons)
        self.ff = _fused_step(self.model) if fused else None
        self._sig = None  # the fused step's argument types (checked against what is compiled)
        self.fused_ok = False  # the fused step is compiled in this process: the block runs it

    def fused_ready(self) -> bool:
        """True when the block can run the fused step without compiling it (the target's step is compiled
        for the same types in this process). Checked until it is."""
        if self.fused_ok or self.ff is None:
            return self.fused_ok
        from ..backends.cpu.step import fused_forward
        if self._sig is None:
            from ..backends.cpu.tier import fused_signature
            self._sig = fused_signature(self.ff, self.ff.kv_tuple(self.cache))
        self.fused_ok = self._sig in fused_forward.overloads
        return self.fused_ok

    def run(self, tokens: Sequence[int], g: np.ndarray, pos0: int,
            rows_out: int = 1) -> tuple[np.ndarray | None, np.ndarray]:
        """T <= MAX_ROWS pairs (tokens[i], g[i]) at cache positions pos0..pos0+T-1 (the cache must hold pos0):
        logits (rows_out, head rows) of the last rows_out pairs (None for rows_out 0: pairs that need no
        prediction) and the output hidden states (T, d), host copies."""
        m = self.model
        toks = np.asarray(tokens, np.int32)
        t_n, d = toks.shape[0], self.enorm.shape[0]
        cat = self.cat[:t_n]
        for i, y in enumerate(toks.tolist()):
            cat[i, :d] = self._erow(y)
        gn = self.gn[:t_n]
        m.be.rmsnorm(gn, np.ascontiguousarray(g, np.float32).reshape(t_n, d), self.hnorm, self.eps)
        cat[:, d:] = gn
        if self.fused_ready():
            ff = self.ff
            rows = max(rows_out, 1)  # (a pass with no head row runs one)
            m.be.matmul(ff.input_rows(t_n, rows), cat, self.w_eh, m.state.scratch)  # z: the pass's input rows
            logits = ff.run(toks, pos0, self.cache, rows)
            return (logits.copy() if rows_out else None), ff.hidden(t_n).copy()
        m.begin(toks, pos0, self.cache)
        s = m.state
        m.be.matmul(s.x[:t_n], cat, self.w_eh, s.scratch)  # z: in place of the embedding
        m.be.rmsnorm(s.xb[:t_n], s.x[:t_n], m.layers[0].attn_norm, self.eps)
        for ph in LAYER_PHASES:  # engine.forward's layer walk, one layer
            m.phase(ph, 0)
            m.tail(ph, 0)
        self.cache.length = pos0 + t_n
        hidden = m.be.to_host(s.x[:t_n])
        return (m.head(rows_out) if rows_out else None), hidden

    def token(self, j: int) -> int:
        """The token of head row j."""
        return int(j) if self.hot_ids is None else int(self.hot_ids[j])


def _fused_step(model):
    """The cpu fused step over the block's one-layer model, its input rows given (no embedding); None where
    the step does not take these weights."""
    from ..backends.cpu.step import build
    ff = build(model)
    if ff is not None:
        from ..backends.cpu.step_mm import GIVEN
        ff.emb = (GIVEN,) + tuple(ff.emb[1:])  # the caller writes the pass's input rows into x
        ff.guard = _FollowTarget()
    return ff


class _FollowTarget:
    """The drafter's guard (step.FusedForward's `guard`): its passes run on the thread count the target's
    step left. A ContentionGuard of its own set numba's thread count behind the target's guard, which keeps
    its own record of the mode it set: the target's verify passes then ran on one thread."""

    def before(self) -> None:
        pass

    def after(self, steps: int = 1) -> None:
        pass

    def full_threads(self) -> None:
        pass

    def block_limit(self) -> int:
        return 1 << 30


class MTPDrafter:
    """engine.spec.base.Drafter over an MTPBlock. Keeps the block's cache of first-step pairs in step with
    what the target was fed (`observe`), drafts by recursive steps from the last fed position (`propose`).

    The pairs `observe` learns are run with the next proposal's first step, in one pass (the last row's
    logits are the first draft): the first step's pair (h of the last fed position, the last context token)
    is itself a true pair, kept in the cache, so a round's block passes are its k drafts and nothing else."""

    name = "mtp"

    @property
    def calibration_key(self):
        """The network whose confidences these are (engine.spec.adaptive.shared_calibration)."""
        return self.block

    def __init__(self, block: MTPBlock, last_layer: int):
        self.block = block
        self.last = last_layer
        self.features_needed = (last_layer,)
        self.reset()

    def reset(self) -> None:
        self.confidence: list[float] = []  # the drafter's probability of each draft of the last propose
        self.stop_below = 0.0  # stop drafting once the product of the confidences is below (set by adaptive)
        self.block.cache.truncate(0)
        self.n = 0  # block cache positions holding true first-step pairs
        self.feed_g: list[np.ndarray] = []  # true pairs known, not yet run (the next proposal runs them)
        self.feed_y: list[int] = []
        self.pending: np.ndarray | None = None  # (d,) target hidden of the last fed position (its pair needs
        #                                         the token after it: known at the next observe / propose)
        self.done_y: int | None = None  # the last proposal ran the pair (pending, done_y) at position n - 1

    def observe(self, tokens: Sequence[int], features: Features | None) -> None:
        if not tokens:
            return
        if features is None or self.last not in features:  # fed without features: the context is lost
            self.reset()
            return
        h = np.asarray(features[self.last], np.float32)  # (len(tokens), d)
        toks = [int(t) for t in tokens]
        if self.pending is not None and self.done_y == toks[0]:  # that pair is in the cache already
            gs, ys = h[:-1], toks[1:]
        else:
            if self.done_y is not None:  # (another token was fed after the proposal: run the pair again)
                self.n -= 1
            gs, ys = (np.concatenate([self.pending[None], h[:-1]]), toks) if self.pending is not None \
                else (h[:-1], toks[1:])
        self.done_y = None
        if self.n + len(self.feed_y) + len(ys) + 1 > self.block.cache.capacity:  # the target's context is full
            self.reset()
            return
        self.feed_g.append(gs)
        self.feed_y.extend(ys)
        self.pending = h[-1]
        if len(self.feed_y) >= MAX_ROWS:  # a long prompt: run whole chunks now (memory stays bounded)
            self._run_feed(len(self.feed_y) // MAX_ROWS * MAX_ROWS)

    def _run_feed(self, n_rows: int, head: tuple[np.ndarray, int] | None = None):
        """Run the first n_rows pairs of the feed (whole MAX_ROWS chunks but the last), then `head` (g (d,),
        y) as the last row of the last pass; its (logits row, hidden row), or None without it."""
        gs = np.concatenate(self.feed_g) if self.feed_g else np.zeros((0, self.block.enorm.shape[0]), np.float32)
        ys = self.feed_y
        rest_g, rest_y = gs[n_rows:], ys[n_rows:]
        gs, ys = gs[:n_rows], ys[:n_rows]
        if head is not None:
            gs, ys = np.concatenate([gs, head[0][None]]), ys + [head[1]]
        self.block.cache.truncate(self.n)  # drop the last proposal's speculative steps
        out = None
        for i in range(0, len(ys), MAX_ROWS):
            last = head is not None and i + MAX_ROWS >= len(ys)
            logits, hidden = self.block.run(ys[i:i + MAX_ROWS], gs[i:i + MAX_ROWS], self.n, 1 if last else 0)
            self.n += len(ys[i:i + MAX_ROWS])
            if last:
                out = (logits[0], hidden[-1:])
        self.feed_g, self.feed_y = ([rest_g] if len(rest_y) else []), list(rest_y)
        return out

    def propose(self, context_tokens: Sequence[int], k: int, features: Features | None) -> list[int]:
        self.confidence: list[float] = []
        if self.pending is None or k <= 0 or not context_tokens:
            return []
        if self.done_y is not None:  # proposed again without an observe between: run that pair again
            self.n -= 1
            self.done_y = None
        k = min(k, self.block.cache.capacity - self.n - len(self.feed_y))
        if k <= 0:
            return []
        y0 = int(context_tokens[-1])
        logits, g = self._run_feed(len(self.feed_y), (self.pending, y0))
        self.done_y = y0
        y = self.block.token(int(np.argmax(logits)))
        out, self.confidence = [y], [top_probability(logits)]
        sure = self.confidence[0]  # the chance that every draft so far is right, by the drafter's own account
        for s in range(1, k):
            if sure < self.stop_below:  # the next drafts would not be verified (engine.spec.adaptive)
                break
            logits, g = self.block.run([y], g, self.n + s - 1)
            y = self.block.token(int(np.argmax(logits[0])))
            out.append(y)
            self.confidence.append(top_probability(logits[0]))
            sure *= self.confidence[-1]
        return out


def unavailable_reason(model_path: str | None) -> str | None:
    """None when a drafter file for this model is installed, else why not (one line)."""
    return find(FORMAT, VERSION, model_path)[1]


def make_drafter(model=None, model_path: str | None = None, *, lm_head_draft: bool = False,
                 adaptive: bool = True, capacity: int | None = None, **_options):
    """Registry entry (engine.spec.base). lm_head_draft: draft over the hot vocabulary's head rows;
    adaptive: draft only as many tokens as pay for their verify cost (engine.spec.adaptive)."""
    block, last = kept_network(_BLOCKS, "mtp", FORMAT, VERSION, model_path, WEIGHTS, (lm_head_draft, capacity),
                               lambda df, target: (MTPBlock(df, target, capacity or target.args.context_length,
                                                            hot=lm_head_draft), target.args.n_layer - 1))
    drafter = MTPDrafter(block, last)  # reset(): the block's cache starts empty
    if not adaptive:
        return drafter
    from .adaptive import AdaptiveLength, shared_costs
    return AdaptiveLength(drafter, draft_fixed=1.0, **shared_costs(model, "mtp"))
