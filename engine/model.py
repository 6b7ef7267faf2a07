"""Decoder-only transformer forward pass (llama / qwen2 / qwen3) over a backend's kernels.

The model knows shapes and the order of operations only: weight layouts belong to the backend
(`prepare_weight`), memory to the backend (`empty`), the cache to `KVCache`. Per layer (pre-norm):

    h  = x + Wo . attn(rope(norm_q(Wq . n1(x) + bq)), rope(norm_k(Wk . n1(x) + bk)), Wv . n1(x) + bv)
    x' = h + Wdown . (silu(Wgate . n2(h)) * Wup . n2(h))

qwen2 adds the q/k/v biases, qwen3 the per-head RMSNorm of q and k (before RoPE); llama has neither.
The output head is `output.weight`, or the token embedding when the file ties them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .config import ModelArgs
from .errors import InputError, ModelFileError
from .kv_cache import KVCache
from .quant import QTensor, dequantize


@dataclass
class LayerWeights:
    """One transformer block, prepared by the backend. Biases / q-k norms are None when absent."""

    attn_norm: object  # (d,) f32 device array
    wq: object  # prepared (q_dim, d)
    wk: object  # prepared (kv_dim, d)
    wv: object  # prepared (kv_dim, d)
    wo: object  # prepared (d, q_dim)
    ffn_norm: object  # (d,) f32
    w_gate: object  # prepared (d_ff, d)
    w_up: object  # prepared (d_ff, d)
    w_down: object  # prepared (d, d_ff)
    bq: object = None  # (q_dim,) f32 (qwen2)
    bk: object = None  # (kv_dim,) f32
    bv: object = None  # (kv_dim,) f32
    q_norm: object = None  # (head_dim,) f32 (qwen3)
    k_norm: object = None  # (head_dim,) f32


class RunState:
    """Activation buffers for up to max_t rows, allocated once; forward uses the first T rows of each."""

    def __init__(self, be, a: ModelArgs, max_t: int):
        f32 = "float32"
        self.max_t = max_t
        self.x = be.zeros((max_t, a.d_model), f32)  # (T, d) residual stream
        self.xb = be.zeros((max_t, a.d_model), f32)  # (T, d) normed input of a sub-block
        self.q = be.zeros((max_t, a.q_dim), f32)  # (T, n_head * hd)
        self.k = be.zeros((max_t, a.kv_dim), f32)  # (T, n_kv_head * hd)
        self.v = be.zeros((max_t, a.kv_dim), f32)
        self.att = be.zeros((max_t, a.q_dim), f32)  # (T, n_head * hd) attention output
        self.proj = be.zeros((max_t, a.d_model), f32)  # (T, d) output of Wo / Wdown
        self.gate = be.zeros((max_t, a.d_ff), f32)  # (T, d_ff)
        self.up = be.zeros((max_t, a.d_ff), f32)  # (T, d_ff)
        self.hb = be.zeros((max_t, a.d_ff), f32)  # (T, d_ff) silu(gate) * up
        self.tokens = be.zeros((max_t,), "int32")  # (T,) token ids on the device
        self.scratch = be.new_scratch(max_t, max(a.d_model, a.q_dim, a.d_ff))
        self.logits = None  # (rows, vocab) f32, allocated on first use (all_logits needs T rows)



def check_forward_args(tokens, pos0: int, cache, vocab_size: int) -> np.ndarray:
    """The forward() contract, shared by every model wrapper (plain, fused CUDA, TP): tokens (T,) int32 in
    the vocabulary, T >= 1, a cache holding exactly pos0 tokens with room for T more."""
    tokens = np.asarray(tokens, dtype=np.int32).reshape(-1)
    if tokens.shape[0] == 0:
        raise InputError("forward() needs at least one token")
    if cache.length != pos0:
        raise ValueError(f"cache holds {cache.length} tokens but pos0 is {pos0}; truncate it first")
    cache.check_room(pos0 + tokens.shape[0])
    bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if bad.size:
        raise InputError(f"token id {int(bad[0])} is outside the vocabulary (0..{vocab_size - 1})")
    return tokens


class Model:
    """Weights prepared for a backend + preallocated run state. See `forward`.

    Read by engine/tp.py, kernels/cpu_fast_step.py and kernels/cuda_graph.py (keep stable): args, be, layers
    (LayerWeights), tok_embd, output, output_norm, inv_freq, attn_scale, state (RunState), captured; tp.py
    runs each rank's layers through attention_partial / ffn_partial.
    """

    def __init__(self, args: ModelArgs, tensors: dict[str, QTensor], backend, max_batch: int = 64,
                 store=None):
        """max_batch: the largest T a forward call is expected to take (prefill chunk, verify block); a
        larger T grows the run state once. store: an engine.weight_store.WeightStore for a backend whose
        module prepares weights with one (cpu_fast: arrays an earlier start repacked); None: prepare all."""
        self.args, self.be = args, backend
        a, be = args, backend
        missing = [n for n in _required_names(a) if n not in tensors]
        if missing:
            raise ModelFileError(f"model is missing tensors: {', '.join(missing)}; re-download or re-convert it")

        def vec(name):  # 1-D float tensor (norm weight, bias) -> (n,) f32 on the device
            return be.to_device(dequantize(tensors[name]).reshape(-1).astype(np.float32))

        # a backend may prepare every layer's matrices at once, in a layout of its own (cpu_fast.prepare_layers)
        stacked: dict[str, object] = {}
        kw = {} if store is None else {"store": store}
        prepare_layers = getattr(getattr(be, "module", None), "prepare_layers", None)
        if prepare_layers is not None:
            stacked = prepare_layers({role: [tensors[f"blk.{i}.{role}.weight"] for i in range(a.n_layer)]
                                      for role in _STACKED_ROLES}, **kw)

        def mat(name):
            return stacked[name] if name in stacked else be.prepare_weight(tensors[name], **kw)

        self.tok_embd = mat("token_embd.weight")  # prepared (vocab, d)
        self.output = mat("output.weight") if "output.weight" in tensors else self.tok_embd  # tied head
        self.output_norm = vec("output_norm.weight")
        self.layers = []
        for i in range(a.n_layer):
            p = f"blk.{i}."
            opt = (lambda n: vec(p + n) if p + n in tensors else None)  # noqa: E731
            self.layers.append(LayerWeights(
                attn_norm=vec(p + "attn_norm.weight"), wq=mat(p + "attn_q.weight"), wk=mat(p + "attn_k.weight"),
                wv=mat(p + "attn_v.weight"), wo=mat(p + "attn_output.weight"), ffn_norm=vec(p + "ffn_norm.weight"),
                w_gate=mat(p + "ffn_gate.weight"), w_up=mat(p + "ffn_up.weight"), w_down=mat(p + "ffn_down.weight"),
                bq=opt("attn_q.bias"), bk=opt("attn_k.bias"), bv=opt("attn_v.bias"),
                q_norm=opt("attn_q_norm.weight"), k_norm=opt("attn_k_norm.weight")))
        # RoPE frequencies: pair i turns by pos * base^(-2i/hd)
        inv = 1.0 / (a.rope_base ** (np.arange(0, a.head_dim, 2, dtype=np.float64) / a.head_dim))
        self.inv_freq = be.to_device(inv.astype(np.float32))  # (hd/2,) f32
        self.attn_scale = 1.0 / math.sqrt(a.head_dim)
        self.state = RunState(be, a, max_batch)
        # a backend may run the whole forward in one call (engine/kernels/cpu_fast_step.py); None otherwise
        build_fused = getattr(getattr(be, "module", None), "build_fused", None)
        self.fused = build_fused(self) if build_fused is not None else None
        self.captured: dict[int, np.ndarray] = {}  # layer -> (T, d) host copy of its output (see forward)

    def decode_block(self, token: int, pos0: int, cache: KVCache, n: int, stop_ids: frozenset,
                     choice=None) -> list[int] | None:
        """Up to n tokens after `token` (forwarded at pos0) in one call, when the backend's one-call forward
        can choose them itself (kernels/cpu_fast_step.FusedForward.block): each chosen from the previous
        one's logits by `choice` (TokenChooser.block; None: the argmax) and forwarded next, as n forward +
        choose rounds would; stops after a token in stop_ids (returned last). The cache then holds pos0 +
        len(result). None when this model cannot, or not yet (the tiered start's first steps): the caller
        runs single forwards."""
        block = getattr(self.fused, "block", None)
        if block is None:
            return None
        check_forward_args([token], pos0, cache, self.args.vocab_size)
        cache.check_room(pos0 + n)
        return block(int(token), pos0, cache, n, stop_ids, choice)

    def new_cache(self, capacity: int, kv_dtype: str = "f16") -> KVCache:
        """An empty KV cache for this model holding up to `capacity` positions."""
        a = self.args
        return KVCache(self.be, a.n_layer, capacity, a.n_kv_head, a.head_dim, kv_dtype)

    def forward(self, tokens, pos0: int, cache: KVCache, *, all_logits: bool = False,
                capture: tuple[int, ...] = ()) -> np.ndarray:
        """Run tokens (T,) at positions pos0..pos0+T-1 in ONE batched pass; returns logits f32 on the host:
        (T, vocab) if all_logits (verify / teacher forcing), else (1, vocab) for the last position.

        The cache must hold exactly pos0 tokens before the call; it holds pos0+T after. capture: layer ids
        whose output hidden state (the residual stream after that block, (T, d)) is copied into
        `self.captured[layer]` (for drafters).
        """
        a, be = self.args, self.be
        tokens = check_forward_args(tokens, pos0, cache, a.vocab_size)
        t_n = tokens.shape[0]
        if self.fused is not None and not capture:
            self.captured = {}
            return self.fused.run(tokens, pos0, cache, t_n if all_logits else 1).copy()
        if t_n > self.state.max_t:
            self.state = RunState(be, a, t_n)
        s = self.state
        tok = s.tokens[:t_n]
        be.upload(tok, tokens)
        x, xb = s.x[:t_n], s.xb[:t_n]
        be.embed(x, self.tok_embd, tok)
        self.captured = {}
        for i, lw in enumerate(self.layers):
            self.attention_partial(lw, cache.layer(i), cache.kv_dtype, t_n, pos0)
            be.residual_add(x, s.proj[:t_n])
            self.ffn_partial(lw, t_n)
            be.residual_add(x, s.proj[:t_n])
            if i in capture:
                self.captured[i] = be.to_host(x)
        cache.length = pos0 + t_n
        rows = t_n if all_logits else 1
        if s.logits is None or s.logits.shape[0] < rows:
            s.logits = be.zeros((rows, a.vocab_size), "float32")
        logits = s.logits[:rows]
        src = x if all_logits else x[t_n - 1:t_n]
        be.rmsnorm(xb[:rows], src, self.output_norm, a.rms_eps)
        be.matmul(logits, xb[:rows], self.output, s.scratch)
        return be.to_host(logits)

    def attention_partial(self, lw: LayerWeights, kv: tuple, kv_dtype: str, t_n: int, pos0: int):
        """A layer's attention block up to its output projection, into state.proj[:t_n] (T, d); the caller
        adds it to the residual stream (forward; engine/tp.py after summing the ranks' partial sums)."""
        a, be, s = self.args, self.be, self.state
        x, xb = s.x[:t_n], s.xb[:t_n]
        q, k, v = s.q[:t_n], s.k[:t_n], s.v[:t_n]
        be.rmsnorm(xb, x, lw.attn_norm, a.rms_eps)
        be.matmul(q, xb, lw.wq, s.scratch)
        be.matmul(k, xb, lw.wk, s.scratch)
        be.matmul(v, xb, lw.wv, s.scratch)
        if lw.bq is not None:
            be.bias_add(q, lw.bq)
            be.bias_add(k, lw.bk)
            be.bias_add(v, lw.bv)
        if lw.q_norm is not None:  # qwen3: RMSNorm over each head, in place
            qh, kh = q.reshape(t_n * a.n_head, a.head_dim), k.reshape(t_n * a.n_kv_head, a.head_dim)
            be.rmsnorm(qh, qh, lw.q_norm, a.rms_eps)
            be.rmsnorm(kh, kh, lw.k_norm, a.rms_eps)
        q3 = q.reshape(t_n, a.n_head, a.head_dim)  # (T, H, hd)
        k3 = k.reshape(t_n, a.n_kv_head, a.head_dim)  # (T, n_kv, hd)
        v3 = v.reshape(t_n, a.n_kv_head, a.head_dim)
        be.rope(q3, pos0, self.inv_freq, a.rope_neox)
        be.rope(k3, pos0, self.inv_freq, a.rope_neox)
        att3 = s.att[:t_n].reshape(t_n, a.n_head, a.head_dim)
        if kv_dtype == "f16":
            be.kv_store_f16(*kv, k3, v3, pos0)
            be.attention_f16(att3, q3, *kv, pos0, self.attn_scale)
        else:
            be.kv_store_int8(*kv, k3, v3, pos0)
            be.attention_int8(att3, q3, *kv, pos0, self.attn_scale)
        be.matmul(s.proj[:t_n], s.att[:t_n], lw.wo, s.scratch)

    def ffn_partial(self, lw: LayerWeights, t_n: int):
        """A layer's feed-forward block, into state.proj[:t_n] (T, d); the caller adds it (as above)."""
        a, be, s = self.args, self.be, self.state
        xb = s.xb[:t_n]
        be.rmsnorm(xb, s.x[:t_n], lw.ffn_norm, a.rms_eps)
        be.matmul(s.gate[:t_n], xb, lw.w_gate, s.scratch)
        be.matmul(s.up[:t_n], xb, lw.w_up, s.scratch)
        be.swiglu(s.hb[:t_n], s.gate[:t_n], s.up[:t_n])
        be.matmul(s.proj[:t_n], s.hb[:t_n], lw.w_down, s.scratch)


_STACKED_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _required_names(a: ModelArgs) -> list[str]:
    names = ["token_embd.weight", "output_norm.weight"]
    per = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    if a.qkv_bias:
        per_b = ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
    else:
        per_b = []
    if a.qk_norm:
        per_b += ["attn_q_norm.weight", "attn_k_norm.weight"]
    for i in range(a.n_layer):
        names += [f"blk.{i}.{n}.weight" for n in per] + [f"blk.{i}.{n}" for n in per_b]
    return names
