"""Sample-and-match verification: the one model-free place that decides which drafts are kept.

At each verified position i the reply's own sampling chain (`TokenChooser`: penalties, thinking-budget
forcing, temperature/top-k/top-p/min-p, its seeded generator) draws the target's token y_i from logits row i.
Drafts are accepted while y_i == d_i; the first mismatching y_i is emitted instead; if every draft matched,
the draw at the last row is the bonus token. Every emitted token is exactly the token plain decoding would
have drawn at that position with the same chooser state, so the output distribution is the target's for any
drafter (no draft probabilities needed). Greedy is the temperature-0 case of the same code.

`chooser.accept(y)` is called for each emitted token in order, so penalties and forcing at position i already
count d_1..d_{i-1}, and nothing has to be rolled back: the chooser never sees a rejected draft.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Protocol, Sequence

import numpy as np


class Chooser(Protocol):
    """The part of `engine.sampling.TokenChooser` verification uses."""

    def choose(self, logits_row: np.ndarray) -> int: ...

    def accept(self, token: int) -> None: ...


@dataclass
class VerifyResult:
    """What one verification emitted.

    tokens: the emitted tokens: accepted drafts, then the target's own token (mismatch or bonus), unless a
        stop token or the token budget ended the round earlier.
    n_accepted: drafts accepted (the target drew exactly them).
    flags: per draft position, whether that draft was accepted (False after the first rejection).
    stopped: the last emitted token is a stop token.
    """

    tokens: list[int] = field(default_factory=list)
    n_accepted: int = 0
    flags: list[bool] = field(default_factory=list)
    stopped: bool = False


def verify(chooser: Chooser, logits: np.ndarray, drafts: Sequence[int],
           stop_ids: Collection[int] = (), max_tokens: int | None = None) -> VerifyResult:
    """Decide drafts d_1..d_k against target logits (k+1, vocab) of [last, d_1..d_k] (row i predicts the
    token after d_i; row 0 the token after `last`).

    Emits at most `max_tokens` tokens (the reply's remaining budget) and stops after a stop token.
    """
    k = len(drafts)
    assert logits.ndim == 2 and logits.shape[0] >= k + 1, f"need {k + 1} logit rows, got {logits.shape}"
    res = VerifyResult(flags=[False] * k)
    limit = k + 1 if max_tokens is None else min(k + 1, max_tokens)
    for i in range(limit):
        y = int(chooser.choose(logits[i]))
        chooser.accept(y)
        res.tokens.append(y)
        matched = i < k and y == int(drafts[i])
        if matched:
            res.n_accepted += 1
            res.flags[i] = True
        if y in stop_ids:
            res.stopped = True
            break
        if not matched:
            break
    return res
