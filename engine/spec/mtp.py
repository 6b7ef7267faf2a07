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
is the trained hot vocabulary's rows only (a few thousand of 49,152: the draft costs a small share of a target
step); the target always verifies over the full vocabulary, so the output stays lossless.

The block runs on the cpu backend's kernels as a one-layer `engine.model.Model` (its weights quantized to
Q8_0 at load) walked phase by phase: the same layer walk as every runner (engine.forward), with z in place of
the embedding. Weights: a drafter file (engine.spec.drafter_file) keyed by the base model's sha256.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ..forward import LAYER_PHASES
from .base import Features
from .drafter_file import DrafterFile, find, load

FORMAT, VERSION = "ninfer-mtp", 1
WEIGHTS = ("enorm", "hnorm", "w_eh", "attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down",
           "hot_ids")
_GGUF_NAMES = {"attn_norm": "attn_norm.weight", "wq": "attn_q.weight", "wk": "attn_k.weight",
               "wv": "attn_v.weight", "wo": "attn_output.weight", "ffn_norm": "ffn_norm.weight",
               "w_gate": "ffn_gate.weight", "w_up": "ffn_up.weight", "w_down": "ffn_down.weight"}
MAX_ROWS = 64  # rows of one block pass (an observe of more positions runs in chunks)
_BLOCKS: dict = {}  # (drafter file, model, head, capacity) -> (MTPBlock, last layer): one reply at a time


def _draft_kernels():
    """The kernels a drafter's block runs: the cpu set (its matmuls and attention share out over numba's
    threads), or with NINFER_DRAFT_SERIAL=1 the calling thread's (_serial_kernels). Measured on a quiet
    2-core machine (bench/results-verify.md): an MTP hot-head draft step 1.42 -> 0.59 ms, a 4-row observe
    1.20 -> 0.75 ms, the same logits bit for bit."""
    import os
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
    from ..backends.cpu.fast import FastWeight, matmul, mm_q8_part, quantize_rows
    from ..quant import QK
    if not isinstance(w, FastWeight) or w.kind != "q8":
        matmul(out, x, w, scratch)
        return
    t_n, n = x.shape
    qa, sa, xs = scratch.qa[:t_n, :n], scratch.sa[:t_n, :n // QK], scratch.xs[:t_n, :n // QK]
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


def _f32(name: str, v: np.ndarray):
    from gguf import GGMLQuantizationType as QT

    from ..quant import QTensor
    v = np.ascontiguousarray(v, dtype=np.float32).reshape(-1)
    return QTensor(name, QT.F32, v.shape, v)


class MTPBlock:
    """The drafter's network: `run(tokens, g, pos0) -> (logits, hidden)` over T pairs at cache positions pos0..

    target: the target's model file (engine.gguf.ModelFile: its embedding, head and output norm);
    hot: the head over the drafter's hot vocabulary (logit j is token hot_ids[j]) instead of all rows."""

    def __init__(self, df: DrafterFile, target, capacity: int, hot: bool):
        from ..model import Model
        from ..quant import QTensor
        a, w, t = target.args, df.arrays, target.tensors
        self.eps = float(a.rms_eps)
        self.emb = t["token_embd.weight"]  # (vocab, d): rows dequantized per step (a few rows)
        head = t.get("output.weight", self.emb)
        self.hot_ids = np.asarray(w["hot_ids"], np.int64) if hot else None
        rows = head if self.hot_ids is None else QTensor(head.name, head.qtype, (len(self.hot_ids), head.shape[1]),
                                                        np.ascontiguousarray(head.data[self.hot_ids]))
        margs = dataclasses.replace(a, n_layer=1, vocab_size=rows.shape[0], qkv_bias=False, qk_norm=False,
                                    tied_embeddings=True)
        tensors = {"token_embd.weight": rows, "output_norm.weight": t["output_norm.weight"]}
        for k, gguf_name in _GGUF_NAMES.items():
            arr = w[k]
            tensors[f"blk.0.{gguf_name}"] = _f32(k, arr) if arr.ndim == 1 else _q8(k, arr)
        self.model = Model(margs, tensors, _draft_kernels(), max_batch=MAX_ROWS)  # head = the rows (tied)
        self.w_eh = self.model.be.prepare_weight(_q8("w_eh", w["w_eh"]))  # (d, 2d)
        self.enorm = np.asarray(w["enorm"], np.float32)
        self.hnorm = np.asarray(w["hnorm"], np.float32)
        self.cache = self.model.new_cache(capacity, "f16")
        self.cat = np.zeros((MAX_ROWS, 2 * a.d_model), np.float32)  # (T, 2d) [norm(E[y]); norm(g)]

    def _norm(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * w

    def run(self, tokens: Sequence[int], g: np.ndarray, pos0: int,
            head: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
        """T <= MAX_ROWS pairs (tokens[i], g[i]) at cache positions pos0..pos0+T-1 (the cache must hold pos0):
        logits (T, head rows) (None without `head`: the cache's pairs need no prediction) and output
        hidden states (T, d), host copies."""
        from ..quant import dequantize_rows
        m = self.model
        toks = np.asarray(tokens, np.int32)
        t_n, d = toks.shape[0], self.enorm.shape[0]
        e = np.stack([dequantize_rows(self.emb, int(y), int(y) + 1)[0] for y in toks])  # (T, d) E[y]
        cat = self.cat[:t_n]
        cat[:, :d] = self._norm(e, self.enorm)
        cat[:, d:] = self._norm(np.asarray(g, np.float32).reshape(t_n, d), self.hnorm)
        m.begin(toks, pos0, self.cache)
        s = m.state
        m.be.matmul(s.x[:t_n], cat, self.w_eh, s.scratch)  # z: in place of the embedding
        m.be.rmsnorm(s.xb[:t_n], s.x[:t_n], m.layers[0].attn_norm, self.eps)
        for ph in LAYER_PHASES:  # engine.forward's layer walk, one layer
            m.phase(ph, 0)
            m.tail(ph, 0)
        self.cache.length = pos0 + t_n
        hidden = m.be.to_host(s.x[:t_n])
        return (m.head(t_n) if head else None), hidden

    def token(self, j: int) -> int:
        """The token of head row j."""
        return int(j) if self.hot_ids is None else int(self.hot_ids[j])


class MTPDrafter:
    """engine.spec.base.Drafter over an MTPBlock. Keeps the block's cache of first-step pairs in step with
    what the target was fed (`observe`), drafts by recursive steps from the last fed position (`propose`)."""

    name = "mtp"

    def __init__(self, block: MTPBlock, last_layer: int, hybrid: int = 0):
        """hybrid n > 0: where the context's last n tokens occurred before (an n-gram match), draft what
        followed them (engine.spec.ngram) instead: MTP wins the first position, n-gram long continuations."""
        from .ngram import NgramDrafter
        self.block = block
        self.last = last_layer
        self.features_needed = (last_layer,)
        self.ngram = NgramDrafter(n_min=hybrid, n_max=hybrid) if hybrid > 0 else None
        self.reset()

    def reset(self) -> None:
        if self.ngram is not None:
            self.ngram.reset()
        self.block.cache.truncate(0)
        self.n = 0  # block cache positions holding true first-step pairs
        self.pending: np.ndarray | None = None  # (d,) target hidden of the last fed position (its pair needs
        #                                         the token after it: known at the next observe / propose)

    def observe(self, tokens: Sequence[int], features: Features | None) -> None:
        if not tokens:
            return
        if features is None or self.last not in features:  # fed without features: the context is lost
            self.reset()
            return
        h = np.asarray(features[self.last], np.float32)  # (len(tokens), d)
        toks = [int(t) for t in tokens]
        if self.pending is not None:
            gs, ys = np.concatenate([self.pending[None], h[:-1]]), toks
        else:
            gs, ys = h[:-1], toks[1:]
        cap = self.block.cache.capacity
        if self.n + len(ys) + 1 > cap:  # the target's context is full: nothing more to draft for
            self.reset()
            return
        self.block.cache.truncate(self.n)  # drop the last proposal's speculative steps
        for i in range(0, len(ys), MAX_ROWS):
            self.block.run(ys[i:i + MAX_ROWS], gs[i:i + MAX_ROWS], self.n, head=False)
            self.n += len(ys[i:i + MAX_ROWS])
        self.pending = h[-1]

    def propose(self, context_tokens: Sequence[int], k: int, features: Features | None) -> list[int]:
        if self.ngram is not None and k > 0:
            drafts = self.ngram.propose(context_tokens, k)
            if drafts:
                return drafts
        if self.pending is None or k <= 0 or not context_tokens:
            return []
        k = min(k, self.block.cache.capacity - self.n)
        self.block.cache.truncate(self.n)
        g, y, out = self.pending[None], int(context_tokens[-1]), []
        for s in range(k):
            logits, g = self.block.run([y], g, self.n + s)
            y = self.block.token(int(np.argmax(logits[0])))
            out.append(y)
        return out


def unavailable_reason(model_path: str | None) -> str | None:
    """None when a drafter file for this model is installed, else why not (one line)."""
    return find(FORMAT, VERSION, model_path)[1]


def make_drafter(model=None, model_path: str | None = None, *, lm_head_draft: bool = False,
                 adaptive: bool = True, capacity: int | None = None, hybrid: int = 0, **_options):
    """Registry entry (engine.spec.base). lm_head_draft: draft over the hot vocabulary's head rows;
    adaptive: draft only as many tokens as pay for their verify cost (engine.spec.adaptive); hybrid: see
    MTPDrafter."""
    from ..gguf import load_gguf
    path, why = find(FORMAT, VERSION, model_path)
    if path is None:
        from ..errors import ConfigError
        raise ConfigError(f"--spec mtp: {why}")
    key = (str(path), path.stat().st_mtime_ns, str(model_path), lm_head_draft, capacity)
    if key not in _BLOCKS:  # a reply makes its drafter; the block (weights quantized, a KV cache) is kept
        target = load_gguf(model_path)
        df = load(path, FORMAT, VERSION, model_path, WEIGHTS)
        _BLOCKS.clear()  # one model's drafter at a time
        _BLOCKS[key] = (MTPBlock(df, target, capacity or target.args.context_length, hot=lm_head_draft),
                        target.args.n_layer - 1)
    block, last = _BLOCKS[key]
    drafter = MTPDrafter(block, last, hybrid)  # reset(): the block's cache starts empty
    if not adaptive:
        return drafter
    from .adaptive import AdaptiveLength, shared_cost_table
    return AdaptiveLength(drafter, cost_table=shared_cost_table(model))
