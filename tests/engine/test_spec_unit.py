"""Model-free tests of speculative decoding: verify (hand-built logits), the n-gram drafter, the registry,
and the round against a tiny fake model whose logits are a pure function of the prefix (so speculation must
be exactly lossless). The adaptive draft length's tests: test_spec_adaptive.py."""
from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest

from engine.errors import ConfigError
from engine.spec import NO_DRAFTER, available_modes, make_drafter, verify
from engine.spec.ngram import NgramDrafter
from spec_fakes import PROMPT, FakeChooser, FakeModel, ListDrafter, accepted, plain_decode, spec_decode


# ---------------------------------------------------------------- verify

def onehot_rows(tokens, vocab=10):
    rows = np.zeros((len(tokens), vocab), np.float32)
    rows[np.arange(len(tokens)), tokens] = 5.0
    return rows


def test_verify_all_accepted_gives_bonus():
    res = verify(FakeChooser(), onehot_rows([4, 5, 6, 7]), [4, 5, 6])
    assert res.tokens == [4, 5, 6, 7] and res.n_accepted == 3 and res.flags == [True] * 3


def test_verify_first_mismatch_is_emitted_and_rest_ignored():
    res = verify(FakeChooser(), onehot_rows([4, 9, 6, 7]), [4, 5, 6])
    assert res.tokens == [4, 9] and res.n_accepted == 1 and res.flags == [True, False, False]
    res = verify(FakeChooser(), onehot_rows([1, 5, 6, 7]), [4, 5, 6])
    assert res.tokens == [1] and res.n_accepted == 0


def test_verify_no_drafts_is_a_plain_step():
    res = verify(FakeChooser(), onehot_rows([3]), [])
    assert res.tokens == [3] and res.n_accepted == 0 and res.flags == []


def test_verify_stops_at_stop_token_and_budget():
    res = verify(FakeChooser(), onehot_rows([4, 2, 6, 7]), [4, 2, 6], stop_ids={2})
    assert res.tokens == [4, 2] and res.stopped and res.n_accepted == 2
    res = verify(FakeChooser(), onehot_rows([4, 5, 6, 7]), [4, 5, 6], max_tokens=2)
    assert res.tokens == [4, 5]


def test_verify_penalties_see_earlier_drafts():
    # Every row prefers 3 slightly over 7; a presence penalty must flip position 2 once 3 was accepted.
    rows = np.zeros((3, 10), np.float32)
    rows[:, 3], rows[:, 7] = 2.0, 1.5
    ch = FakeChooser(presence=1.0)
    res = verify(ch, rows, [3, 3])
    assert res.tokens == [3, 7] and res.n_accepted == 1
    assert ch.seen_at_choose == [(), (3,)]
    assert ch.history == [3, 7]  # exactly the emitted tokens; the rejected draft never reached the chooser


def test_verify_forced_token_overrides_logits():
    ch = FakeChooser(force_at=1, force_token=8)
    res = verify(ch, onehot_rows([4, 5, 6]), [4, 8])
    assert res.tokens == [4, 8, 6] and res.n_accepted == 2


# ---------------------------------------------------------------- n-gram drafter

def brute_ngram(ctx, k, n_min, n_max):
    """Reference: scan backwards for the most recent earlier occurrence of the longest suffix."""
    for n in range(min(n_max, len(ctx)), n_min - 1, -1):
        suffix = ctx[len(ctx) - n:]
        for end in range(len(ctx) - 1, n - 1, -1):  # end: exclusive end of an earlier occurrence
            if ctx[end - n:end] == suffix:
                seq = list(ctx)
                while len(seq) < end + k:
                    seq.append(seq[len(seq) - (len(ctx) - end)])
                return seq[end:end + k]
    return []


def test_ngram_longest_then_most_recent():
    d = NgramDrafter(n_min=1, n_max=3)
    # suffix (1,2,3) occurred once, followed by 9; (2,3) more recently followed by 5: the longer match wins.
    assert d.propose([1, 2, 3, 9, 8, 2, 3, 5, 0, 1, 2, 3], 2) == [9, 8]
    d.reset()
    assert d.propose([7, 1, 4, 7, 2, 6, 7], 1) == [2]  # only 1-gram matches: most recent occurrence
    d.reset()
    assert d.propose([1, 2, 3], 3) == []


def test_ngram_wraps_periodic_pattern():
    d = NgramDrafter()
    assert d.propose([5, 5, 5, 5], 4) == [5, 5, 5, 5]
    assert NgramDrafter().propose([1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert NgramDrafter(wrap=False).propose([1, 2, 1, 2, 1, 2], 5) == [1, 2]


def test_ngram_incremental_matches_bruteforce():
    rng = random.Random(3)
    d = NgramDrafter(n_min=2, n_max=4)
    ctx: list[int] = []
    for step in range(400):
        ctx.append(rng.randrange(6))
        if step == 200:
            ctx = ctx[:150]  # an edit of the history: the drafter must rebuild, not extend
        k = rng.randrange(1, 6)
        assert d.propose(ctx, k) == brute_ngram(ctx, k, 2, 4), step


def test_ngram_long_context_is_fast():
    import time
    ctx = list(np.random.default_rng(0).integers(0, 50_000, 8000))
    d = NgramDrafter()
    d.propose(ctx, 3)
    t0 = time.perf_counter()
    for i in range(500):  # per-step cost must not grow with the context
        ctx.append(i % 97)
        d.propose(ctx, 5)
    assert time.perf_counter() - t0 < 0.5


# ---------------------------------------------------------------- registry

def test_registry_modes():
    modes = available_modes(None)
    assert list(modes) == ["off", "ngram", "mtp", "dflash"]
    assert modes["off"] is None and modes["ngram"] is None
    for mode in ("mtp", "dflash"):
        if modes[mode] is not None:  # until their drafters land
            assert modes[mode] == NO_DRAFTER
            with pytest.raises(ConfigError, match="no drafter for this model"):
                make_drafter(mode)
    assert make_drafter("off") is None
    assert isinstance(make_drafter("ngram", n_max=4, adaptive=False), NgramDrafter)
    assert isinstance(make_drafter("ngram").inner, NgramDrafter)
    model = FakeModel()  # adaptive drafters of one model share its measured verify costs across replies
    a, b = make_drafter("ngram", model), make_drafter("ngram", model)
    a.cost_ms[4] = 12.0
    assert b.cost_ms == {4: 12.0} and make_drafter("ngram", FakeModel()).cost_ms == {}
    with pytest.raises(ConfigError, match="--spec 'bogus'"):
        make_drafter("bogus")


# ---------------------------------------------------------------- round vs plain decode (fake model)



@pytest.mark.parametrize("k", [1, 3, 5])
def test_round_greedy_lossless_ngram(k):
    model = FakeModel()
    want = plain_decode(model, PROMPT, FakeChooser(), 60)
    got, rounds = spec_decode(model, PROMPT, FakeChooser(), 60, NgramDrafter(), k)
    assert got == want
    assert accepted(rounds) > 0 and len(rounds) < 60  # the counting pattern must be drafted
    assert max(r.drafted for r in rounds) == k


@pytest.mark.parametrize("k", [1, 4])
def test_round_sampled_same_draws_with_penalty_and_forcing(k):
    # One chooser draw per emitted token, in order: with the same seed spec reproduces plain decode exactly.
    model = FakeModel(noise=1.5)
    mk = lambda: FakeChooser(temperature=0.8, presence=0.7, seed=11, force_at=9, force_token=2)
    want = plain_decode(model, PROMPT, mk(), 50)
    for drafter in (NgramDrafter(), ListDrafter([0] * len(PROMPT) + want, corrupt=0.3)):
        got, rounds = spec_decode(model, PROMPT, mk(), 50, drafter, k)
        assert got == want
        assert accepted(rounds) > 0


def test_round_stops_and_respects_budget_and_capacity():
    model = FakeModel()
    want = plain_decode(model, PROMPT, FakeChooser(), 40, stop_ids={5})
    got, _ = spec_decode(model, PROMPT, FakeChooser(), 40, NgramDrafter(), 5, stop_ids={5})
    assert got == want and got[-1] == 5
    got, _ = spec_decode(model, PROMPT, FakeChooser(), 7, NgramDrafter(), 5)
    assert len(got) == 7
    cap = len(PROMPT) + 10
    got, _ = spec_decode(model, PROMPT, FakeChooser(), 40, NgramDrafter(), 5, capacity=cap)
    assert got == plain_decode(model, PROMPT, FakeChooser(), len(got))


def test_round_drops_out_of_vocabulary_drafts():
    class Args:
        vocab_size = 12
    model = FakeModel()
    model.args = Args()
    want = plain_decode(model, PROMPT, FakeChooser(), 30)
    bad = ListDrafter([0] * len(PROMPT) + [t if i % 3 else 99 for i, t in enumerate(want)])
    got, rounds = spec_decode(model, PROMPT, FakeChooser(), 30, bad, 4)
    assert got == want and accepted(rounds) > 0


def chi2_pvalue(stat, df):
    """Upper tail of chi-square (Wilson-Hilferty normal approximation; fine for df >= 3)."""
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_round_sampled_distribution_matches_target():
    # Independent seeds per sample: the joint law of the first 3 reply tokens under speculation (drafts
    # half-corrupted, so accept and reject paths both occur) must be the target's exact law.
    model = FakeModel(vocab=6, bias=1.0, noise=1.0)
    prompt = [1, 2, 3]

    def p_next(prefix):
        x = model.next_logits(prefix).astype(np.float64)
        p = np.exp(x - x.max())
        return p / p.sum()

    exact = {}
    for a in range(6):
        for b in range(6):
            for c in range(6):
                exact[(a, b, c)] = (p_next(prompt)[a] * p_next(prompt + [a])[b] * p_next(prompt + [a, b])[c])
    n = 3000
    counts = Counter()
    for s in range(n):
        drafter = ListDrafter([0] * 3 + [2, 3, 4, 5], corrupt=0.5, vocab=6, seed=s)
        got, _ = spec_decode(model, prompt, FakeChooser(temperature=1.0, seed=s), 3, drafter, 3)
        counts[tuple(got)] += 1
    # Pool cells with small expectation so the chi-square approximation holds.
    stat, df, pool_o, pool_e = 0.0, -1, 0, 0.0
    for cell, p in exact.items():
        e = n * p
        if e < 5:
            pool_o += counts[cell]
            pool_e += e
            continue
        stat += (counts[cell] - e) ** 2 / e
        df += 1
    stat += (pool_o - pool_e) ** 2 / pool_e
    df += 1
    assert df >= 10
    assert chi2_pvalue(stat, df) > 1e-3, (stat, df)
