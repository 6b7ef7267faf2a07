"""sha256 of model files, cached by (real path, size, mtime): files are GBs, hashing one takes seconds to
minutes, and the chat records the hash of every model it ran.

    sha256_file(path, progress=None, cancel=None) -> "9f86d0..."   (reads the file once; cached after)
    cached_sha256(path) -> the hash if known for the file as it is now, else None (reads nothing)

The cache is one JSON file in the user cache directory (NINFER_CACHE_DIR overrides), written atomically; any
problem reading it means "hash again", never an error. A file changed since (size or mtime) is hashed again.
hashlib releases the GIL on large reads, so a background thread does not hold up the UI; on Linux the thread
that hashes lowers its own priority, so a reply decoding meanwhile keeps the cores.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

CHUNK = 8 << 20  # bytes per read
CACHE_FILE = "sha256.json"
_lock = threading.Lock()  # one read-modify-write of the cache file at a time in this process


def cache_path() -> Path:
    from ..numba_env import cache_root
    return cache_root() / CACHE_FILE


def _key(path: Path) -> tuple[str, dict]:
    st = path.stat()
    return os.path.realpath(path), {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _load() -> dict:
    try:
        d = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def cached_sha256(path: str | os.PathLike) -> str | None:
    """The cached hash of `path` as it is now (same size and mtime), else None."""
    try:
        real, stamp = _key(Path(path))
    except OSError:
        return None
    e = _load().get(real)
    if isinstance(e, dict) and all(e.get(k) == v for k, v in stamp.items()) and isinstance(e.get("sha256"), str):
        return e["sha256"]
    return None


def _store(real: str, stamp: dict, digest: str) -> None:
    from ..paths import write_atomically
    with _lock:
        d = _load()
        d[real] = {**stamp, "sha256": digest}
        try:
            cache_path().parent.mkdir(parents=True, exist_ok=True)
            write_atomically(cache_path(), lambda f: f.write(json.dumps(d, indent=1).encode()))
        except OSError:
            pass  # a read-only or full cache disk: the hash is only recomputed next time


def _lower_priority() -> None:
    """Nice this thread (Linux: priority is per thread) so hashing yields the CPU to decoding."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def sha256_file(path: str | os.PathLike, progress: Callable[[int, int], None] | None = None,
                cancel: threading.Event | None = None, background: bool = False) -> str | None:
    """The file's sha256 (hex), from the cache or by reading it. progress(done_bytes, total) after each chunk;
    `cancel` set: stop and return None (nothing cached). `background`: lower this thread's priority first
    (call it from a thread of its own). OSError where the file cannot be read."""
    path = Path(path)
    real, stamp = _key(path)
    if (hit := cached_sha256(path)) is not None:
        return hit
    if background:
        _lower_priority()
    h = hashlib.sha256()
    done = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            if cancel is not None and cancel.is_set():
                return None
            h.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, stamp["size"])
    digest = h.hexdigest()
    if _key(path)[1] == stamp:  # the file did not change while it was read
        _store(real, stamp, digest)
    return digest


def hash_in_background(path: str | os.PathLike, done: Callable[[str | None, str | None], None]) -> threading.Thread:
    """Start a daemon thread that hashes `path` (sha256_file, niced) and then calls done(sha256, None), or
    done(None, why) where the file cannot be read. Returns the thread (join it to wait)."""
    def run() -> None:
        try:
            digest = sha256_file(path, background=True)
        except OSError as e:
            done(None, str(e.strerror or e))
            return
        done(digest, None)
    t = threading.Thread(target=run, name="model-sha256", daemon=True)
    t.start()
    return t
