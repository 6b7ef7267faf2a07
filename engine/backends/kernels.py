"""A backend's kernel set: kernels + memory for one device kind, chosen by name. `engine.model` only talks to this.

Each backend package has a kernel module with the same kernel names and signatures (`ref/kernels.py` is the
specification; the cpu backend runs `cpu/fast.py`, cuda `cuda/kernels.py`), wrapped here with memory helpers.
A kernel module may define its own memory helpers (a GPU module must):

    empty(shape, dtype)  zeros(shape, dtype)  to_device(host_array)  to_host(array) -> numpy copy
    zeros_sparse(shape, dtype)  (zeros for a large buffer filled a little at a time: the KV cache)
    upload(dst, host_array)  (copy into an existing buffer)  synchronize()

Missing ones default to numpy (host memory). Every buffer the model and the KV cache use is allocated through
these, so device arrays never have to pass through numpy on the hot path.
"""
from __future__ import annotations

import importlib
import mmap
from types import ModuleType

import numpy as np

from ..config import BACKENDS
from ..errors import BackendUnavailable, ConfigError

# Kernel names every kernel module provides (see engine/backends/ref/kernels.py for their contracts).
KERNELS = (
    "prepare_weight", "weight_shape", "new_scratch",
    "matmul", "embed", "bias_add", "residual_add", "rmsnorm", "swiglu", "rope", "argmax",
    "kv_store_f16", "kv_store_int8", "attention_f16", "attention_int8",
)


def _np_empty(shape, dtype):
    return np.empty(shape, dtype)


def _np_zeros(shape, dtype):
    return np.zeros(shape, dtype)


SPARSE_MIN_BYTES = 1 << 22  # numpy asks for huge pages from 4 MiB up


def _np_zeros_sparse(shape, dtype):
    """Zeros in a mapping of its own with huge pages off (Linux), for host memory filled a little at a time.

    Why: numpy asks the kernel for 2 MiB pages for large arrays. The KV cache is one array per role with a
    layer axis, so a first reply touches a new 2 MiB page in each layer's K and V: 60 pages cleared, and on
    a fragmented host compacted for first, ~1-2 ms each on the dev VM (the first step of a fresh process
    spent ~0.2 s of system time there). With 4 KiB pages a position costs what it touches, and the
    resident size is what the conversation used. scripts/first_step.py: a 40-token prompt's prefill on a
    new cache 103 -> 50 ms; decode the same at 1000 context, ~1.5% slower at 1500 (TLB misses)."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if nbytes < SPARSE_MIN_BYTES or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.zeros(shape, dt)
    buf = mmap.mmap(-1, nbytes)  # anonymous: zero-filled, page-aligned
    buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dt).reshape(shape)


def _np_to_device(a):
    return np.ascontiguousarray(a)


def _np_to_host(a):
    return np.array(a, copy=True)


def _np_upload(dst, a):
    dst[:] = a


def _nothing():
    return None


class Kernels:
    """Kernels + memory helpers of one backend. Kernel functions are plain attributes: `be.matmul(...)`."""

    def __init__(self, name: str, module: ModuleType):
        self.name = name
        self.module = module
        missing = [k for k in KERNELS if not hasattr(module, k)]
        if missing:  # a kernel module that drifted from ref.py is a bug, not a user error
            raise AssertionError(f"kernel module {module.__name__} lacks {', '.join(missing)}")
        for k in KERNELS:
            setattr(self, k, getattr(module, k))
        self.kv_group = getattr(module, "kv_group")
        self.empty = getattr(module, "empty", _np_empty)
        self.zeros = getattr(module, "zeros", _np_zeros)
        self.zeros_sparse = getattr(module, "zeros_sparse", _np_zeros_sparse if self.zeros is _np_zeros else self.zeros)
        self.to_device = getattr(module, "to_device", _np_to_device)
        self.to_host = getattr(module, "to_host", _np_to_host)
        self.on_host = self.to_host is _np_to_host  # its arrays are numpy's: a host copy is a numpy copy
        self.upload = getattr(module, "upload", _np_upload)
        self.synchronize = getattr(module, "synchronize", _nothing)

    def __repr__(self):
        return f"Kernels({self.name!r})"


_cache: dict[str, Kernels] = {}
# backend name -> kernel module: "cpu" runs cpu/fast.py (interleaved int8-dot matmuls; all other kernels are
# cpu/kernels.py's, and weight types it does not repack keep that layout)
_MODULES = {"ref": "engine.backends.ref.kernels", "cpu": "engine.backends.cpu.fast",
            "cuda": "engine.backends.cuda.kernels"}


def get_kernels(name: str = "cpu") -> Kernels:
    """The backend called `name` ('cpu' numba, 'ref' numpy, 'cuda' numba.cuda; imported lazily)."""
    if name not in BACKENDS:
        raise ConfigError(f"--backend {name!r} is not one of {', '.join(BACKENDS)}")
    if name not in _cache:
        try:
            module = importlib.import_module(_MODULES[name])
        except ImportError as e:  # e.g. cuda without numba-cuda installed, or no GPU driver
            raise BackendUnavailable(f"backend {name!r} cannot be loaded here ({e}); "
                                     "use --backend cpu, or install the 'cuda' extra on a GPU machine") from e
        _cache[name] = Kernels(name, module)
    return _cache[name]
