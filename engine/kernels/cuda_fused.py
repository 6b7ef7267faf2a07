"""Fused forward pass for a cuda-backend Model: fewer, larger launches (launch overhead decides small models).

Per layer, instead of 15 launches (`engine.model.Model.forward`):

    rmsnorm | matmul Wqkv (Wq, Wk, Wv rows concatenated) | rope_qkv (bias + RoPE of q and k, v copied)
    | kv_store | attention (split + combine on long caches) | matmul Wo with `x +=` epilogue
    | rmsnorm | matmul Wgate/up (rows interleaved) with silu(gate) * up epilogue | matmul Wdown with `x +=`

= 9 launches (10 with split attention); ~275 per SmolLM2 token instead of ~455. Same arithmetic as the plain
path except the order of the residual sums, so logits agree to rounding. The concatenated weights are built
once from the prepared ones (same device format required; otherwise `FusedModel.supported` says why not).
qwen3's per-head q/k RMSNorm has no fused kernel: such models run plainly.
"""
from __future__ import annotations

import numpy as np

from ..model import RunState, check_forward_args
from . import cuda as ck
from .cuda_quant import CudaWeight


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


class FusedModel:
    """The `Model` interface over a cuda Model, running the fused kernel sequence. Check `supported` first."""

    def __init__(self, model):
        self.model = model
        self.why_not = _why_not(model)
        self.supported = self.why_not is None
        if not self.supported:
            return
        a = model.args
        self.layers = [FusedLayer(lw) for lw in model.layers]
        self.d_qkv = a.q_dim + 2 * a.kv_dim
        self.qkv = ck.zeros((model.state.max_t, self.d_qkv), "float32")  # (T, q_dim + 2 kv_dim)
        self.no_bias = ck.zeros((1,), "float32")

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, tokens, pos0: int, cache, *, all_logits: bool = False, capture: tuple[int, ...] = ()):
        """As `Model.forward`."""
        m, a, be = self.model, self.model.args, ck
        tokens = check_forward_args(tokens, pos0, cache, a.vocab_size)
        t_n = tokens.shape[0]
        if t_n > m.state.max_t:
            m.state = RunState(m.be, a, t_n)
            self.qkv = ck.zeros((t_n, self.d_qkv), "float32")
        s = m.state
        be.upload(s.tokens[:t_n], tokens)
        x, xb = s.x[:t_n], s.xb[:t_n]
        be.embed(x, m.tok_embd, s.tokens[:t_n])
        q3 = s.q[:t_n].reshape(t_n, a.n_head, a.head_dim)  # (T, H, hd)
        k3 = s.k[:t_n].reshape(t_n, a.n_kv_head, a.head_dim)  # (T, n_kv, hd)
        v3 = s.v[:t_n].reshape(t_n, a.n_kv_head, a.head_dim)
        att = s.att[:t_n]
        att3 = att.reshape(t_n, a.n_head, a.head_dim)
        qkv = self.qkv[:t_n]
        m.captured = {}
        for i, (lw, fl) in enumerate(zip(m.layers, self.layers)):
            kv = cache.layer(i)
            be.rmsnorm(xb, x, lw.attn_norm, a.rms_eps)
            be.matmul_epi(qkv, xb, fl.qkv, 0)
            has_bias = fl.bias is not None
            be._launch("rope_qkv", be._elt_grid(t_n * (a.n_head + a.n_kv_head) * a.head_dim // 2), be.LAUNCH.elt,
                       q3, k3, v3, qkv, fl.bias if has_bias else self.no_bias, int(has_bias),
                       *be._pos_args(pos0), m.inv_freq, int(bool(a.rope_neox)))
            if cache.kv_dtype == "f16":
                be.kv_store_f16(*kv, k3, v3, pos0)
                be.attention_f16(att3, q3, *kv, pos0, m.attn_scale)
            else:
                be.kv_store_int8(*kv, k3, v3, pos0)
                be.attention_int8(att3, q3, *kv, pos0, m.attn_scale)
            be.matmul_epi(x, att, lw.wo, 1)  # x += att Wo^T
            be.rmsnorm(xb, x, lw.ffn_norm, a.rms_eps)
            be.matmul_epi(s.hb[:t_n], xb, fl.gate_up, 2)  # hb = silu(gate) * up
            be.matmul_epi(x, s.hb[:t_n], lw.w_down, 1)  # x += hb Wdown^T
            if i in capture:
                m.captured[i] = be.to_host(x)
        cache.length = pos0 + t_n
        rows = t_n if all_logits else 1
        if s.logits is None or s.logits.shape[0] < rows:
            s.logits = be.zeros((rows, a.vocab_size), "float32")
        logits = s.logits[:rows]
        be.rmsnorm(xb[:rows], x if all_logits else x[t_n - 1:t_n], m.output_norm, a.rms_eps)
        be.matmul(logits, xb[:rows], m.output, s.scratch)
        return be.to_host(logits)
