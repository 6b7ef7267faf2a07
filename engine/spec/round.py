"""The speculative round the generation loop calls instead of a plain one-token step.

Round = draft k tokens, run the target once over [last, d1..dk] (one batched pass: each weight block read once
for all k+1 rows), verify with the reply's chooser (`spec.verify`), roll the KV cache back to what was kept.

Cache invariant, same as plain decode: before and after a round the cache holds every context token but the
last one (the last emitted token is fed by the next round). A round that emits e_1..e_m keeps
[last, e_1..e_{m-1}] = [last, d_1..d_{m-1}] (those are accepted drafts), i.e. truncates to pos + m.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

import numpy as np

from .base import Drafter, Features
from .verify import Chooser, verify


@dataclass
class RoundResult:
    """One round. tokens: emitted (accepted drafts + the target's token); flags: per drafted position."""

    tokens: list[int]
    n_drafted: int
    n_accepted: int
    flags: list[bool]
    draft_ms: float
    verify_ms: float
    stopped: bool = False


def target_forward(model: Any, tokens: np.ndarray, pos: int, cache: Any, layers: tuple[int, ...]
                   ) -> tuple[np.ndarray, Features | None]:
    """model.forward over tokens (T,) int32 at pos -> (logits (T, vocab), features of `layers` or None)."""
    if not layers:
        return model.forward(tokens, pos, cache, all_logits=True), None
    logits = model.forward(tokens, pos, cache, all_logits=True, capture=layers)
    return logits, {layer: model.captured[layer] for layer in layers}


def spec_round(model: Any, cache: Any, chooser: Chooser, drafter: Drafter, context: Sequence[int], k: int, *,
               stop_ids: Collection[int] = (), max_tokens: int | None = None, capacity: int | None = None,
               features: Features | None = None) -> tuple[RoundResult, Features | None]:
    """Run one speculative round.

    context: every token so far (prompt + reply); the cache holds all but the last (len(context) - 1).
    k: draft length asked of the drafter; clipped so the round emits at most `max_tokens` tokens and the
        cache (`capacity` positions) never overflows.
    features: the drafter's features of the previously kept positions (returned by the last round).
    Returns the round and the features of the positions kept this round (for the next round's drafter).
    """
    pos = len(context) - 1
    last = int(context[-1])
    if max_tokens is not None:
        k = min(k, max_tokens - 1)
    if capacity is not None:
        k = min(k, capacity - pos - 1)
    t0 = time.perf_counter()
    drafts = [int(t) for t in drafter.propose(context, k, features)][:max(k, 0)] if k > 0 else []
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if vocab is not None:  # a drafter bug must not end the reply: keep drafts up to the first invalid id
        bad = next((i for i, t in enumerate(drafts) if not 0 <= t < vocab), None)
        drafts = drafts if bad is None else drafts[:bad]
    t1 = time.perf_counter()
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
    return RoundResult(tokens=res.tokens, n_drafted=len(drafts), n_accepted=res.n_accepted, flags=res.flags,
                       draft_ms=(t1 - t0) * 1e3, verify_ms=(t2 - t1) * 1e3, stopped=res.stopped), kept


@dataclass
class SpecStats:
    """Running speculative statistics for one reply (the FinalStats/StepStats spec fields).

    per_position_accept[j]: among rounds that drafted at least j+1 tokens, the fraction whose draft j+1 was
    accepted (so it also counts d_1..d_j all matching: acceptance decays with j)."""

    mode: str = "off"
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    pos_drafted: list[int] = field(default_factory=list)
    pos_accepted: list[int] = field(default_factory=list)

    def add(self, r: RoundResult) -> None:
        self.rounds += 1
        self.drafted += r.n_drafted
        self.accepted += r.n_accepted
        self.draft_ms += r.draft_ms
        self.verify_ms += r.verify_ms
        while len(self.pos_drafted) < r.n_drafted:
            self.pos_drafted.append(0)
            self.pos_accepted.append(0)
        for j, ok in enumerate(r.flags):
            self.pos_drafted[j] += 1
            self.pos_accepted[j] += int(ok)

    @property
    def per_position_accept(self) -> tuple[float, ...]:
        return tuple(a / d if d else 0.0 for a, d in zip(self.pos_accepted, self.pos_drafted))

    def final_fields(self) -> dict:
        """Keyword arguments for `engine.events.FinalStats`."""
        return dict(spec_mode=self.mode, rounds=self.rounds, drafted=self.drafted, accepted=self.accepted,
                    draft_ms=self.draft_ms, verify_ms=self.verify_ms,
                    per_position_accept=self.per_position_accept)
