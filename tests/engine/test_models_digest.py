"""engine.models.digest: a model file's sha256, cached by (real path, size, mtime)."""
from __future__ import annotations

import hashlib
import json
import os
import threading

from engine.models import digest


def test_sha256_is_cached_by_path_size_and_mtime(tmp_path, monkeypatch):
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(digest, "CHUNK", 1000)  # several reads, so progress is seen more than once
    f = tmp_path / "m.gguf"
    f.write_bytes(os.urandom(4500))
    seen = []
    assert digest.cached_sha256(f) is None
    got = digest.sha256_file(f, progress=lambda done, total: seen.append((done, total)), background=True)
    assert got == hashlib.sha256(f.read_bytes()).hexdigest()
    assert seen == [(1000, 4500), (2000, 4500), (3000, 4500), (4000, 4500), (4500, 4500)]
    entry = json.loads(digest.cache_path().read_text())[os.path.realpath(f)]
    assert entry["sha256"] == got and entry["size"] == 4500
    assert digest.cached_sha256(tmp_path / "." / "m.gguf") == got  # by real path
    seen.clear()
    assert digest.sha256_file(f, progress=lambda *a: seen.append(a)) == got and seen == []  # not read again
    f.write_bytes(os.urandom(4500))  # same size, new contents and mtime: hashed again
    os.utime(f, ns=(1, 1))
    assert digest.cached_sha256(f) is None
    assert digest.sha256_file(f) == hashlib.sha256(f.read_bytes()).hexdigest()


def test_cancel_and_a_damaged_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x" * 100)
    stop = threading.Event()
    stop.set()
    assert digest.sha256_file(f, cancel=stop) is None and digest.cached_sha256(f) is None
    digest.cache_path().parent.mkdir(parents=True)
    digest.cache_path().write_text("{damaged")  # means "hash again", never an error
    assert digest.sha256_file(f) == hashlib.sha256(b"x" * 100).hexdigest()
    assert digest.cached_sha256(f) is not None
