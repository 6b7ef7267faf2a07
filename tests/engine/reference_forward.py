"""A plain numpy forward pass, written independently of engine/kernels and engine/model.py, plus helpers
that build tiny random models in memory and read a GGUF with `gguf.GGUFReader` alone.

`reference_logits(args, tensors, tokens)` runs the whole sequence at once (no KV cache, explicit causal mask)
in float64 with weights dequantized by `gguf.quants.dequantize` (llama.cpp's own Python code).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, quants

from engine.config import ModelArgs
from engine.quant import SUPPORTED, QTensor


def _deq(qt: QTensor) -> np.ndarray:
    # (rows, cols) or (n,) float64, dequantized by the gguf package
    if qt.qtype in (QT.F32, QT.F16):  # raw bytes or already floats: view them as the float type
        w = np.ascontiguousarray(qt.data).view(np.float32 if qt.qtype == QT.F32 else np.float16).astype(np.float64)
    else:
        w = quants.dequantize(np.asarray(qt.data), qt.qtype).astype(np.float64)
    return w.reshape(qt.shape)


def norm(x, w, eps):
    """rmsnorm over the last axis (this forward's, and the MTP and DFlash tests' numpy forms of their drafters)."""
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, positions, base, neox):
    # x (T, H, hd): llama GGUF = complex rotation of adjacent pairs; NEOX = rotate_half on the two halves
    hd = x.shape[-1]
    theta = positions[:, None] * base ** (-np.arange(0, hd, 2) / hd)[None, :]  # (T, hd/2)
    if neox:
        cos = np.concatenate([np.cos(theta)] * 2, -1)[:, None, :]
        sin = np.concatenate([np.sin(theta)] * 2, -1)[:, None, :]
        rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * cos + rot * sin
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * theta)[:, None, :]
    return np.stack([z.real, z.imag], -1).reshape(x.shape)


def rope_one(x, pos, base):
    """x (H, hd) at one position, rotated as llama rotates adjacent pairs (the drafters' numpy forms): _rope's."""
    return _rope(x[None], np.array([pos], np.float64), base, False)[0]


def greedy(model, prompt, n_new, kv_dtype, chunk=4):
    """Greedy tokens through model.forward, the logits rows that chose them and the cache: chunked prefill
    (passes of T > 1), then one token a pass (the cuda and TP tests' walks against the reference kernels')."""
    cache = model.new_cache(32, kv_dtype)
    pos = 0
    for i in range(0, len(prompt), chunk):
        logits = model.forward(prompt[i:i + chunk], pos, cache)
        pos += len(prompt[i:i + chunk])
    toks, rows = [], []
    for _ in range(n_new):
        rows.append(logits[-1])
        toks.append(int(np.argmax(logits[-1])))
        if len(toks) < n_new:  # the last token needs no forward
            logits = model.forward(np.array([toks[-1]], np.int32), pos, cache)
            pos += 1
    return toks, np.stack(rows), cache


def reference_logits(a: ModelArgs, tensors: dict[str, QTensor], tokens, pos0: int = 0) -> np.ndarray:
    """Logits (T, vocab) float64 for tokens at positions pos0..pos0+T-1 with an empty history (pos0 only
    shifts RoPE)."""
    def w(name):  # dequantized on use, not kept: peak memory stays at one matrix (SmolLM2: ~0.2 GB)
        return _deq(tensors[name])

    tokens = np.asarray(tokens)
    t_n = len(tokens)
    pos = np.arange(pos0, pos0 + t_n, dtype=np.float64)
    x = w("token_embd.weight")[tokens]  # (T, d)
    mask = np.triu(np.full((t_n, t_n), -np.inf), 1)  # causal
    for i in range(a.n_layer):
        p = f"blk.{i}."
        h = norm(x, w(p + "attn_norm.weight"), a.rms_eps)
        q, k, v = [h @ w(p + f"attn_{n}.weight").T for n in "qkv"]
        if p + "attn_q.bias" in tensors:
            q, k, v = (m + w(p + f"attn_{n}.bias") for m, n in zip((q, k, v), "qkv"))
        q = q.reshape(t_n, a.n_head, a.head_dim)
        k = k.reshape(t_n, a.n_kv_head, a.head_dim)
        v = v.reshape(t_n, a.n_kv_head, a.head_dim)
        if p + "attn_q_norm.weight" in tensors:
            q = norm(q, w(p + "attn_q_norm.weight"), a.rms_eps)
            k = norm(k, w(p + "attn_k_norm.weight"), a.rms_eps)
        q, k = _rope(q, pos, a.rope_base, a.rope_neox), _rope(k, pos, a.rope_base, a.rope_neox)
        rep = a.n_head // a.n_kv_head
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)  # GQA: (T, H, hd)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(a.head_dim) + mask  # (H, T, T)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(t_n, -1)
        x = x + o @ w(p + "attn_output.weight").T
        h = norm(x, w(p + "ffn_norm.weight"), a.rms_eps)
        g, u = h @ w(p + "ffn_gate.weight").T, h @ w(p + "ffn_up.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ w(p + "ffn_down.weight").T
    x = norm(x, w("output_norm.weight"), a.rms_eps)
    head = w("output.weight") if "output.weight" in tensors else w("token_embd.weight")
    return x @ head.T


# ------------------------------------------------------------------------------------ tiny random models
def random_qtensor(qtype, rows, cols, rng=None, name="w", dscale=0.02):
    """A random weight of `qtype`: quantized with gguf.quants where it can, else random valid K-quant blocks."""
    rng = rng if rng is not None else np.random.default_rng(0)
    if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        bs, bb = SUPPORTED[qtype]
        raw = rng.integers(0, 256, size=(rows * cols // bs, bb), dtype=np.uint8)
        scales = rng.uniform(-dscale, dscale, size=(raw.shape[0], 2)).astype(np.float16).view(np.uint8)
        if qtype in (QT.Q4_K, QT.Q5_K):
            raw[:, 0:4] = np.abs(scales.view(np.float16)).view(np.uint8)  # d, dmin >= 0 as real files have
        else:
            raw[:, 208:210] = scales[:, 0:2]
        return QTensor(name, qtype, (rows, cols), raw.reshape(rows, -1))
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == QT.F32:
        return QTensor(name, qtype, (rows, cols), x)
    if qtype == QT.F16:
        return QTensor(name, qtype, (rows, cols), x.astype(np.float16))
    return QTensor(name, qtype, (rows, cols), quants.quantize(x, qtype))


def _qtensor(name, qtype, rows, cols, rng, scale):
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    if qtype == QT.F32:
        return QTensor(name, qtype, (rows, cols), x)
    if qtype == QT.F16:
        return QTensor(name, qtype, (rows, cols), x.astype(np.float16))
    if qtype in (QT.Q4_K, QT.Q5_K, QT.Q6_K):  # gguf cannot quantize these: random valid blocks, scaled small
        return random_qtensor(qtype, rows, cols, rng, name, dscale=0.01 * scale)
    return QTensor(name, qtype, (rows, cols), quants.quantize(x, qtype))


def _vec(name, n, rng, around):
    return QTensor(name, QT.F32, (n,), (around + 0.1 * rng.standard_normal(n)).astype(np.float32))


def tiny_model(arch: str, *, seed=0, qtype=QT.Q4_1, embd_qtype=QT.Q8_0, d=64, n_head=4, n_kv_head=2,
               head_dim=16, d_ff=128, vocab=96, n_layer=2, tied=True):
    """(ModelArgs, tensors) of a random model of `arch` ('llama' | 'qwen2' | 'qwen3') built in memory."""
    rng = np.random.default_rng(seed)
    a = ModelArgs(arch=arch, n_layer=n_layer, d_model=d, n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim,
                  d_ff=d_ff, vocab_size=vocab, rope_base=10000.0, rms_eps=1e-5, context_length=256,
                  qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", tied_embeddings=tied,
                  rope_neox=arch != "llama")
    t = {}

    def add(qt):
        t[qt.name] = qt

    add(_qtensor("token_embd.weight", embd_qtype, vocab, d, rng, 1.0))
    if not tied:
        add(_qtensor("output.weight", qtype, vocab, d, rng, 0.2))
    add(_vec("output_norm.weight", d, rng, 1.0))
    for i in range(n_layer):
        p = f"blk.{i}."
        add(_vec(p + "attn_norm.weight", d, rng, 1.0))
        add(_vec(p + "ffn_norm.weight", d, rng, 1.0))
        for n, rows, cols in [("attn_q", a.q_dim, d), ("attn_k", a.kv_dim, d), ("attn_v", a.kv_dim, d),
                              ("attn_output", d, a.q_dim), ("ffn_gate", d_ff, d), ("ffn_up", d_ff, d),
                              ("ffn_down", d, d_ff)]:
            add(_qtensor(p + n + ".weight", qtype, rows, cols, rng, 0.3))
        if a.qkv_bias:
            for n, rows in [("attn_q", a.q_dim), ("attn_k", a.kv_dim), ("attn_v", a.kv_dim)]:
                add(_vec(p + n + ".bias", rows, rng, 0.0))
        if a.qk_norm:
            add(_vec(p + "attn_q_norm.weight", head_dim, rng, 1.0))
            add(_vec(p + "attn_k_norm.weight", head_dim, rng, 1.0))
    return a, t


# ------------------------------------------------------------------------------------- GGUF, gguf only
def read_gguf(path) -> tuple[ModelArgs, dict[str, QTensor]]:
    """ModelArgs + QTensors of a llama/qwen GGUF using only gguf.GGUFReader (independent of engine.gguf)."""
    r = GGUFReader(path)

    def meta(key, default=None):
        f = r.fields.get(key)
        if f is None:
            return default
        return f.contents()

    arch = meta("general.architecture")
    tensors = {}
    for t in r.tensors:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        if len(shape) == 2 and shape[0] == 1 and "norm" in t.name:
            shape = (shape[1],)
        tensors[t.name] = QTensor(t.name, QT(t.tensor_type), shape, t.data)
    n_head = int(meta(f"{arch}.attention.head_count"))
    d = int(meta(f"{arch}.embedding_length"))
    head_dim = int(meta(f"{arch}.attention.key_length", d // n_head))
    a = ModelArgs(arch=arch, n_layer=int(meta(f"{arch}.block_count")), d_model=d, n_head=n_head,
                  n_kv_head=int(meta(f"{arch}.attention.head_count_kv", n_head)), head_dim=head_dim,
                  d_ff=int(meta(f"{arch}.feed_forward_length")),
                  vocab_size=tensors["token_embd.weight"].shape[0],
                  rope_base=float(meta(f"{arch}.rope.freq_base", 10000.0)),
                  rms_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
                  context_length=int(meta(f"{arch}.context_length", 2048)),
                  qkv_bias="blk.0.attn_q.bias" in tensors, qk_norm="blk.0.attn_q_norm.weight" in tensors,
                  tied_embeddings="output.weight" not in tensors, rope_neox=arch in ("qwen2", "qwen3"))
    return a, tensors
