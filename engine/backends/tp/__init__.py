"""Tensor parallelism: `--tp 2` over two devices of a kernel backend (cpu "devices" in-process, or cuda).

    plan.py    which heads, FFN columns and vocabulary rows each rank holds; shards of the file tensors
    model.py   TPModel: engine.forward's walk over both ranks in lockstep, all-reduce transports
"""
from __future__ import annotations

from ...config import EngineArgs


class Backend:
    """engine.backends' interface for TP over the kernel backend args.backend names."""

    name = "tp"

    def __init__(self, args: EngineArgs, path):
        self.args = args

    def build(self, model_file, max_batch: int):
        if self.args.backend == "cpu":
            from ..cpu import prepare_numba
            prepare_numba()
        from .model import build_tp_model
        return build_tp_model(model_file.args, model_file.tensors, self.args, max_batch=max_batch)

    def warm_up(self, runner, say=None) -> None:
        from ...forward import scratch_steps
        scratch_steps(runner, self.args.kv_dtype)

    def describe(self, runner) -> str:
        return runner.describe()  # which all-reduce transport was chosen, and why
