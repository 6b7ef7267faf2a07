"""Backends: one package per device kind, behind one interface. The engine core never names one.

    ref/   numpy: the specification of every kernel (kernels.py), the plain runner
    cpu/   numba: kernels, SIMD, the fused one-call step, threading, start-up tiers and weight caches
    cuda/  numba.cuda: kernels, device quant formats, the fused launch sequence, CUDA graphs
    tp/    tensor parallelism: a kernel backend's ranks over shards of the weights, all-reduce transports

Each package has a `Backend` class with one interface:

    Backend(args: EngineArgs, path)          early set-up (before the model file is parsed)
    .build(model_file, max_batch) -> Runner  prepare the weights, build the runner
    .warm_up(runner, say) -> None            compile / capture before the first token
    .describe(runner) -> str                 one line: what runs, and how

A `Runner` (engine.forward.Runner) is what the reply loop calls: forward, decode_block, new_cache, args,
captured. Every runner is derived from the one layer walk of engine.forward. Packages load lazily: numba.cuda
is imported only when the cuda backend is chosen.
"""
from __future__ import annotations

import importlib

from ..config import BACKENDS, EngineArgs
from ..errors import BackendUnavailable, ConfigError

PACKAGES = {name: f"engine.backends.{name}" for name in (*BACKENDS, "tp")}


def select(args: EngineArgs) -> type:
    """The Backend class of the package that runs `args`: tp (over args.backend's kernels) when args.tp > 1."""
    name = "tp" if args.tp > 1 else args.backend
    if name not in PACKAGES:
        raise ConfigError(f"--backend {name!r} is not one of {', '.join(BACKENDS)}")
    try:
        return importlib.import_module(PACKAGES[name]).Backend
    except ImportError as e:  # e.g. cuda without numba-cuda installed, or no GPU driver
        raise BackendUnavailable(f"backend {name!r} cannot be loaded here ({e}); "
                                 "use --backend cpu, or install the 'cuda' extra on a GPU machine") from e
