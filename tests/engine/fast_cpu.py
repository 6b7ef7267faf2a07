"""Test helpers: a model file loaded as the cpu backend loads it (engine.backends.cpu.build_model)."""
from __future__ import annotations


def fast_model(path, max_batch: int = 8):
    """(CpuRunner, its FusedForward or None) for a model file: the runner the engine would use (fused step,
    decode blocks); `runner.model.forward` is the plain walk over the same weights, one kernel at a time."""
    from engine.gguf import load_gguf
    runner = fast_runner(load_gguf(path), max_batch)
    return runner, runner.step


def fast_runner(model_file, max_batch: int = 8):
    """The cpu backend's runner (engine.backends.cpu.runner.CpuRunner) for a loaded model file."""
    from engine.backends.cpu import build_model
    from engine.backends.cpu.runner import CpuRunner
    from engine.backends.cpu.step import build
    model = build_model(model_file, max_batch)
    return CpuRunner(model, build(model))
