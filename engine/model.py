"""Decoder-only transformer (llama / qwen2 / qwen3): its weights on a backend's kernels, and the plain runner.

`Model` holds the weights prepared by a kernel set and walks engine.forward's phases one kernel call at a
time (its `LayerOps`). It knows shapes and the order of operations only: weight layouts belong to the
backend (`prepare_weight`), memory to the backend (`empty`), the cache to `KVCache`. Per layer (pre-norm):

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
from .forward import ATTENTION, DOWN, GATE_UP, O, QKV, Phase, walk
from .kv_cache import KVCache
from .logits_copies import LogitsCopies
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


def rope_inv_freq(head_dim: int, base: float) -> np.ndarray:
    """RoPE's frequencies (hd/2,) f32: pair i turns by pos * base^(-2i/hd) (computed in float64)."""
    return (1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))).astype(np.float32)


class Model:
    """Weights prepared by a backend's kernels + preallocated run state: the plain runner, which walks the
    forward (engine.forward.walk) calling one kernel at a time. See `forward`.

    Other runners build on it: the CPU fused step reads its prepared weights, the CUDA fused sequence and
    graphs run its layers, TP ranks are Models of their shards (each rank walks the same phases)."""

    def __init__(self, args: ModelArgs, tensors: dict[str, QTensor], backend, max_batch: int = 64,
                 store=None, stacked: dict | None = None):
        """backend: an engine.backends.kernels.Kernels (the kernel set and memory of one device kind).
        max_batch: the largest T a forward call is expected to take (prefill chunk, verify block); a
        larger T grows the run state once. stacked: {tensor name: prepared weight} a backend prepared in a
        layout of its own (the CPU backend's role stacks); the others are prepared one by one here, with
        `store` (a backend's cache of prepared arrays) when given."""
        self.args, self.be = args, backend
        # where a host backend's passes leave their logits (Model.head, cpu's CpuRunner); a device's go to_host
        self.logit_rows = LogitsCopies() if getattr(backend, "on_host", False) else None
        a, be = args, backend
        missing = [n for n in _required_names(a) if n not in tensors]
        if missing:
            raise ModelFileError(f"model is missing tensors: {', '.join(missing)}; re-download or re-convert it")

        def vec(name):  # 1-D float tensor (norm weight, bias) -> (n,) f32 on the device
            return be.to_device(dequantize(tensors[name]).reshape(-1).astype(np.float32))

        stacked = stacked or {}
        kw = {} if store is None else {"store": store}

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
        self.n_layer = a.n_layer
        self.inv_freq = be.to_device(rope_inv_freq(a.head_dim, a.rope_base))  # (hd/2,) f32
        self.attn_scale = 1.0 / math.sqrt(a.head_dim)
        self.state = RunState(be, a, max_batch)
        self.captured: dict[int, np.ndarray] = {}  # layer -> (T, d) host copy of its output (see forward)
        self._pass = (0, 0, None)  # (T, pos0, cache) of the pass being walked

    def decode_block(self, token: int, pos0: int, cache: KVCache, n: int, stop_ids: frozenset,
                     choice=None, capture: tuple[int, ...] = (), triggers=None) -> list[int] | None:
        """None: the plain runner chooses no tokens itself (the reply loop runs single forwards)."""
        return None

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
        tokens = check_forward_args(tokens, pos0, cache, self.args.vocab_size)
        t_n = tokens.shape[0]
        self.captured = {}
        return walk(self, tokens, pos0, cache, t_n if all_logits else 1, capture)

    # ---- engine.forward.LayerOps: one kernel call at a time
    def begin(self, tokens, pos0: int, cache) -> None:
        t_n = tokens.shape[0]
        if t_n > self.state.max_t:
            self.state = RunState(self.be, self.args, t_n)
        self.be.upload(self.state.tokens[:t_n], tokens)
        self._pass = (t_n, pos0, cache)

    def embed(self) -> None:
        be, s, t_n = self.be, self.state, self._pass[0]
        be.embed(s.x[:t_n], self.tok_embd, s.tokens[:t_n])
        be.rmsnorm(s.xb[:t_n], s.x[:t_n], self.layers[0].attn_norm, self.args.rms_eps)

    def phase(self, ph: Phase, layer: int) -> None:
        be, s = self.be, self.state
        t_n, pos0, cache = self._pass
        if ph.kind == ATTENTION:
            a = self.args
            q3 = s.q[:t_n].reshape(t_n, a.n_head, a.head_dim)  # (T, H, hd)
            att3 = s.att[:t_n].reshape(t_n, a.n_head, a.head_dim)
            kv = cache.layer(layer)
            if cache.kv_dtype == "f16":
                be.attention_f16(att3, q3, *kv, pos0, self.attn_scale)
            else:
                be.attention_int8(att3, q3, *kv, pos0, self.attn_scale)
            return
        lw = self.layers[layer]
        src = getattr(s, ph.src)[:t_n]
        for role, dst in zip(ph.roles, ph.dst):
            be.matmul(getattr(s, dst)[:t_n], src, getattr(lw, role), s.scratch)

    def tail(self, ph: Phase, layer: int) -> None:
        a, be, s = self.args, self.be, self.state
        t_n, pos0, cache = self._pass
        lw = self.layers[layer]
        x, xb = s.x[:t_n], s.xb[:t_n]
        if ph.kind == QKV:
            q, k, v = s.q[:t_n], s.k[:t_n], s.v[:t_n]
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
            store = be.kv_store_f16 if cache.kv_dtype == "f16" else be.kv_store_int8
            store(*cache.layer(layer), k3, v3, pos0)
        elif ph.kind == O:
            be.residual_add(x, s.proj[:t_n])
            be.rmsnorm(xb, x, lw.ffn_norm, a.rms_eps)
        elif ph.kind == GATE_UP:
            be.swiglu(s.hb[:t_n], s.gate[:t_n], s.up[:t_n])
        elif ph.kind == DOWN:
            be.residual_add(x, s.proj[:t_n])
            if layer + 1 < a.n_layer:
                be.rmsnorm(xb, x, self.layers[layer + 1].attn_norm, a.rms_eps)

    def capture(self, layer: int) -> None:
        self.captured[layer] = self.be.to_host(self.state.x[:self._pass[0]])

    def head(self, rows_out: int) -> np.ndarray:
        """Output norm + head of the last rows_out rows (host copy)."""
        logits = self.head_device(rows_out)
        return self.logit_rows.copy(logits) if self.logit_rows is not None else self.be.to_host(logits)

    def head_device(self, rows_out: int):
        """The head's logits (rows_out, vocab) in the run state's device buffer (TP gathers them)."""
        a, be, s = self.args, self.be, self.state
        t_n = self._pass[0]
        if s.logits is None or s.logits.shape[0] < rows_out:
            s.logits = be.zeros((rows_out, a.vocab_size), "float32")
        logits = s.logits[:rows_out]
        be.rmsnorm(s.xb[:rows_out], s.x[t_n - rows_out:t_n], self.output_norm, a.rms_eps)
        be.matmul(logits, s.xb[:rows_out], self.output, s.scratch)
        return logits


# GGUF tensor roles of a layer's matrices, in engine.forward.MATRIX_ROLES order
STACKED_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


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
