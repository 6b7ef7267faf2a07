"""Lookup first (engine/spec/lookup.py): n-gram drafts where the context's last tokens occurred before, the
trained drafter's otherwise; each source with its own adaptive length. Model-free (spec_fakes)."""
from __future__ import annotations

import pytest
from spec_fakes import FakeChooser, FakeModel, ListDrafter, SimClock, plain_decode, spec_decode

from engine.spec.adaptive import AdaptiveLength
from engine.spec.lookup import LOOKUP_DRAFTS, LookupFirst, lookup_first
from engine.spec.round import SpecRound
from engine.spec.ngram import NgramDrafter

PROMPT = [1, 2, 3]


class Recording(ListDrafter):
    """A scripted drafter that records what it is asked and shown."""

    name = "scripted"

    def __init__(self, script, **kw):
        super().__init__(script, **kw)
        self.proposed: list[int] = []  # context lengths it was asked to draft at
        self.asked: list[int] = []  # the k it was asked for

    def propose(self, context, k, features):
        self.proposed.append(len(context))
        self.asked.append(k)
        return super().propose(context, k, features)


def _pair(script, corrupt, clock, costs=None, lookup_drafts=0):
    inner = Recording(script, corrupt=corrupt, seed=1)
    table = dict(costs or {})
    drafter = AdaptiveLength(inner, clock=clock, cost_table=table)
    lookup = AdaptiveLength(NgramDrafter(n_min=3, n_max=5), clock=clock, cost_table=table)
    return inner, LookupFirst(drafter, lookup, lookup_drafts)


@pytest.mark.parametrize("corrupt", [0.0, 0.7])
def test_lookup_first_is_lossless_and_both_sources_draft(corrupt):
    """Plain decode's tokens whoever drafts; on a counting pattern (repeats every 12 tokens) the lookup drafts
    once the text repeats and the trained drafter before; the trained drafter observes every fed position."""
    sim = SimClock(FakeModel(noise=0.2), base=10.0, slope=1.0)
    want = plain_decode(sim, PROMPT, FakeChooser(), 90)
    inner, hy = _pair(PROMPT + want, corrupt, sim)
    got, rounds = spec_decode(sim, PROMPT, FakeChooser(), 90, hy, 5)
    assert got == want
    fed = [t for r in rounds for t in r.tokens]
    assert fed == want[1:]
    assert inner.proposed and min(inner.proposed) < 12 + len(PROMPT)  # the trained drafter drafts new text
    assert hy.lookup.tries and hy.lookup.tries[0] > 0  # the lookup's own acceptance history
    assert inner.observed[-1] == want[-2]  # every fed position reaches the trained drafter (all but the last)


def test_a_match_goes_to_the_lookup_and_clears_the_other_plan():
    """With a match the lookup drafts (its continuation of the earlier occurrence) and the trained drafter's
    plan from block_instead is dropped; without one the trained drafter decides and drafts."""
    clock = SimClock(FakeModel(), base=10.0, slope=1.0)
    inner, hy = _pair(list(range(100)), 0.0, clock, {1: 10.0, 2: 10.5, 8: 13.0})
    ctx = [5, 6, 7, 8, 9, 5, 6, 7]
    assert hy.matches(ctx) and not hy.matches([5, 6, 7, 8])
    assert not hy.block_instead(4, ctx)  # the lookup may draft: no block, and nothing asked of the other
    assert hy.drafter._planned is None
    hy.drafter._planned = 2  # (as if block_instead had planned a round of the trained drafter's)
    drafts = hy.propose(ctx, 4, None)  # (as many as the lookup's length plans)
    assert len(drafts) >= 3 and drafts == [8, 9, 5, 6][:len(drafts)]
    assert hy.source is hy.lookup and hy.drafter._planned is None and inner.proposed == []
    hy.observe([7, 8, 9], None)  # two drafts accepted: the lookup's history learns, the trained one's does not
    assert hy.lookup.tries[:2] == [1.0, 1.0] and hy.lookup.hits[:2] == [1.0, 1.0] and hy.drafter.tries == []
    assert inner.observed == [7, 8, 9]
    got = hy.propose([1, 2, 3, 4], 3, None)  # no earlier occurrence: the trained drafter's round
    assert hy.source is hy.drafter and inner.proposed == [4] and got == [4, 5, 6][:len(got)]
    assert hy.lookup._pending is None  # (its empty propose is not timed as a verify of its own)


def test_the_lookups_cost_table_is_the_models():
    model = object.__new__(FakeModel)
    a = AdaptiveLength(NgramDrafter(), cost_table={})
    hy = lookup_first(a, None)
    assert isinstance(hy, LookupFirst) and hy.lookup.inner.n_min == 3
    from engine.spec.adaptive import shared_cost_table
    b = AdaptiveLength(NgramDrafter(), cost_table=shared_cost_table(model))
    assert lookup_first(b, model).lookup.cost_ms is b.cost_ms


def test_the_better_source_drafts_and_the_lookup_learns_either_way():
    """Where both can price rounds, the lookup drafts only when its best round promises at least the trained
    drafter's tokens per ms; when it does not, its drafts are still scored against the reply (its history
    follows the text), and the trained drafter's round runs."""
    clock = SimClock(FakeModel(), base=10.0, slope=1.0)
    costs = {1: 10.0, 2: 10.5, 4: 11.5, 8: 13.0}
    inner, hy = _pair(list(range(100)), 0.0, clock, costs)
    for a, acc in ((hy.drafter, 0.95), (hy.lookup, 0.05)):
        a.tries, a.hits = [100.0] * 4, [100.0 * acc] * 4
    ctx = [5, 6, 7, 8, 9, 5, 6, 7]
    assert hy.matches(ctx) and not hy.lookup_pays(4)
    hy.block_timed(8, 80.0)  # (a block's token measured: the lengths plan rounds, not their first block)
    assert not hy.block_instead(4, ctx) and hy.drafter._planned  # the trained drafter plans the round
    got = hy.propose(ctx, 4, None)
    assert hy.source is hy.drafter and got == [8, 9, 10, 11][:len(got)] and inner.proposed == [len(ctx)]
    before = list(hy.lookup.tries)
    hy.observe([7, 8, 9, 10], None)  # the reply went on 8, 9, 10: the lookup's drafts 8, 9, 5, 6 score 2 of 3
    assert hy.lookup.tries[:3] == pytest.approx([t * hy.lookup.decay + 1 for t in before[:3]])
    assert hy.lookup.hits[2] == pytest.approx(5.0 * hy.lookup.decay)  # (its third draft, 5, was wrong)
    hy.lookup.tries, hy.lookup.hits = [100.0] * 4, [99.0] * 4  # now the lookup is the better source
    assert hy.lookup_pays(4)


def test_propose_takes_block_instead_s_verdict():
    """The round block_instead judged (a match, lookup_pays) is the round propose drafts: the index is not asked
    again by it, nor are both lengths priced again (only the lookup's own length asks the index, for its
    drafts); a propose for another context judges afresh."""
    clock = SimClock(FakeModel(), base=10.0, slope=1.0)
    inner, hy = _pair(list(range(100)), 0.0, clock, {1: 10.0, 2: 10.5, 4: 11.5, 8: 13.0})
    asked, priced = [], []
    index, plan = hy.lookup.inner.propose, AdaptiveLength.best_plan
    hy.lookup.inner.propose = lambda ctx, k, features=None: asked.append(len(ctx)) or index(ctx, k)
    for a in (hy.drafter, hy.lookup):
        a.best_plan = lambda k_max, a=a: priced.append(a) or plan(a, k_max)
        a.tries, a.hits = [100.0] * 4, [90.0] * 4
    hy.block_timed(8, 80.0)
    ctx = [5, 6, 7, 8, 9, 5, 6, 7]
    assert not hy.block_instead(4, ctx)  # a match that pays: the lookup's round
    n_asked, n_priced = len(asked), priced.count(hy.drafter)
    drafts = hy.propose(ctx, 4, None)
    assert hy.source is hy.lookup and drafts == [8, 9, 5, 6][:len(drafts)]
    assert len(asked) == n_asked + 1 and priced.count(hy.drafter) == n_priced  # the lookup's length's ask only
    hy.observe([7, 8], None)
    hy.propose([5, 6, 7, 8, 9, 5, 6, 7, 8, 9], 4, None)  # no verdict for this context: judged here
    assert priced.count(hy.drafter) > n_priced


@pytest.mark.parametrize("corrupt", [0.0, 0.7])
def test_lookup_rounds_draft_past_the_trained_drafters_length(corrupt):
    """With lookup_drafts 7 and --draft-tokens 3, SpecRound's bound is 7: lookup rounds on a repeating text verify
    more than 3 drafts, the trained drafter is never asked for more than 3, and the reply is plain decode's."""
    sim = SimClock(FakeModel(noise=0.2), base=10.0, slope=1.0)
    want = plain_decode(sim, PROMPT, FakeChooser(), 120)
    inner, hy = _pair(PROMPT + want, corrupt, sim, lookup_drafts=7)
    k = SpecRound(hy, 3).k_round
    assert k == 7 and hy.drafter_k == 3
    got, rounds = spec_decode(sim, PROMPT, FakeChooser(), 120, hy, k)
    assert got == want
    lookup_rounds = [r for r in rounds if r.lookup]
    assert max(r.drafted for r in lookup_rounds) > 3 and max(r.drafted for r in rounds) <= 7
    assert inner.asked and max(inner.asked) <= 3
    assert max(r.drafted for r in rounds if not r.lookup) <= 3


def test_the_round_bound_is_k_without_a_wider_lookup():
    """A drafter without round_length, or a lookup no wider than k, leaves SpecRound's bound at k."""
    clock = SimClock(FakeModel(), base=10.0, slope=1.0)
    assert SpecRound(ListDrafter([]), 3).k_round == 3
    assert SpecRound(_pair([], 0.0, clock, lookup_drafts=0)[1], 5).k_round == 5
    assert SpecRound(_pair([], 0.0, clock, lookup_drafts=7)[1], 9).k_round == 9
    assert lookup_first(AdaptiveLength(NgramDrafter(), cost_table={})).lookup_drafts == LOOKUP_DRAFTS


def test_blocks_end_where_the_lookup_would_draft_while_it_pays():
    """block_triggers: the context's keys (engine.triggers) while the lookup's rounds pay; None once the trained
    drafter's rounds promise more, or where the lookup matches other than three tokens."""
    from engine.triggers import context_keys
    clock = SimClock(FakeModel(), base=10.0, slope=1.0)
    inner, hy = _pair(list(range(100)), 0.0, clock, {1: 10.0, 2: 10.5, 4: 11.5, 8: 13.0}, lookup_drafts=7)
    hy.round_length(3)
    ctx = [5, 6, 7, 8, 9, 5, 6, 7]
    keys, prev = hy.block_triggers(ctx)
    want = context_keys(ctx)
    assert keys.tolist() == want[0].tolist() and prev == want[1] == 6
    for a, acc in ((hy.drafter, 0.95), (hy.lookup, 0.05)):
        a.tries, a.hits = [100.0] * 8, [100.0 * acc] * 8
    assert not hy.lookup_pays(7) and hy.block_triggers(ctx) is None
    two = LookupFirst(hy.drafter, AdaptiveLength(NgramDrafter(n_min=2, n_max=5), cost_table={}))
    assert two.block_triggers(ctx) is None


def test_a_round_that_starts_a_copy_is_priced_apart_from_one_that_goes_on():
    """With a fresh length, a lookup round after a round without kept lookup drafts (a block, the trained
    drafter's, the reply's start) drafts and learns through `fresh`; one right after a lookup round that kept a
    draft, through `lookup`. Both follow the reply."""
    clock = SimClock(FakeModel(), base=10.0, slope=1.0)
    inner = Recording(list(range(100)), seed=1)
    table = {1: 10.0, 2: 10.5, 4: 11.5, 8: 13.0}
    ngram = NgramDrafter(n_min=3, n_max=5)
    going, fresh = (AdaptiveLength(ngram, clock=clock, cost_table=table) for _ in range(2))
    hy = LookupFirst(AdaptiveLength(inner, clock=clock, cost_table=table), going, 7, fresh)
    ctx = [5, 6, 7, 8, 9, 5, 6, 7]
    assert hy.propose(ctx, 4, None) and hy.source is fresh and hy.from_lookup
    hy.observe([7, 8, 9], None)  # two drafts kept: the copy goes on
    assert fresh.tries[:2] == [1.0, 1.0] and going.tries == []
    ctx += [8, 9]
    assert hy.propose(ctx, 4, None) and hy.source is going
    hy.observe([9], None)  # none kept: the next match starts a copy again
    assert going.tries[:1] == [1.0] and hy.propose(ctx + [5, 6, 7], 4, None) and hy.source is fresh
    hy.observe([7, 8], None)  # a draft kept: going on ...
    assert hy._lk() is going
    hy.blocked(8)  # ... until a decode block runs in place of a round
    hy.observe([9, 5, 6, 7, 8, 9, 5, 6], None)
    assert hy._lk() is fresh
    single = LookupFirst(hy.drafter, going)
    assert single.fresh is single.lookup and single._lengths() == (going,)
