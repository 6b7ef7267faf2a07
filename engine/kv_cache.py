"""Preallocated, position-indexed KV cache. Rolling back (rejected drafts, prefix reuse) = truncate(n).

Layout per layer (what the kernels take, see engine/backends/ref/kernels.py):
    f16:  k, v                  (capacity, n_kv_head, head_dim) float16
    int8: k_q, v_q              (capacity, n_kv_head, head_dim) int8
          k_s, v_s              (capacity, n_kv_head, head_dim // group) float32, one scale per group values
The whole cache is one array per role with a leading n_layer axis; `layer(i)` returns the per-layer views in
the argument order of `kv_store_<dtype>` / `attention_<dtype>`. On the host the arrays come from the backend's
`zeros_sparse` (4 KiB pages, see engine/backend.py): a reply faults in the positions it writes, not a 2 MiB
page per layer and role.
"""
from __future__ import annotations

from .config import KV_DTYPES
from .errors import ConfigError, InputError


class KVCache:
    """Keys/values of positions 0..length-1 for every layer; positions >= length are garbage."""

    def __init__(self, backend, n_layer: int, capacity: int, n_kv_head: int, head_dim: int,
                 kv_dtype: str = "f16"):
        if kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if capacity < 1:
            raise ConfigError(f"--kv-capacity must be >= 1, got {capacity}")
        self.kv_dtype = kv_dtype
        self.capacity = capacity
        self.length = 0
        shape = (n_layer, capacity, n_kv_head, head_dim)
        try:
            self._allocate(backend, shape, kv_dtype, head_dim)
        except (MemoryError, OSError) as e:  # numpy's MemoryError, mmap's ENOMEM, a device's out of memory
            per_pos = n_layer * n_kv_head * head_dim * 2 * (2 if kv_dtype == "f16" else 1)
            why = getattr(e, "strerror", None) or "out of memory"
            raise ConfigError(f"a KV cache of {capacity} positions (about {per_pos * capacity / 2**30:.1f} GiB of "
                              f"{kv_dtype}) cannot be allocated here ({why}); lower --kv-capacity or --max-context"
                              ) from None
        self._layers = [tuple(a[i] for a in self._arrays) for i in range(n_layer)]  # views, built once

    def _allocate(self, backend, shape: tuple, kv_dtype: str, head_dim: int) -> None:
        n_layer, capacity, n_kv_head = shape[:3]
        if kv_dtype == "f16":
            self.k = backend.zeros_sparse(shape, "float16")  # (n_layer, capacity, n_kv_head, head_dim) f16
            self.v = backend.zeros_sparse(shape, "float16")
            self._arrays = (self.k, self.v)
        else:
            group = backend.kv_group(head_dim)
            s_shape = (n_layer, capacity, n_kv_head, head_dim // group)
            self.k_q = backend.zeros_sparse(shape, "int8")  # (n_layer, capacity, n_kv_head, head_dim) int8
            self.k_s = backend.zeros_sparse(s_shape, "float32")  # (n_layer, capacity, n_kv_head, head_dim // g) f32
            self.v_q = backend.zeros_sparse(shape, "int8")
            self.v_s = backend.zeros_sparse(s_shape, "float32")
            self._arrays = (self.k_q, self.k_s, self.v_q, self.v_s)

    def layer(self, i: int) -> tuple:
        """Per-layer views in kernel argument order: (k, v) for f16, (k_q, k_s, v_q, v_s) for int8."""
        return self._layers[i]

    @property
    def nbytes(self) -> int:
        """Memory held by the cache, in bytes."""
        return sum(int(a.nbytes) for a in self._arrays)

    def check_room(self, n_total: int) -> None:
        """InputError unless `n_total` positions fit in the cache."""
        if n_total > self.capacity:
            raise InputError(f"the conversation needs {n_total} tokens but the KV cache holds {self.capacity}; "
                             "raise --kv-capacity/--max-context, or start a new conversation")

    def truncate(self, n: int) -> None:
        """Keep positions 0..n-1 (n <= length); later positions will be overwritten."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}) outside 0..{self.length}")
        self.length = n

    def reset(self) -> None:
        """Forget everything (length 0)."""
        self.length = 0
