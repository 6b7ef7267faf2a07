"""The speculative round the generation loop calls instead of a plain one-token step (`SpecRound`, a
`engine.rounds.RoundFn`; `spec_round` is its body).

Round = draft k tokens, run the target once over [last, d1..dk] (one batched pass: each weight block read once
for all k+1 rows), verify with the reply's chooser (`spec.verify`), roll the KV cache back to what was kept.

Cache invariant, same as plain decode: before and after a round the cache holds every context token but the
last one (the last emitted token is fed by the next round). A round that emits e_1..e_m keeps
[last, e_1..e_{m-1}] = [last, d_1..d_{m-1}] (those are accepted drafts), i.e. truncates to pos + m.

A round without drafts (an adaptive length that finds no draft worth its verify row, decided ahead:
`block_instead`; or a propose that kept none: confidences that cut every draft, an n-gram without a match)
runs a decode block instead, as a plain reply does (rounds.plain_round), once the length's verify costs are
measured (`may_block`): a one-token round costs ~1.1x a token of a block on the CPU
(bench/results-verify.md), and on chat about half the rounds drafted nothing. The block hands out each pass's
last hidden row (Runner.decode_block's capture), which the drafter observes as it would a round's kept
positions; the same tokens either way (a block chooses what single rounds would).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Collection, Sequence

import numpy as np

from ..rounds import Round, RoundContext, block_size, decode_block
from .base import Drafter, Features
from .verify import Chooser, verify


def target_forward(model: Any, tokens: np.ndarray, pos: int, cache: Any, layers: tuple[int, ...]
                   ) -> tuple[np.ndarray, Features | None]:
    """model.forward over tokens (T,) int32 at pos -> (logits (T, vocab), features of `layers` or None)."""
    if not layers:
        return model.forward(tokens, pos, cache, all_logits=True), None
    logits = model.forward(tokens, pos, cache, all_logits=True, capture=layers)
    return logits, {layer: model.captured[layer] for layer in layers}


def clip_drafts(k: int, pos: int, max_tokens: int | None, capacity: int | None) -> int:
    """k drafts at most, so that a round emits at most max_tokens tokens and the cache (capacity positions)
    never overflows; pos = the position the round's first token is fed at."""
    if max_tokens is not None:
        k = min(k, max_tokens - 1)
    if capacity is not None:
        k = min(k, capacity - pos - 1)
    return k


def spec_round(model: Any, cache: Any, chooser: Chooser, drafter: Drafter, context: Sequence[int], k: int, *,
               stop_ids: Collection[int] = (), max_tokens: int | None = None, capacity: int | None = None,
               features: Features | None = None,
               no_drafts: Callable[[], tuple[Round, Features | None] | None] | None = None
               ) -> tuple[Round, Features | None]:
    """Run one speculative round.

    context: every token so far (prompt + reply); the cache holds all but the last (len(context) - 1).
    k: draft length asked of the drafter; clipped so the round emits at most `max_tokens` tokens and the
        cache (`capacity` positions) never overflows.
    features: the drafter's features of the previously kept positions (returned by the last round).
    no_drafts: where the drafter proposes nothing (e.g. its confidences cut every draft), what runs instead
        of verifying one token (SpecRound: a decode block), or None for the plain one-token pass.
    Returns the round and the features of the positions kept this round (for the next round's drafter).
    """
    pos = len(context) - 1
    last = int(context[-1])
    k = clip_drafts(k, pos, max_tokens, capacity)
    t0 = time.perf_counter()
    bind = getattr(drafter, "bind_target", None)  # a drafter that reads the target's cache (dflash: KV taps)
    if bind is not None:
        bind(model, cache)
    drafts = [int(t) for t in drafter.propose(context, k, features)][:max(k, 0)] if k > 0 else []
    by_lookup = bool(getattr(drafter, "from_lookup", False))  # (a lookup-first drafter's round: whose drafts)
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if vocab is not None:  # a drafter bug must not end the reply: keep drafts up to the first invalid id
        bad = next((i for i, t in enumerate(drafts) if not 0 <= t < vocab), None)
        drafts = drafts if bad is None else drafts[:bad]
    t1 = time.perf_counter()
    if not drafts and no_drafts is not None:
        out = no_drafts()
        if out is not None:
            out[0].draft_ms += (t1 - t0) * 1e3
            return out
    fed = np.array([last, *drafts], dtype=np.int32)  # (k+1,)
    logits, feats = target_forward(model, fed, pos, cache, drafter.features_needed)
    logits = np.asarray(logits).reshape(len(fed), -1)  # (k+1, vocab)
    res = verify(chooser, logits, drafts, stop_ids, max_tokens)
    m = len(res.tokens)
    if m < len(fed):
        cache.truncate(pos + m)  # drop d_m..d_k: rejected, or beyond a stop / the budget
    kept = None
    if feats is not None:
        kept = {layer: h[:m] for layer, h in feats.items()}  # (m, d) per layer
    drafter.observe(fed[:m].tolist(), kept)
    t2 = time.perf_counter()
    return Round(res.tokens, drafted=len(drafts), accepted=res.n_accepted, draft_ms=(t1 - t0) * 1e3,
                 verify_ms=(t2 - t1) * 1e3, lookup=by_lookup and bool(drafts)), kept


class SpecRound:
    """The speculative round function of one drafter (one per reply): draft, verify, roll back.

    The drafter sees the prompt as the prefill forwards it (`observe_prefill`, with the hidden states of the
    layers it reads: `capture`) and is reset when a reply begins."""

    def __init__(self, drafter: Drafter, k: int, capacity: int | None = None):
        self.drafter = drafter
        self.k = k  # drafts asked for per round (--draft-tokens; an adaptive drafter may draft fewer)
        widen = getattr(drafter, "round_length", None)  # lookup first: its rounds may draft more
        self.k_round = widen(k) if widen is not None else k
        self.capacity = capacity  # the cache's positions: no round drafts past them
        self.capture = tuple(drafter.features_needed)
        self.features: Features | None = None  # of the positions kept last (the prefill's last pass, a round)

    def begin(self) -> None:
        self.drafter.reset()
        self.features = None

    def observe_prefill(self, tokens: Sequence[int], features: Features | None) -> None:
        self.drafter.observe(list(tokens), features)
        self.features = features

    def __call__(self, ctx: RoundContext) -> Round:
        can_block = self._can_block(ctx)
        if can_block and self.drafter.block_instead(
                clip_drafts(self.k_round, len(ctx.seq) - 1, ctx.max_tokens, self.capacity), ctx.seq):  # decided ahead
            out = self._run_block(ctx)
            if out is not None:
                rnd, self.features = out
                return rnd
        rnd, self.features = spec_round(ctx.model, ctx.cache, ctx.chooser, self.drafter, ctx.seq, self.k_round,
                                        stop_ids=ctx.stop_ids, max_tokens=ctx.max_tokens,
                                        capacity=self.capacity, features=self.features,
                                        no_drafts=(lambda: self._run_block(ctx))
                                        if can_block and self.drafter.may_block() else None)
        return rnd

    def _can_block(self, ctx: RoundContext) -> bool:
        """Whether this round may emit plain tokens in a decode block where it has no drafts: the drafter can
        decide so (an adaptive length) and plain_round would block here (the model blocks; not the reply's
        first token, which goes out alone; no forced insert pending)."""
        return (hasattr(self.drafter, "block_instead") and getattr(ctx.model, "decode_block", None) is not None
                and block_size() > 1 and len(ctx.seq) != ctx.reply_start and not ctx.chooser.forced_run())

    def _run_block(self, ctx: RoundContext) -> tuple[Round, Features | None] | None:
        """A decode block in place of a round with no drafts: (the round, the features of its fed positions),
        or None where the chooser cannot hand its choice over, there is room for one token only, or the block
        chose nothing (the round then verifies one token)."""
        t0 = time.perf_counter()
        keys = getattr(self.drafter, "block_triggers", None)  # lookup first: end the block where the text repeats
        taken = decode_block(ctx, self.capture, keys(ctx.seq) if keys is not None else None)  # with the hidden rows
        if not taken:
            return None
        feats = None
        if self.capture:  # the passes' hidden rows of the fed tokens [last, taken[:-1]]
            got = {layer: ctx.model.captured.get(layer) for layer in self.capture}
            if all(h is not None and len(h) >= len(taken) for h in got.values()):
                feats = {layer: h[:len(taken)] for layer, h in got.items()}
        self.drafter.blocked(len(taken))  # (first: what it observes next is no verify pass of its drafts)
        self.drafter.observe([int(ctx.seq[-1]), *taken[:-1]], feats)  # no features: the drafter starts over
        ms = (time.perf_counter() - t0) * 1e3
        timed = getattr(self.drafter, "block_timed", None)
        if timed is not None:  # what a token costs when nothing is drafted (the adaptive length's plain price)
            timed(len(taken), ms)
        return Round(taken, verify_ms=ms, block=True), feats
