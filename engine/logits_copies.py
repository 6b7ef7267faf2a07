"""Host copies of a forward pass's logits rows that reuse memory no caller holds any more (Model.head)."""
from __future__ import annotations

import sys

import numpy as np


class LogitsCopies:
    """Where a host backend's forward copies a pass's logits rows (the run state's buffer is overwritten by the
    next pass; Model.head, the CPU fused step's runner): a few kept buffers, each reused once no caller holds it
    or any view of it (CPython's reference count says so), so the array forward returns stays its caller's for
    as long as the caller keeps it. A verify pass's rows (T x vocab
    f32: 786 KB at T=4) are past glibc's mmap threshold (cpu/fast_weights sets 256 KiB): a fresh copy was a fresh
    mapping and its page faults every pass, 262 us at T=4 and 550 us at T=8 against 38 and 116 us into memory
    already mapped (this host, 2026-12-07)."""

    KEEP = 4  # buffers kept; while callers hold them all, a pass's rows go to a fresh array
    MAX_BYTES = 8 << 20  # larger rows (a long prompt's all_logits: scoring, accuracy runs) are copied as before,
    # and freed with the caller's array (a verify pass: 1.5 MB at T=8 with SmolLM2's vocabulary, 4.9 MB Qwen's)

    def __init__(self):
        self.bufs: list[np.ndarray] = []

    def copy(self, rows: np.ndarray) -> np.ndarray:
        if rows.nbytes > self.MAX_BYTES:
            return rows.copy()
        for i in range(len(self.bufs)):
            if _refs(self.bufs, i) != _HELD_BY_LIST_ONLY:  # a caller's array, or a view of it, holds one more
                continue
            buf = self.bufs[i]
            if buf.shape[1:] == rows.shape[1:] and buf.dtype == rows.dtype:
                if buf.shape[0] < rows.shape[0]:
                    buf = self.bufs[i] = np.empty_like(rows)
                out = buf[:rows.shape[0]]
                np.copyto(out, rows)
                return out
        out = rows.copy()
        if len(self.bufs) < self.KEEP:
            self.bufs.append(out)
        return out


def _refs(bufs: list, i: int) -> int:
    """References to bufs[i]: the list's, those of this call, and any the caller's arrays hold."""
    return sys.getrefcount(bufs[i])


_HELD_BY_LIST_ONLY = _refs([np.empty(0)], 0)  # (measured, not assumed: the interpreter's own count varies)
