"""Decode-block triggers: where a decode block should hand back early because prompt lookup would draft there.

A decode block (Runner.decode_block) chooses up to 8 tokens in one call; a speculative reply decides how to go on
only between calls. Where the text starts repeating inside a block (its last three tokens occurred before), a
lookup-first drafter (engine.spec.lookup) would have drafted from there, but the block runs on, up to 7 tokens at a
plain token's cost each. With triggers the block ends after such a token instead; the tokens are the same either
way (a block chooses what single rounds would), only where the reply's rounds begin moves.

A trigger is three consecutive tokens packed into one int64 (`gram_key`, GRAM_BITS each: vocabularies up to 2M
tokens); the CPU step's block checks the last three tokens after each of its passes (backends/cpu/step._ends)
against the sorted keys of every three consecutive tokens of the context before the block (`context_keys`;
`ContextKeys` keeps them for a growing reply: a block's new tokens merged in, not the whole context sorted again).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

GRAM_BITS = 21  # bits per token of a packed key: token ids below 2**21


def gram_key(a: int, b: int, c: int) -> int:
    """Three tokens as one key (the step packs them the same way)."""
    return (a << (2 * GRAM_BITS)) | (b << GRAM_BITS) | c


def context_keys(tokens: Sequence[int]) -> tuple[np.ndarray, int] | None:
    """(the sorted distinct keys of every three consecutive tokens, the last-but-one token) of the context before
    a block (its last token is the block's first, fed at the block's first position), as FusedForward.block's
    `triggers`; None where the context is shorter than three tokens or holds a token id that does not fit."""
    t = np.asarray(tokens, np.int64)
    if t.shape[0] < 3 or t.min() < 0 or t.max() >= 1 << GRAM_BITS:
        return None
    keys = (t[:-2] << (2 * GRAM_BITS)) | (t[1:-1] << GRAM_BITS) | t[2:]
    return np.unique(keys), int(t[-2])


class ContextKeys:
    """context_keys of a reply as it grows: each call merges the keys of the tokens added since the last one into
    the kept sorted array (a context that does not continue the last one starts over). At 8K tokens of context a
    block's keys cost ~2.5 ms sorted afresh (a block is ~25 ms), tens of microseconds merged."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.keys = np.zeros(0, np.int64)
        self.tail: list[int] = []  # the context's last two tokens seen, and how many tokens were seen
        self.n = 0

    def __call__(self, tokens: Sequence[int]) -> tuple[np.ndarray, int] | None:
        n = len(tokens)
        if n < self.n or (self.n and list(tokens[self.n - 2:self.n]) != self.tail):
            self.reset()
        if n < 3:
            return None
        new = np.asarray(tokens[max(self.n - 2, 0):], np.int64)  # the windows that end at the new tokens
        if new.shape[0] and (new.min() < 0 or new.max() >= 1 << GRAM_BITS):
            return None
        if new.shape[0] >= 3:
            got = np.unique((new[:-2] << (2 * GRAM_BITS)) | (new[1:-1] << GRAM_BITS) | new[2:])
            at = np.searchsorted(self.keys, got)
            if self.keys.shape[0]:  # keys already held are not inserted again
                fresh = self.keys[np.minimum(at, self.keys.shape[0] - 1)] != got
                got, at = got[fresh], at[fresh]
            self.keys = np.insert(self.keys, at, got)
        self.n, self.tail = n, [int(t) for t in tokens[n - 2:n]]
        return self.keys, self.tail[0]
