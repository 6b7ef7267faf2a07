"""Numpy reference of every kernel: the specification that cpu.py and cuda.py must match.

Contract shared by ref, cpu and cuda (same names, same signatures):
- A kernel writes its result into its FIRST argument (in place where noted) and returns None. It never
  allocates an array the caller sees; buffers are allocated once by the model through the backend.
  (Numpy temporaries inside *this* module are fine: ref is about meaning, not speed.)
- Activations are float32 row-major: a batch of T rows (T = 1 for decode, T > 1 for a prefill chunk or a
  speculative verify pass). Row t of a batch sits at absolute position pos0 + t.
- Weights reach kernels only as the opaque object returned by this module's `prepare_weight(qt)`; each
  backend picks its own layout. `weight_shape(w)` gives the logical (rows, cols).
- The KV cache of one layer is position-indexed: (capacity, n_kv_head, head_dim), either float16, or int8
  quants plus float32 scales (capacity, n_kv_head, head_dim // KV_GROUP) with one scale per KV_GROUP values.
- Attention is causal over the cache: the query at position p sees cache positions 0..p (its own K/V must
  have been stored first with kv_store_*).
"""
from __future__ import annotations

import numpy as np

from ...quant import QTensor, dequantize

KV_GROUP = 32  # int8 KV cache: one float32 scale per (position, kv_head, 32 values); head_dim % 32 == 0 or
#               head_dim < 32 (then one scale per head), see kv_group()


def kv_group(head_dim: int) -> int:
    """Values per int8 KV scale for this head_dim (KV_GROUP, or head_dim when smaller / not divisible)."""
    return KV_GROUP if head_dim % KV_GROUP == 0 else head_dim


class RefWeight:
    """Reference layout: the weight dequantized once to float32 (d, n). Simple and exact, memory-hungry."""

    def __init__(self, qt: QTensor):
        self.name = qt.name
        self.qtype = qt.qtype
        self.shape = tuple(qt.shape)
        self.w = dequantize(qt).reshape(self.shape[0], -1)  # (d, n) f32


def prepare_weight(qt: QTensor) -> RefWeight:
    """Repack a file tensor into this backend's layout (called once at load time)."""
    return RefWeight(qt)


def weight_shape(w: RefWeight) -> tuple[int, int]:
    """Logical (rows, cols) = (out_features, in_features) of a prepared weight."""
    return w.shape


def new_scratch(max_t: int, max_n: int):
    """Scratch for `matmul` covering x of up to (max_t, max_n) (e.g. quantized activations). ref needs none."""
    return None


# ----------------------------------------------------------------------------------------------- linear
def matmul(out, x, w, scratch):
    """out (T, d) f32 <- x (T, n) f32 @ W (d, n)^T. One pass over W serves all T rows."""
    out[:] = x @ w.w.T


def embed(out, w, tokens):
    """out (T, n) f32 <- rows tokens (T,) int32 of the embedding table W (vocab, n)."""
    out[:] = w.w[tokens]


def bias_add(out, b):
    """out (T, n) += b (n,) f32."""
    out += b


def residual_add(out, x):
    """out (T, n) += x (T, n)."""
    out += x


# ------------------------------------------------------------------------------------------ elementwise
def rmsnorm(out, x, w, eps):
    """out (R, n) <- x (R, n) / sqrt(mean(x^2) + eps) * w (n,). R = T rows (or T*n_head for q/k norm).
    out may be x itself (the q/k norm runs in place)."""
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    out[:] = (x64 * inv * w).astype(np.float32)


def swiglu(out, gate, up):
    """out (T, f) <- silu(gate (T, f)) * up (T, f);  silu(g) = g / (1 + exp(-g))."""
    g = gate.astype(np.float64)
    out[:] = (g / (1.0 + np.exp(-g)) * up).astype(np.float32)


def rope(x, pos0, inv_freq, neox):
    """Rotate x (T, H, hd) in place; row t at position pos0 + t; inv_freq (hd/2,) f32.

    Pair i (i < hd/2) is rotated by angle (pos * inv_freq[i]). neox=False (llama GGUF, "NORM" mode, the
    converter permuted q/k for it): pairs are adjacent (x[2i], x[2i+1]). neox=True (qwen2/qwen3): pairs are
    halves (x[i], x[i + hd/2]).
    """
    t_n, _, hd = x.shape
    half = hd // 2
    pos = np.arange(pos0, pos0 + t_n, dtype=np.float64)[:, None]  # (T, 1)
    ang = pos * inv_freq.astype(np.float64)[None, :]  # (T, hd/2)
    cos = np.cos(ang)[:, None, :]  # (T, 1, hd/2)
    sin = np.sin(ang)[:, None, :]
    if neox:
        a, b = x[..., :half].astype(np.float64), x[..., half:].astype(np.float64)
        x[..., :half] = a * cos - b * sin
        x[..., half:] = a * sin + b * cos
    else:
        a, b = x[..., 0::2].astype(np.float64), x[..., 1::2].astype(np.float64)
        x[..., 0::2] = a * cos - b * sin
        x[..., 1::2] = a * sin + b * cos


def argmax(out, logits):
    """out (T,) int32 <- index of the largest value of each row of logits (T, vocab) (first on ties)."""
    out[:] = np.argmax(logits, axis=-1)


# ---------------------------------------------------------------------------------------------- KV cache
def kv_store_f16(k_cache, v_cache, k, v, pos0):
    """k_cache, v_cache (cap, n_kv, hd) f16 [pos0 : pos0+T] <- k, v (T, n_kv, hd) f32."""
    t_n = k.shape[0]
    k_cache[pos0:pos0 + t_n] = k
    v_cache[pos0:pos0 + t_n] = v


def quantize_kv_int8(x, group):
    """x (T, n_kv, hd) f32 -> (int8 quants (T, n_kv, hd), f32 scales (T, n_kv, hd//group)): symmetric,
    scale = max|x| / 127 per group, q = round-half-away(x / scale) clipped to [-127, 127]."""
    t_n, kvh, hd = x.shape
    g = x.reshape(t_n, kvh, hd // group, group).astype(np.float32)
    s = (np.max(np.abs(g), axis=-1) / np.float32(127.0)).astype(np.float32)  # (T, n_kv, hd//group)
    inv = np.where(s > 0, np.float32(1.0) / np.where(s > 0, s, 1), 0).astype(np.float32)
    y = g * inv[..., None]
    q = np.clip(np.trunc(y + np.copysign(np.float32(0.5), y)), -127, 127).astype(np.int8)
    return q.reshape(t_n, kvh, hd), s


def kv_store_int8(k_q, k_s, v_q, v_s, k, v, pos0):
    """k_q, v_q (cap, n_kv, hd) int8 and k_s, v_s (cap, n_kv, hd//g) f32 [pos0 : pos0+T] <- k, v (T, n_kv, hd)."""
    t_n, _, hd = k.shape
    group = hd // k_s.shape[-1]
    k_q[pos0:pos0 + t_n], k_s[pos0:pos0 + t_n] = quantize_kv_int8(k, group)
    v_q[pos0:pos0 + t_n], v_s[pos0:pos0 + t_n] = quantize_kv_int8(v, group)


def _attend(out, q, kf, vf, pos0, scale):
    # q (T, H, hd); kf, vf (n_ctx, n_kv, hd) f64 with n_ctx >= pos0 + T; GQA: head h uses kv head h // group.
    t_n, n_head, hd = q.shape
    group = n_head // kf.shape[1]
    for t in range(t_n):
        n_see = pos0 + t + 1  # causal: positions 0..pos0+t
        for h in range(n_head):
            kh = kf[:n_see, h // group]  # (n_see, hd)
            s = kh @ q[t, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[t, h] = (p / p.sum()) @ vf[:n_see, h // group]


def attention_f16(out, q, k_cache, v_cache, pos0, scale):
    """out (T, H, hd) <- softmax(q K^T * scale) V, causal, GQA. q (T, H, hd) f32; caches (cap, n_kv, hd) f16."""
    n = pos0 + q.shape[0]
    _attend(out, q, k_cache[:n].astype(np.float64), v_cache[:n].astype(np.float64), pos0, scale)


def dequantize_kv_int8(q, s):
    """q (N, n_kv, hd) int8, s (N, n_kv, hd//g) f32 -> (N, n_kv, hd) f64."""
    n, kvh, hd = q.shape
    g = hd // s.shape[-1]
    return (q.reshape(n, kvh, hd // g, g).astype(np.float64) * s[..., None]).reshape(n, kvh, hd)


def attention_int8(out, q, k_q, k_s, v_q, v_s, pos0, scale):
    """As attention_f16 over an int8 cache: k_q, v_q (cap, n_kv, hd) int8; k_s, v_s (cap, n_kv, hd//g) f32."""
    n = pos0 + q.shape[0]
    _attend(out, q, dequantize_kv_int8(k_q[:n], k_s[:n]), dequantize_kv_int8(v_q[:n], v_s[:n]), pos0, scale)


def quantize_query_q16(q, group):
    """q (..., hd) f32 -> its values as attn_int8_vnni multiplies them (f64): per group, d = max|x| / 127,
    hi = quantize_kv_int8's int8, lo = round(256 (x / d - hi)) clipped to +-127, x ~ (256 hi + lo) d / 256."""
    shape = q.shape
    x = q.reshape(-1, group).astype(np.float32)
    d = (np.max(np.abs(x), axis=-1) / np.float32(127.0)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1.0) / np.where(d > 0, d, 1), 0).astype(np.float32)
    y = x * inv[:, None]

    def rounded(z):
        return np.trunc(z + np.copysign(np.float32(0.5), z))
    hi = rounded(y)
    lo = np.clip(rounded((y - hi) * np.float32(256.0)), -127, 127)
    return ((256 * hi.astype(np.float64) + lo) * (d.astype(np.float64) / 256)[:, None]).reshape(shape)


def attention_int8_q16(out, q, k_q, k_s, v_q, v_s, pos0, scale):
    """attention_int8 with the query in 16 bits per value as attn_int8_vnni multiplies it
    (quantize_query_q16, the K cache's groups): the integer scores of the AVX512-VNNI kernel."""
    attention_int8(out, quantize_query_q16(q, q.shape[-1] // k_s.shape[-1]), k_q, k_s, v_q, v_s, pos0, scale)
