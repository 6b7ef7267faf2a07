"""Chat-completion chunks -> engine events, and the reply's figures measured from the stream.

Reasoning arrives as `reasoning_content` deltas (ninfer-serve, llama.cpp, SGLang, vLLM before 0.10), as
`reasoning` deltas (vLLM since 0.10), or inside the content between <think> and </think> (llama.cpp's server
without a reasoning parser, llama-cpp-python): the content goes through the engine's own ChannelSplitter, so a
marker split across two chunks is still found.

The figures are the client's own: TTFT from sending the request to the first text, decode tok/s from the first
text to the last over the tokens generated after the first (the server's usage count where it sends one, else
one token per delta, which is what vLLM and llama.cpp stream). Prompt tokens, cached tokens and reasoning tokens
come from `usage`; a server that sends llama.cpp-style `timings` (ninfer-serve, llama.cpp) adds its prefill rate
and speculative figures; vLLM's come from its /metrics counters (metrics.py).
"""
from __future__ import annotations

import hashlib
import time

from ..events import FinalStats, ReasoningDelta, StepStats, TextDelta, ThinkingForced
from ..thinking import IDLE, REASONING, ChannelSplitter, ThinkingPlan
from .metrics import SpecCounters

FINISH = {"stop": "stop", "length": "length", "eos": "stop", "content_filter": "stop", "tool_calls": "stop",
          "function_call": "stop", "abort": "cancelled"}


def _extra(obj) -> dict:
    """The fields pydantic kept beyond the openai types' own (reasoning_content, timings, ...)."""
    return dict(getattr(obj, "model_extra", None) or {})


class ReplyMeter:
    """Feed it the chunks of one streamed reply (`feed`), then ask for the `final` stats."""

    def __init__(self, *, stats_interval_s: float = 0.1, capacity: int = 0, kv_dtype: str = "n/a",
                 spec_requested: str = "off"):
        self.t0 = time.perf_counter()  # the request was sent
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.stats_interval_s = stats_interval_s
        self._last_stats = 0.0
        self.capacity, self.kv_dtype, self.spec_requested = capacity, kv_dtype, spec_requested
        self.splitter = ChannelSplitter(ThinkingPlan("native", start=IDLE), IDLE)  # <think> in the content
        self.deltas = 0  # text-bearing deltas (a token each on most servers)
        self.reasoning_deltas = 0
        self.text: list[str] = []  # everything generated, reasoning and answer, as it came
        self.answer_chars = 0
        self.finish: str | None = None
        self.usage = None
        self.timings: dict = {}

    # -- the stream --------------------------------------------------------------------------------------------
    def feed(self, chunk) -> list:
        """The events of one ChatCompletionChunk."""
        out: list = []
        if chunk.usage is not None:
            self.usage = chunk.usage
        if isinstance(t := _extra(chunk).get("timings"), dict):
            self.timings = t
        for choice in chunk.choices or ():
            if choice.index != 0:
                continue
            delta = choice.delta
            extra = _extra(delta) if delta is not None else {}
            reasoning = extra.get("reasoning_content") or extra.get("reasoning")
            content = delta.content if delta is not None else None
            got = False
            if isinstance(reasoning, str) and reasoning:
                out.append(ReasoningDelta(reasoning))
                self.text.append(reasoning)
                self.reasoning_deltas += 1
                got = True
            if content:
                self.text.append(content)
                routed = self._route(self.splitter.feed(content))
                out += routed
                # a token of the reasoning: it carried reasoning, or a marker still being spelled out
                if any(isinstance(e, ReasoningDelta) for e in routed) or (not routed and self._marker_held()):
                    self.reasoning_deltas += 1
                got = True
            if got:
                self._token()
                out += self._maybe_stats()
            if choice.finish_reason:
                self.finish = choice.finish_reason
        return out

    def _marker_held(self) -> bool:
        """The splitter holds back the start of a reasoning marker (or is inside the reasoning)."""
        sp = self.splitter
        return sp.mode == REASONING or (sp.mode == IDLE and bool(sp.text[sp.pos:].strip()))

    def end(self) -> list:
        """What the <think> splitter still held back when the stream ended (a lone '<' at the very end)."""
        return self._route(self.splitter.feed("", final=True))

    def _route(self, pieces) -> list:
        out = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(ReasoningDelta(text))
            else:
                out.append(TextDelta(text))
                self.answer_chars += len(text)
        return out

    def _token(self) -> None:
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        self.deltas += 1

    def _maybe_stats(self) -> list:
        now = time.perf_counter()
        if self.deltas > 1 and now - self._last_stats < self.stats_interval_s:
            return []
        self._last_stats = now
        ttft = self.t_first - self.t0
        return [StepStats(output_tokens=self.deltas, reasoning_tokens=self.reasoning_deltas,
                          elapsed_s=now - self.t_first, decode_tok_s=self._rate(self.deltas),
                          context_used=self.deltas, ttft_s=ttft)]

    def _rate(self, tokens: int) -> float:
        """Tokens after the first over the time since the first (the engine's reply_stats.decode_rate)."""
        if self.t_first is None or self.t_last is None or tokens < 2 or self.t_last <= self.t_first:
            return 0.0
        return (tokens - 1) / (self.t_last - self.t_first)

    # -- the end -----------------------------------------------------------------------------------------------
    def forced(self) -> list:
        """ThinkingForced where the server reports that its budget closed the reasoning (ninfer-serve)."""
        if self.timings.get("thinking_forced"):
            return [ThinkingForced(int(self.timings.get("reasoning_tokens", 0) or 0), "")]
        return []

    def final(self, cancelled: bool = False, spec: SpecCounters | None = None, detail: str = "") -> FinalStats:
        now = time.perf_counter()
        u, t = self.usage, self.timings
        prompt = int(getattr(u, "prompt_tokens", 0) or t.get("prompt_n", 0) or 0)
        output = int(getattr(u, "completion_tokens", 0) or t.get("predicted_n", 0) or self.deltas)
        cached = int(getattr(getattr(u, "prompt_tokens_details", None), "cached_tokens", 0) or t.get("cache_n", 0)
                     or 0)
        counted = getattr(getattr(u, "completion_tokens_details", None), "reasoning_tokens", None)
        if counted is not None:  # the server's count
            reasoning = int(counted)
        else:  # one token per reasoning delta, as the count of output
            reasoning = min(self.reasoning_deltas, output)
        ttft = (self.t_first - self.t0) if self.t_first is not None else now - self.t0
        if "prompt_per_second" in t:  # the server's own (0 where the whole prompt came from its cache)
            prefill = float(t["prompt_per_second"] or 0.0)
        else:  # the client's view: the prompt's new tokens over the time to the first text
            prefill = (prompt - cached) / ttft if ttft > 0 and prompt > cached else 0.0
        decode = self._rate(output)
        if not decode and t.get("predicted_per_second"):  # the reply came in one chunk: the stream cannot tell
            decode = float(t["predicted_per_second"])
        finish = "cancelled" if cancelled else FINISH.get(self.finish or "stop", "stop")
        detail = detail or str(t.get("finish_detail") or "")  # ninfer-serve: e.g. the stop string that matched
        if not detail and self.finish and self.finish not in ("stop", "length"):
            detail = f"the server's finish_reason {self.finish!r}"
        spec_mode, rounds, drafted, accepted = "off", 0, 0, 0
        draft_ms = verify_ms = 0.0
        per_pos: tuple[float, ...] = ()
        if t.get("spec_mode") not in (None, "off"):  # ninfer-serve: the engine's own figures
            spec_mode, rounds = str(t["spec_mode"]), int(t.get("rounds", 0) or 0)
            drafted, accepted = int(t.get("draft_n", 0) or 0), int(t.get("draft_n_accepted", 0) or 0)
            draft_ms, verify_ms = float(t.get("draft_ms", 0) or 0), float(t.get("verify_ms", 0) or 0)
        elif spec is not None and spec.draft_tokens > 0:  # vLLM's counters around the reply
            spec_mode, rounds = "server", int(spec.drafts)
            drafted, accepted = int(spec.draft_tokens), int(spec.accepted)
            per_pos = spec.per_position_accept()
        elif int(t.get("draft_n", 0) or 0) > 0:  # llama.cpp's server: drafts and acceptances, no rounds
            spec_mode = "server"
            drafted, accepted = int(t["draft_n"]), int(t.get("draft_n_accepted", 0) or 0)
        answer = max(output - reasoning, 0)
        return FinalStats(
            finish_reason=finish, prompt_tokens=prompt, output_tokens=output, reasoning_tokens=reasoning,
            answer_tokens=answer, cached_prompt_tokens=cached, ttft_s=ttft, prefill_tok_s=prefill,
            decode_tok_s=decode, wall_s=now - self.t0,
            output_sha256=hashlib.sha256("".join(self.text).encode()).hexdigest(),
            thinking_forced=bool(t.get("thinking_forced", False)), stop_reason_detail=detail,
            spec_mode=spec_mode, rounds=rounds, drafted=drafted, accepted=accepted, draft_ms=draft_ms,
            verify_ms=verify_ms, per_position_accept=per_pos, backend="remote",
            kv_dtype=str(t.get("kv_dtype") or self.kv_dtype), context_capacity=self.capacity)
