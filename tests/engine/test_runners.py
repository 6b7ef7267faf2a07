"""Every runner is engine.forward's one layer walk, and equals the plain walk (engine.model.Model):

- the phase list is what the fused CPU step compiles in (kinds, count, weight-stack order);
- on tiny llama / qwen2 / qwen3 files in the fused step's weight types: the fused CPU step and the
  start-up tier (its kernels called from Python) give the plain walk's logits bit for bit, for a prompt
  chunk, a verify block and a decode step; the numpy reference walk agrees to rounding; TP2 over two CPU
  devices agrees to rounding with the same greedy tokens.
(CUDA's fused walk and graphs against the plain cuda walk: tests/engine/test_cuda_model.py, simulator.)
"""
from __future__ import annotations

import numpy as np
import pytest
from fast_cpu import PROMPT, VERIFY, equal_to_plain_walk, passes
from gguf import GGMLQuantizationType as QT

from engine import forward
from engine.config import EngineArgs

ALL_Q4 = dict(attn_q=QT.Q4_1, attn_k=QT.Q4_1, attn_v=QT.Q4_0, attn_output=QT.Q4_1, ffn_gate=QT.Q4_0,
              ffn_up=QT.Q4_1, ffn_down=[QT.Q4_1])


def test_phase_list_is_the_fused_steps_loop():
    from engine.backends.cpu import step
    from engine.model import STACKED_ROLES
    assert [ph.kind for ph in forward.LAYER_PHASES] == list(range(forward.N_LAYER_PHASES))
    assert forward.MATRIX_ROLES == ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    assert step._ROLES == forward.MATRIX_ROLES and len(STACKED_ROLES) == len(forward.MATRIX_ROLES)
    # the step's phases: embedding, each layer's phases (a prompt's pass: each tail a phase too), head
    assert step.n_phases.py_func(3) == 3 * forward.N_LAYER_PHASES + 2
    assert step.n_phases.py_func(3, True) == 3 * 2 * forward.N_LAYER_PHASES + 2


class _Recorder:
    """LayerOps that records the walk's calls."""

    n_layer = 2

    def __init__(self):
        self.calls = []

    def begin(self, tokens, pos0, cache):
        self.calls.append(("begin", pos0))

    def embed(self):
        self.calls.append(("embed",))

    def phase(self, ph, layer):
        self.calls.append(("phase", ph.name, layer))

    def tail(self, ph, layer):
        self.calls.append(("tail", ph.name, layer))

    def capture(self, layer):
        self.calls.append(("capture", layer))

    def head(self, rows_out):
        self.calls.append(("head", rows_out))
        return np.zeros((rows_out, 4), np.float32)


def test_walk_order():
    rec, cache = _Recorder(), type("C", (), {"length": 3})()
    forward.walk(rec, np.zeros(2, np.int32), 3, cache, 2, capture=(0,))
    names = [ph.name for ph in forward.LAYER_PHASES]
    layer = lambda i: [c for n in names for c in (("phase", n, i), ("tail", n, i))]  # noqa: E731
    assert rec.calls == [("begin", 3), ("embed",)] + layer(0) + [("capture", 0)] + layer(1) + [("head", 2)]
    assert cache.length == 5


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def q4_file(request, tmp_path_factory, make_tiny):
    from engine.gguf import load_gguf
    arch = request.param
    qtypes = ALL_Q4 | ({"output": QT.Q8_0} if arch == "qwen2" else {})  # qwen2's untied head: one the step takes
    path = make_tiny(tmp_path_factory.mktemp("runners") / f"tiny-{arch}.gguf", arch, seed=5, qtypes=qtypes)
    return load_gguf(path)


def test_cpu_runners_equal_the_plain_walk(q4_file):
    model, ff = fast_model_from(q4_file)
    assert ff is not None
    equal_to_plain_walk(model, ff)


def fast_model_from(model_file):
    """(Model on the cpu backend's weights, its fused step)."""
    from engine.backends.cpu import build_model
    from engine.backends.cpu.step import build
    model = build_model(model_file, 16)
    return model, build(model)


def test_ref_and_tp2_agree_with_the_plain_walk(q4_file):
    from engine.backends.kernels import get_kernels
    from engine.backends.tp.model import build_tp_model
    from engine.model import Model
    model, _ = fast_model_from(q4_file)
    want = passes(lambda t, p, c, all_: model.forward(t, p, c, all_logits=all_), model.new_cache(64))
    ref = Model(q4_file.args, q4_file.tensors, get_kernels("ref"), max_batch=16)
    tp = build_tp_model(q4_file.args, q4_file.tensors, EngineArgs(tp=2, devices=(0, 1)), max_batch=16)
    for other in (ref, tp):
        got = passes(lambda t, p, c, all_: other.forward(t, p, c, all_logits=all_), other.new_cache(64))
        for w, g in zip(want, got):
            scale = np.abs(w).max()
            np.testing.assert_allclose(g, w, atol=2e-2 * scale, rtol=0)
            assert np.mean(g.argmax(-1) == w.argmax(-1)) >= 0.8


def test_cpu_runner_captures_the_last_layer_from_the_fused_step(q4_file):
    """capture=(last layer,) is served by the fused step (its residual-stream buffer after the pass): the
    plain walk's captured states, bit for bit, and the same logits."""
    from engine.backends.cpu.runner import CpuRunner
    model, ff = fast_model_from(q4_file)
    runner, last = CpuRunner(model, ff), q4_file.args.n_layer - 1
    runs = ff.run
    calls = []
    ff.run = lambda *a: (calls.append(1), runs(*a))[1]
    c1, c2 = model.new_cache(64), model.new_cache(64)
    for toks, pos in ((PROMPT, 0), (VERIFY, len(PROMPT))):
        want = model.forward(toks, pos, c1, all_logits=True, capture=(last,))
        want_h = model.captured[last].copy()  # the runner's captured dict is the model's: copy first
        got = runner.forward(toks, pos, c2, all_logits=True, capture=(last,))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(runner.captured[last], want_h)
    assert len(calls) == 2


def test_logits_copies_reuse_only_what_no_caller_holds():
    """LogitsCopies: a kept buffer is written again only once no array of a caller (nor a view of one)
    holds it; with all of them held, a pass's rows go to a fresh array."""
    from engine.logits_copies import LogitsCopies
    keep = LogitsCopies()
    rows = [np.full((4, 8), i, np.float32) for i in range(8)]
    a = keep.copy(rows[1])
    b = keep.copy(rows[2])
    row_of_a = a[1]  # a view keeps a's buffer held
    del a
    c = keep.copy(rows[3][:2])  # fewer rows
    assert (row_of_a == 1).all() and (b == 2).all() and c.shape == (2, 8) and (c == 3).all()
    assert len(keep.bufs) == 3
    del row_of_a
    d = keep.copy(rows[4])  # a's buffer again
    assert np.shares_memory(d, keep.bufs[0]) and (d == 4).all() and (b == 2).all() and (c == 3).all()
    held = [keep.copy(r) for r in rows[5:8]]  # all KEEP buffers held now: a fresh array
    assert len(keep.bufs) == LogitsCopies.KEEP and not any(np.shares_memory(held[-1], x) for x in keep.bufs)
    assert [int(x[0, 0]) for x in held] == [5, 6, 7] and (b == 2).all() and (c == 3).all() and (d == 4).all()
    del b
    e = keep.copy(np.zeros((6, 8), np.float32))  # more rows than the free buffer: it grows
    assert e.shape == (6, 8) and (e == 0).all() and any(np.shares_memory(e, x) for x in keep.bufs)
    del e
    big = keep.copy(np.ones((LogitsCopies.MAX_BYTES // 32 + 1, 8), np.float32))  # past MAX_BYTES: not kept
    assert (big == 1).all() and not any(np.shares_memory(big, x) for x in keep.bufs)


def test_cpu_runner_logits_stay_the_callers(q4_file):
    """CpuRunner.forward's logits are the plain walk's, and a pass's logits stay as they were while the caller
    holds them, through the passes after it (the step's own buffer is overwritten by each)."""
    from engine.backends.cpu.runner import CpuRunner
    model, ff = fast_model_from(q4_file)
    runner = CpuRunner(model, ff)
    want = passes(lambda t, p, c, all_: model.forward(t, p, c, all_logits=all_), model.new_cache(64))
    got = passes(lambda t, p, c, all_: runner.forward(t, p, c, all_logits=all_), runner.new_cache(64))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    again = passes(lambda t, p, c, all_: runner.forward(t, p, c, all_logits=all_), runner.new_cache(64))
    for w, g in zip(want, again):
        np.testing.assert_array_equal(g, w)
    del want, got, again  # the plain walk's copies go to the model's kept buffers too, once freed
    plain = model.forward(PROMPT, 0, model.new_cache(64), all_logits=True)
    assert any(np.shares_memory(plain, b) for b in model.logit_rows.bufs)
