"""The MTP drafter as a torch module (DeepSeek-V3 style, recursive), trained unrolled over `steps` steps.

One step at position p takes a pair (g, y): g = the target's last-layer hidden h_p (first step) or the
previous step's output hidden, y = the token at p+1; it predicts the token at p+2:

    a = rmsnorm(E[y], enorm); b = rmsnorm(g, hnorm)
    z = W_eh @ [a; b]                                   W_eh (d, 2d): columns [0:d] take a, [d:2d] take b
    u = z + Wo attn(rope(Wq n1(z)), rope(Wk n1(z)), Wv n1(z))       n1 = rmsnorm(., attn_norm)
    o = u + Wdown(silu(Wgate n2(u)) * Wup n2(u))                   n2 = rmsnorm(., ffn_norm)
    logits = H_hot @ rmsnorm(o, output_norm)            o is the next step's g

E, H_hot (the target's head rows of the hot vocabulary) and output_norm are the target's, frozen.
Attention context, as the runtime keeps it: a KV cache of FIRST-step pairs (true h_p, true x_{p+1}) at
positions 0..p. A chain drafted from p runs step s at position p+s-1; it sees the first-step keys at 0..p,
its own steps 2..s-1, and itself. RoPE and GQA as engine/backends/ref/kernels.py (neox=False: adjacent
pairs; query head h reads kv head h // (n_head / n_kv_head)); scale 1/sqrt(head_dim).

Training sees every chain of a sequence at once: step 1 is causal self-attention over the sequence;
step s >= 2 of chain p adds its own chain's keys as s-1 extra columns beside the first-step keys.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# The drafter's own tensors, in the export's names; shapes in terms of the target's (see `shapes`).
PARAM_NAMES = ("enorm", "hnorm", "w_eh", "attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up",
               "w_down")


@dataclass(frozen=True)
class MTPConfig:
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    rms_eps: float
    rope_base: float
    rope_neox: bool = False

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    def shapes(self) -> dict[str, tuple[int, ...]]:
        d, f = self.d_model, self.d_ff
        return dict(enorm=(d,), hnorm=(d,), w_eh=(d, 2 * d), attn_norm=(d,), wq=(self.q_dim, d),
                    wk=(self.kv_dim, d), wv=(self.kv_dim, d), wo=(d, self.q_dim), ffn_norm=(d,),
                    w_gate=(f, d), w_up=(f, d), w_down=(d, f))


def fake_q4_1(w: torch.Tensor) -> torch.Tensor:
    """w (rows, cols) quantized to Q4_1 and back, per 32 values of a row (as gguf.quants.quantize: values
    round((w - min) / scale) clipped to 0..15 with scale (max - min) / 15, stored scale and min f16), with
    the gradient of the identity (straight-through). engine/spec/mtp.py quantizes the block this way."""
    r, c = w.shape
    b = w.detach().reshape(r, c // 32, 32)
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.clamp(torch.trunc((b - lo) * inv + 0.5), 0, 15)
    deq = (q * d.half().float() + lo.half().float()).reshape(r, c)  # the stored scale and min are f16
    return w + (deq - w).detach()


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(cfg: MTPConfig, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (n_pos, hd/2) f32 of angle pos * base^(-2i/hd), computed in f64 as the ref kernel does."""
    inv = 1.0 / (cfg.rope_base ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
    ang = np.arange(n_pos, dtype=np.float64)[:, None] * inv[None, :]
    return torch.from_numpy(np.cos(ang).astype(np.float32)), torch.from_numpy(np.sin(ang).astype(np.float32))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """x (B, heads, P, hd) rotated; cos, sin (P, hd/2) of each row's position."""
    if neox:
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


class MTPDrafter(nn.Module):
    """The trainable drafter over the frozen target pieces: embed (vocab, d), head_hot (n_hot, d),
    output_norm (d,). `init` maps PARAM_NAMES to float32 arrays (see `init_from_target`)."""

    def __init__(self, cfg: MTPConfig, embed: np.ndarray, head_hot: np.ndarray, output_norm: np.ndarray,
                 init: dict[str, np.ndarray], qat: bool = False):
        """qat: the block's matrices (wq .. w_down) enter the forward as the runtime runs them, Q4_1
        (fake_q4_1: quantized and dequantized, the gradient passed straight through)."""
        super().__init__()
        self.cfg = cfg
        self.qat = qat
        for name, shape in cfg.shapes().items():
            w = np.asarray(init[name], np.float32)
            assert w.shape == shape, f"{name}: {w.shape} != {shape}"
            setattr(self, name, nn.Parameter(torch.from_numpy(w.copy())))
        self.register_buffer("embed", torch.from_numpy(np.asarray(embed, np.float32)), persistent=False)
        self.register_buffer("head_hot", torch.from_numpy(np.asarray(head_hot, np.float32)), persistent=False)
        self.register_buffer("output_norm", torch.from_numpy(np.asarray(output_norm, np.float32)),
                             persistent=False)

    # ------------------------------------------------------------------------------------------ pieces
    def m(self, name: str) -> torch.Tensor:
        """A block matrix as the forward uses it: fake_q4_1 of it under qat, else as it is."""
        w = getattr(self, name)
        return fake_q4_1(w) if self.qat else w

    def combine(self, g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """z (B, P, d) from g (B, P, d) and tokens y (B, P)."""
        eps = self.cfg.rms_eps
        ab = torch.cat([rmsnorm(self.embed[y], self.enorm, eps), rmsnorm(g, self.hnorm, eps)], -1)
        return ab @ self.w_eh.T

    def qkv(self, z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q (B, H, P, hd), k and v (B, H, P, hd) with kv heads repeated for their query heads (GQA)."""
        c = self.cfg
        b, p, _ = z.shape
        n1 = rmsnorm(z, self.attn_norm, c.rms_eps)
        q = (n1 @ self.m("wq").T).view(b, p, c.n_head, c.head_dim).transpose(1, 2)
        k = (n1 @ self.m("wk").T).view(b, p, c.n_kv_head, c.head_dim).transpose(1, 2)
        v = (n1 @ self.m("wv").T).view(b, p, c.n_kv_head, c.head_dim).transpose(1, 2)
        group = c.n_head // c.n_kv_head
        q, k = rope(q, cos, sin, c.rope_neox), rope(k, cos, sin, c.rope_neox)
        return q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def finish(self, z: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """o (B, P, d) from z and the attention output att (B, H, P, hd)."""
        b, _, p, _ = att.shape
        u = z + att.transpose(1, 2).reshape(b, p, -1) @ self.m("wo").T
        n2 = rmsnorm(u, self.ffn_norm, self.cfg.rms_eps)
        return u + (F.silu(n2 @ self.m("w_gate").T) * (n2 @ self.m("w_up").T)) @ self.m("w_down").T

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        """(..., n_hot) over the hot vocabulary."""
        return rmsnorm(o, self.output_norm, self.cfg.rms_eps) @ self.head_hot.T

    # ---------------------------------------------------------------------------------------- unrolled
    def forward(self, h: torch.Tensor, ys: list[torch.Tensor], valid: torch.Tensor) -> list[torch.Tensor]:
        """The output hiddens o_s (B, P, d), s = 1..len(ys), of every chain p = 0..P-1 of a batch.

        h (B, P, d): the target's h_p; ys[s-1] (B, P): the token step s of chain p takes (x_{p+s});
        valid (B, P) bool: rows that are real first-step pairs (padding rows are never attended to)."""
        c = self.cfg
        _, p, _ = h.shape
        cos, sin = rope_tables(c, p + len(ys))
        scale = 1.0 / math.sqrt(c.head_dim)
        causal = torch.ones(p, p, dtype=torch.bool).tril()  # row p sees first-step keys 0..p
        mask = causal[None, None] & valid[:, None, None, :]  # (B, 1, P, P)
        outs, own = [], []  # own: (k, v) of the chain's steps 2.. so far
        g = h
        for s, y in enumerate(ys, 1):
            z = self.combine(g, y)
            q, k, v = self.qkv(z, cos[s - 1:s - 1 + p], sin[s - 1:s - 1 + p])  # step s sits at p+s-1
            if s == 1:
                k1, v1 = k, v
            else:
                own.append((k, v))
            first = (q @ k1.transpose(-1, -2)) * scale  # (B, H, P, P)
            first = first.masked_fill(~mask, float("-inf"))
            extra = [(q * kr).sum(-1, keepdim=True) * scale for kr, _ in own]  # (B, H, P, 1) each
            att = torch.softmax(torch.cat([first] + extra, -1), -1)
            out = att[..., :p] @ v1
            for i, (_, vr) in enumerate(own):
                out = out + att[..., p + i:p + i + 1] * vr
            g = self.finish(z, out)
            outs.append(g)
        return outs


def init_from_target(cfg: MTPConfig, layer: dict[str, np.ndarray], h_rms: float, seed: int = 0,
                     a_scale: float = 0.02) -> dict[str, np.ndarray]:
    """Initial drafter weights: the block = the target's last layer (dequantized f32, keys as PARAM_NAMES),
    norms of the pair ones, W_eh = [small random | h_rms * I], so z starts near g at the residual stream's
    own scale (h_rms: the typical RMS of h)."""
    d = cfg.d_model
    rng = np.random.default_rng(seed)
    w_eh = np.concatenate([rng.normal(0, a_scale, (d, d)), h_rms * np.eye(d)], 1).astype(np.float32)
    out = {k: np.asarray(layer[k], np.float32) for k in ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm",
                                                        "w_gate", "w_up", "w_down")}
    return dict(out, enorm=np.ones(d, np.float32), hnorm=np.ones(d, np.float32), w_eh=w_eh)
