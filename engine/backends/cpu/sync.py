"""Work sharing between the threads of one parallel region (numba): atomic counters as LLVM intrinsics.

The fused decode step (step.fused_forward) runs a whole forward pass inside ONE parallel region
instead of ~150 (a fork/join of numba's OpenMP pool costs ~2.2 us, measured: 0.33 ms per token). Its work
is a chain of phases (a matmul's row groups, attention's chunks); within a phase every thread claims chunks
of items from a shared counter, and the thread whose report completes the phase does the serial work
that follows (norms, rope, merges) and opens the next phase. No thread ever waits for a *particular* other
thread, only for work that somebody has claimed: if the runtime gave the region fewer threads than asked
for (or ran its iterations one after another), the first thread simply does everything and the others
find nothing left. So this never deadlocks, whatever the threading layer does.

`sync` (new_sync) is an int64 array (n_phases + 1, 8 * (max_threads + 1)), zeroed before the region
starts: row p holds phase p's claim counters (one per thread's part) and its done counter, each on a cache
line of its own; the last row the number of open phases. The intrinsics take flat indices into it.
"""
from __future__ import annotations

from ... import numba_env  # noqa: F401  (flags before numba)

import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

# a claim takes this share of what is left of a part: ~10 claims for 48 items, the last ones single items
# (fixed quarters left up to a quarter part to one thread at a phase's end: 100-160 us per token waited at
# the gate/up and head phases, measured with scripts/step_phases.py)
GUIDED = 3
SPIN_BEFORE_YIELD = 4000  # pause instructions (~40 us) before a waiting thread yields its core
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _slot(context, builder, arrty, arr, idx):
    # element idx of the array's data, flat (C order)
    a = context.make_array(arrty)(context, builder, arr)
    return builder.gep(a.data, [idx])


@intrinsic
def atomic_add(typingctx, arr, idx, val):
    """arr[idx] += val atomically (sequentially consistent); returns the old value. arr: int64 array."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.layout == "C"):
        return None
    sig = types.int64(arr, idx, val)

    def codegen(context, builder, signature, args):
        p = _slot(context, builder, signature.args[0], args[0], args[1])
        v = context.cast(builder, args[2], signature.args[2], types.int64)
        return builder.atomic_rmw("add", p, v, "seq_cst")
    return sig, codegen


@intrinsic
def atomic_load(typingctx, arr, idx):
    """arr[idx], an atomic (sequentially consistent) load: never hoisted out of a wait loop."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.layout == "C"):
        return None
    sig = types.int64(arr, idx)

    def codegen(context, builder, signature, args):
        p = _slot(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(p, "seq_cst", 8)
    return sig, codegen


@intrinsic
def atomic_store(typingctx, arr, idx, val):
    """arr[idx] <- val atomically (sequentially consistent: every write before it is visible first)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.layout == "C"):
        return None
    sig = types.void(arr, idx, val)

    def codegen(context, builder, signature, args):
        p = _slot(context, builder, signature.args[0], args[0], args[1])
        builder.store_atomic(context.cast(builder, args[2], signature.args[2], types.int64), p, "seq_cst", 8)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def spin_pause(typingctx, n):
    """One spin-wait step: the x86 `pause` hint (saves power, frees the sibling hyperthread), and after
    n >= SPIN_BEFORE_YIELD steps sched_yield(): a waiting thread whose partner was descheduled (another
    process busy on that core) hands its core back instead of burning a time slice."""
    sig = types.void(n)

    def codegen(context, builder, signature, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        n64 = context.cast(builder, args[0], signature.args[0], types.int64)
        with builder.if_then(builder.icmp_signed(">=", n64, ir.Constant(ir.IntType(64), SPIN_BEFORE_YIELD)),
                             likely=False):
            yf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
            builder.call(yf, [])
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def grab(sync, ph, tid, nt, n, h):
    """The next chunk of phase ph's items 0..n for thread tid of nt -> (h, lo, hi); none left when lo >= hi.
    The items are cut into nt contiguous parts; a thread takes chunks of its own part first (so each thread
    streams its own contiguous run of weights, as a static schedule would), then of the others' (h counts
    the parts it has emptied; start at 0). Each part's claim counter sits on a cache line of its own.
    Guided: a claim takes 1/GUIDED of what is left of the part (at least one item), so the last chunks of
    a phase are single items and a thread that runs out waits at most one item for the other."""
    row = ph * sync.shape[1]
    while h < nt:
        part = (tid + h) % nt
        p_lo, p_hi = part * n // nt, (part + 1) * n // nt
        left = p_hi - p_lo - atomic_load(sync, row + part * 8)
        if left > 0:
            c = max(1, left // GUIDED)
            i = p_lo + atomic_add(sync, row + part * 8, c)
            if i < p_hi:
                return h, i, min(i + c, p_hi)
        h += 1
    return h, 0, 0


@njit(cache=True, nogil=True, inline="always")
def finish(sync, ph, count, n):
    """Report count items of phase ph done; True for the thread whose report completes the phase. A report
    of nothing is not made (it could see the phase complete too: two finishers). The fused step's threads
    report once each, after their last item, not after every chunk: the done counter's cache line then
    crosses between the cores once per thread and phase instead of ~10 times (scripts/step_phases.py,
    60-99 positions: the step's phases 3145 -> 3108 and 2659 -> 2629 us per token, the same logits)."""
    return count > 0 and atomic_add(sync, ph * sync.shape[1] + sync.shape[1] - 8, count) + count == n


@njit(cache=True, nogil=True, inline="always")
def open_phase(sync, ph):
    """Phase ph is complete, its serial tail included: let the threads waiting on it go."""
    atomic_store(sync, (sync.shape[0] - 1) * sync.shape[1], ph + 1)


@intrinsic
def prefetch(typingctx, addr):
    """Ask for the cache line at address addr (an integer: an array's ctypes.data plus a byte offset) to be
    brought into L2. A hint: it never faults and returns nothing."""
    if not isinstance(addr, types.Integer):
        return None
    sig = types.void(addr)

    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        p = builder.inttoptr(context.cast(builder, args[0], signature.args[0], types.int64), i8p)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0i8")
        builder.call(fn, [p, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])  # read, L2, data
        return context.get_dummy_value()
    return sig, codegen


@njit(cache=True, nogil=True, inline="always")
def is_open(sync, ph):
    """Phase ph is complete, tail included."""
    return atomic_load(sync, (sync.shape[0] - 1) * sync.shape[1]) > ph


@njit(cache=True, nogil=True, inline="always")
def wait_open(sync, ph):
    """Wait until phase ph is complete, tail included."""
    n = 0
    while not is_open(sync, ph):
        spin_pause(n)
        n += 1


@njit(cache=True, nogil=True)
def wait_fetching(sync, ph, a, lines, b):
    """wait_open(sync, ph), asking meanwhile for up to `lines` cache lines from address a on and, unless b is
    0, as many from b on, one of each in turn (addresses as ints: what a waiting thread will read next, one
    stream or two: step._ahead)."""
    n = 0
    i = 0
    while not is_open(sync, ph):
        if i < lines:
            prefetch(a + 64 * i)
            if b != 0:
                prefetch(b + 64 * i)
            i += 1
        else:
            spin_pause(n)
            n += 1


@njit(cache=True, nogil=True)
def reset(sync):
    """All counters to zero (before the region; a plain loop, not an array expression, so that a parallel
    caller does not turn it into a parallel region of its own)."""
    reset_rows(sync, sync.shape[0] - 1)


@njit(cache=True, nogil=True)
def reset_rows(sync, rows):
    """The counters of phases 0..rows-1 and the open-phase count to zero: what a region of that many
    phases uses (a decode block's passes size sync for the longest block, a single pass uses a part)."""
    w = sync.shape[1]
    flat = sync.reshape(-1)
    for i in range(min(rows, sync.shape[0] - 1) * w):
        flat[i] = 0
    for i in range((sync.shape[0] - 1) * w, sync.shape[0] * w):
        flat[i] = 0


def new_sync(n_phases: int, max_threads: int):
    """The counters for n_phases phases and up to max_threads threads: one row per phase (a claim counter
    per thread's part and the done counter, 64 bytes apart) and a last row holding the open-phase count."""
    import numpy as np
    return np.zeros((n_phases + 1, 8 * (max_threads + 1)), np.int64)
