"""Test helper: a model file loaded on the fast CPU backend (engine.kernels.cpu_fast), with its fused step."""
from __future__ import annotations


def fast_model(path):
    """(Model, its FusedForward) for a model file; the step built here when the Model left none (its weight
    types), and then set as the model's."""
    from engine.backend import Backend
    from engine.gguf import load_gguf
    from engine.kernels import cpu_fast, cpu_fast_step
    from engine.model import Model
    mf = load_gguf(path)
    model = Model(mf.args, mf.tensors, Backend("cpu", cpu_fast), max_batch=8)
    if getattr(model, "fused", None) is None:
        model.fused = cpu_fast_step.build(model)
    return model, model.fused
