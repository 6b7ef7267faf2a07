"""On-disk store of a model's prepared weights: a warm start reads the repacked arrays instead of repacking.

Why: the CPU backend repacks every quantized matrix at load (engine/backends/cpu/fast.py: rows interleaved,
each block's scales after its values), ~0.25 s of every start's time to first token on the 2-core dev VM;
reading the same 96 MB back from the page cache into fresh arrays takes ~0.08 s.

Key: the model file's identity (real path, size, mtime, inode) and the sources of the layout code
(fast.py, fast_weights.py, repack.py, avx2*.py, kquant*.py: its block sizes and offsets) and of this file: a
changed model file or layout is never served old bytes.
One file per model path and layout code, `<cache root>/weights/<path digest>-<code digest>-<identity
digest>.bin` (two builds started in turn, as a benchmark's A-B of two checkouts does, keep one each instead of
deleting each other's and repacking at every start): a magic line,
the header's length, a JSON header (per name: each array's dtype, shape and offset; the data's size), then
the arrays from the next 64-byte boundary. Written whole to a temporary file and renamed into place, so a
reader sees a whole file or none; any problem reading one (missing, truncated, corrupt, another model's)
means "prepare again", never an error, and a failed write (read-only or full disk) leaves the model loaded
as it is. The KEEP most recently used files are kept (each about the size of the model's quantized
matrices); models whose prepared arrays are under MIN_BYTES are not stored.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import zlib
from pathlib import Path

import numpy as np

from ...paths import write_atomically

SUBDIR = "weights"
MAGIC = b"NINFER-WEIGHTS-1\n"
ALIGN = 64
KEEP = 4  # files kept: the most recently used models
MIN_BYTES = 16 << 20  # smaller models repack in about the time a read costs: not stored (test models)


def cache_dir() -> Path:
    from ...numba_env import cache_root
    return cache_root() / SUBDIR


def _code_digest() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256()
    for p in (here / "fast.py", here / "fast_weights.py", here / "layout.py", here / "repack.py", here / "avx2.py",
              here / "avx2_q8.py", here / "kquant.py", here / "kquant_avx2.py", Path(__file__)):
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _data_start(header_len: int) -> int:
    """The arrays start at the first ALIGN boundary after the magic, the header's length and the header."""
    return _aligned(len(MAGIC) + 8 + header_len)


class WeightStore:
    """Prepared arrays of one model file by name: `get` what an earlier start stored, `put` what was prepared
    now, then `save` once (writes only when something was put). `preload` reads the stored arrays in a
    background thread (its reads and checksums release the GIL: they overlap the tokenizer and numba's
    import)."""

    def __init__(self, model_path: str | os.PathLike):
        real = os.path.realpath(model_path)
        st = os.stat(real)
        self.identity = {"path": real, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino,
                         "code": _code_digest()}
        ident = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:24]
        # this path's files of this code: an older one is another version of the model file, never read again
        self.prefix = f"{hashlib.sha256(real.encode()).hexdigest()[:16]}-{self.identity['code']}"
        self.path = cache_dir() / f"{self.prefix}-{ident}.bin"
        self._index: dict[str, list] = {}  # name -> [[dtype, shape, offset from the data start, crc32], ...]
        self._base = 0
        self._arrays: dict[str, tuple[np.ndarray, ...]] | None = None
        self._loader: threading.Thread | None = None
        self._new: dict[str, tuple[np.ndarray, ...]] = {}
        self._served: dict[str, tuple[np.ndarray, ...]] = {}
        self._open()

    def _open(self) -> None:
        """Read the header; any problem leaves the index empty (everything is prepared again)."""
        try:
            with open(self.path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return
                n = int.from_bytes(f.read(8), "little")
                head = json.loads(f.read(n))
                base = _data_start(n)
                if head.get("identity") != self.identity or os.fstat(f.fileno()).st_size != base + head["size"]:
                    return
                self._index, self._base = head["arrays"], base
            os.utime(self.path)  # recently used: pruning keeps it
        except Exception:  # noqa: BLE001 - a cache must never be the reason a model does not load
            self._index = {}

    def preload(self) -> "WeightStore":
        """Start reading every stored array in a background thread; `get` waits for it."""
        if self._loader is None and self._index:
            self._loader = threading.Thread(target=self._load_all, name="weight-store", daemon=True)
            self._loader.start()
        return self

    def _load_all(self) -> None:
        """All arrays into memory, each checked against its crc32; any problem: none (prepare again). One
        thread: the load's own work (tokenizer, numba's import) has the other core meanwhile."""
        arrays: dict[str, tuple[np.ndarray, ...]] = {}
        try:
            with open(self.path, "rb", buffering=0) as f:
                for name, entries in self._index.items():
                    arrs = tuple(self._read(f.fileno(), e) for e in entries)
                    if any(a is None for a in arrs):
                        arrays = {}
                        break
                    arrays[name] = arrs
        except Exception:  # noqa: BLE001 - unreadable: prepare again
            arrays = {}
        self._arrays = arrays

    def _read(self, fd: int, entry: list) -> np.ndarray | None:
        """One array [dtype, shape, offset, crc32] of the file, or None when short or damaged."""
        dtype, shape, offset, crc = entry
        a = np.empty(shape, np.dtype(dtype))
        view = memoryview(a.reshape(-1).view(np.uint8))
        got = 0
        while got < a.nbytes:  # preadv may return short counts
            k = os.preadv(fd, [view[got:]], self._base + offset + got)
            if k <= 0:
                return None
            got += k
        return a if zlib.crc32(view) == crc else None

    @property
    def hits(self) -> bool:
        """Whether stored arrays were read back intact and are not all handed out yet (waits for `preload`)."""
        self._wait()
        return bool(self._arrays)

    def _wait(self) -> None:
        if self._arrays is None:
            if self._loader is None:
                self.preload()
            if self._loader is not None:
                self._loader.join()
            if self._arrays is None:
                self._arrays = {}

    def get(self, name: str) -> tuple[np.ndarray, ...] | None:
        """The arrays stored under name (fresh, writable, in memory; handed out once), or None."""
        self._wait()
        got = self._arrays.pop(name, None)
        if got is not None:
            self._served[name] = got  # kept in a rewrite, should anything be put beside them
        return got

    def put(self, name: str, arrays: tuple[np.ndarray, ...]) -> None:
        self._new[name] = tuple(np.ascontiguousarray(a) for a in arrays)

    def release(self) -> None:
        """Drop the references to the arrays handed out or put (after save): the model's weights own them now
        and may be restacked (the fused step's per-layout stacks: step_weights.py) without a second copy."""
        self._served, self._new = {}, {}

    def save(self) -> None:
        """Write every array put (when any was) to a new file, atomically; then drop this model's older
        files and all but the KEEP most recently used ones. Errors are ignored: the model is loaded already."""
        if not self._new:
            return
        every = {**self._served, **self._new}  # what this start got from the file too: the file stays whole
        if sum(a.nbytes for arrs in every.values() for a in arrs) < MIN_BYTES:
            return
        d = cache_dir()
        try:
            d.mkdir(parents=True, exist_ok=True)
            arrays, size = {}, 0
            for name, arrs in every.items():
                arrays[name] = []
                for a in arrs:
                    arrays[name].append([a.dtype.str, list(a.shape), size,
                                         zlib.crc32(memoryview(a.reshape(-1).view(np.uint8)))])
                    size += _aligned(a.nbytes)
            blob = json.dumps({"identity": self.identity, "arrays": arrays, "size": size}).encode()
            base = _data_start(len(blob))

            def write(f):
                f.write(MAGIC + len(blob).to_bytes(8, "little") + blob)
                for name, arrs in every.items():
                    for a, (_, _, off, _) in zip(arrs, arrays[name]):
                        f.seek(base + off)
                        f.write(memoryview(a.reshape(-1).view(np.uint8)))
                f.truncate(base + size)
            write_atomically(self.path, write)
            self._index, self._base, self._new, self._served = arrays, base, {}, {}
            self._prune(d)
        except Exception:  # noqa: BLE001 - read-only or full disk: run without the store
            pass

    def _prune(self, d: Path) -> None:
        files = [p for p in d.glob("*.bin") if p != self.path]
        for p in files:
            if p.name.startswith(self.prefix + "-"):
                p.unlink(missing_ok=True)
        rest = sorted((p for p in files if p.exists()), key=lambda p: p.stat().st_mtime, reverse=True)
        for p in rest[KEEP - 1:]:
            p.unlink(missing_ok=True)
