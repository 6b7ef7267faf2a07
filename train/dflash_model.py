"""The DFlash drafter as a torch module: a block of B positions drafted in one forward, conditioned on target
features (Chen et al. 2026, "DFlash: Block Diffusion for Flash Speculative Decoding"; our own code).

A round at position a (the cache holds tokens 0..a-1; x_a is the last emitted token, not yet fed) drafts
x_{a+1}..x_{a+B-1} from one pass over the block [x_a, MASK, ..., MASK] at positions a..a+B-1:

    c_p = rmsnorm(W_fc f_p, hidden_norm)           f_p: the tapped feature row of context position p < a
                                                    (engine/spec/dflash_taps: [h_p; K_j unroped; V_j])
    z_0 = E[x_a],  z_i = m (i >= 1)                 m: a trained mask embedding; E frozen (the target's)
    per draft layer (llama block, pre-norm):
      n1 = rmsnorm(z, attn_norm)
      q = rope(Wq n1);  keys/values = [rope(Wk c_p), Wv c_p for p < a] ++ [rope(Wk n1_i), Wv n1_i for the block]
      z += Wo softmax(q K^T / sqrt(hd)) V          bidirectional inside the block, all of the context
      z += Wdown(silu(Wgate n2) * Wup n2),  n2 = rmsnorm(z, ffn_norm)
    logits_i = H_hot rmsnorm(z_i, norm)             row i >= 1 predicts x_{a+i}; H_hot: the target's head rows
                                                    of the hot vocabulary (frozen)

Context keys and values of a draft layer depend on p only, so the runtime keeps them in a KV cache (one per
draft layer) and adds the new positions of each round. RoPE and GQA as engine/backends/ref/kernels.py.
Training scores N anchors of a sequence at once: queries (N, B), keys = every context position (masked to
p < a per anchor) plus the anchor's own block.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.spec.dflash import WEIGHTS  # how the runtime holds the matrices (train.dflash_train's choices)

from .mtp_model import fake_q4_1, rmsnorm, rope, rope_tables

LAYER_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")
TOP_PARAMS = ("fc", "hidden_norm", "mask_emb", "norm")


@dataclass(frozen=True)
class DFlashConfig:
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    rms_eps: float
    rope_base: float
    rope_neox: bool
    feat_width: int  # width of a feature row (dflash_taps.Taps.width)
    n_layers: int = 1  # draft decoder layers
    block: int = 8  # B: the bonus token + B - 1 mask positions

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    def param_names(self) -> tuple[str, ...]:
        return TOP_PARAMS + tuple(f"l{i}.{k}" for i in range(self.n_layers) for k in LAYER_PARAMS)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        d, f = self.d_model, self.d_ff
        layer = {"attn_norm": (d,), "wq": (self.q_dim, d), "wk": (self.kv_dim, d), "wv": (self.kv_dim, d),
                     "wo": (d, self.q_dim), "ffn_norm": (d,), "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}
        out = {"fc": (d, self.feat_width), "hidden_norm": (d,), "mask_emb": (d,), "norm": (d,)}
        for i in range(self.n_layers):
            out.update({f"l{i}.{k}": s for k, s in layer.items()})
        return out


class DFlashDrafter(nn.Module):
    """The trainable drafter over the frozen target pieces: embed (vocab, d), head_hot (n_hot, d). `init` maps
    param_names() to float32 arrays (init_from_target).

    weights "q4_1": quantization-aware, the runtime's 4-bit form (engine/spec/dflash.py): every matrix (fc and
    the layers') enters the forward as Q4_1 (mtp_model.fake_q4_1: gguf's values, straight-through gradient)
    and the hot head rows as their Q4_1 copy (frozen). "q8_0": float, as the runtime's Q8_0 form is close to
    it."""

    def __init__(self, cfg: DFlashConfig, embed: np.ndarray, head_hot: np.ndarray, init: dict[str, np.ndarray],
                 weights: str = "q8_0"):
        super().__init__()
        if weights not in WEIGHTS:
            raise ValueError(f"weights {weights!r} is not one of {', '.join(WEIGHTS)}")
        self.cfg, self.weights = cfg, weights
        self.names = cfg.param_names()
        self.params = nn.ParameterDict()
        for name, shape in cfg.shapes().items():
            w = np.asarray(init[name], np.float32)
            assert w.shape == shape, f"{name}: {w.shape} != {shape}"
            self.params[name.replace(".", "_")] = nn.Parameter(torch.from_numpy(w.copy()))
        self.register_buffer("embed", torch.from_numpy(np.asarray(embed, np.float32)), persistent=False)
        head = torch.from_numpy(np.asarray(head_hot, np.float32))
        self.register_buffer("head_hot", fake_q4_1(head) if weights == "q4_1" else head, persistent=False)

    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "_")]

    def m(self, name: str) -> torch.Tensor:
        """Matrix parameter `name` as the runtime holds it (Q4_1-rounded for weights "q4_1")."""
        w = self.p(name)
        return fake_q4_1(w) if self.weights == "q4_1" else w

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {n: self.p(n).detach().numpy().copy() for n in self.names}

    def context(self, feats: torch.Tensor) -> torch.Tensor:
        """c (S, L, d) from feature rows (S, L, W)."""
        return rmsnorm(feats @ self.m("fc").T, self.p("hidden_norm"), self.cfg.rms_eps)

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """(..., n_hot) over the hot vocabulary."""
        return rmsnorm(z, self.p("norm"), self.cfg.rms_eps) @ self.head_hot.T

    def forward(self, feats: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                ctx_valid: torch.Tensor) -> torch.Tensor:
        """Output hiddens z (S, N, B, d) of the blocks at `anchors`.

        feats (S, L, W): feature rows of positions 0..L-1; tokens (S, L); anchors (S, N) long: block starts a
        (0 <= a < L; the context is p < a); ctx_valid (S, L) bool: real (unpadded) positions."""
        c = self.cfg
        s_n, l_n, _ = feats.shape
        n, b, hd, g = anchors.shape[1], c.block, c.head_dim, c.n_head // c.n_kv_head
        ctx = self.context(feats)
        cos, sin = rope_tables(c, l_n + b)
        blk_pos = anchors[..., None] + torch.arange(b)  # (S, N, B)
        bcos, bsin = cos[blk_pos][:, None], sin[blk_pos][:, None]  # (S, 1, N, B, hd/2)
        first = self.embed[tokens.gather(1, anchors)]  # (S, N, d) E[x_a]
        z = torch.cat([first[:, :, None], self.p("mask_emb").expand(s_n, n, b - 1, -1)], 2)  # (S, N, B, d)
        # context p visible to anchor a iff p < a (and real)
        see = (torch.arange(l_n)[None, None, :] < anchors[..., None]) & ctx_valid[:, None, :]  # (S, N, L)
        bias = torch.zeros(see.shape).masked_fill(~see, float("-inf"))[:, None, :, None, :]  # (S,1,N,1,L)
        scale = 1.0 / math.sqrt(hd)
        for i in range(c.n_layers):
            w = {k: (self.p if k.endswith("norm") else self.m)(f"l{i}.{k}") for k in LAYER_PARAMS}.__getitem__
            kc = (ctx @ w("wk").T).view(s_n, l_n, c.n_kv_head, hd).transpose(1, 2)  # (S, kvH, L, hd)
            vc = (ctx @ w("wv").T).view(s_n, l_n, c.n_kv_head, hd).transpose(1, 2)
            kc = rope(kc, cos[:l_n], sin[:l_n], c.rope_neox).repeat_interleave(g, 1)  # (S, H, L, hd)
            vc = vc.repeat_interleave(g, 1)
            n1 = rmsnorm(z, w("attn_norm"), c.rms_eps)
            q = (n1 @ w("wq").T).view(s_n, n, b, c.n_head, hd).permute(0, 3, 1, 2, 4)  # (S, H, N, B, hd)
            kb = (n1 @ w("wk").T).view(s_n, n, b, c.n_kv_head, hd).permute(0, 3, 1, 2, 4)
            vb = (n1 @ w("wv").T).view(s_n, n, b, c.n_kv_head, hd).permute(0, 3, 1, 2, 4)
            q, kb = rope(q, bcos, bsin, c.rope_neox), rope(kb, bcos, bsin, c.rope_neox)
            kb, vb = kb.repeat_interleave(g, 1), vb.repeat_interleave(g, 1)
            s_ctx = torch.einsum("shnbd,shld->shnbl", q, kc) * scale + bias  # (S, H, N, B, L)
            s_blk = (q @ kb.transpose(-1, -2)) * scale  # (S, H, N, B, B)
            att = torch.softmax(torch.cat([s_ctx, s_blk], -1), -1)
            out = torch.einsum("shnbl,shld->shnbd", att[..., :l_n], vc) + att[..., l_n:] @ vb
            z = z + out.permute(0, 2, 3, 1, 4).reshape(s_n, n, b, c.q_dim) @ w("wo").T
            n2 = rmsnorm(z, w("ffn_norm"), c.rms_eps)
            z = z + (F.silu(n2 @ w("w_gate").T) * (n2 @ w("w_up").T)) @ w("w_down").T
        return z


def init_from_target(cfg: DFlashConfig, layers: list[dict[str, np.ndarray]], output_norm: np.ndarray,
                     mask_emb: np.ndarray, seed: int = 0, out_scale: float = 0.1,
                     norm_scale: float = 0.15) -> dict[str, np.ndarray]:
    """Initial weights: draft layer i = the target layer layers[i] (dequantized, keys as LAYER_PARAMS) with its
    output projections wo and w_down scaled by out_scale (the block's rows start near their embeddings: the
    target layer, fed embedding-sized inputs, made confident garbage, init loss 15-20 nats); norm = the target's
    output norm x norm_scale (with the full norm, the tied head gives an embedding row's own token a logit
    of ~110 and the block starts sure and wrong; AdamW moves a norm weight ~lr per step, far too slowly to
    undo that); fc = [I | N(0, 0.01)] so c starts as rmsnorm(h), the last block's output; hidden_norm ones;
    mask_emb as given (a random vector of the embeddings' scale: their mean gave logits of std 30)."""
    d = cfg.d_model
    rng = np.random.default_rng(seed)
    fc = np.concatenate([np.eye(d), rng.normal(0, 0.01, (d, cfg.feat_width - d))], 1).astype(np.float32)
    out = {"fc": fc, "hidden_norm": np.ones(d, np.float32), "mask_emb": np.asarray(mask_emb, np.float32),
           "norm": np.asarray(output_norm, np.float32) * norm_scale}
    for i in range(cfg.n_layers):
        out.update({f"l{i}.{k}": np.asarray(layers[i][k], np.float32) * (out_scale if k in ("wo", "w_down") else 1)
                    for k in LAYER_PARAMS})
    return out
