"""The cpu backend: numba kernels on the host (see engine.backends for the interface).

    kernels.py     the contract kernels (engine/backends/ref/kernels.py's names), generic layout
    layout.py      the row-interleaved weight layout (repack.py writes it, the matmuls read it)
    fast.py        the kernel set this backend runs: int8-dot matmuls over that layout (avx2.py, avx2_q8.py)
    fast_weights.py  the set's weights: files repacked into that layout, the layers' buffer per thread
    attn*.py       attention: split decode items, prompt row tiles, int8 cache variants, softmax
    step.py        the fused step: the whole forward in ONE parallel region, generated from engine.forward's
                   phase list; step_mm.py its matmul phases, step_weights.py its per-layout weight tables
                   (any mix of fast.py's and kquant.py's layouts), sync.py its phase counters, guard.py its
                   decode thread guard
    runner.py      CpuRunner: the fused step, or the plain walk (engine.model.Model) where it does not apply
    tier.py, compile_bg.py   the cold start: kernels one by one while a helper process compiles the fused step
    repack.py, weight_store.py   the interleaved layout, and its on-disk cache of repacked weights
    kv_taps.py, dflash_kernels.py   the DFlash drafter's reads of the target's cache, its RoPE + KV store
    target.py      which SIMD the host has
"""
from __future__ import annotations

import os

from ...config import EngineArgs
from ...model import STACKED_ROLES, Model


class Backend:
    """engine.backends' interface for the host CPU."""

    name = "cpu"

    def __init__(self, args: EngineArgs, path):
        """Early set-up, before the model file is parsed: the repacked weights an earlier start stored for
        this file are read in the background meanwhile (whole matrices only: not for TP shards)."""
        self.args = args
        self.store = _weight_store(path) if args.tp <= 1 else None

    def build(self, model_file, max_batch: int):
        """A CpuRunner over build_model's weights; the fused step when every matrix took a fast layout."""
        prepare_numba()
        from .runner import CpuRunner
        from .step import build
        model = build_model(model_file, max_batch, self.store)
        if self.store is not None:
            self.store.save()  # a first start of this model (or layout): the next one reads these arrays
            self.store.release()
        return CpuRunner(model, build(model))

    def warm_up(self, runner, say=None) -> None:
        """Compile the kernels now, not at the first token (see warm_up)."""
        warm_up(runner, self.args.kv_dtype, say)

    def describe(self, runner) -> str:
        step = type(runner.step).__name__ if runner.step is not None else "kernel by kernel"
        return f"cpu ({step})"


def build_model(model_file, max_batch: int = 64, store=None) -> Model:
    """The model's weights on the cpu kernels: the layers' matrices prepared at once into the fused step's
    layout (fast.prepare_layers: one region per thread), the rest one by one; store: weight_store.WeightStore
    of arrays an earlier start prepared (None: prepare all)."""
    from ..kernels import get_kernels
    from . import fast
    a, tensors = model_file.args, model_file.tensors
    kw = {} if store is None else {"store": store}
    stacked = fast.prepare_layers({role: [tensors[f"blk.{i}.{role}.weight"] for i in range(a.n_layer)]
                                   for role in STACKED_ROLES}, **kw)
    return Model(a, tensors, get_kernels("cpu"), max_batch=max_batch, store=store, stacked=stacked)


def warm_up(runner, kv_dtype: str = "f16", say=None) -> None:
    """Compile the kernels now (one decode step and a 2-token step on a scratch cache), not at first token.

    The fused step on a cold numba cache is compiled in tiers (tier.py, compile_bg.py): the runner serves
    with the step's kernels called one by one while a helper process compiles the one-call fused step;
    NINFER_COMPILE_BG=0 compiles the fused step here instead (the old way, for A-B comparisons).
    On a warm start the fused step is already loaded from numba's cache (tier.start): nothing is left to
    compile, so the two scratch steps are skipped (they cost ~20 ms quiet, ~100 ms with another process on
    a core, of every start's time to first token; the first real step pays only the dispatch)."""
    from ...forward import scratch_steps
    from .step import FusedForward
    ff = runner.step
    if isinstance(ff, FusedForward) and os.environ.get("NINFER_COMPILE_BG") != "0":
        from .tier import start
        runner.step = start(ff, kv_dtype, say)
        if runner.step is ff and fused_loaded(ff, kv_dtype):
            return
    scratch_steps(runner, kv_dtype)


def fused_loaded(ff, kv_dtype: str) -> bool:
    """True when the fused step is compiled for this model's argument types in this process (loaded from the
    cache or compiled); never compiles. False for an int8 cache: start() leaves its fused step to the scratch
    steps to compile."""
    from .step import fused_forward
    from .tier import fused_signature
    sig = fused_signature(ff, ff.kv_tuple(ff.model.new_cache(4, kv_dtype)))
    return tuple(sig) in fused_forward.overloads


def prepare_numba() -> None:
    """Before the first CPU kernel: cached kernels load without numba's context refresh (~0.2 s of every
    start a cached kernel does not need; engine.numba_env.lazy_cache_refresh), and numba's thread pool is
    launched. Nothing launches it when a parallel kernel comes from the on-disk cache: a model served
    kernel by kernel (not the fused step, whose builder launches it) segfaulted in its first step on a
    warm start without --threads (seen with the tiny qwen3 model: the CLI test, every run)."""
    import numba

    from ...numba_env import lazy_cache_refresh
    lazy_cache_refresh()
    numba.get_num_threads()


def _weight_store(path):
    """The repacked-weights store of this model file (weight_store.py), its arrays being read; None when
    NINFER_WEIGHT_STORE is 0 (A-B comparisons) or the file cannot be looked at."""
    if os.environ.get("NINFER_WEIGHT_STORE") == "0":
        return None
    from .weight_store import WeightStore
    try:
        return WeightStore(path).preload()
    except OSError:
        return None
