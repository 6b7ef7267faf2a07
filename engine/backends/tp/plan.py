"""The tensor-parallel plan: which heads / FFN columns / vocab rows each rank holds (see engine/tp.py).

Megatron-style split, applied to the file tensors before each device's backend prepares them, so every
backend (cpu, ref, cuda) shards the same way and `model.py` knows nothing about it:

  attention  KV heads split as evenly as possible (3 -> {0,1} | {2}); each rank keeps the query heads of its
             KV heads (GQA groups stay whole: q 0-5 | 6-8). Wq/Wk/Wv (+ biases) split by rows, Wo by columns
             (its input, 384 | 192 for SmolLM2). The KV cache of a rank holds only its KV heads.
  MLP        gate/up split by rows, down by columns (768 | 768), on block boundaries of down's quant type.
  head       vocab-parallel: each rank computes the logits of its vocab rows; the host concatenates them.
  replicated embedding, norms, the residual stream x (T, d): every rank holds an identical copy.

"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ...gguf_types import GGMLQuantizationType as QT

from ...config import ModelArgs
from ...errors import ConfigError
from ...quant import QTensor, _raw_rows, block_info, dequantize


# --------------------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Shard:
    """What rank `rank` holds: [start, stop) ranges of KV heads, query heads, FFN columns, vocab rows."""

    rank: int
    kv: tuple[int, int]
    q: tuple[int, int]
    ff: tuple[int, int]
    vocab: tuple[int, int]


def _split(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[start, stop) ranges splitting n into `parts` multiples of `unit`, the first ones larger."""
    if n % unit:
        raise ConfigError(f"cannot split {n} into multiples of {unit}")
    units = n // unit
    sizes = [units // parts + (1 if r < units % parts else 0) for r in range(parts)]
    out, s = [], 0
    for size in sizes:
        out.append((s * unit, (s + size) * unit))
        s += size
    return out


def plan_shards(a: ModelArgs, tp: int, ff_unit: int = 32) -> list[Shard]:
    """The shards of a model for `tp` ranks. ff_unit: the quant block size the FFN split must respect (values
    per block of Wdown, whose columns are split). Head splits follow KV heads; a Wo column split off block
    boundaries falls back to F32 for that tensor (`cols_of`)."""
    if tp != 2:
        raise ConfigError(f"--tp {tp}: only --tp 1 and --tp 2 are supported")
    if a.n_kv_head < tp:
        raise ConfigError(f"--tp {tp}: the model has only {a.n_kv_head} KV head(s); use --tp 1")
    kv = _split(a.n_kv_head, tp)
    q = [(k0 * a.group, k1 * a.group) for k0, k1 in kv]
    ff = _split(a.d_ff, tp, ff_unit)
    vocab = _split(a.vocab_size, tp)
    return [Shard(r, kv[r], q[r], ff[r], vocab[r]) for r in range(tp)]


def shard_args(a: ModelArgs, s: Shard) -> ModelArgs:
    """The ModelArgs of one rank's slice (heads, d_ff and vocab of the shard)."""
    return ModelArgs(arch=a.arch, n_layer=a.n_layer, d_model=a.d_model, n_head=s.q[1] - s.q[0],
                     n_kv_head=s.kv[1] - s.kv[0], head_dim=a.head_dim, d_ff=s.ff[1] - s.ff[0],
                     vocab_size=s.vocab[1] - s.vocab[0], rope_base=a.rope_base, rms_eps=a.rms_eps,
                     context_length=a.context_length, qkv_bias=a.qkv_bias, qk_norm=a.qk_norm,
                     tied_embeddings=a.tied_embeddings, rope_neox=a.rope_neox)


def rows_of(qt: QTensor, r0: int, r1: int) -> QTensor:
    """Rows r0..r1 of a 2-D tensor, or elements r0..r1 of a 1-D one (a view, no copy of the file bytes)."""
    if len(qt.shape) == 1:
        return QTensor(qt.name, qt.qtype, (r1 - r0,), np.asarray(qt.data).reshape(-1)[r0:r1])
    return QTensor(qt.name, qt.qtype, (r1 - r0, qt.shape[1]), _raw_rows(qt)[r0:r1])


def cols_of(qt: QTensor, c0: int, c1: int) -> QTensor:
    """Columns c0..c1 of a 2-D tensor. On quant block boundaries the blocks are sliced as they are; otherwise
    (e.g. a Q4_K Wo split at head 6 of 9) the slice is dequantized to F32: exact, larger, and only for the
    small tensors whose input dimension is split."""
    bs, bb = block_info(qt.qtype, qt.name)
    if c0 % bs or c1 % bs:
        dense = np.ascontiguousarray(dequantize(qt)[:, c0:c1], np.float32)  # (rows, c1-c0)
        return QTensor(qt.name, QT.F32, (qt.shape[0], c1 - c0), dense.view(np.uint8))
    raw = _raw_rows(qt)[:, c0 // bs * bb:c1 // bs * bb]
    return QTensor(qt.name, qt.qtype, (qt.shape[0], c1 - c0), np.ascontiguousarray(raw))


def shard_tensors(a: ModelArgs, tensors: dict[str, QTensor], s: Shard) -> dict[str, QTensor]:
    """The file tensors of one rank, named as in the file (the head is always `output.weight`)."""
    hd = a.head_dim
    out = {"token_embd.weight": tensors["token_embd.weight"], "output_norm.weight": tensors["output_norm.weight"]}
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    out["output.weight"] = rows_of(head, *s.vocab)
    qr, kr, fr = (s.q[0] * hd, s.q[1] * hd), (s.kv[0] * hd, s.kv[1] * hd), s.ff
    for i in range(a.n_layer):
        p = f"blk.{i}."
        for n in ("attn_norm.weight", "ffn_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight"):
            if p + n in tensors:
                out[p + n] = tensors[p + n]
        for n, rng in (("attn_q", qr), ("attn_k", kr), ("attn_v", kr)):
            out[p + n + ".weight"] = rows_of(tensors[p + n + ".weight"], *rng)
            if p + n + ".bias" in tensors:
                out[p + n + ".bias"] = rows_of(tensors[p + n + ".bias"], *rng)
        out[p + "attn_output.weight"] = cols_of(tensors[p + "attn_output.weight"], *qr)
        out[p + "ffn_gate.weight"] = rows_of(tensors[p + "ffn_gate.weight"], *fr)
        out[p + "ffn_up.weight"] = rows_of(tensors[p + "ffn_up.weight"], *fr)
        out[p + "ffn_down.weight"] = cols_of(tensors[p + "ffn_down.weight"], *fr)
    return out


def ff_unit(a: ModelArgs, tensors: dict[str, QTensor]) -> int:
    """The largest quant block size among the Wdown tensors (their columns are split by the FFN plan)."""
    units = [block_info(tensors[f"blk.{i}.ffn_down.weight"].qtype)[0] for i in range(a.n_layer)]
    unit = max(32, *units)
    return unit if a.d_ff % (2 * unit) == 0 else 32  # unaligned: cols_of falls back to F32 for Wdown
