"""The cuda backend: numba.cuda kernels on one NVIDIA GPU (sm_70 V100 up). Imported only when chosen.

    kernels.py   launch wrappers and memory helpers (engine/backends/ref/kernels.py's contract)
    ops.py       the device kernels;  quant.py: device weight formats (dequantized at load or kept quantized)
    fused.py     engine.forward's walk with fused launches (epilogues: residual sums, swiglu)
    graph.py     GraphDecoder, the runner: one captured CUDA graph per decode step
"""
from __future__ import annotations

from ...config import EngineArgs


class Backend:
    """engine.backends' interface for a CUDA device."""

    name = "cuda"

    def __init__(self, args: EngineArgs, path):
        self.args = args

    def build(self, model_file, max_batch: int):
        from ...model import Model
        from ..kernels import get_kernels
        from .graph import GraphDecoder
        model = Model(model_file.args, model_file.tensors, get_kernels("cuda"), max_batch=max_batch)
        return GraphDecoder(model)  # single-token steps replay one captured CUDA graph

    def warm_up(self, runner, say=None) -> None:
        from ...forward import scratch_steps
        scratch_steps(runner, self.args.kv_dtype)

    def describe(self, runner) -> str:
        return runner.describe()
