"""A lean GGUF parser: header, metadata and tensor infos read with `struct` over a read-only memory map.

Why not `gguf.GGUFReader` (llama.cpp's): it turns every element of every metadata array into its own numpy
view. For SmolLM2's 49k-token vocabulary and 48k merges that is ~10^6 small objects: 3.6 s and ~160 MB
(measured, warm page cache, 2-core Zen 3) before the first token can be produced. Here scalars are read
eagerly, arrays are recorded as (element type, count, byte range) and decoded only when asked for: numeric
arrays with one `np.frombuffer`, string arrays in one pass over their length prefixes (~40 ms for all of
SmolLM2's). Tensor data are zero-copy views of the map. Values are what `GGUFReader` + the old
`read_field` gave (tests/engine/test_gguf_reader.py compares both on every fixture). Little-endian files
only: engine.gguf rejects big-endian ones before parsing. gguf's enums come from engine.gguf_types (importing
the `gguf` package costs ~70 ms of every start).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .gguf_types import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT
from .gguf_types import GGMLQuantizationType as QT
from .gguf_types import GGUFValueType as VT

# Fixed-size value types: struct format (little-endian) and numpy dtype.
_SCALAR = {VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
           VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d"}
_STRUCTS = {t: struct.Struct(f) for t, f in _SCALAR.items()}
_DTYPE = {t: np.dtype(f) for t, f in _SCALAR.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
# Tensor types whose data are plain elements (GGUFReader's choice); every other type is viewed as bytes.
_ELEMENT = {QT.F32: np.float32, QT.F16: np.float16, QT.F64: np.float64, QT.I8: np.int8, QT.I16: np.int16,
            QT.I32: np.int32, QT.I64: np.int64}


class GGUFFormatError(ValueError):
    """The file's structure is inconsistent (engine.gguf turns this into a ModelFileError)."""


@dataclass(frozen=True)
class Field:
    """One metadata key. value: the decoded scalar/string (None for arrays, read them with `GGUFFile.value`).
    Arrays: sub = element type, count = number of elements, [start, end) = byte range of the elements."""

    name: str
    type: VT
    value: Any = None
    sub: VT | None = None
    count: int = 0
    start: int = 0
    end: int = 0


@dataclass(frozen=True)
class TensorInfo:
    """shape: GGUF order (ne0 first, the contiguous dimension); data_offset: absolute byte offset."""

    name: str
    tensor_type: QT
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int


class StringArray:
    """Read-only sequence view of a GGUF string array: element i decoded on access (invalid UTF-8 ->
    U+FFFD); iterating decodes all of them in one pass. Element offsets are found once, on first access."""

    def __init__(self, file: "GGUFFile", f: Field):
        self._file, self._f = file, f
        self._starts: np.ndarray | None = None  # (count + 1,) byte offsets of the elements' length prefixes

    def __len__(self) -> int:
        return self._f.count

    def __getitem__(self, i: int) -> str:
        n = self._f.count
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"string index {i} out of range ({n})")
        if self._starts is None:
            self._starts = self._file.string_starts(self._f)
        a, b = int(self._starts[i]) + 8, int(self._starts[i + 1])
        return str(self._file._buf[a:b], "utf-8", "replace")

    def __iter__(self):
        return iter(self._file.strings(self._f))


class GGUFFile:
    """Parsed header of a GGUF file over `data`, an np.memmap of the whole file (read-only)."""

    def __init__(self, path: str | Path):
        self.data = np.memmap(path, mode="r")
        self._buf = memoryview(self.data)
        self._size = len(self.data)
        self.fields: dict[str, Field] = {}
        off = 4
        version = self._scalar(VT.UINT32, off)
        n_tensors, n_kv = self._scalar(VT.UINT64, off + 4), self._scalar(VT.UINT64, off + 12)
        off += 20
        # Every key and tensor info takes >= 12 bytes: absurd counts are damage, not a long loop.
        if n_kv * 12 > self._size or n_tensors * 12 > self._size:
            raise GGUFFormatError(f"header counts {n_tensors} tensors / {n_kv} keys do not fit the file")
        self._add(Field("GGUF.version", VT.UINT32, version))
        self._add(Field("GGUF.tensor_count", VT.UINT64, n_tensors))
        self._add(Field("GGUF.kv_count", VT.UINT64, n_kv))
        for _ in range(n_kv):
            key, off = self._string(off)
            vtype = self._vtype(self._scalar(VT.UINT32, off))
            field, off = self._value(key, vtype, off + 4)
            self._add(field)
        self.tensors: list[TensorInfo] = []
        infos = []
        for _ in range(n_tensors):
            name, off = self._string(off)
            n_dims = self._scalar(VT.UINT32, off)
            self._need(off + 4, 8 * n_dims)
            dims = tuple(int(d) for d in np.frombuffer(self._buf, "<u8", n_dims, off + 4))
            off += 4 + 8 * n_dims
            raw_type, rel = self._scalar(VT.UINT32, off), self._scalar(VT.UINT64, off + 4)
            off += 12
            infos.append((name, dims, raw_type, rel))
        self.alignment = self._alignment()
        self.data_offset = off + (-off % self.alignment)
        seen = set()
        for name, dims, raw_type, rel in infos:
            if name in seen:
                raise GGUFFormatError(f"duplicated tensor {name}")
            seen.add(name)
            qtype = QT(raw_type)  # ValueError "... is not a valid GGMLQuantizationType" for unknown types
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            self.tensors.append(TensorInfo(name, qtype, dims, n, n * type_size // block, self.data_offset + rel))

    # ---- values ------------------------------------------------------------------------------------------
    def value(self, key: str, default: Any = None) -> Any:
        """The decoded value of a metadata key, or `default` if absent. Arrays -> lists (strings decoded
        leniently); an empty array reads as `default` (as GGUFReader + read_field did), so does a nested
        array (GGUFReader flattened those; nothing uses them)."""
        f = self.fields.get(key)
        if f is None:
            return default
        if f.type != VT.ARRAY:
            return f.value
        if f.count == 0 or f.sub == VT.ARRAY:
            return default
        if f.sub == VT.STRING:
            return self.strings(f)
        return np.frombuffer(self._buf, _DTYPE[f.sub], f.count, f.start).tolist()

    def strings(self, f: Field) -> list[str]:
        """A string array, decoded (invalid UTF-8 -> U+FFFD: a broken token must not crash the loader)."""
        buf = bytes(self._buf[f.start:f.end])  # slicing bytes is faster than slicing the memoryview
        unpack, out, off = _U64.unpack_from, [], 0
        append = out.append
        for _ in range(f.count):
            (n,) = unpack(buf, off)
            off += 8
            append(buf[off:off + n].decode("utf-8", "replace"))
            off += n
        return out

    def lazy_strings(self, key: str) -> "StringArray | None":
        """A string array field as a sequence that decodes each element when it is read (None if the key is
        absent, not a string array, or empty): the tokenizer reads a few of 49k token strings at start."""
        f = self.fields.get(key)
        if f is None or f.type != VT.ARRAY or f.sub != VT.STRING or f.count == 0:
            return None
        return StringArray(self, f)

    def string_starts(self, f: Field) -> np.ndarray:
        """(count + 1,) int64: offset of each element's length prefix in a string array, then its end."""
        buf, unpack = self._buf, _U64.unpack_from
        out = np.empty(f.count + 1, np.int64)
        off = f.start
        for i in range(f.count):
            out[i] = off
            off += 8 + unpack(buf, off)[0]
        out[f.count] = off
        return out

    def raw(self, key: str) -> memoryview | None:
        """The bytes of an array field as stored (for hashing without decoding), None if absent/not an array."""
        f = self.fields.get(key)
        return self._buf[f.start:f.end] if f is not None and f.type == VT.ARRAY else None

    def tensor_data(self, t: TensorInfo) -> np.ndarray:
        """Zero-copy view of a tensor's data, shaped like GGUFReader's: numpy order (ne reversed); quantized
        types as uint8 with the last dimension in bytes. The caller checks that the data lies in the file."""
        np_shape = tuple(reversed(t.shape))
        dtype = _ELEMENT.get(t.tensor_type)
        if dtype is None:
            block, type_size = GGML_QUANT_SIZES[t.tensor_type]
            if np_shape and np_shape[-1] % block:
                raise GGUFFormatError(f"tensor {t.name}: row size {np_shape[-1]} is not a multiple of "
                                      f"{t.tensor_type.name} block size {block}")
            if np_shape:
                np_shape = (*np_shape[:-1], np_shape[-1] // block * type_size)
            dtype, count = np.uint8, t.n_bytes
        else:
            count = t.n_elements
        return self.data[t.data_offset:t.data_offset + t.n_bytes].view(dtype)[:count].reshape(np_shape)

    # ---- parsing -----------------------------------------------------------------------------------------
    def _add(self, f: Field) -> None:
        if f.name in self.fields:
            raise GGUFFormatError(f"duplicated key {f.name}")
        self.fields[f.name] = f

    def _need(self, off: int, n: int) -> None:
        if off + n > self._size:
            raise GGUFFormatError(f"metadata runs past the end of the file (byte {off + n} of {self._size})")

    def _scalar(self, vtype: VT, off: int):
        s = _STRUCTS[vtype]
        self._need(off, s.size)
        return s.unpack_from(self._buf, off)[0]

    def _string(self, off: int) -> tuple[str, int]:
        n = self._scalar(VT.UINT64, off)
        self._need(off + 8, n)
        return str(self._buf[off + 8:off + 8 + n], "utf-8", "replace"), off + 8 + n

    @staticmethod
    def _vtype(raw: int) -> VT:
        try:
            return VT(raw)
        except ValueError:
            raise GGUFFormatError(f"unknown metadata value type {raw}") from None

    def _value(self, key: str, vtype: VT, off: int) -> tuple[Field, int]:
        """Field at off (just after its type) and the offset after it."""
        if vtype == VT.STRING:
            s, end = self._string(off)
            return Field(key, vtype, s), end
        if vtype != VT.ARRAY:
            return Field(key, vtype, self._scalar(vtype, off)), off + _STRUCTS[vtype].size
        sub = self._vtype(self._scalar(VT.UINT32, off))
        count = self._scalar(VT.UINT64, off + 4)
        start = off + 12
        end = self._skip(sub, count, start)
        return Field(key, vtype, None, sub, count, start, end), end

    def _skip(self, sub: VT, count: int, off: int) -> int:
        """Offset just past `count` values of type `sub` starting at off (bounds-checked)."""
        if sub in _STRUCTS:
            n = _STRUCTS[sub].size * count
            self._need(off, n)
            return off + n
        buf, unpack, size = self._buf, _U64.unpack_from, self._size
        if sub == VT.STRING:
            for _ in range(count):
                if off + 8 > size:
                    self._need(off, 8)
                off += 8 + unpack(buf, off)[0]
            self._need(off, 0)
            return off
        for _ in range(count):  # nested arrays: walk them (nothing we use, but they must be skipped)
            inner = self._vtype(self._scalar(VT.UINT32, off))
            off = self._skip(inner, self._scalar(VT.UINT64, off + 4), off + 12)
        return off

    def _alignment(self) -> int:
        f = self.fields.get("general.alignment")
        if f is None:
            return GGUF_DEFAULT_ALIGNMENT
        if f.type != VT.UINT32:
            raise GGUFFormatError("bad type for general.alignment")
        if f.value == 0 or f.value & (f.value - 1):
            raise GGUFFormatError(f"invalid alignment {f.value}: must be a non-zero power of two")
        return f.value
