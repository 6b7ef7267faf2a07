"""Fused forward pass for a cuda-backend Model: fewer, larger launches (launch overhead decides small models).

engine.forward's layer walk with fused kernels: per layer, instead of 15 launches (`engine.model.Model`):

    rmsnorm | matmul Wqkv (Wq, Wk, Wv rows concatenated) | rope_qkv (bias + RoPE of q and k, v copied; k and
    v stored into an f16 cache too: an int8 cache adds kv_store) | attention (split + combine on long caches)
    | matmul Wo with `x +=` epilogue | rmsnorm | matmul Wgate/up (rows interleaved) with silu(gate) * up
    epilogue | matmul Wdown with `x +=`

= 8 launches with an f16 cache (9 with split attention, +1 with int8); ~245 per SmolLM2 token instead of
~455. Same arithmetic as the plain path except the order of the residual sums, so logits agree to rounding.
The concatenated weights are built once from the prepared ones (same device format required; otherwise
`FusedModel.supported` says why not).
qwen3's per-head q/k RMSNorm has no fused kernel: such models run plainly.
"""
from __future__ import annotations

import numpy as np

from ...forward import ATTENTION, DOWN, GATE_UP, O, QKV, OverModel, walk
from ...model import check_forward_args
from . import kernels as ck
from .quant import CudaWeight


def _concat(ws: list[CudaWeight], interleave: bool = False) -> CudaWeight:
    """Rows of ws stacked (or interleaved row by row: w0[0], w1[0], w0[1], ...) into one device weight."""
    w0 = ws[0]
    arrays = []
    for parts in zip(*(w.arrays for w in ws)):
        host = [p.copy_to_host() for p in parts]  # load time only
        if interleave:
            a = np.stack(host, axis=1).reshape(-1, host[0].shape[1])
        else:
            a = np.concatenate(host, axis=0)
        arrays.append(ck.to_device(a))
    rows = sum(w.shape[0] for w in ws)
    return CudaWeight(w0.name, w0.qtype, (rows, w0.shape[1]), w0.fmt, tuple(arrays), w0.group)


def _why_not(model) -> str | None:
    a = model.args
    if getattr(model.be, "name", "") != "cuda":
        return "not the cuda backend"
    if a.qk_norm:
        return "per-head q/k RMSNorm (qwen3) has no fused kernel"
    if ck.LAUNCH.rows % 2:
        return "the gate/up epilogue needs an even number of rows per block"
    for lw in model.layers:
        for group in ((lw.wq, lw.wk, lw.wv), (lw.w_gate, lw.w_up)):
            if len({(w.fmt, w.group, w.arrays[0].dtype, w.shape[1]) for w in group}) != 1:
                return f"{group[0].name}: the weights to fuse have different device formats"
    return None


class FusedLayer:
    """Concatenated weights of one layer."""

    def __init__(self, lw):
        self.qkv = _concat([lw.wq, lw.wk, lw.wv])  # (q_dim + 2 kv_dim, d)
        self.gate_up = _concat([lw.w_gate, lw.w_up], interleave=True)  # (2 d_ff, d): gate i, up i, ...
        if lw.bq is not None:
            self.bias = ck.to_device(np.concatenate([b.copy_to_host() for b in (lw.bq, lw.bk, lw.bv)]))
        else:
            self.bias = None


class FusedModel(OverModel):
    """engine.forward's layer walk over a cuda Model with the fused kernels (a runner). Check `supported`
    first."""

    def __init__(self, model):
        super().__init__(model)
        self.n_layer = model.args.n_layer
        self.why_not = _why_not(model)
        self.supported = self.why_not is None
        if not self.supported:
            return
        a = model.args
        self.layers = [FusedLayer(lw) for lw in model.layers]
        self.d_qkv = a.q_dim + 2 * a.kv_dim
        self.qkv = ck.zeros((model.state.max_t, self.d_qkv), "float32")  # (T, q_dim + 2 kv_dim)
        self.no_bias = ck.zeros((1,), "float32")
        self.no_cache = ck.zeros((1, 1, 1), "float16")  # rope_qkv's cache arguments when it stores none

    def forward(self, tokens, pos0: int, cache, *, all_logits: bool = False, capture: tuple[int, ...] = ()):
        """As `Model.forward`."""
        tokens = check_forward_args(tokens, pos0, cache, self.args.vocab_size)
        self.model.captured = {}
        return walk(self, tokens, pos0, cache, tokens.shape[0] if all_logits else 1, capture)

    # ---- engine.forward.LayerOps: the matmuls carry their tails' residual sums and swiglu as epilogues
    def begin(self, tokens, pos0: int, cache) -> None:
        m, t_n = self.model, tokens.shape[0]
        if t_n > m.state.max_t:
            self.qkv = ck.zeros((t_n, self.d_qkv), "float32")
        m.begin(tokens, pos0, cache)  # regrows the run state, uploads the tokens
        self.t_n, self.pos0, self.cache = t_n, pos0, cache

    def embed(self) -> None:
        self.model.embed()

    def phase(self, ph, layer: int) -> None:
        m, a, s, t_n = self.model, self.args, self.model.state, self.t_n
        lw, fl = m.layers[layer], self.layers[layer]
        if ph.kind == QKV:
            ck.matmul_epi(self.qkv[:t_n], s.xb[:t_n], fl.qkv, 0)
        elif ph.kind == ATTENTION:
            q3 = s.q[:t_n].reshape(t_n, a.n_head, a.head_dim)  # (T, H, hd)
            att3 = s.att[:t_n].reshape(t_n, a.n_head, a.head_dim)
            kv = self.cache.layer(layer)
            attend = ck.attention_f16 if self.cache.kv_dtype == "f16" else ck.attention_int8
            attend(att3, q3, *kv, self.pos0, m.attn_scale)
        elif ph.kind == O:
            ck.matmul_epi(s.x[:t_n], s.att[:t_n], lw.wo, 1)  # x += att Wo^T (the tail's residual sum)
        elif ph.kind == GATE_UP:
            ck.matmul_epi(s.hb[:t_n], s.xb[:t_n], fl.gate_up, 2)  # hb = silu(gate) * up (the tail)
        else:
            ck.matmul_epi(s.x[:t_n], s.hb[:t_n], lw.w_down, 1)  # x += hb Wdown^T

    def tail(self, ph, layer: int) -> None:
        m, a, s, t_n = self.model, self.args, self.model.state, self.t_n
        if ph.kind == QKV:  # biases + RoPE of q and k, v copied out of the concatenated rows; the KV store
            q3 = s.q[:t_n].reshape(t_n, a.n_head, a.head_dim)  # (T, H, hd)
            k3 = s.k[:t_n].reshape(t_n, a.n_kv_head, a.head_dim)  # (T, n_kv, hd)
            v3 = s.v[:t_n].reshape(t_n, a.n_kv_head, a.head_dim)
            fl = self.layers[layer]
            has_bias = fl.bias is not None
            f16 = self.cache.kv_dtype == "f16"
            kc, vc = self.cache.layer(layer)[:2] if f16 else (self.no_cache, self.no_cache)
            ck._launch("rope_qkv", ck._elt_grid(t_n * (a.n_head + a.n_kv_head) * a.head_dim // 2), ck.LAUNCH.elt,
                       q3, k3, v3, self.qkv[:t_n], fl.bias if has_bias else self.no_bias, int(has_bias),
                       *ck._pos_args(self.pos0), m.inv_freq, int(bool(a.rope_neox)), kc, vc, int(f16))
            if not f16:  # an f16 cache was written by rope_qkv itself
                ck.kv_store_int8(*self.cache.layer(layer), k3, v3, self.pos0)
        elif ph.kind == O:
            ck.rmsnorm(s.xb[:t_n], s.x[:t_n], m.layers[layer].ffn_norm, a.rms_eps)
        elif ph.kind == DOWN and layer + 1 < self.n_layer:
            ck.rmsnorm(s.xb[:t_n], s.x[:t_n], m.layers[layer + 1].attn_norm, a.rms_eps)

    def capture(self, layer: int) -> None:
        self.model.capture(layer)

    def head(self, rows_out: int):
        return self.model.head(rows_out)
