"""What a GGUF file is, read from its header and metadata only (never its tensors): name, architecture,
parameter count, quant mix, and whether this engine can run it, or why not.

`read_info` never raises for a bad file: a file that is not GGUF, a truncated header, an unknown tensor type,
an architecture the engine does not have or tensor data past the end of the file come back as a ModelInfo
whose `problem` says so in one line, so the model list shows every file with its reason. The header is
parsed by engine.gguf_reader over a memory map: the OS reads only the pages the header spans (a few MB for a
large vocabulary), not the GBs of weights. Results are cached per (file, size, mtime) for the process.
"""
from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ARCHITECTURES
from ..gguf_types import GGMLQuantizationType as QT

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

# general.file_type (llama.cpp's LLAMA_FTYPE_MOSTLY_*): the name quantizers give a mix, e.g. Q4_K_M.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
              25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M",
              32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE"}


@dataclass(frozen=True)
class ModelInfo:
    """Facts from one file's header. `problem`: why this engine cannot run it (None: it can, as far as the
    header tells; the full check of every tensor's name and shape happens at load)."""

    path: Path
    size: int = 0  # bytes on disk
    title: str = ""  # general.name
    arch: str = ""
    n_params: int = 0  # elements of every tensor
    file_type: str = ""  # general.file_type's name (Q4_K_M), else the type holding most weight bytes
    quant_mix: tuple[tuple[str, float], ...] = ()  # (tensor type, share of the weight bytes), largest first
    context_length: int = 0
    problem: str | None = None
    extra: dict = field(default_factory=dict, compare=False)  # split.count etc., for callers that care

    @property
    def supported(self) -> bool:
        return self.problem is None

    def params_label(self) -> str:
        """135M, 1.5B, 7.6B ("" when unknown)."""
        n = self.n_params
        if not n:
            return ""
        if n >= 10**9:
            return f"{n / 1e9:.1f}B"
        if n >= 10**6:
            return f"{n / 1e6:.0f}M"
        return f"{n / 1e3:.0f}K"

    def size_label(self) -> str:
        return size_label(self.size)

    def quant_label(self, parts: int = 3) -> str:
        """"Q4_K_M (Q4_K 71%, Q6_K 21%, F32 1%)": the file type, then the largest shares of the weight bytes."""
        mix = ", ".join(f"{name} {share:.0%}" for name, share in self.quant_mix[:parts] if share >= 0.005)
        if not self.file_type:
            return mix
        return f"{self.file_type} ({mix})" if mix and len(self.quant_mix) > 1 else self.file_type


def size_label(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


_cache: dict[tuple[str, int, int], ModelInfo] = {}


def read_info(path: str | os.PathLike) -> ModelInfo:
    """ModelInfo of a GGUF file (cached per real path, size and mtime). Never raises for a bad file."""
    path = Path(path)
    try:
        st = path.stat()  # follows links: an HF snapshot entry is a link to its blob
    except OSError as e:
        why = "a link to a missing file (an incomplete or removed download?)" if path.is_symlink() else \
            f"cannot be read ({e.strerror or e})"
        return ModelInfo(path, problem=why)
    if not path.is_file():
        return ModelInfo(path, problem="not a regular file")
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    info = _cache.get(key)
    if info is None:
        info = _read(path, st.st_size)
        _cache[key] = info
    return info if info.path == path else _with_path(info, path)


def _with_path(info: ModelInfo, path: Path) -> ModelInfo:
    from dataclasses import replace
    return replace(info, path=path)


def _read(path: Path, size: int) -> ModelInfo:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        return ModelInfo(path, size, problem=f"cannot be read ({e.strerror or e})")
    if head[:4] != GGUF_MAGIC:
        return ModelInfo(path, size, problem=f"not a GGUF file (it starts with {head[:4]!r})" if head
                         else "not a GGUF file (it is empty)")
    if len(head) < 8:
        return ModelInfo(path, size, problem=f"truncated: the header ends after {size} bytes")
    (version,) = struct.unpack("<I", head[4:8])
    if version not in SUPPORTED_VERSIONS:
        if struct.unpack(">I", head[4:8])[0] in SUPPORTED_VERSIONS:
            return ModelInfo(path, size, problem="a big-endian GGUF file (not supported)")
        return ModelInfo(path, size, problem=f"GGUF version {version} (supported: 2, 3)")
    from ..gguf_reader import GGUFFile
    try:
        reader = GGUFFile(path)
    except Exception as e:  # noqa: BLE001 - GGUFFormatError on damage, ValueError for an unknown tensor type
        detail = str(e).splitlines()[0][:100] if str(e) else type(e).__name__
        if "GGMLQuantizationType" in detail:
            return ModelInfo(path, size, problem=f"an unknown tensor type ({detail})")
        return ModelInfo(path, size, problem=f"truncated or damaged header ({detail})")
    try:
        return _facts(reader, path, size)
    finally:
        del reader  # the memory map closes with the last reference


def _facts(reader, path: Path, size: int) -> ModelInfo:
    value = reader.value
    arch = str(value("general.architecture", "") or "")
    title = str(value("general.name", "") or "")
    n_params = sum(t.n_elements for t in reader.tensors)
    by_bytes: Counter[str] = Counter()
    for t in reader.tensors:
        by_bytes[t.tensor_type.name] += t.n_bytes
    total = sum(by_bytes.values()) or 1
    mix = tuple((name, n / total) for name, n in by_bytes.most_common())
    ftype = value("general.file_type")
    file_type = FILE_TYPES.get(ftype, "") if isinstance(ftype, int) else ""
    file_type = file_type or (mix[0][0] if mix else "")
    ctx = value(f"{arch}.context_length", 0) if arch else 0
    splits = value("split.count", 0)
    extra = {"split_count": int(splits)} if isinstance(splits, int) and splits > 1 else {}
    return ModelInfo(path, size, title, arch, n_params, file_type, mix, int(ctx) if isinstance(ctx, int) else 0,
                     problem=_problem(reader, arch, size, extra), extra=extra)


def _problem(reader, arch: str, size: int, extra: dict) -> str | None:
    """Why the engine cannot run this file, from its header; None where it can."""
    from ..quant import SUPPORTED
    if extra.get("split_count"):
        return (f"split into {extra['split_count']} files (not supported); merge them into one with "
                "llama-gguf-split --merge")
    if not arch:
        return "no general.architecture (not a language model file?)"
    if arch not in ARCHITECTURES:
        return f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
    if not reader.tensors:
        return "no tensors (a vocabulary-only or damaged file)"
    end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    if end > size:
        return f"truncated: the tensor data needs {end} bytes, the file has {size} (an incomplete download?)"
    bad = sorted({t.tensor_type.name for t in reader.tensors if QT(t.tensor_type) not in SUPPORTED})
    if bad:
        return f"tensor type(s) {', '.join(bad)} not supported (supported: {', '.join(q.name for q in SUPPORTED)})"
    return None
