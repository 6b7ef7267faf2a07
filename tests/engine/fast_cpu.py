"""Test helpers: a model file loaded as the cpu backend loads it (engine.backends.cpu.build_model), and the
passes its runners are compared over."""
from __future__ import annotations

import numpy as np

PROMPT = np.array([3, 17, 42, 5, 99, 7, 1, 250, 31, 8, 77], np.int32)
VERIFY = np.array([12, 40, 7, 7, 201], np.int32)


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


def passes(fwd, cache):
    """Logits of a prompt chunk, a verify block (all rows) and a decode step through fwd(tokens, pos0, cache,
    all_logits)."""
    out = [fwd(PROMPT, 0, cache, True)]
    out.append(fwd(VERIFY, len(PROMPT), cache, True))
    out.append(fwd(VERIFY[:1], len(PROMPT) + len(VERIFY), cache, False))
    return out


def equal_to_plain_walk(model, ff):
    """The fused step ff and the start-up tier over it (its kernels called from Python, never switching to the
    fused step) give the plain walk's (model.forward's) logits bit for bit over `passes`."""
    from engine.backends.cpu.tier import TieredForward
    want = passes(lambda t, p, c, all_: model.forward(t, p, c, all_logits=all_), model.new_cache(64))
    got = passes(lambda t, p, c, all_: ff(t, p, c, all_logits=all_), model.new_cache(64))

    class Never:  # a helper that never finishes: the tier stays on its kernel-by-kernel walk
        failure = None
        fused_done = type("E", (), {"is_set": staticmethod(lambda: False)})()
    tiered = TieredForward(ff, ff.kv_tuple(model.new_cache(4)), Never())
    leaf = passes(lambda t, p, c, all_: tiered(t, p, c, all_logits=all_), model.new_cache(64))
    assert tiered.steps["fused"] == 0
    for w, g, lf in zip(want, got, leaf):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(lf, w)
