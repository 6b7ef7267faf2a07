"""engine/triggers.py: the keys a decode block ends at (three consecutive tokens that occurred before)."""
from __future__ import annotations

import numpy as np

from engine.spec.ngram import NgramDrafter
from engine.triggers import GRAM_BITS, context_keys, gram_key


def test_context_keys_are_every_three_consecutive_tokens():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 50, 300).tolist()
    keys, prev = context_keys(seq)
    want = {gram_key(*seq[i:i + 3]) for i in range(len(seq) - 2)}
    assert keys.dtype == np.int64 and keys.tolist() == sorted(want) and prev == seq[-2]
    assert gram_key(1, 2, 3) == (1 << 2 * GRAM_BITS) | (2 << GRAM_BITS) | 3


def test_a_key_is_where_prompt_lookup_matches_three_tokens():
    """The continuation's last three tokens are a key exactly where the n-gram drafter (3+ matched tokens)
    would draft: the block's trigger and the lookup's match agree."""
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 6, 60).tolist()
    keys, prev = context_keys(seq)
    ng = NgramDrafter(n_min=3, n_max=5)
    for nxt in range(6):
        ctx = seq + [nxt]
        assert (gram_key(*ctx[-3:]) in set(keys.tolist())) == bool(ng.propose(ctx, 1)), nxt


def test_no_keys_for_a_short_context_or_an_id_that_does_not_fit():
    assert context_keys([1, 2]) is None
    assert context_keys([1, 2, 1 << GRAM_BITS]) is None
    assert context_keys([1, -1, 2]) is None


def test_kept_keys_equal_the_context_keys_as_a_reply_grows():
    """The n-gram drafter's trigger_keys, its index's keys merged block by block, equal context_keys of the whole
    context at every step; a context that does not continue the last one (another reply) starts over."""
    rng = np.random.default_rng(2)
    seq = rng.integers(0, 8, 400).tolist()
    kept = NgramDrafter(n_min=3, n_max=5).trigger_keys
    n = 1
    while n < len(seq):
        got, want = kept(seq[:n]), context_keys(seq[:n])
        assert (got is None) == (want is None)
        if got is not None:
            assert got[0].tolist() == want[0].tolist() and got[1] == want[1]
        n += int(rng.integers(1, 9))
    other = rng.integers(8, 16, 50).tolist()
    assert kept(other)[0].tolist() == context_keys(other)[0].tolist()
