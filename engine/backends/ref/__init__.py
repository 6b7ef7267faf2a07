"""The ref backend: numpy kernels (kernels.py), the specification every other backend's kernels are tested
against, run by the plain walk (engine.model.Model). Slow; for tests, oracles and debugging."""
from __future__ import annotations

from ...config import EngineArgs


class Backend:
    """engine.backends' interface for the numpy reference."""

    name = "ref"

    def __init__(self, args: EngineArgs, path):
        self.args = args

    def build(self, model_file, max_batch: int):
        from ...model import Model
        from ..kernels import get_kernels
        return Model(model_file.args, model_file.tensors, get_kernels("ref"), max_batch=max_batch)

    def warm_up(self, runner, say=None) -> None:
        from ...forward import scratch_steps
        scratch_steps(runner, self.args.kv_dtype)

    def describe(self, runner) -> str:
        return "ref: numpy reference kernels, one call at a time"
