"""Typed events `Session.generate` yields. The UI and CLI consume these and nothing else."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextDelta:
    """Answer text; never half a UTF-8 character."""
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """Reasoning text (between the thinking markers), streamed apart from the answer."""
    text: str


@dataclass(frozen=True)
class ThinkingForced:
    """The thinking budget ran out: the engine appended the early-close message and the close marker."""
    reasoning_tokens: int
    inserted_text: str


@dataclass(frozen=True)
class Progress:
    """Long operations before the first token (model load, JIT compile, prefill chunks). At the start of a
    reply, "compile" says the backend is still warming up (Engine.warming): this reply runs slower."""
    stage: str  # "load" | "compile" | "prefill"
    done: int
    total: int
    message: str = ""


@dataclass(frozen=True)
class StepStats:
    """Per decode round (one token without speculation). Emitted at most every stats interval."""
    output_tokens: int
    reasoning_tokens: int
    elapsed_s: float  # since the first decoded token
    decode_tok_s: float  # running average over the reply
    context_used: int
    round_tokens: int = 1  # tokens accepted this round (accepted drafts + 1)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    # the prompt's figures, known from the first token on (FinalStats repeats them)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    ttft_s: float = 0.0
    prefill_tok_s: float = 0.0


@dataclass(frozen=True)
class FinalStats:
    """Emitted once, last. finish_reason: stop | length | cancelled | error."""
    finish_reason: str
    prompt_tokens: int
    output_tokens: int
    reasoning_tokens: int
    answer_tokens: int
    cached_prompt_tokens: int  # reused from the previous turn (prefix reuse)
    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float  # tokens after the first round / time since it (reply_stats.decode_rate)
    wall_s: float
    output_sha256: str  # of the full output text (reasoning + answer as generated)
    token_ids: tuple[int, ...] = ()
    thinking_forced: bool = False
    stop_reason_detail: str = ""  # e.g. the stop string that matched, or why an answer is empty
    spec_mode: str = "off"
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    per_position_accept: tuple[float, ...] = ()
    backend: str = "cpu"
    kv_dtype: str = "f16"
    context_capacity: int = 0
    # decode blocks a speculative reply ran where its drafter would have drafted nothing (SpecRound): their
    # rounds, tokens and ms are in the totals above; the per-round figures below leave them out
    block_rounds: int = 0
    block_tokens: int = 0
    block_ms: float = 0.0
    # speculative rounds whose drafts came from prompt lookup (engine.spec.lookup), and the tokens they emitted
    lookup_rounds: int = 0
    lookup_tokens: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens per round (per speculative round where the reply also ran decode blocks)."""
        n = self.rounds - self.block_rounds
        return (self.output_tokens - self.block_tokens) / n if n > 0 else (
            self.output_tokens / self.rounds if self.rounds else 0.0)

    @property
    def ms_per_round(self) -> float:
        n = self.rounds - self.block_rounds
        return (self.draft_ms + self.verify_ms - self.block_ms) / n if n > 0 else (
            (self.draft_ms + self.verify_ms) / self.rounds if self.rounds else 0.0)


Event = TextDelta | ReasoningDelta | ThinkingForced | Progress | StepStats | FinalStats
