"""Random-weight GGUF files with the exact shapes of real models, for measuring cost against size.

    write_shaped(path, "qwen3-0.6b", mix="q4_k_m")     # Qwen3-0.6B's shapes, llama.cpp's Q4_K_M type per tensor
    write_shaped(path, "llama3.2-1b", mix="q4_1")      # every layer matrix Q4_1 (our fast path), Q8_0 embedding

SHAPES are the models' published configs (Hugging Face config.json: hidden size, layers, heads, KV heads,
head size, FFN size, vocabulary, RoPE base, tied embeddings). Llama 3.2's "llama3" RoPE scaling (a
`rope_freqs` tensor in converted files) is left out: it changes no cost.

Mixes:
- q4_k_m: llama.cpp's own choice for LLAMA_FTYPE_MOSTLY_Q4_K_M (src/llama-quant.cpp): Q4_K everywhere;
  Q6_K for the output head (the token embedding when tied) and for attn_v / ffn_down in the "more bits"
  layers (the first and last eighth, and every third between); a matrix whose rows are not a multiple of
  256 values falls back (Q4_K -> Q5_0, Q6_K -> Q8_0; the head -> Q8_0), as for SmolLM2-360M's 960.
- q4_1: every layer matrix Q4_1 and the embedding / head Q8_0, as the shipped SmolLM2-135M file: the
  kernels our fast path runs.

The blocks are random bytes with their scale fields set so that weights are ~0.02 in size (no inf/NaN, the
activations stay finite through dozens of layers): the speed of a kernel does not depend on the values.
The tokenizer is SmolLM2-135M's (the default model, a real byte-level BPE that both engines load), padded
with unused tokens to the model's vocabulary size; the chat template is its ChatML one. Files are written
tensor by tensor (never whole in memory): Qwen3-4B in Q4_K_M is ~2.4 GB.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import NinferError
from ..gguf_types import GGMLQuantizationType as QT


@dataclass(frozen=True)
class Shape:
    arch: str  # general.architecture: llama | qwen3
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    vocab: int
    rope_base: float
    tied: bool = True
    rms_eps: float = 1e-5
    context: int = 8192

    @property
    def params(self) -> int:
        """Weights of the matrices (embedding once when tied)."""
        q, kv = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        layer = self.d_model * (2 * q + 2 * kv) + 3 * self.d_model * self.d_ff
        return self.n_layer * layer + self.vocab * self.d_model * (1 if self.tied else 2)


SHAPES = {
    "smollm2-360m": Shape("llama", 960, 32, 15, 5, 64, 2560, 49152, 100000.0),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 128, 3072, 151936, 1e6, rms_eps=1e-6),
    "llama3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, 500000.0),
    "smollm2-1.7b": Shape("llama", 2048, 24, 32, 32, 64, 8192, 49152, 130000.0),
    "qwen3-1.7b": Shape("qwen3", 2048, 28, 16, 8, 128, 6144, 151936, 1e6, rms_eps=1e-6),
    "llama3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 128256, 500000.0),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, 1e6, rms_eps=1e-6),
}
MIXES = ("q4_k_m", "q4_1")

# (values per block, bytes per block) of the types written here
BLOCK = {QT.F32: (1, 4), QT.Q8_0: (32, 34), QT.Q4_1: (32, 20), QT.Q5_0: (32, 22), QT.Q4_K: (256, 144),
         QT.Q6_K: (256, 210)}
_FALLBACK = {QT.Q4_K: QT.Q5_0, QT.Q6_K: QT.Q8_0}


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layers)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(mix: str, role: str, layer: int, n_layer: int, cols: int, tied: bool) -> QT:
    """The quant type of one matrix (role: token_embd, output, or a layer role such as attn_v)."""
    if mix == "q4_1":
        return QT.Q8_0 if role in ("token_embd", "output") else QT.Q4_1
    if mix != "q4_k_m":
        raise NinferError(f"mix {mix!r} is not one of {', '.join(MIXES)}")
    if role == "output" or (role == "token_embd" and tied):
        return QT.Q8_0 if cols % 256 else QT.Q6_K
    t = QT.Q6_K if role in ("attn_v", "ffn_down") and _more_bits(layer, n_layer) else QT.Q4_K
    return _FALLBACK[t] if cols % 256 else t


def tensors(shape: Shape, mix: str) -> list[tuple[str, tuple[int, int] | tuple[int], QT]]:
    """(name, numpy shape (rows, cols) or (n,), type) of every tensor, in file order."""
    s = shape
    q, kv = s.n_head * s.head_dim, s.n_kv_head * s.head_dim
    out = [("token_embd.weight", (s.vocab, s.d_model), tensor_type(mix, "token_embd", 0, s.n_layer, s.d_model, s.tied)),
           ("output_norm.weight", (s.d_model,), QT.F32)]
    if not s.tied:
        out.append(("output.weight", (s.vocab, s.d_model), tensor_type(mix, "output", 0, s.n_layer, s.d_model, False)))
    for i in range(s.n_layer):
        b = f"blk.{i}."
        mats = [("attn_q", q, s.d_model), ("attn_k", kv, s.d_model), ("attn_v", kv, s.d_model),
                ("attn_output", s.d_model, q), ("ffn_gate", s.d_ff, s.d_model), ("ffn_up", s.d_ff, s.d_model),
                ("ffn_down", s.d_model, s.d_ff)]
        out += [(b + "attn_norm.weight", (s.d_model,), QT.F32), (b + "ffn_norm.weight", (s.d_model,), QT.F32)]
        if s.arch == "qwen3":
            out += [(b + "attn_q_norm.weight", (s.head_dim,), QT.F32), (b + "attn_k_norm.weight", (s.head_dim,), QT.F32)]
        out += [(b + r + ".weight", (rows, cols), tensor_type(mix, r, i, s.n_layer, cols, s.tied))
                for r, rows, cols in mats]
    return out


def nbytes(shape: tuple, qtype: QT) -> int:
    vals, size = BLOCK[qtype]
    n = int(np.prod(shape))
    return n // vals * size


def file_bytes(shape: Shape, mix: str) -> int:
    """The tensor data's size (the file is this plus the vocabulary, ~2 MB)."""
    return sum(nbytes(sh, t) for _, sh, t in tensors(shape, mix))


def _f16(x: float) -> np.ndarray:
    return np.frombuffer(np.float16(x).tobytes(), np.uint8)


def random_blocks(rng: np.random.Generator, qtype: QT, shape: tuple) -> np.ndarray:
    """uint8 (rows, bytes per row) of random blocks of qtype, scale fields set for weights ~0.02; F32 (n,)
    norm weights near 1."""
    if qtype == QT.F32:
        return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    rows, cols = shape
    vals, size = BLOCK[qtype]
    nb = cols // vals
    blk = np.frombuffer(rng.bytes(rows * nb * size), np.uint8).reshape(rows, nb, size).copy()
    if qtype == QT.Q8_0:  # d | int8[32]: x = d q, |q| ~ 74
        blk[..., 0:2] = _f16(0.02 / 74)
    elif qtype == QT.Q4_1:  # d | m | nibbles: x = d q + m, q - 7.5 ~ 4.6
        blk[..., 0:2] = _f16(0.02 / 4.6)
        blk[..., 2:4] = _f16(-7.5 * 0.02 / 4.6)
    elif qtype == QT.Q5_0:  # d | qh u32 | nibbles: x = d (q5 - 16), ~9.2
        blk[..., 0:2] = _f16(0.02 / 9.2)
    elif qtype == QT.Q4_K:  # d | dmin | 12 bytes of 6-bit scales and mins | nibbles
        # scale j and min j equal, dmin = 7.5 d: x = d sc (q - 7.5), sc ~ 32
        sc = blk[..., 4:8] & 63  # 4 low-half scales; reuse them for the high half and as the mins
        blk[..., 4:8] = sc
        blk[..., 8:12] = sc
        blk[..., 12:16] = (sc & 15) | ((sc & 15) << 4)
        blk[..., 0:2] = _f16(0.02 / (32 * 4.6))
        blk[..., 2:4] = _f16(7.5 * 0.02 / (32 * 4.6))
    elif qtype == QT.Q6_K:  # ql | qh | int8 scales[16] | d: x = d s (q6 - 32), s in -16..16, q6 - 32 ~ 18.5
        blk[..., 192:208] = (rng.integers(-16, 17, size=(rows, nb, 16), dtype=np.int8)).view(np.uint8)
        blk[..., 208:210] = _f16(0.02 / (9.5 * 18.5))
    return blk.reshape(rows, nb * size)


def _tokenizer_fields(vocab: int):
    """SmolLM2-135M's tokenizer (the default model): tokens, types, merges, ids, template; padded with
    unused tokens up to `vocab`."""
    from ..gguf_reader import GGUFFile
    from ..paths import SETUP_HINT, default_model_path
    src = default_model_path()
    if src is None:
        raise NinferError(f"the shaped models take SmolLM2's tokenizer from the default model, which is not "
                          f"installed; {SETUP_HINT}")
    f = GGUFFile(src)
    tokens = list(f.value("tokenizer.ggml.tokens"))
    types = [int(t) for t in f.value("tokenizer.ggml.token_type")]
    if vocab < len(tokens):
        raise NinferError(f"vocabulary {vocab} is smaller than the tokenizer's {len(tokens)}")
    pad = vocab - len(tokens)
    tokens += [f"<|unused_{i}|>" for i in range(pad)]
    types += [5] * pad  # UNUSED
    return {"tokens": tokens, "types": types, "merges": list(f.value("tokenizer.ggml.merges")),
            "bos": int(f.value("tokenizer.ggml.bos_token_id")), "eos": int(f.value("tokenizer.ggml.eos_token_id")),
            "pre": f.value("tokenizer.ggml.pre"), "template": f.value("tokenizer.chat_template")}


def write_shaped(path: str | Path, name: str | Shape, mix: str = "q4_k_m", seed: int = 0) -> Path:
    """Write model `name` (a SHAPES key, or a Shape) in `mix` with random blocks to path, atomically."""
    from gguf import GGMLQuantizationType as GQT
    from gguf import GGUFWriter
    if isinstance(name, Shape):
        s, name = name, "custom"
    elif name in SHAPES:
        s = SHAPES[name]
    else:
        raise NinferError(f"model shape {name!r} is not one of {', '.join(SHAPES)}")
    plan = tensors(s, mix)
    tok = _tokenizer_fields(s.vocab)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    rng = np.random.default_rng(seed)
    try:
        w = GGUFWriter(str(tmp), s.arch)
        w.add_name(f"random {name} {mix}")
        w.add_context_length(s.context)
        w.add_embedding_length(s.d_model)
        w.add_block_count(s.n_layer)
        w.add_feed_forward_length(s.d_ff)
        w.add_head_count(s.n_head)
        w.add_head_count_kv(s.n_kv_head)
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_rope_dimension_count(s.head_dim)
        w.add_rope_freq_base(s.rope_base)
        w.add_layer_norm_rms_eps(s.rms_eps)
        w.add_vocab_size(s.vocab)
        w.add_file_type(15 if mix == "q4_k_m" else 3)  # LLAMA_FTYPE_MOSTLY_Q4_K_M / _Q4_1
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tok["pre"])
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        w.add_bos_token_id(tok["bos"])
        w.add_eos_token_id(tok["eos"])
        w.add_add_bos_token(False)
        w.add_chat_template(tok["template"])
        for tname, shape, qtype in plan:
            if qtype == QT.F32:
                w.add_tensor_info(tname, shape, np.dtype(np.float32), nbytes(shape, qtype))
            else:
                w.add_tensor_info(tname, (shape[0], nbytes(shape, qtype) // shape[0]), np.dtype(np.uint8),
                                  nbytes(shape, qtype), raw_dtype=GQT(int(qtype)))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for tname, shape, qtype in plan:
            w.write_tensor_data(random_blocks(rng, qtype, shape))
        w.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
