"""A scripted stand-in for `engine.api.Engine`: same API, no model, controllable token timing.

Used by the TUI tests and by `ninfer-chat --fake` (a demo without loading weights). It yields exactly the
event types of `engine.events`, in the order the real engine does: Progress(prefill), reasoning deltas,
ThinkingForced when the budget runs out, answer deltas, StepStats, FinalStats last.
"""
from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from engine.config import EngineArgs, GenerateRequest
from engine.events import (FinalStats, Progress, ReasoningDelta, StepStats, TextDelta, ThinkingForced)

DEFAULT_ANSWER = ("Here is a short answer to **{prompt}**.\n\n"
                  "```python\nprint('hello from the fake engine')\n```\n\n"
                  "- first point\n- second point\n\nThat is all.")
DEFAULT_REASONING = "Let me think about {prompt}. The user wants a clear answer with an example. " * 3


@dataclass
class Script:
    """What the fake model says. `answer`/`reasoning` may use {prompt}; callables get the messages."""

    answer: str | Callable[[list[dict]], str] = DEFAULT_ANSWER
    reasoning: str | Callable[[list[dict]], str] = DEFAULT_REASONING
    native_thinking: bool = False  # like SmolLM2: reasoning only when asked (prompted thinking)
    delay: float = 0.0  # seconds per token
    hold_after: int | None = None  # block after this many tokens until `release` is set (tests)
    release: threading.Event = field(default_factory=threading.Event)
    spec_modes: dict = field(default_factory=lambda: {
        "off": None, "ngram": None, "mtp": "no MTP head in this model", "dflash": "no DFlash drafter for this model"})
    fail_with: Exception | None = None
    virtual_tok_s: float | None = None  # report timings as if decoding ran at this speed (snapshots)


def _tokens(text: str) -> list[str]:
    """Split into word-ish pieces that concatenate back to the text (one piece = one 'token')."""
    out, cur = [], ""
    for ch in text:
        cur += ch
        if ch in " \n":
            out.append(cur)
            cur = ""
    if cur:
        out.append(cur)
    return out


class FakeEngine:
    """Implements Engine.load / session / spec_modes like engine.api."""

    def __init__(self, args: EngineArgs | None = None, script: Script | None = None):
        self.args = args or EngineArgs()
        self.script = script or Script()
        self.model_name = "fake-model (scripted)"
        self.context_capacity = 2048
        self.native_thinking = self.script.native_thinking
        self.requests: list[GenerateRequest] = []  # every request seen, for tests

    @classmethod
    def load(cls, args: EngineArgs, progress: Callable | None = None, script: Script | None = None) -> "FakeEngine":
        for i in range(1, 4):
            if progress:
                progress(Progress("load", i, 3, f"fake tensors {i}/3"))
        return cls(args, script)

    def spec_modes(self) -> dict[str, str | None]:
        return dict(self.script.spec_modes)

    def session(self) -> "FakeSession":
        return FakeSession(self)


class FakeSession:
    def __init__(self, engine: FakeEngine):
        self.engine = engine

    def generate(self, messages: list[dict], request: GenerateRequest | None = None,
                 cancel: threading.Event | None = None) -> Iterator:
        eng, sc = self.engine, self.engine.script
        req = request or GenerateRequest()
        eng.requests.append(req)
        cancel = cancel or threading.Event()
        if sc.fail_with is not None:
            raise sc.fail_with
        prompt = messages[-1]["content"] if messages else ""
        fill = (lambda v: v(messages) if callable(v) else v.format(prompt=prompt[:40]))
        prompt_tokens = sum(len(_tokens(m["content"])) + 4 for m in messages)
        yield Progress("prefill", prompt_tokens, prompt_tokens)
        t0 = time.perf_counter()
        think = req.thinking.enabled if req.thinking.enabled is not None else sc.native_thinking
        budget = req.thinking.budget
        max_new = req.sampling.max_new
        spec = req.spec or eng.args.spec
        n_out = n_reason = 0
        forced, finish, text_all = False, "stop", []
        ttft = None
        steps = ([("r", t) for t in _tokens(fill(sc.reasoning))] if think else []) + \
            [("a", t) for t in _tokens(fill(sc.answer))]
        in_reasoning = think
        for kind, piece in steps:
            if cancel.is_set():
                finish = "cancelled"
                break
            if n_out >= max_new:
                finish = "length"
                break
            if sc.hold_after is not None and n_out == sc.hold_after:
                while not sc.release.wait(0.01):
                    if cancel.is_set():
                        break
                if cancel.is_set():
                    finish = "cancelled"
                    break
            if sc.delay:
                time.sleep(sc.delay)
            if kind == "r" and not in_reasoning:
                continue  # the budget closed the reasoning early: skip the rest of it
            if kind == "a" and in_reasoning:
                in_reasoning = False
            if kind == "r" and budget is not None and n_reason >= budget:
                forced, in_reasoning = True, False
                yield ThinkingForced(n_reason, req.thinking.message)
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            n_out += 1
            text_all.append(piece)
            if kind == "r":
                n_reason += 1
                yield ReasoningDelta(piece)
            else:
                yield TextDelta(piece)
            el = time.perf_counter() - t0 if sc.virtual_tok_s is None else n_out / sc.virtual_tok_s
            yield StepStats(output_tokens=n_out, reasoning_tokens=n_reason, elapsed_s=el,
                            decode_tok_s=n_out / max(el, 1e-6), context_used=prompt_tokens + n_out,
                            round_tokens=2 if spec != "off" else 1,
                            draft_ms=0.1 if spec != "off" else 0.0, verify_ms=1.0 if spec != "off" else 0.0,
                            prompt_tokens=prompt_tokens, ttft_s=ttft,
                            prefill_tok_s=prompt_tokens / ttft if ttft else 0.0)
        wall = time.perf_counter() - t0
        if sc.virtual_tok_s is not None:  # deterministic figures: prefill 10x faster than decode
            wall = max(n_out, 1) / sc.virtual_tok_s
            ttft = prompt_tokens / (10 * sc.virtual_tok_s)
        rounds = n_out if spec == "off" else max(1, n_out // 2)
        yield FinalStats(
            finish_reason=finish, prompt_tokens=prompt_tokens, output_tokens=n_out, reasoning_tokens=n_reason,
            answer_tokens=n_out - n_reason, cached_prompt_tokens=0, ttft_s=ttft or wall,
            prefill_tok_s=prompt_tokens / max(ttft or wall, 1e-6), decode_tok_s=n_out / max(wall, 1e-6),
            wall_s=wall, output_sha256=hashlib.sha256("".join(text_all).encode()).hexdigest(),
            thinking_forced=forced, spec_mode=spec or "off", rounds=rounds,
            drafted=0 if spec == "off" else rounds * 3, accepted=0 if spec == "off" else rounds,
            draft_ms=0.0 if spec == "off" else rounds * 0.1, verify_ms=rounds * 1.0,
            backend=eng.args.backend, kv_dtype=eng.args.kv_dtype, context_capacity=eng.context_capacity)
