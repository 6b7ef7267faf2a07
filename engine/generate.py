"""One reply: the round seam, and the reply loop that drives it (`run_reply`).

The loop's other concerns live beside it: engine/prefill.py (prefix reuse, chunked prefill),
engine/reply_text.py (tokens -> text events, stop tokens and stop strings), engine/reply_stats.py
(StepStats, FinalStats, decode_rate).

The round seam (speculative decoding plugs in here)
---------------------------------------------------
After the prefill the loop never calls the model itself; it calls a *round function* (`RoundFn`): one
round `round_fn(ctx) -> Round` returns the next tokens, each already taken by the chooser. Invariant
before and after every round: `ctx.seq` is the whole sequence (prompt + reply so far) and the KV cache
holds exactly `seq[:-1]` (the newest token is pending; it is the first input of the next round).

- `plain_round` (`PlainRound`): forward [seq[-1]] at position len(seq)-1, `chooser.choose` the next token,
  `chooser.accept` it, return Round([t]); or a decode block of several such tokens in one model call.
- a speculative round (`engine.spec.SpecRound`): propose drafts d1..dk (k <= ctx.max_tokens - 1), forward
  [seq[-1], d1..dk] with `all_logits=True`, then per position i in order: y = choose(row i), accept(y),
  emit y; continue while y == d_i and y not in ctx.stop_ids; finally `cache.truncate(len(seq_before) +
  n_returned - 1)` so the invariant holds, and return Round([y...], drafted=k, accepted=n-1, ms...).
A round never returns more than `ctx.max_tokens` tokens. The loop handles stop tokens, stop strings, max_new
and cancel on the returned tokens; if it stops in the middle of a round it truncates the cache itself.
Pass a round function for one reply with `Session.generate(..., round_fn=...)`; by default the session
picks `PlainRound` or, when the request (or EngineArgs) names a speculative mode, a `SpecRound`.
"""
from __future__ import annotations

import functools
import os
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Mapping, Protocol

import numpy as np

from .errors import ConfigError
from .prefill import Target, prefill, reuse_prefix
from .reply_stats import ReplyStats
from .reply_text import Finish, TextStream
from .thinking import ThinkingState


@dataclass
class RoundContext:
    """What a round function may use. The round must not modify `seq`; the loop appends what it returns."""

    model: object
    cache: object
    seq: list[int]  # prompt + reply so far; the cache holds seq[:-1]
    chooser: object  # engine.sampling.TokenChooser
    max_tokens: int  # the most tokens this round may return (>= 1)
    stop_ids: frozenset[int]
    reply_start: int = 0  # len(seq) when the reply began (the prompt's length); 0: not known


@dataclass
class Round:
    tokens: list[int]  # accepted drafts + the bonus token, already accepted by the chooser
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0


class RoundFn(Protocol):
    """The round seam: one object serves one reply at a time."""

    capture: tuple[int, ...]  # target layers whose hidden states the prefill captures for it; () for none

    def begin(self) -> None:
        """A reply starts (before its prefill)."""

    def observe_prefill(self, tokens: list[int], features: Mapping[int, np.ndarray] | None) -> None:
        """`tokens` were just prefilled; `features`: layer -> hidden states (len(tokens), d) of `capture`,
        None when it is ()."""

    def __call__(self, ctx: RoundContext) -> Round:
        """One round (see the module docstring)."""


@functools.cache
def block_size() -> int:
    """Tokens per decode block (plain_round): 8, the UI getting them in bursts of ~8 x 5 ms; the environment
    variable NINFER_DECODE_BLOCK=1 turns blocks off, and the batched forced insert with them (benchmarks
    compare one token per round in the same run)."""
    v = os.environ.get("NINFER_DECODE_BLOCK", "8")
    if not v.isdigit() or int(v) < 1:
        raise ConfigError(f"NINFER_DECODE_BLOCK must be a whole number >= 1, got {v!r}")
    return int(v)


def plain_round(ctx: RoundContext) -> Round:
    """One token: forward the pending token, choose the next one. When the chooser can hand its choice to
    the model (TokenChooser.block: greedy with or without penalties, or sampling; in the answer, or in
    the reasoning up to its budget) and the model can choose by itself, a decode block instead: up to
    block_size() tokens in one call (Model.decode_block), the tokens single rounds would give. A stop token
    the chooser gives back (see TokenChooser.accepted) leaves the cache one position shorter. Not for the
    reply's first token (ctx.reply_start), which the user waits for. Tokens the thinking state forces (the
    budget's insert) need no choice: the rest of them go through one batched forward."""
    t0 = time.perf_counter()
    pos = len(ctx.seq) - 1
    forced = ctx.chooser.forced_run()[:ctx.max_tokens] if block_size() > 1 else ()
    if len(forced) > 1:  # known tokens (a forced insert): one batched forward, as a prefill; no choice to make
        ctx.model.forward(np.array([ctx.seq[-1], *forced[:-1]], np.int32), pos, ctx.cache)
        for tok in forced:
            ctx.chooser.accept(tok)
        return Round(list(forced), verify_ms=(time.perf_counter() - t0) * 1e3)
    # the reply's first token goes out alone: its text shows one forward after the prefill, not a block's
    n = 1 if len(ctx.seq) == ctx.reply_start else ctx.chooser.block_room(min(ctx.max_tokens, block_size()))
    block = getattr(ctx.model, "decode_block", None) if n > 1 else None
    choice = ctx.chooser.block(n) if block is not None else None
    if choice is not None:
        toks = block(ctx.seq[-1], pos, ctx.cache, n, ctx.stop_ids, choice) or []  # None: not yet
        taken = ctx.chooser.accepted(toks)  # [] for none: rewinds the generator, nothing taken
        if len(taken) < len(toks):  # a stop token given back: its position is chosen again
            ctx.cache.truncate(ctx.cache.length - (len(toks) - len(taken)))
        if taken:
            return Round(taken, verify_ms=(time.perf_counter() - t0) * 1e3)
    logits = ctx.model.forward(np.array([ctx.seq[-1]], np.int32), pos, ctx.cache)  # (1, vocab)
    tok = ctx.chooser.choose(logits[0])
    ctx.chooser.accept(tok)
    return Round([tok], verify_ms=(time.perf_counter() - t0) * 1e3)


class PlainRound:
    """`plain_round` as a RoundFn: no drafter, so nothing to reset and nothing to watch in the prefill."""

    capture: tuple[int, ...] = ()

    def begin(self) -> None:
        pass

    def observe_prefill(self, tokens, features) -> None:
        pass

    def __call__(self, ctx: RoundContext) -> Round:
        return plain_round(ctx)


@dataclass
class ReplyOptions:
    """Per-reply knobs resolved by the session (engine args + request)."""

    max_context: int
    prefill_chunk: int = 256
    prefix_reuse: bool = True
    stats_interval_s: float = 0.1
    spec_mode: str = "off"  # the rest only label FinalStats
    backend: str = "cpu"
    kv_dtype: str = "f16"
    capacity: int = 0


@dataclass
class Reply:
    """One reply, resolved by the session from the request."""

    prompt: list[int]
    chooser: object  # engine.sampling.TokenChooser, over `thinking`
    thinking: ThinkingState
    text: TextStream
    stop_ids: frozenset[int]
    max_new: int
    round_fn: RoundFn


def run_reply(target: Target, reply: Reply, opts: ReplyOptions,
              cancel: threading.Event | None = None) -> Iterator:
    """Generate one reply, yielding engine.events; FinalStats last. `cancel` is checked between prefill
    passes and between rounds. `target.cached` says what the cache holds at every step (see Target)."""
    stats = ReplyStats(len(reply.prompt), reply.thinking, opts)
    cancelled = cancel.is_set if cancel is not None else (lambda: False)
    prompt, P = reply.prompt, len(reply.prompt)
    stats.reused = reuse_prefix(target, prompt, opts.prefix_reuse)
    reply.round_fn.begin()
    done = yield from prefill(target, prompt, opts.prefill_chunk, reply.round_fn, cancelled)
    if done is None:
        yield stats.final(Finish("cancelled", "cancelled during prefill"), [], reply.text)
        return
    stats.prefill = done

    seq = list(prompt)
    limit = min(reply.max_new, opts.max_context - P)
    at_limit = Finish("length", f"max_new {reply.max_new} reached" if reply.max_new <= opts.max_context - P
                      else f"context full ({opts.max_context} tokens)")
    ctx = RoundContext(target.model, target.cache, seq, reply.chooser, 1, reply.stop_ids, reply_start=P)
    finish = None
    while finish is None:
        if cancelled():
            finish = Finish("cancelled", "cancelled by the user")
            break
        ctx.max_tokens = limit - (len(seq) - P)
        rnd = _play(reply.round_fn, ctx, target)
        stats.round_done(rnd)
        kept, finish, events = reply.text.take(rnd.tokens, len(seq) - P)
        seq.extend(rnd.tokens[:kept])
        target.holds(seq)
        if finish is None and len(seq) - P >= limit:
            finish = at_limit
        if finish is None:
            events += stats.step(len(seq), rnd)
        yield from events
    yield from reply.text.flush()
    yield stats.final(finish, seq[P:], reply.text)


def _play(round_fn: RoundFn, ctx: RoundContext, target: Target) -> Round:
    """One round; the cache's state is unknown after a failed one."""
    try:
        rnd = round_fn(ctx)
    except BaseException:
        target.forget()
        raise
    assert len(rnd.tokens) <= ctx.max_tokens, f"a round returned {len(rnd.tokens)} of {ctx.max_tokens} tokens"
    return rnd
