"""One reply's settings, clock and counters, and the StepStats / FinalStats events built from them."""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .events import FinalStats, StepStats
from .prefill import Prefilled
from .reply_text import Finish, TextStream
from .thinking import ThinkingState

if TYPE_CHECKING:
    from .rounds import Round


@dataclass
class ReplyOptions:
    """The engine's settings a reply runs under, resolved by the session: the prefill's (the loop reads
    them) and the labels FinalStats reports."""

    max_context: int
    prefill_chunk: int = 256
    prefix_reuse: bool = True
    stats_interval_s: float = 0.1
    spec_mode: str = "off"  # the rest only label FinalStats
    backend: str = "cpu"
    kv_dtype: str = "f16"
    capacity: int = 0


def decode_rate(n_out: int, decode_s: float, first: Round | None) -> float:
    """Decode tok/s of a reply: the tokens after the first round over the time since it ended (the first
    round's end is the first token's time: it holds the prompt's last forward). A first round of several
    tokens (a decode block, accepted drafts) counts with the first token, not in the rate, so its tokens are
    not divided by the time of the others. A reply that came whole in its first round: that round's own
    rate, when it had more than one token."""
    n_first = min(len(first.tokens), n_out) if first is not None else 0
    if n_out > n_first and decode_s > 0:
        return (n_out - n_first) / decode_s
    ms = (first.draft_ms + first.verify_ms) if first is not None else 0.0
    return n_first / (ms / 1e3) if n_first > 1 and ms > 0 else 0.0


class ReplyStats:
    """Starts the reply's clock when made; told the reused prefix, the prefill and every round."""

    def __init__(self, prompt_tokens: int, thinking: ThinkingState, opts: ReplyOptions):
        self.t_start = time.perf_counter()
        self.prompt_tokens = prompt_tokens
        self.thinking = thinking
        self.opts = opts
        self.reused = 0  # prompt tokens the cache already held
        self.prefill = Prefilled(0, 0.0)  # the rest of the prompt but its last token, forwarded
        self.t_first = 0.0  # when the first round ended (0: not yet)
        self.t_step = 0.0  # when the last StepStats was made
        self.rounds: list[Round] = []

    def round_done(self, rnd: Round) -> None:
        self.rounds.append(rnd)
        if not self.t_first:
            self.t_first = time.perf_counter()

    def step(self, context_used: int, rnd: Round) -> list[StepStats]:
        """[StepStats] after a round that does not end the reply, at most one per stats interval; else []."""
        now = time.perf_counter()
        if now - self.t_step < self.opts.stats_interval_s:
            return []
        self.t_step = now
        n_out = context_used - self.prompt_tokens
        elapsed = now - self.t_first
        return [StepStats(n_out, self.thinking.reasoning_tokens, elapsed,
                          decode_rate(n_out, elapsed, self.rounds[0]), context_used, len(rnd.tokens),
                          rnd.draft_ms, rnd.verify_ms, self.prompt_tokens, self.reused, self._ttft(),
                          self._prefill_rate())]

    def final(self, finish: Finish, token_ids: list[int], text: TextStream) -> FinalStats:
        """The last event. An empty answer says why in its detail (unless the user cancelled)."""
        now = time.perf_counter()
        th, rounds, n_out = self.thinking, self.rounds, len(token_ids)
        detail = finish.detail
        if text.answer_empty and finish.reason != "cancelled" and n_out:
            detail = th.why_no_answer(detail)
        k = max((r.drafted for r in rounds), default=0)
        # per draft position i: among rounds that drafted at least i+1 tokens, the share whose draft i+1 was
        # accepted (so d_1..d_i all matched: acceptance decays with i)
        ppa = tuple(sum(1 for r in rounds if r.drafted > i and r.accepted > i) /
                    max(1, sum(1 for r in rounds if r.drafted > i)) for i in range(k))
        return FinalStats(
            finish_reason=finish.reason, prompt_tokens=self.prompt_tokens, output_tokens=n_out,
            reasoning_tokens=th.reasoning_tokens, answer_tokens=th.answer_tokens,
            cached_prompt_tokens=self.reused, ttft_s=self._ttft(), prefill_tok_s=self._prefill_rate(),
            decode_tok_s=decode_rate(n_out, now - self.t_first if self.t_first else 0.0,
                                     rounds[0] if rounds else None),
            wall_s=now - self.t_start, output_sha256=hashlib.sha256(text.text.encode()).hexdigest(),
            token_ids=tuple(token_ids), thinking_forced=th.forced, stop_reason_detail=detail,
            spec_mode=self.opts.spec_mode, rounds=len(rounds), drafted=sum(r.drafted for r in rounds),
            accepted=sum(r.accepted for r in rounds), draft_ms=sum(r.draft_ms for r in rounds),
            verify_ms=sum(r.verify_ms for r in rounds), per_position_accept=ppa, backend=self.opts.backend,
            kv_dtype=self.opts.kv_dtype, context_capacity=self.opts.capacity,
            block_rounds=sum(1 for r in rounds if r.block), block_tokens=sum(len(r.tokens) for r in rounds if r.block),
            block_ms=sum(r.draft_ms + r.verify_ms for r in rounds if r.block),
            lookup_rounds=sum(1 for r in rounds if r.lookup),
            lookup_tokens=sum(len(r.tokens) for r in rounds if r.lookup))

    def _ttft(self) -> float:
        return (self.t_first - self.t_start) if self.t_first else 0.0

    def _prefill_rate(self) -> float:
        return self.prefill.tokens / self.prefill.seconds if self.prefill.seconds > 0 else 0.0
