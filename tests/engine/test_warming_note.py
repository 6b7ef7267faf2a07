"""Engine.warming: while the CPU backend's cold start serves kernel by kernel (the fused step compiling in the
background), a reply starts with Progress("compile", 0, 1, note), so a UI can say why it is slower; at full
speed no such event comes. Model-free: the tier's state is set by hand."""
from __future__ import annotations

import threading

from engine.config import GenerateRequest, SamplingParams
from engine.events import FinalStats, Progress, TextDelta
from engine.fake import fake_engine

MSGS = [{"role": "user", "content": "hi"}]
REQ = GenerateRequest(SamplingParams(greedy=True, max_new=4))


def test_a_reply_says_first_that_the_backend_is_warming_up():
    eng = fake_engine()
    events = list(eng.session().generate(MSGS, REQ))
    assert not any(isinstance(e, Progress) and e.stage == "compile" for e in events) and eng.warming() is None
    eng.model.warming = lambda: "still compiling"
    events = list(eng.session().generate(MSGS, REQ))
    assert events[0] == Progress("compile", 0, 1, "still compiling")
    assert any(isinstance(e, TextDelta) for e in events) and isinstance(events[-1], FinalStats)


class _Helper:
    def __init__(self):
        self.fused_done, self.failure = threading.Event(), None


def test_the_tier_is_warming_until_the_fused_step_is_ready_or_the_helper_failed():
    from engine.backends.cpu.runner import CpuRunner
    from engine.backends.cpu.tier import TieredForward
    tiered = object.__new__(TieredForward)  # its state only: no model, no helper process
    tiered.fused_ready, tiered.note, tiered.helper = False, None, _Helper()
    runner = object.__new__(CpuRunner)
    runner.step = tiered
    assert "first start only" in runner.warming()
    tiered.helper.fused_done.set()  # cached: the next step switches to it
    assert runner.warming() is None
    tiered.helper = _Helper()
    tiered.helper.failure = "it exited with status 1"  # this run keeps the slower step: not warming up
    assert runner.warming() is None
    runner.step = None  # weight types without a fused step
    assert runner.warming() is None
