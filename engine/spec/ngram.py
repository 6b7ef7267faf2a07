"""N-gram drafter (prompt lookup): the longest recent suffix match in the context proposes what followed it.

No weights, works with any model. Strong on input-grounded or repetitive text (lists, code edits, counting),
weak on new text; a miss costs nothing but the round being a plain step.

The index maps every n-gram (n in [n_min, n_max]) to the position right after its most recent occurrence
that has a continuation, and is extended incrementally as the context grows, so a proposal costs
O(n_max + k) however long the context is (no rescanning).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import ConfigError
from ..triggers import GRAM_BITS, gram_key, merge_keys
from .base import Features


class NgramDrafter:
    """Prompt-lookup drafter. Longest n first (n_max down to n_min), most recent occurrence first.

    wrap: when the match continues into the current suffix (a repeating pattern), keep copying from the
    draft itself, so a period shorter than k still yields k drafts ("1, 2, 1, 2" or "xxxx").
    """

    name = "ngram"
    features_needed: tuple[int, ...] = ()

    def __init__(self, n_min: int = 1, n_max: int = 3, wrap: bool = True):
        if not 1 <= n_min <= n_max:
            raise ConfigError(f"n-gram range must satisfy 1 <= n_min <= n_max, got {n_min}..{n_max}")
        self.n_min, self.n_max, self.wrap = n_min, n_max, wrap
        self.reset()

    def reset(self) -> None:
        """Forget the indexed context."""
        self._ctx: list[int] = []
        # _index[n]: n-gram tuple -> start of what followed its most recent occurrence (always < len(_ctx))
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.n_min, self.n_max + 1)}
        # the 3-grams' packed keys (engine.triggers), sorted (trigger_keys merges the new ones in), and the new ones
        self._keys, self._new_keys, self._top = np.zeros(0, np.int64), [], 0

    def observe(self, tokens: Sequence[int], features: Features | None) -> None:
        """Nothing to do: `propose` indexes whatever context it is given (tokens fed or not)."""

    def _append(self, tok: int) -> None:
        ctx = self._ctx
        i = len(ctx)  # position of the new token: it is the continuation of the n-grams ending right before it
        ctx.append(tok)
        for n, index in self._index.items():
            if i >= n:
                index[tuple(ctx[i - n:i])] = i
        if i >= 3 and 3 in self._index:
            self._new_keys.append(gram_key(*ctx[i - 3:i]))
        self._top = max(self._top, tok)

    def _sync(self, context: Sequence[int]) -> None:
        """Extend the index to `context`; rebuild if `context` does not continue what was indexed.

        The continuation check is a spot check (length and the last indexed token): callers reset() when a
        reply starts, so a context that is not a continuation only arrives after an edit of the history."""
        n_have = len(self._ctx)
        if len(context) < n_have or (n_have and int(context[n_have - 1]) != self._ctx[-1]):
            self.reset()
            n_have = 0
        for tok in context[n_have:]:
            self._append(int(tok))

    def trigger_keys(self, context: Sequence[int]) -> tuple[np.ndarray, int] | None:
        """engine.triggers.context_keys of `context` from the index (n_min <= 3 <= n_max): its 3-grams' keys,
        kept sorted as the context grows, and the last window's (not indexed yet: no continuation); None where the
        context is shorter than three tokens or holds an id that does not fit a key. At 8K tokens of context a
        block's keys sorted afresh cost ~2.5 ms (a block is ~25 ms), merged tens of microseconds."""
        self._sync(context)
        ctx = self._ctx
        if len(ctx) < 3 or 3 not in self._index or self._top >= 1 << GRAM_BITS:
            return None
        # the last window's key goes in with the block's new ones (one merge a block): its continuation's _append
        # would add it anyway, and the merge keeps keys distinct
        self._new_keys.append(gram_key(*ctx[-3:]))
        self._keys, self._new_keys = merge_keys(self._keys, np.array(self._new_keys, np.int64)), []
        return self._keys, ctx[-2]

    def propose(self, context_tokens: Sequence[int], k: int, features: Features | None = None) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        self._sync(context_tokens)
        ctx = self._ctx
        n_ctx = len(ctx)
        if k <= 0:
            return []
        for n in range(min(self.n_max, n_ctx), self.n_min - 1, -1):
            start = self._index[n].get(tuple(ctx[n_ctx - n:]))
            if start is None:
                continue
            avail = n_ctx - start  # >= 1 by construction
            if not self.wrap or avail >= k:
                return ctx[start:start + k]
            draft = ctx[start:]
            while len(draft) < k:  # copy from the draft itself: the pattern has period n_ctx - start
                draft.append(draft[len(draft) - avail])
            return draft
        return []


def unavailable_reason(model_path: str | None) -> str | None:
    """The n-gram drafter needs no weights: always available."""
    return None


def make_drafter(model=None, model_path: str | None = None, *, n_min: int = 1, n_max: int = 3,
                 adaptive: bool = True, **_options):
    """Registry entry (see engine.spec.base). adaptive: draft only as many tokens as pay for their verify
    cost (engine.spec.adaptive); False: always the longest match up to --draft-tokens."""
    drafter = NgramDrafter(n_min=n_min, n_max=n_max)
    if not adaptive:
        return drafter
    from .adaptive import AdaptiveLength, shared_costs
    return AdaptiveLength(drafter, **shared_costs(model, "ngram"))
