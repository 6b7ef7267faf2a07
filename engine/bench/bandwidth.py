"""Memory read bandwidth, for the roofline: decode of a small model streams every weight once per token.

`measure_read_bandwidth()` times a streaming read (a sum) over a buffer much larger than the last-level cache
with numpy, one thread per worker thread (numpy releases the GIL in `np.add.reduce` on large float arrays
only partly, so the threads run in separate processes). The best of a few repeats is returned, in bytes/s.
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import time

import numpy as np


def _read_once(nbytes: int, repeats: int) -> float:
    a = np.ones(nbytes // 8, np.float64)  # (n,) f64: sums stay exact-ish and vectorize
    a.sum()  # touch the pages first
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best


def _child(nbytes, repeats, barrier, q):
    a = np.ones(nbytes // 8, np.float64)
    a.sum()
    barrier.wait()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    q.put(a.nbytes / best)


def measure_read_bandwidth(threads: int = 1, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Aggregate streaming read bandwidth (bytes/s) with `threads` concurrent readers of nbytes each."""
    if threads <= 1:
        return _read_once(nbytes, repeats)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(threads)
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(nbytes // threads, repeats, barrier, q)) for _ in range(threads)]
    for p in procs:
        p.start()
    rates = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return float(sum(rates))


def weight_bytes_per_token(model_path: str) -> dict:
    """Bytes of the weight matrices one decode step reads: every 2-D tensor once (the tied embedding is read
    as the output head; its one looked-up row is negligible), norms and biases ignored."""
    from gguf import GGUFReader
    r = GGUFReader(model_path)
    total = 0
    per_type: dict[str, int] = {}
    for t in r.tensors:
        if len([d for d in t.shape if d > 1]) >= 2:
            total += int(t.n_bytes)
            name = t.tensor_type.name
            per_type[name] = per_type.get(name, 0) + int(t.n_bytes)
    return {"bytes": total, "per_type": per_type}


def kv_bytes_per_position(model_path: str, kv_dtype: str = "f16") -> int:
    """Bytes of KV cache a decode step reads per position of context: K and V of every layer and KV head in
    the cache's own layout (engine.kv_cache.KVCache of one position, f16 or int8 with its scales)."""
    from ..backend import get_backend
    from ..kv_cache import KVCache
    n_layer, n_kv_head, head_dim = _kv_shape(model_path)
    return KVCache(get_backend("ref"), n_layer, 1, n_kv_head, head_dim, kv_dtype).nbytes


@functools.lru_cache(maxsize=4)
def _kv_shape(model_path: str) -> tuple[int, int, int]:
    """(n_layer, n_kv_head, head_dim) from the file's metadata, read once per file."""
    from ..gguf import load_gguf
    a = load_gguf(model_path).args
    return a.n_layer, a.n_kv_head, a.head_dim
