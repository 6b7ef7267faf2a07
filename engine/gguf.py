"""Open and validate a GGUF model file: metadata -> ModelArgs, tensors -> memory-mapped QTensors.

Parsed by engine.gguf_reader (a lean parser over a memory map: llama.cpp's `gguf.GGUFReader` spent 3.6 s and
~160 MB turning the vocabulary into numpy objects); tensor data is never copied.
Every way a file can be wrong ends in ONE `ModelFileError` line that names the file and says what to do;
missing, unknown and mis-shaped tensors are all listed together so a user sees the whole problem at once.
"""
from __future__ import annotations

import math
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import ARCHITECTURES, ModelArgs
from .errors import ModelFileError, NinferError
from .gguf_reader import GGUFFile, TensorInfo
from .gguf_types import GGMLQuantizationType as QT
from .gguf_types import GGUFValueType
from .quant import SUPPORTED, QTensor

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
SUPPORTED_QTYPES = tuple(SUPPORTED)  # the types engine.quant can dequantize (the reference of every kernel)
_FIX = "re-download or re-convert the model"

# Per-layer tensors every supported architecture has (GGUF names, without the "blk.{i}." prefix).
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


@dataclass
class ModelFile:
    """A validated, memory-mapped GGUF model.

    tensors: GGUF name -> QTensor (shape = numpy (rows, cols); data = read-only view into the mapping).
    metadata: the scalar key/value fields (arrays such as the vocabulary are read through `field`).
    """

    path: Path
    args: ModelArgs
    tensors: dict[str, QTensor]
    metadata: dict[str, Any]
    quant_summary: dict[str, int]
    file_size: int
    reader: GGUFFile = field(repr=False)

    def field(self, key: str, default: Any = None) -> Any:
        """Any metadata value, arrays included (e.g. `tokenizer.ggml.tokens` -> list[str])."""
        return read_field(self.reader, key, default)

    def describe(self) -> str:
        """One line for progress output: name, arch, layers, quant mix, size."""
        a = self.args
        q = ", ".join(f"{k} x{v}" for k, v in sorted(self.quant_summary.items()))
        name = self.metadata.get("general.name") or self.path.name
        return (f"{name}: {a.arch}, {a.n_layer} layers, d_model {a.d_model}, vocab {a.vocab_size}, "
                f"{q}, {self.file_size / 2**20:.1f} MiB")


def read_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """The decoded value of a metadata field (strings decoded leniently), or `default` if absent."""
    return reader.value(key, default)


def _check_header(path: Path) -> int:
    """Existence, readability, magic and version, before the reader sees the file. Returns the size."""
    if not path.exists():
        raise ModelFileError(f"model file {path} does not exist; check the path")
    if path.is_dir():
        raise ModelFileError(f"model path {path} is a directory; pass the .gguf file inside it")
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
    except OSError as e:
        raise ModelFileError(f"cannot read model file {path}: {e.strerror or e}; check its permissions") from None
    if len(head) < 4 or head[:4] != GGUF_MAGIC:
        raise ModelFileError(f"{path} is not a GGUF file (magic {head[:4]!r}, expected b'GGUF'); "
                             "pass a .gguf model file")
    if len(head) < 8:
        raise ModelFileError(f"{path} is truncated (only {size} bytes); {_FIX}")
    (version,) = struct.unpack("<I", head[4:8])
    if version not in SUPPORTED_VERSIONS:
        if struct.unpack(">I", head[4:8])[0] in SUPPORTED_VERSIONS:
            raise ModelFileError(f"{path} is a big-endian GGUF file, which is not supported; "
                                 "convert it on a little-endian machine")
        raise ModelFileError(f"{path} has GGUF version {version}, supported: "
                             f"{', '.join(map(str, SUPPORTED_VERSIONS))}; re-convert it with a current llama.cpp")
    return size


def _open_reader(path: Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except NinferError:
        raise
    except Exception as e:  # GGUFFormatError, or ValueError for an unknown enum value, on damage
        detail = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        if "GGMLQuantizationType" in detail:
            raise ModelFileError(f"{path} uses an unknown tensor type ({detail}); supported: "
                                 f"{', '.join(q.name for q in SUPPORTED_QTYPES)}") from None
        raise ModelFileError(f"{path} is truncated or corrupt ({detail}); {_FIX}") from None


def _meta_int(meta: dict, path: Path, key: str, default: int | None = None) -> int:
    v = meta.get(key, default)
    if v is None:
        raise ModelFileError(f"{path} lacks metadata {key!r}; {_FIX}")
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise ModelFileError(f"{path} has an invalid {key!r} = {v!r}; {_FIX}")
    return int(v)


def args_from_metadata(meta: dict, path: Path, n_vocab_tokens: int | None,
                       tensor_names: set[str]) -> ModelArgs:
    """ModelArgs from GGUF metadata; qkv bias / tied head are read from which tensors exist."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelFileError(f"{path} has no general.architecture; {_FIX}")
    if arch not in ARCHITECTURES:
        raise ModelFileError(f"{path} has architecture {arch!r}, which is not supported; "
                             f"supported: {', '.join(ARCHITECTURES)}")
    p = arch + "."
    d_model = _meta_int(meta, path, p + "embedding_length")
    n_head = _meta_int(meta, path, p + "attention.head_count")
    n_kv_head = _meta_int(meta, path, p + "attention.head_count_kv", n_head)
    # key_length is the true head size (qwen3 has head_dim * n_head != d_model); default like llama.cpp.
    head_dim = _meta_int(meta, path, p + "attention.key_length", d_model // n_head if d_model % n_head == 0 else None)
    vocab = meta.get(p + "vocab_size") or n_vocab_tokens
    if vocab is None:
        raise ModelFileError(f"{path} has neither {p}vocab_size nor a tokenizer vocabulary; {_FIX}")
    try:
        return ModelArgs(
            arch=arch,
            n_layer=_meta_int(meta, path, p + "block_count"),
            d_model=d_model, n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim,
            d_ff=_meta_int(meta, path, p + "feed_forward_length"),
            vocab_size=int(vocab),
            rope_base=_meta_positive(meta, path, p + "rope.freq_base", 10000.0),
            rms_eps=_meta_positive(meta, path, p + "attention.layer_norm_rms_epsilon", 1e-5),
            context_length=_meta_int(meta, path, p + "context_length", 2048),
            qkv_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensor_names,
            qk_norm=arch == "qwen3",
            tied_embeddings="output.weight" not in tensor_names,
            rope_neox=arch in ("qwen2", "qwen3"),
        )
    except ModelFileError:
        raise  # names the file and the fix already
    except NinferError as e:
        raise ModelFileError(f"{path}: {e}; {_FIX}") from None


def _meta_positive(meta: dict, path, key: str, default: float) -> float:
    """A float the forward pass divides by or takes powers of (RMS epsilon, RoPE base): finite and > 0, else a
    damaged file (NaN there made every activation NaN and the threaded step wait forever)."""
    v = meta.get(key, default)
    try:
        f = float(v)
    except (TypeError, ValueError):
        f = math.nan
    if not (math.isfinite(f) and f > 0):
        raise ModelFileError(f"{path} has an invalid {key!r} = {v!r} (must be a finite number > 0); {_FIX}")
    return f


def expected_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, GGUF name -> numpy shape (rows, cols) = (out, in)."""
    s: dict[str, tuple[int, ...]] = {"token_embd.weight": (a.vocab_size, a.d_model),
                                     "output_norm.weight": (a.d_model,)}
    if not a.tied_embeddings:
        s["output.weight"] = (a.vocab_size, a.d_model)
    for i in range(a.n_layer):
        b = f"blk.{i}."
        s |= {b + "attn_norm.weight": (a.d_model,), b + "ffn_norm.weight": (a.d_model,),
              b + "attn_q.weight": (a.q_dim, a.d_model), b + "attn_k.weight": (a.kv_dim, a.d_model),
              b + "attn_v.weight": (a.kv_dim, a.d_model), b + "attn_output.weight": (a.d_model, a.q_dim),
              b + "ffn_gate.weight": (a.d_ff, a.d_model), b + "ffn_up.weight": (a.d_ff, a.d_model),
              b + "ffn_down.weight": (a.d_model, a.d_ff)}
        if a.qkv_bias:
            s |= {b + "attn_q.bias": (a.q_dim,), b + "attn_k.bias": (a.kv_dim,), b + "attn_v.bias": (a.kv_dim,)}
        if a.qk_norm:
            s |= {b + "attn_q_norm.weight": (a.head_dim,), b + "attn_k_norm.weight": (a.head_dim,)}
    return s


def _names(names: list[str], limit: int = 6) -> str:
    """A short list for an error line: the first few names and how many more."""
    head = ", ".join(names[:limit])
    return head + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _as_qtensor(t: TensorInfo, data: np.ndarray, shape: tuple[int, ...]) -> QTensor:
    """Wrap a tensor's mapped data without copying (matrices as uint8 block rows, vectors as floats)."""
    qtype = QT(t.tensor_type)
    if len(shape) == 1:
        if qtype == QT.BF16:  # bf16 is the high half of an f32: widen (tiny vectors, a copy is fine)
            data = (np.asarray(data).view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
            qtype = QT.F32
        elif qtype not in (QT.F32, QT.F16):  # a quantized vector (rare): dequantize it once
            from gguf.quants import dequantize
            data = dequantize(np.asarray(data), qtype).astype(np.float32).reshape(shape)
            qtype = QT.F32
        else:
            data = data.reshape(shape)
    else:
        rows = shape[0]
        data = data.view(np.uint8).reshape(rows, -1)  # (rows, bytes_per_row), still a view of the mmap
    return QTensor(name=t.name, qtype=qtype, shape=shape, data=data)


def load_gguf(path: str | os.PathLike) -> ModelFile:
    """Open, validate and memory-map a GGUF model. Raises ModelFileError (one line) on any problem."""
    path = Path(path).expanduser()
    size = _check_header(path)
    reader = _open_reader(path)
    meta = {key: f.value for key, f in reader.fields.items() if f.type != GGUFValueType.ARRAY}
    names = [t.name for t in reader.tensors]
    tok_field = reader.fields.get("tokenizer.ggml.tokens")
    n_tokens = tok_field.count if tok_field is not None and tok_field.type == GGUFValueType.ARRAY else None
    args = args_from_metadata(meta, path, n_tokens, set(names))

    # Tensor data must lie inside the file: a truncated download otherwise reads as short views.
    short = [t.name for t in reader.tensors if t.data_offset + t.n_bytes > size]
    if short:
        raise ModelFileError(f"{path} is truncated: tensor data for {_names(short)} lies past the end "
                             f"of the file ({size} bytes); {_FIX}")
    # ... each tensor at an aligned offset, none running into the next (a damaged type or offset field would
    # otherwise read another tensor's bytes, or bytes off the block grid, as weights)
    align = reader.alignment
    off_grid = [t.name for t in reader.tensors if (t.data_offset - reader.data_offset) % align]
    if off_grid:
        raise ModelFileError(f"{path} is damaged: tensor data for {_names(off_grid)} does not start on the "
                             f"file's {align}-byte alignment; {_FIX}")
    spans = sorted((t.data_offset, t.data_offset + t.n_bytes, t.name) for t in reader.tensors)
    overlap = [b[2] for a, b in zip(spans, spans[1:]) if b[0] < a[1]]
    if overlap:
        raise ModelFileError(f"{path} is damaged: tensor data for {_names(overlap)} overlaps the tensor before "
                             f"it (a wrong type or offset field); {_FIX}")
    bad_q = sorted({QT(t.tensor_type).name for t in reader.tensors if t.tensor_type not in SUPPORTED_QTYPES})
    if bad_q:
        raise ModelFileError(f"{path} uses unsupported quant type(s) {', '.join(bad_q)}; supported: "
                             f"{', '.join(q.name for q in SUPPORTED_QTYPES)}; use a file quantized to one of these")

    want = expected_shapes(args)
    have = {t.name: t for t in reader.tensors}
    missing = [n for n in want if n not in have]
    unknown = [n for n in names if n not in want]
    wrong = []
    for n, t in have.items():
        if n in want:
            got = tuple(reversed(t.shape))  # GGUF ne is reversed numpy order
            while len(got) > 1 and got[0] == 1 and len(want[n]) == 1:
                got = got[1:]
            if got != want[n]:
                wrong.append(f"{n} {got} != {want[n]}")
    if missing or unknown or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing tensor(s): {_names(missing)}")
        if unknown:
            parts.append(f"{len(unknown)} unknown tensor(s): {_names(unknown)}")
        if wrong:
            parts.append(f"{len(wrong)} with wrong shape: {_names(wrong, 3)}")
        raise ModelFileError(f"{path} does not match a {args.arch} model with {args.n_layer} layers: "
                             f"{'; '.join(parts)}; the file is incomplete or not a supported model, {_FIX}")

    tensors = {}
    for n, shp in want.items():
        try:
            tensors[n] = _as_qtensor(have[n], reader.tensor_data(have[n]), shp)
        except ValueError as e:
            raise ModelFileError(f"{path}: tensor {n} has an inconsistent size ({e}); {_FIX}") from None
    # norms and biases (1-D floats once _as_qtensor has them, a few KB each): NaN or inf there makes every
    # activation NaN (a damaged file)
    bad = [n for n, shp in want.items() if len(shp) == 1 and not np.isfinite(tensors[n].data).all()]
    if bad:
        raise ModelFileError(f"{path} is damaged: {_names(bad)} hold(s) NaN or infinite values; {_FIX}")
    summary = Counter(QT(t.tensor_type).name for t in reader.tensors)
    return ModelFile(path=path, args=args, tensors=tensors, metadata=meta, quant_summary=dict(summary),
                     file_size=size, reader=reader)
