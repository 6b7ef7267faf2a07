"""The fast kernel set's weights: a quantized matrix repacked into the interleaved layout (layout.py, written
by repack.py's jitted pass) as a FastWeight, the layer matrices in one buffer laid out per thread
(prepare_layers), each file tensor's pages let go of once repacked, and the matmul's activation scratch.
fast.py runs the kernels over them and says why the layout is what it is; kquant.py prepares the 5- and 6-bit
types. Through a warm start the arrays come back from backends/cpu/weight_store.py instead of being repacked.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np

from ...gguf_types import GGMLQuantizationType as QT
from ...quant import QK, QTensor, validate
from . import kernels as cpu
from . import kquant  # Q4_K, Q5_0, Q5_1, Q5_K, Q6_K (KWeight)
from .avx2 import XS
from .layout import G, parts

class FastWeight:
    """A Q4_0/Q4_1/Q4_K/Q8_0 weight in the interleaved layout. kind: 'q4' (Q4_0, Q4_1) | 'q4k' (Q4_K: q4k.py,
    blocks (ng, nsb, SB4K); `d`, `m` view its super-blocks' f16 d and dmin, `qs` None) | 'q8'.

    q4: blocks uint8 (ng, nb, BLK4): per group and block its nibbles (bytes 0-511, avx2's order), its
        rows' f16 scales (D_OFF: 32 uint16) and mins (M_OFF), the file's bits (Q4_0 has no min: m = -8 d,
        exact in f16, so the kernels' m + 8 d is 0). `qs`, `d`, `m` are views of its parts (for inspection).
    q8: blocks int8 (ng, nb, BLK8): per group and block values 2i, 2i+1 of row r at bytes 64 i + 2r, 64 i +
        2r + 1, then the rows' f16 scales (D8_OFF). `qs` (ng, nb, 16, 2G) and `d` view them.
    acc16/acc32 (ng, G): per-group integer accumulators (scratch, so the kernels never allocate).
    A layer matrix of prepare_layers has 4-bit blocks (P, ng / P, nb, BLK4): its groups cut into P parts,
    each contiguous (part p's groups are groups p * ng / P ..), the parts apart in memory.
    """

    def __init__(self, name, kind, shape, blocks):
        self.name, self.kind, self.shape = name, kind, shape
        self.set_blocks(blocks)
        self.stack = None  # the role's (L, P, ng / P, nb, BLK4) view this weight is a slot of (prepare_layers)
        ng = blocks.shape[0] * blocks.shape[1] if blocks.ndim == 4 else blocks.shape[0]
        self.acc16 = np.zeros((ng, G), np.int16)  # (ng, G) kernel scratch (4-bit)
        self.acc32 = np.zeros((ng, G), np.int32)  # (ng, G) kernel scratch (Q8_0)

    def set_blocks(self, blocks):
        """The weight's blocks (e.g. a view of a role's stack: step); qs, d, m: views of their parts."""
        self.blocks = blocks
        self.qs, self.d, self.m = parts(blocks, self.kind)


class FastScratch:
    """matmul scratch for x of up to (max_t, max_n): int8 activations, their block scales and block sums."""

    def __init__(self, max_t: int, max_n: int):
        nb = (max_n + QK - 1) // QK
        self.qa = np.zeros((max_t, nb * QK), np.int8)  # (T, n) int8 quantized activations
        self.sa = np.zeros((max_t, nb), np.float32)  # (T, nb) their scales
        self.xs = np.zeros((max_t, XS * nb), np.float32)  # (T, XS nb): each block's sums (quantize_rows)
        self.cpu = cpu.new_scratch(max_t, max_n)  # for weights that stay in cpu.py's layout


def _file_blocks(qt: QTensor) -> np.ndarray:
    """qt's raw blocks as (rows, bytes_per_row) uint8, a plain ndarray view of the file mapping."""
    return np.ascontiguousarray(qt.data).view(np.uint8).reshape(qt.shape[0], -1)


def repack(qt: QTensor, store=None) -> FastWeight:
    """File blocks (rows, nb * bytes_per_row) -> the interleaved layout, in one jitted pass
    (backends/cpu/repack.py), or the arrays an earlier start stored (store: engine.weight_store
    .WeightStore or None). Rows are padded with zero blocks up to a multiple of G; kernels never write the
    padding rows to `out`. None for a Q4_0 weight whose -8 d overflows f16 (|d| > 8188)."""
    from .repack import layout, repack_arrays
    rows, cols = qt.shape[0], qt.shape[-1]
    kind = {QT.Q8_0: "q8", QT.Q4_K: "q4k"}.get(qt.qtype, "q4")
    arrays = _stored(store, qt.name, layout(kind, (), rows, cols))
    if arrays is None:
        arrays = repack_arrays(_file_blocks(qt), QT(qt.qtype).name.lower(), cols)
        if arrays is None:
            return None
        if store is not None:
            store.put(qt.name, arrays)
    return FastWeight(qt.name, kind, (rows, cols), *arrays)


def _stored(store, name: str, shapes: list):
    """The store's arrays for name when they have these [(dtype, shape)] (repack.layout), else None."""
    got = store.get(name) if store is not None else None
    if got is None or len(got) != len(shapes) or \
            any(a.dtype != dt or a.shape != shape for a, (dt, shape) in zip(got, shapes)):
        return None
    return got


def thread_parts(ngs, threads: int) -> int:
    """How many parts the layer weights' layout cuts every matrix's row groups into (prepare_layers): one per
    thread when each matrix's groups divide evenly (then thread t streams part t of every phase), else 1."""
    return threads if threads > 1 and all(n % threads == 0 for n in ngs) else 1


def prepare_layers(roles: dict, store=None, threads: int | None = None) -> dict:
    """The layer matrices (roles: role -> its layers' QTensors) repacked into ONE buffer laid out per
    thread: region p holds, layer by layer and role by role in the step's order, part p of each matrix
    (its row groups p * ng / P .. (p + 1) * ng / P). A decode step's thread then reads one address stream
    from its first layer to its last, phase after phase, where with a stack per role it jumped to another
    array at every phase (the hardware prefetcher starts over each time; the other thread's half lies
    between): the kernels over all layers in the step's order read ~5% faster (scripts/stream_ceiling.py,
    "kernels" against "role-major"; a plain reader of the same segments 8-12%).
    Each FastWeight's blocks are then (P, ng / P, nb, BLK4), a view of its slot, and `stack` the role's
    (L, P, ng / P, nb, BLK4) view (the fused step's). A role qualifies when all its layers are Q4_0 / Q4_1 / Q4_K
    of one shape; the others are left out (the caller prepares them one by one). Returns {name:
    FastWeight}. threads: the parts wanted (default: numba's thread count; thread_parts decides).
    store (weight_store.WeightStore or None): the buffer an earlier start stored, else stored now."""
    from .repack import layout
    ok = {}
    for role, ts in roles.items():
        t0 = ts[0]
        if t0.qtype in (QT.Q4_0, QT.Q4_1, QT.Q4_K) and len(t0.shape) == 2 and all(
                t.qtype == t0.qtype and tuple(t.shape) == tuple(t0.shape) for t in ts):
            for t in ts:
                validate(t)
            ok[role] = (ts, layout(_kind(t0), (), t0.shape[0], t0.shape[-1])[0][1])  # (ng, nb, BLK4 | nsb, SB4K)
    if not ok:
        return {}
    n_l = len(next(iter(ok.values()))[0])
    if any(len(ts) != n_l for ts, _ in ok.values()):
        return {}
    nt = numba.get_num_threads() if threads is None else threads
    P = thread_parts([shape[0] for _, shape in ok.values()], nt)
    part = {r: shape[0] // P * shape[1] * shape[2] for r, (_, shape) in ok.items()}  # bytes of one part, one layer
    per_layer = sum(part.values())
    key = f"layers:{P}:" + ",".join(ok)
    got = _stored(store, key, [(np.uint8, (P * n_l * per_layer,))])
    buf = got[0] if got is not None else np.zeros(P * n_l * per_layer, np.uint8)
    views, off = {}, 0
    for r, (ts, (ng, nb, blk)) in ok.items():
        views[r] = np.lib.stride_tricks.as_strided(buf[off:], (n_l, P, ng // P, nb, blk),
                                                   (per_layer, n_l * per_layer, nb * blk, blk, 1))
        off += part[r]
    if got is None:
        if not all(_repack_parts(ts, views[r]) for r, (ts, _) in ok.items()):
            return {}
        if store is not None:
            store.put(key, (buf,))
    out = {}
    for r, (ts, _) in ok.items():
        for i, t in enumerate(ts):
            w = FastWeight(t.name, _kind(t), (t.shape[0], t.shape[-1]), views[r][i])
            w.stack = views[r]
            out[t.name] = w
            release_pages(t.data)
    return out


def _kind(qt: QTensor) -> str:
    """The FastWeight kind a 4-bit tensor's layout is: 'q4k' for Q4_K (q4k.py), 'q4' for Q4_0 / Q4_1."""
    return "q4k" if qt.qtype == QT.Q4_K else "q4"


def _repack_parts(role_tensors: list[QTensor], stack) -> bool:
    """Each layer's file blocks into its parts of the role's view (L, P, h, nb, BLK4 | nsb, SB4K); False if one
    does not fit."""
    from .repack import repack_q4, repack_q4k
    kind = QT(role_tensors[0].qtype).name.lower()
    h = stack.shape[2]

    def one(i):  # the jitted repack releases the GIL: two layers at a time on two cores
        raw = _file_blocks(role_tensors[i])
        parts = [raw[p * h * G:(p + 1) * h * G] for p in range(stack.shape[1])]
        if kind == "q4_k":
            return all(repack_q4k(part, stack[i, p]) for p, part in enumerate(parts))
        return all(repack_q4(part, kind, stack[i, p]) for p, part in enumerate(parts))
    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:
        return all(pool.map(one, range(len(role_tensors))))


def prepare_weight(qt: QTensor, store=None):
    """Interleaved layout for Q4_0/Q4_1/Q8_0 (and Q4_K: q4k.py) matrices, kquant's 5- and 6-bit layouts for Q5_0/Q5_1/
    Q5_K/Q6_K; cpu.py's layout for everything else. store: as for `repack`."""
    validate(qt)
    if qt.qtype in (QT.Q4_0, QT.Q4_1, QT.Q8_0, *kquant.QTYPES) and len(qt.shape) == 2:
        w = (kquant.prepare_weight if qt.qtype in kquant.QTYPES else repack)(qt, store)
        if w is not None:
            release_pages(qt.data)
            return w
    return cpu.prepare_weight(qt)


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:  # pragma: no cover - not glibc/Linux
        return None


_LIBC = _libc()
_PAGE = mmap.PAGESIZE
if _LIBC is not None and hasattr(_LIBC, "mallopt"):
    # Fixed mmap threshold (256 KiB): glibc otherwise raises it after the first large free, and the
    # repacking temporaries then stay in the heap and count in RSS long after they are freed.
    _LIBC.mallopt(-3, 256 * 1024)  # M_MMAP_THRESHOLD


def release_pages(data: np.ndarray) -> None:
    """Drop the resident pages of a memory-mapped (read-only, file-backed) tensor once it is repacked:
    they count in RSS otherwise. Harmless if read again (the kernel re-reads them from the page cache);
    a no-op for arrays that do not come from a file mapping or off Linux."""
    if _LIBC is None or not isinstance(data, np.ndarray) or data.flags.writeable or data.nbytes < 4 * _PAGE:
        return
    base = data
    while isinstance(base, np.ndarray) and base.base is not None and not isinstance(base, np.memmap):
        base = base.base
    if not isinstance(base, (np.memmap, mmap.mmap)) and not isinstance(getattr(base, "base", None), mmap.mmap):
        return
    start = data.ctypes.data
    lo = (start + _PAGE - 1) // _PAGE * _PAGE  # whole pages inside the tensor only
    hi = (start + data.nbytes) // _PAGE * _PAGE
    if hi > lo:
        _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED


def weight_shape(w) -> tuple[int, int]:
    """Logical (rows, cols) = (out_features, in_features) of a prepared weight."""
    return w.shape


def new_scratch(max_t: int, max_n: int) -> FastScratch:
    """Scratch for `matmul` covering x of up to (max_t, max_n)."""
    return FastScratch(max_t, max_n)
