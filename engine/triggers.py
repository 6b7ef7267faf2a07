"""Decode-block triggers: where a decode block should hand back early because prompt lookup would draft there.

A decode block (Runner.decode_block) chooses up to 8 tokens in one call; a speculative reply decides how to go on
only between calls. Where the text starts repeating inside a block (its last three tokens occurred before), a
lookup-first drafter (engine.spec.lookup) would have drafted from there, but the block runs on, up to 7 tokens at a
plain token's cost each. With triggers the block ends after such a token instead; the tokens are the same either
way (a block chooses what single rounds would), only where the reply's rounds begin moves.

A trigger is three consecutive tokens packed into one int64 (`gram_key`, GRAM_BITS each: vocabularies up to 2M
tokens); the CPU step's block checks the last three tokens after each of its passes (backends/cpu/step._ends)
against the sorted keys of every three consecutive tokens of the context before the block (`context_keys`; the
n-gram drafter's index keeps them for a growing reply, engine.spec.ngram.NgramDrafter.trigger_keys, a block's new
tokens merged in rather than the whole context sorted again).
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


def merge_keys(keys: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Sorted distinct `keys` with the keys of `new` (any order, repeats) merged in: a new array."""
    new = np.unique(new)
    at = np.searchsorted(keys, new)
    if keys.shape[0]:  # keys already held are not inserted again
        fresh = keys[np.minimum(at, keys.shape[0] - 1)] != new
        new, at = new[fresh], at[fresh]
    return np.insert(keys, at, new)
