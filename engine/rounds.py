"""The round seam: what the reply loop (engine/generate.py) calls after the prefill, one round at a time.

After the prefill the loop never calls the model itself; it calls a *round function* (`RoundFn`): one
round `round_fn(ctx) -> Round` returns the next tokens, each already taken by the chooser. Invariant
before and after every round: `ctx.seq` is the whole sequence (prompt + reply so far) and the KV cache
holds exactly `seq[:-1]` (the newest token is pending; it is the first input of the next round).

- `plain_round` (`PlainRound`): forward [seq[-1]] at position len(seq)-1, `chooser.choose` the next token,
  `chooser.accept` it, return Round([t]); or a decode block of several such tokens in one model call.
- a speculative round (`engine.spec.SpecRound`): propose drafts d1..dk (k <= ctx.max_tokens - 1), forward
  [seq[-1], d1..dk] with `all_logits=True`, then per position i in order: y = choose(row i), accept(y),
  emit y; continue while y == d_i and y not in ctx.stop_ids; finally `cache.truncate(len(seq_before) +
  n_returned - 1)` so the invariant holds, and return Round([y...], drafted=k, accepted=n-1, ms...); where its
  drafter would draft nothing, a decode block instead, as plain_round's (Round(block=True)).
A round never returns more than `ctx.max_tokens` tokens. The loop handles stop tokens, stop strings, max_new
and cancel on the returned tokens; if it stops in the middle of a round it truncates the cache itself.
Pass a round function for one reply with `Session.generate(..., round_fn=...)`; by default the session
picks `PlainRound` or, when the request (or EngineArgs) names a speculative mode, a `SpecRound`.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Mapping, Protocol

import numpy as np

from .errors import ConfigError


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
    block: bool = False  # a decode block a speculative round ran instead of verifying no drafts (SpecRound)
    lookup: bool = False  # its drafts came from prompt lookup, not the trained drafter (engine.spec.lookup)


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
    taken = decode_block(ctx) if len(ctx.seq) != ctx.reply_start else None
    if taken:
        return Round(taken, verify_ms=(time.perf_counter() - t0) * 1e3)
    logits = ctx.model.forward(np.array([ctx.seq[-1]], np.int32), pos, ctx.cache)  # (1, vocab)
    tok = ctx.chooser.choose(logits[0])
    ctx.chooser.accept(tok)
    return Round([tok], verify_ms=(time.perf_counter() - t0) * 1e3)


def decode_block(ctx: RoundContext, capture: tuple[int, ...] = (), triggers=None) -> list[int] | None:
    """Up to block_size() tokens after seq[-1] in one model call (Model.decode_block), each taken by the
    chooser, or None / [] where the chooser cannot hand its choice over, there is room for one token only,
    the model cannot block (not yet) or nothing was taken (the caller then runs a one-token pass). A stop token
    the chooser gives back leaves the cache one position shorter. capture: as decode_block's (the passes'
    hidden rows in ctx.model.captured); triggers: where the block may also end early (engine.triggers). plain_round's
    block, and a speculative round's without drafts."""
    n = ctx.chooser.block_room(min(ctx.max_tokens, block_size()))
    block = getattr(ctx.model, "decode_block", None) if n > 1 else None
    choice = ctx.chooser.block(n) if block is not None else None
    if choice is None:
        return None
    toks = block(ctx.seq[-1], len(ctx.seq) - 1, ctx.cache, n, ctx.stop_ids, choice, capture=capture,
                 triggers=triggers) or []  # None: not yet
    taken = ctx.chooser.accepted(toks)  # [] for none: rewinds the generator, nothing taken
    if len(taken) < len(toks):  # a stop token given back: its position is chosen again
        ctx.cache.truncate(ctx.cache.length - (len(toks) - len(taken)))
    return taken


class PlainRound:
    """`plain_round` as a RoundFn: no drafter, so nothing to reset and nothing to watch in the prefill."""

    capture: tuple[int, ...] = ()

    def begin(self) -> None:
        pass

    def observe_prefill(self, tokens, features) -> None:
        pass

    def __call__(self, ctx: RoundContext) -> Round:
        return plain_round(ctx)
