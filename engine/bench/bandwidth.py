"""Memory read bandwidth, for the roofline: decode of a small model streams every weight once per token.

`measure_read_bandwidth()` times streaming reads, one reader per worker thread, over buffers of `nbytes` in
all, and returns the better of two ways of reading (bytes/s). ninfer-bench reads as many bytes as a decode
step reads (`probe_bytes` of cli.step_bytes: the weights, and the KV cache at the workload's mean context):
the step streams exactly those, over and over, so the probe meets the same memory level. The rate falls as
the stream outgrows what the host's caches keep (the Xeon guest, 2026-12-03, MiB -> GB/s: 92 -> 53-55, 110
-> 48, 120-140 -> 45-47, 192-256 -> 37-40), and at 1024 positions the KV cache adds a quarter to the
weights' bytes; a weights-sized probe there set a long context's decode against a level it cannot stay in.
A 256 MiB probe read DRAM while a host whose last-level cache holds the model (the 480 MiB L3 of the Xeon
guest of 2026-12-02) served much of the step from that cache: chat-context shares of 83-99% there, single
runs over 100%. Where the cache is smaller than the weights (32 MiB on the Zen 5 host) both
sizes must come from DRAM. The two readers:
- a sum with numpy (numpy releases the GIL in `np.add.reduce` on large float arrays only partly, so these
  readers run in separate processes);
- a vectorized sum in numba that also asks for the line PREFETCH bytes ahead, as the decode kernels read
  their weights (avx2.PREFETCH): readers in threads of one process (the loop releases the GIL), started
  together and timed until the last is done, in a process of its own.
numpy's float64 sum adds about one value per cycle, so on a fast core the adder, not the memory, bounds it:
on the 2-core Zen 5 dev host it read 31-33 GB/s where the vectorized reader read 44-75 GB/s (and the decode
step's matmul phases streamed faster than numpy's figure: roofline shares over 100% before this reader).
The best of a few repeats.
"""
from __future__ import annotations

import functools
import multiprocessing as mp
import threading
import time

import numpy as np


def _read_once(nbytes: int, repeats: int) -> float:
    a = np.arange(nbytes // 8, dtype=np.float64)  # distinct pages (no merging of equal ones)
    a.sum()  # touch the pages first
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best


def _child(nbytes, repeats, barrier, q):
    a = np.arange(nbytes // 8, dtype=np.float64)
    a.sum()
    barrier.wait()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    q.put(a.nbytes / best)


def _numpy_rate(threads: int, nbytes: int, repeats: int) -> float:
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


def prefetched_buffers(threads: int, nbytes: int) -> list:
    """One buffer per prefetching reader, nbytes in all, compiled for and touched once."""
    from ..backends.cpu.avx2 import PREFETCH  # here, not at the top: the numpy readers' processes need no numba
    from .stream_read import stream_sum
    bufs = [np.arange(nbytes // max(1, threads) // 8, dtype=np.float64) for _ in range(max(1, threads))]
    for b in bufs:
        stream_sum(b, PREFETCH)  # compile (or load), touch the pages
    return bufs


def prefetched_passes(bufs: list, repeats: int) -> list[float]:
    """Seconds of each of `repeats` passes of the prefetching readers, one thread per buffer, timed in lock
    step: each pass starts them together and ends when the last is done (the sum of each reader's best
    would count a reader that ran alone at the single-core rate)."""
    from ..backends.cpu.avx2 import PREFETCH
    from .stream_read import stream_sum
    barrier = threading.Barrier(len(bufs))
    times = []

    def reader(i):
        for _ in range(repeats):
            barrier.wait()
            t = time.perf_counter()
            stream_sum(bufs[i], PREFETCH)
            barrier.wait()
            if i == 0:
                times.append(time.perf_counter() - t)
    ts = [threading.Thread(target=reader, args=(i,)) for i in range(len(bufs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return times


def _prefetched_rate(threads: int, nbytes: int, repeats: int) -> float:
    """The prefetching readers' best pass (bytes/s)."""
    bufs = prefetched_buffers(threads, nbytes)
    return sum(b.nbytes for b in bufs) / min(prefetched_passes(bufs, repeats))


def _prefetched_child(threads, nbytes, repeats, q):
    q.put(_prefetched_rate(threads, nbytes, repeats))


def read_rates(threads: int = 1, nbytes: int = 256 << 20, repeats: int = 5) -> dict:
    """Both readers' aggregate rates (bytes/s) with `threads` concurrent readers of nbytes in all. Each in
    processes of their own: the buffers never count in this process's peak RSS (which a benchmark's worker,
    forked from it, would inherit: Linux keeps ru_maxrss across exec)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_prefetched_child, args=(threads, nbytes, repeats, q))
    p.start()
    prefetched = q.get(timeout=300)
    p.join(timeout=30)
    return {"numpy": _numpy_rate(threads, nbytes, repeats), "prefetched": prefetched}


PROBE_MIN = 32 << 20  # a tiny model's probe still reads past the L2 caches


def probe_bytes(weight_bytes: int, threads: int = 1) -> int:
    """The probe's buffer size for a model reading weight_bytes per token: that many bytes (at least
    PROBE_MIN), whole MiB per reader."""
    per = -(-max(int(weight_bytes), PROBE_MIN) // max(1, threads) // (1 << 20)) * (1 << 20)
    return per * max(1, threads)


def measure_read_bandwidth(threads: int = 1, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Aggregate streaming read bandwidth (bytes/s) with `threads` concurrent readers: the better reader's."""
    return max(read_rates(threads, nbytes, repeats).values())


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
    from ..backends.kernels import get_kernels
    from ..kv_cache import KVCache
    n_layer, n_kv_head, head_dim = _kv_shape(model_path)
    return KVCache(get_kernels("ref"), n_layer, 1, n_kv_head, head_dim, kv_dtype).nbytes


@functools.lru_cache(maxsize=4)
def _kv_shape(model_path: str) -> tuple[int, int, int]:
    """(n_layer, n_kv_head, head_dim) from the file's metadata, read once per file."""
    from ..gguf import load_gguf
    a = load_gguf(model_path).args
    return a.n_layer, a.n_kv_head, a.head_dim
