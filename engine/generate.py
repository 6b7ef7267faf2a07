"""One reply: the reply loop (`run_reply`), which drives the round seam (engine/rounds.py).

The loop's other concerns live beside it: engine/prefill.py (prefix reuse, chunked prefill),
engine/reply_text.py (tokens -> text events, stop tokens and stop strings), engine/reply_stats.py
(StepStats, FinalStats, decode_rate).

The round seam (`RoundFn`, `PlainRound`, `plain_round`) is engine/rounds.py; `ReplyOptions` (the engine's
settings a reply runs under) engine/reply_stats.py.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator

from .prefill import Target, prefill, reuse_prefix
from .reply_stats import ReplyOptions, ReplyStats
from .reply_text import Finish, TextStream
from .rounds import Round, RoundContext, RoundFn
from .thinking import ThinkingState


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
