"""numba.cuda backend: the `backends/ref/kernels.py` contract (same names, same signatures, results written into the
first argument) over device arrays, plus the memory helpers `engine.backend` asks a GPU module for.

Importing this module raises BackendUnavailable (one line saying why) without numba-cuda (the `cuda` extra)
or without a usable GPU/driver, unless the CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1, tests); that is what
`--backend cuda` reports through `engine.backend.get_kernels`. The device kernels themselves live in
`cuda_quant` / `cuda_ops`, which import without a GPU: their `KERNELS` tables (function + explicit
signatures) let tests type-check every kernel with `numba.cuda.compile_ptx` for sm_70 and sm_90.

Launch geometry lives in `LAUNCH`: full-size blocks on a GPU, a handful of threads under the simulator (which
runs every thread as a Python thread, ~1 ms each). Kernels loop with stride blockDim, so any geometry is exact.
Every launch increments `LAUNCHES` (launches per token = delta / tokens).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np

from ...errors import BackendUnavailable

if importlib.util.find_spec("numba_cuda") is None:
    raise BackendUnavailable("the cuda backend needs numba-cuda: pip install 'ninfer-chat[cuda]' "
                             "(numba-cuda[cu12]); or use --backend cpu")

from numba import cuda  # noqa: E402

from . import ops as cuda_ops, quant as cuda_quant  # noqa: E402
from .quant import Q4, Q8, TT, CudaWeight  # noqa: E402
from ..ref.kernels import kv_group  # noqa: E402,F401  (same int8 KV grouping as the reference)

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


@dataclass
class Launch:
    """Block geometry. lanes x rows threads per matmul block (lanes share one weight row); `threads` per
    row-block kernel (rmsnorm, argmax, attention); `elt` threads and at most `elt_blocks` blocks for the
    grid-stride elementwise kernels."""

    lanes: int = 32
    rows: int = 4
    threads: int = 128
    elt: int = 256
    elt_blocks: int = 1024
    split_min_cap: int = 512  # attention over a cache of at least this capacity with few rows: split it
    split_max_rows: int = 4  # ... when T <= this (decode, short verify blocks)
    split_len: int = 256  # positions per split (the number of splits follows from the capacity)


LAUNCH = (Launch(lanes=2, rows=4, threads=4, elt=16, elt_blocks=1, split_min_cap=1 << 30) if SIMULATOR
          else Launch())
LAUNCHES = [0]  # total kernel launches so far (a list so tests and benches can read it by reference)


def check_available() -> None:
    """Raise BackendUnavailable (one line saying why) unless a CUDA GPU and driver are usable."""
    if SIMULATOR:
        return
    try:
        ok = cuda.is_available()
    except Exception as e:  # broken driver installs raise instead of returning False
        raise BackendUnavailable(f"the cuda backend cannot start: {e}; use --backend cpu") from e
    if not ok:
        raise BackendUnavailable("the cuda backend found no usable NVIDIA GPU/driver (numba.cuda.is_available() "
                                 "is False); use --backend cpu")


check_available()  # engine.backend turns this import-time error into the user-facing message

_compiled: dict[str, object] = {}


def _kern(name: str):
    """The jitted kernel `name` (compiled for the actual argument types on its first launch)."""
    k = _compiled.get(name)
    if k is None:
        fn = (cuda_quant.KERNELS.get(name) or cuda_ops.KERNELS[name])[0]
        # on-disk cache on a GPU (compiling all kernels takes tens of seconds); the simulator compiles nothing
        k = _compiled[name] = cuda.jit(fn) if SIMULATOR else cuda.jit(cache=True)(fn)
    return k


class _Capture:
    """Where launches go. Normally the legacy default stream; while `cuda_graph` captures a decode step,
    a cuda.core GraphBuilder (GPU) or a Python list of launches (simulator), and the position-dependent
    kernels read the position from `pos_dev` instead of a launch argument."""

    stream = 0
    recording = None  # list of (kernel, grid, block, args) under the simulator
    pos_dev = None  # (1,) int32 device array while capturing

    @property
    def active(self) -> bool:
        return not isinstance(self.stream, int) or self.recording is not None


CAPTURE = _Capture()
_zero_pos: dict[int, object] = {}  # device id -> (1,) int32 zeros: the `pos` array of plain launches


def _pos_args(pos0) -> tuple:
    """(pos array, pos_base) for the position-dependent kernels (see cuda_ops)."""
    if CAPTURE.pos_dev is not None:
        return CAPTURE.pos_dev, 0
    dev = 0 if SIMULATOR else cuda.get_current_device().id
    z = _zero_pos.get(dev)
    if z is None:
        z = _zero_pos[dev] = cuda.to_device(np.zeros(1, np.int32))
    return z, int(pos0)


_launched: set[str] = set()  # kernels launched at least once (their compile and cache load succeeded)


def _launch(name, grid, block, *args):
    LAUNCHES[0] += 1
    k = _kern(name)
    if CAPTURE.recording is not None:
        CAPTURE.recording.append((k, grid, block, args))
    elif not isinstance(CAPTURE.stream, int):
        k[grid, block, CAPTURE.stream](*args)
    elif name in _launched or SIMULATOR:
        k[grid, block](*args)
    else:  # first launch: if the on-disk kernel cache is the problem, compile without it once more
        try:
            k[grid, block](*args)
        except Exception:
            fn = (cuda_quant.KERNELS.get(name) or cuda_ops.KERNELS[name])[0]
            k = _compiled[name] = cuda.jit(fn)
            k[grid, block](*args)  # a real error raises again here
        _launched.add(name)


def _elt_grid(n: int) -> int:
    return max(1, min(LAUNCH.elt_blocks, (n + LAUNCH.elt - 1) // LAUNCH.elt))


# ------------------------------------------------------------------------------------------ memory
def _no_capture(what):
    if CAPTURE.active:
        raise RuntimeError(f"{what} while capturing a CUDA graph: warm the run state up with a plain forward first")


def empty(shape, dtype):
    """Uninitialised device array."""
    _no_capture("allocation")
    return cuda.device_array(shape, np.dtype(dtype))


def zeros(shape, dtype):
    """Zero-filled device array."""
    _no_capture("allocation")
    return cuda.to_device(np.zeros(shape, np.dtype(dtype)))


def to_device(a):
    """Copy a host array to a new device array."""
    return cuda.to_device(np.ascontiguousarray(a))


def to_host(a):
    """Copy a device array to a new numpy array (synchronizes). While capturing: a placeholder of zeros (the
    graph runner copies the real result after each replay)."""
    if CAPTURE.active:
        return np.zeros(a.shape, a.dtype)
    return a.copy_to_host()


def upload(dst, a):
    """Copy host array `a` into the existing device buffer `dst` (same shape). Skipped while capturing: the
    graph runner writes the inputs (tokens, position) before each replay."""
    if CAPTURE.active:
        return
    dst.copy_to_device(np.ascontiguousarray(a, dtype=dst.dtype).reshape(dst.shape))


def synchronize():
    """Wait for all launched work of the current device."""
    cuda.synchronize()


# ------------------------------------------------------------------------------------------ weights
def prepare_weight(qt) -> CudaWeight:
    """Repack a file tensor into a device format (see cuda_quant) and copy it to the current device."""
    return cuda_quant.prepare_weight(qt)


def weight_shape(w: CudaWeight) -> tuple[int, int]:
    """Logical (rows, cols) = (out_features, in_features)."""
    return w.shape


def new_scratch(max_t: int, max_n: int):
    """The cuda matmuls need no scratch."""
    return None


# ------------------------------------------------------------------------------------------- linear
def matmul(out, x, w: CudaWeight, scratch):
    """out (T, d) f32 <- x (T, n) f32 @ W (d, n)^T."""
    matmul_epi(out, x, w, 0)


def matmul_epi(out, x, w: CudaWeight, epi: int):
    """matmul with an epilogue (cuda_fused): 0 out = xW^T; 1 out += xW^T; 2 W rows are (gate, up) pairs and
    out (T, d/2) = silu(gate) * up."""
    d, t_n = w.shape[0], x.shape[0]
    assert epi != 2 or LAUNCH.rows % 2 == 0
    grid = ((d + LAUNCH.rows - 1) // LAUNCH.rows, (t_n + TT - 1) // TT)
    block = (LAUNCH.lanes, LAUNCH.rows)
    if w.fmt == Q4:
        _launch("matmul_q4", grid, block, out, x, *w.arrays, epi)
    elif w.fmt == Q8:
        _launch("matmul_q8", grid, block, out, x, *w.arrays, w.group, epi)
    else:
        _launch("matmul_dense", grid, block, out, x, w.arrays[0], epi)


def embed(out, w: CudaWeight, tokens):
    """out (T, n) f32 <- rows tokens (T,) int32 (device) of the table W (vocab, n)."""
    t_n, n = out.shape
    grid = (t_n, (n + LAUNCH.elt - 1) // LAUNCH.elt)
    if w.fmt == Q4:
        _launch("embed_q4", grid, LAUNCH.elt, out, *w.arrays, tokens)
    elif w.fmt == Q8:
        _launch("embed_q8", grid, LAUNCH.elt, out, *w.arrays, w.group, tokens)
    else:
        _launch("embed_dense", grid, LAUNCH.elt, out, w.arrays[0], tokens)


def bias_add(out, b):
    """out (T, n) += b (n,)."""
    _launch("bias_add", _elt_grid(out.size), LAUNCH.elt, out, b)


def residual_add(out, x):
    """out (T, n) += x (T, n)."""
    _launch("residual_add", _elt_grid(out.size), LAUNCH.elt, out, x)


# -------------------------------------------------------------------------------------- elementwise
def rmsnorm(out, x, w, eps):
    """out (R, n) <- x (R, n) / sqrt(mean(x^2) + eps) * w (n,)."""
    _launch("rmsnorm", x.shape[0], LAUNCH.threads, out, x, w, float(eps))


def swiglu(out, gate, up):
    """out (T, f) <- silu(gate (T, f)) * up (T, f)."""
    _launch("swiglu", _elt_grid(out.size), LAUNCH.elt, out, gate, up)


def rope(x, pos0, inv_freq, neox):
    """Rotate x (T, H, hd) in place at positions pos0.. (see ref.rope)."""
    _launch("rope", _elt_grid(x.size // 2), LAUNCH.elt, x, *_pos_args(pos0), inv_freq, int(bool(neox)))


def argmax(out, logits):
    """out (T,) int32 <- first index of the max of each row of logits (T, vocab)."""
    _launch("argmax", logits.shape[0], LAUNCH.threads, out, logits)


# ------------------------------------------------------------------------------------------ KV cache
def kv_store_f16(k_cache, v_cache, k, v, pos0):
    """k_cache, v_cache (cap, n_kv, hd) f16 [pos0 : pos0+T] <- k, v (T, n_kv, hd) f32."""
    _launch("kv_store_f16", _elt_grid(k.size), LAUNCH.elt, k_cache, v_cache, k, v, *_pos_args(pos0))


def kv_store_int8(k_q, k_s, v_q, v_s, k, v, pos0):
    """int8 cache [pos0 : pos0+T] <- k, v (T, n_kv, hd); one f32 scale per group (see ref.kv_store_int8)."""
    _launch("kv_store_int8", _elt_grid(k_s.shape[1] * k_s.shape[2] * k.shape[0]), LAUNCH.elt,
            k_q, k_s, v_q, v_s, k, v, *_pos_args(pos0))


_split_scratch: dict[tuple, tuple] = {}  # (device, T, H, S, hd) -> (pm, pl, pacc) partials of attention_split
_NO_SCALE = {}  # device -> (1, 1, 1) f32 placeholder for the f16 case


def _split_attention(out, q, k_c, k_s, v_c, v_s, pos0, scale) -> bool:
    """Launch split attention (attention_split + attention_combine) when it pays; False when it does not."""
    t_n, n_h, hd = q.shape
    cap = k_c.shape[0]
    if t_n > LAUNCH.split_max_rows or cap < LAUNCH.split_min_cap:
        return False
    n_s = (cap + LAUNCH.split_len - 1) // LAUNCH.split_len
    split_len = (cap + n_s - 1) // n_s
    dev = 0 if SIMULATOR else cuda.get_current_device().id
    key = (dev, t_n, n_h, n_s, hd)
    bufs = _split_scratch.get(key)
    if bufs is None:  # allocated on the first (plain) call of a shape, reused by graph replays
        bufs = _split_scratch[key] = (empty((t_n, n_h, n_s), "float32"), empty((t_n, n_h, n_s), "float32"),
                                      empty((t_n, n_h, n_s, hd), "float32"))
    has_scale = 1
    if k_s is None:
        has_scale = 0
        k_s = v_s = _NO_SCALE.get(dev)
        if k_s is None:
            k_s = v_s = _NO_SCALE[dev] = empty((1, 1, 1), "float32")
    _launch("attention_split", (t_n, n_h, n_s), LAUNCH.threads, *bufs, q, k_c, k_s, v_c, v_s, has_scale,
            *_pos_args(pos0), float(scale), split_len)
    _launch("attention_combine", (t_n, n_h), min(LAUNCH.threads, hd), out, *bufs)
    return True


def attention_f16(out, q, k_cache, v_cache, pos0, scale):
    """out (T, H, hd) <- causal GQA softmax(q K^T * scale) V over an f16 cache."""
    if _split_attention(out, q, k_cache, None, v_cache, None, pos0, scale):
        return
    _launch("attention_f16", (q.shape[0], q.shape[1]), LAUNCH.threads, out, q, k_cache, v_cache,
            *_pos_args(pos0), float(scale))


def attention_int8(out, q, k_q, k_s, v_q, v_s, pos0, scale):
    """As attention_f16 over an int8 cache."""
    if _split_attention(out, q, k_q, k_s, v_q, v_s, pos0, scale):
        return
    _launch("attention_int8", (q.shape[0], q.shape[1]), LAUNCH.threads, out, q, k_q, k_s, v_q, v_s,
            *_pos_args(pos0), float(scale))
