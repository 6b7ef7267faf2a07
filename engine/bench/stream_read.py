"""The bandwidth probe's second reader (bandwidth.py): a streaming sum that reads as the decode kernels do."""
from __future__ import annotations

from .. import numba_env  # noqa: F401  (flags before numba)

import numpy as np
from numba import njit

from ..backends.cpu.sync import prefetch


@njit(cache=True, nogil=True, fastmath=True)
def stream_sum(a, ahead):
    """Sum of a (f64, contiguous), 64 bytes at a time, asking for the line `ahead` bytes further first."""
    base = np.int64(a.ctypes.data)
    s = 0.0
    for line in range(a.shape[0] // 8):
        prefetch(base + 64 * line + ahead)
        for j in range(8 * line, 8 * line + 8):
            s += a[j]
    return s
