"""Test helper: a model file loaded as the cpu backend loads it (engine.backends.cpu.build_model), with its
fused step."""
from __future__ import annotations


def fast_model(path, max_batch: int = 8):
    """(Model, its FusedForward or None) for a model file: the weights in the cpu backend's layout; the
    Model's own forward is the plain walk, one kernel call at a time."""
    from engine.backends.cpu import build_model
    from engine.backends.cpu.step import build
    from engine.gguf import load_gguf
    model = build_model(load_gguf(path), max_batch)
    return model, build(model)


def fast_runner(model_file, max_batch: int = 8):
    """The cpu backend's runner (engine.backends.cpu.runner.CpuRunner) for a loaded model file."""
    from engine.backends.cpu import build_model
    from engine.backends.cpu.runner import CpuRunner
    from engine.backends.cpu.step import build
    model = build_model(model_file, max_batch)
    return CpuRunner(model, build(model))
