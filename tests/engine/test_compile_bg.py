"""Tiered first start (engine/compile_bg.py, engine/compile_tier.py), without timing anything absolute:

- the kernel-by-kernel step (tier 0) gives logits bit-identical to the fused step, and shares a prompt's
  items with a second Python thread but not a decode step's;
- a tiered model serves tokens before the helper process compiled the fused step, switches once it has,
  and its greedy tokens equal the fused step's;
- a helper that fails leaves the kernel-by-kernel step working and says so once;
- (slow) a cold Engine.load in a fresh numba cache dir: tiered, helper finishes, the next load is warm.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from fast_cpu import fast_model

ROOT = Path(__file__).resolve().parents[2]
ALL_Q4 = dict(attn_q=QT.Q4_1, attn_k=QT.Q4_1, attn_v=QT.Q4_0, attn_output=QT.Q4_1, ffn_gate=QT.Q4_0,
              ffn_up=QT.Q4_1, ffn_down=[QT.Q4_1])
TOKS = np.array([3, 17, 42, 5, 99, 7, 1, 250, 31, 8, 77], np.int32)


@pytest.fixture(scope="module")
def q4_path(tmp_path_factory, make_tiny):
    return make_tiny(tmp_path_factory.mktemp("q4bg") / "tiny-q4.gguf", "llama", seed=3, qtypes=ALL_Q4)


def _greedy(fwd, model, n=8):
    """Prefill TOKS, then n greedy one-token steps through fwd (FusedForward-like); tokens and all logits."""
    cache = model.new_cache(64)
    logits = [fwd(TOKS, 0, cache, all_logits=True)]
    toks = [int(logits[0][-1].argmax())]
    for i in range(n):
        logits.append(fwd(np.array([toks[-1]], np.int32), len(TOKS) + i, cache))
        toks.append(int(logits[-1][0].argmax()))
    return toks, logits


def _helper(model, ff, argv=None):
    from engine.backends.cpu.compile_bg import Helper
    from engine.backends.cpu.step import fused_forward
    from engine.backends.cpu.tier import CHILD_KERNELS, LeafForward, fused_signature
    kv = ff.kv_tuple(model.new_cache(4))
    plan = LeafForward(ff).plan(kv)
    return Helper([p for p in plan if p[0] in CHILD_KERNELS], [(fused_forward, fused_signature(ff, kv))], argv=argv)


def test_kernel_by_kernel_step_is_bit_identical_to_fused(q4_path):
    from engine.backends.cpu.tier import TieredForward
    model, ff = fast_model(q4_path)
    want_toks, want = _greedy(ff, model)

    class Never:  # a helper that has not finished yet: TieredForward stays on the kernel-by-kernel step
        failure = None
        fused_done = type("E", (), {"is_set": staticmethod(lambda: False)})()

    kv = ff.kv_tuple(model.new_cache(4))
    tiered = TieredForward(ff, kv, Never())
    got_toks, got = _greedy(tiered, model)
    assert tiered.steps["fused"] == 0 and tiered.steps["kernels"] == len(got)
    assert got_toks == want_toks
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_kernel_by_kernel_step_shares_a_prompt_not_a_decode_step(q4_path, monkeypatch):
    """Tier 0 has no numba parallel region: a multi-row pass hands half of each kernel's items to a second
    Python thread; a one-token step stays on this thread (the helper compiles on the other core)."""
    import numba

    from engine.backends.cpu import tier as compile_tier
    from engine.backends.cpu.tier import TieredForward
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 numba threads")
    # all threads, whatever an earlier test's fused steps left (their ContentionGuard may have chosen one:
    # the tier then hands nothing to a second thread; seen after test_cpu_sync.py in one process)
    before = numba.get_num_threads()
    numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    try:
        _shares_a_prompt(q4_path, monkeypatch, compile_tier, TieredForward)
    finally:
        numba.set_num_threads(before)


def _shares_a_prompt(q4_path, monkeypatch, compile_tier, TieredForward):
    model, ff = fast_model(q4_path)
    submitted = []

    class Pool:  # runs the half at once, here, and counts it
        def submit(self, fn, *args):
            submitted.append(args[:2])
            fn(*args)
            return type("Done", (), {"result": staticmethod(lambda: None)})()
    monkeypatch.setattr(compile_tier, "_pool", lambda: Pool())

    class Never:
        failure = None
        fused_done = type("E", (), {"is_set": staticmethod(lambda: False)})()

    kv = ff.kv_tuple(model.new_cache(4))
    tiered = TieredForward(ff, kv, Never())
    cache = model.new_cache(64)
    tiered(TOKS, 0, cache, all_logits=True)
    prompt = len(submitted)
    assert prompt > 0 and all(lo == 0 and hi > 0 for lo, hi in submitted)
    tiered(np.array([5], np.int32), len(TOKS), cache)
    assert len(submitted) == prompt  # the decode step: nothing handed to the second thread


def test_tiered_serves_first_then_switches_to_fused(q4_path):
    from engine.backends.cpu.tier import TieredForward
    model, ff = fast_model(q4_path)
    want_toks, want = _greedy(ff, model, n=12)
    helper = _helper(model, ff)
    try:
        kv = ff.kv_tuple(model.new_cache(4))
        tiered = TieredForward(ff, kv, helper)
        cache = model.new_cache(64)
        toks = [int(tiered(TOKS, 0, cache, all_logits=True)[-1].argmax())]
        for i in range(4):  # the helper waits for go(): these steps cannot be the fused ones
            toks.append(int(tiered(np.array([toks[-1]], np.int32), len(TOKS) + i, cache)[0].argmax()))
        assert tiered.steps == {"kernels": 5, "fused": 0} and not helper.fused_done.is_set()
        assert tiered.block(toks[-1], len(TOKS) + 4, cache, 4, frozenset()) is None  # blocks: fused step only
        assert cache.length == len(TOKS) + 4
        assert helper.leaves_done.wait(300) and helper.failure is None
        helper.go()
        assert helper.fused_done.wait(300), helper.failure
        for i in range(4, 8):
            toks.append(int(tiered(np.array([toks[-1]], np.int32), len(TOKS) + i, cache)[0].argmax()))
        toks += tiered.block(toks[-1], len(TOKS) + 8, cache, 4, frozenset())  # a greedy block of 4
        assert tiered.steps == {"kernels": 5, "fused": 8} and tiered.note is None
        assert toks == want_toks
        assert helper.ended.wait(60) and helper.proc.returncode == 0
    finally:
        helper.stop()


def test_failing_helper_keeps_kernel_path_and_says_so_once(q4_path, caplog):
    from engine.backends.cpu.tier import TieredForward
    model, ff = fast_model(q4_path)
    want_toks, _ = _greedy(ff, model)
    helper = _helper(model, ff, argv=[sys.executable, "-c", "import sys; sys.stdin.buffer.read(1); sys.exit(3)"])
    assert helper.ended.wait(60)
    assert "status 3" in helper.failure or "could not start" in helper.failure
    kv = ff.kv_tuple(model.new_cache(4))
    tiered = TieredForward(ff, kv, helper)
    with caplog.at_level(logging.WARNING, logger="ninfer.compile"):
        got_toks, _ = _greedy(tiered, model)
    assert got_toks == want_toks
    assert tiered.steps["fused"] == 0 and tiered.note
    assert len([r for r in caplog.records if "background compile" in r.getMessage()]) == 1


_COLD_SCRIPT = r"""
import json, sys, time
from engine.api import Engine
from engine.config import EngineArgs
from engine.backends.cpu.tier import TieredForward
msgs = []
eng = Engine.load(EngineArgs(model=sys.argv[1], max_context=256), progress=lambda p: msgs.append(p.message))
m = eng.model
tiered = isinstance(m.step, TieredForward)
import numpy as np
def run():
    cache = m.new_cache(64)
    toks = [int(m.forward(np.arange(1, 12, dtype=np.int32), 0, cache)[0].argmax())]
    for i in range(6):
        toks.append(int(m.forward(np.array([toks[-1]], np.int32), 11 + i, cache)[0].argmax()))
    return toks
first = run()
switched = None
if tiered:
    assert m.step.helper.fused_done.wait(900), m.step.helper.failure
    second = run()
    switched = m.step.fused_ready
    assert second == first, (first, second)
note = m.step.note if tiered else None
print(json.dumps({"tiered": tiered, "switched": switched, "tokens": first, "messages": msgs, "note": note}))
"""


@pytest.mark.slow
def test_cold_start_is_tiered_and_next_start_is_warm(q4_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMBA_NUM_THREADS="2")
    with tempfile.TemporaryDirectory() as d:
        env["NINFER_CACHE_DIR"] = d
        env.pop("NUMBA_CACHE_DIR", None)  # engine.numba_env exports it once imported (earlier tests): a warm cache
        outs = []
        for _ in range(2):
            r = subprocess.run([sys.executable, "-c", _COLD_SCRIPT, str(q4_path)], env=env, cwd=ROOT,
                               capture_output=True, text=True, timeout=1800)
            assert r.returncode == 0, r.stderr[-3000:]
            outs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    cold, warm = outs
    assert cold["tiered"] and cold["switched"], cold
    assert any("background" in m for m in cold["messages"])
    assert not warm["tiered"]
    assert warm["tokens"] == cold["tokens"]


def test_engine_exit_during_load_ends_the_helper():
    """An engine process that exits before its helper was told to go leaves no helper process behind."""
    code = (
        "import sys\n"
        "from engine.backends.cpu.compile_bg import Helper\n"
        "h = Helper([], [], argv=[sys.executable, '-c', 'import sys, time; sys.stdin.buffer.read(1); time.sleep(120)'])\n"
        "print(h.proc.pid, flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split()[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_helper_compiles_the_sampler_of_the_usual_settings():
    """The helper's list carries the sampling chain's jitted functions (importable by name in the helper) for
    top-k sampling (its select and draw) and greedy with penalties, so the first token does not wait for their compile."""
    from engine.backends.cpu.compile_bg import _ref, _resolve
    from engine.backends.cpu.tier import sampler_plan
    from engine.sampling_fast import compile_plan
    plan = sampler_plan(49152)
    assert plan == compile_plan(False, 40, 49152) + compile_plan(True, 0, 49152) and len(plan) == 3  # + draw
    for disp, sig in plan:
        assert _resolve(_ref(disp)) is disp and len(sig) > 0


def test_a_second_helper_waits_for_the_first_ones_fused_compile(tmp_path, monkeypatch):
    """While another helper holds the fused phase (here: this test holds its lock), a new helper still
    reports its kernels, but compiles its fused step only after that lock is released (then from the
    cache), instead of compiling the same functions beside it."""
    import fcntl

    from engine.backends.cpu.compile_bg import Helper, phase_locks
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    locks = phase_locks(str(tmp_path))
    assert set(locks) == {"leaves", "fused"}
    fcntl.flock(locks["fused"], fcntl.LOCK_EX)
    helper = Helper([], [])
    try:
        assert helper.leaves_done.wait(120) and helper.failure is None  # the leaves lock is free
        helper.go()
        assert not helper.fused_done.wait(3)  # waiting for the "other helper"
        fcntl.flock(locks["fused"], fcntl.LOCK_UN)
        assert helper.fused_done.wait(60), helper.failure
        assert helper.ended.wait(60) and helper.proc.returncode == 0
    finally:
        helper.stop()
        for fd in locks.values():
            os.close(fd)


def test_helper_ends_when_its_cache_dir_is_removed(tmp_path, monkeypatch):
    """A benchmark's cold run removes its NINFER_CACHE_DIR after the run: the helper it started stops then
    (here while it waits for "go"), instead of compiling on into the next runs."""
    import shutil

    from engine.backends.cpu.compile_bg import Helper
    root = tmp_path / "cold"
    root.mkdir()
    monkeypatch.setenv("NINFER_CACHE_DIR", str(root))
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(root / "numba"))
    helper = Helper([], [])
    try:
        assert helper.leaves_done.wait(120) and helper.failure is None
        assert not helper.ended.wait(1)  # alive, waiting for go
        shutil.rmtree(root)
        assert helper.ended.wait(30) and helper.proc.returncode == 0
        assert not root.exists()
    finally:
        helper.stop()
