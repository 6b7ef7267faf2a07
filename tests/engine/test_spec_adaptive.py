"""Model-free tests of the adaptive draft length (engine.spec.adaptive): its choice from measured costs and
acceptance, its probes and their back-off, confidence gating and calibration, decode blocks in place of
rounds without drafts, and its rounds lossless against the fake model of spec_fakes."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from engine.spec.adaptive import AdaptiveLength
from engine.spec.ngram import NgramDrafter
from spec_fakes import PROMPT, FakeChooser, FakeModel, ListDrafter, SimClock, accepted, plain_decode, spec_decode


# ---------------------------------------------------------------- adaptive draft length



def adaptive_with(costs, acc, n_pos=8):
    a = AdaptiveLength(NgramDrafter())
    a.cost_ms = dict(costs)
    a.tries = [100.0] * n_pos
    a.hits = [100.0 * acc] * n_pos
    return a


def test_adaptive_choice_follows_costs_and_acceptance():
    cheap = {1: 10.0, 2: 10.5, 4: 11.5, 8: 13.0}
    assert adaptive_with(cheap, 0.9).choose_k(7) == 7  # cheap verify, good drafts: draft all
    assert adaptive_with(cheap, 0.02).choose_k(7) == 0  # the drafts are never right: plain steps
    dear = {1: 10.0, 2: 14.0, 4: 22.0, 8: 38.0}
    assert adaptive_with(dear, 0.5).choose_k(7) == 1  # 1.5 tok / 14 ms beats 1 / 10 and 1.75 / 18
    assert adaptive_with(dear, 0.3).choose_k(7) == 0
    assert adaptive_with({}, 0.0).choose_k(7) == 7  # costs unknown: explore at full length,
    assert adaptive_with({8: 20.0}, 0.0).choose_k(7) == 0  # then measure a plain step
    assert adaptive_with({1: 10.0, 8: 17.0}, 0.9).cost(4) == pytest.approx(13.0)  # interpolated


def test_adaptive_prices_no_drafts_at_a_decode_blocks_token():
    """Where rounds without drafts run decode blocks, the plan weighs drafting against what a block's token
    costs (measured by the first block after the verify costs), not against the one-token verify pass, which
    costs far more where a step is cheap (an AVX-512 Xeon: 4.4 ms against 2.4 a block token)."""
    costs = {1: 4.4, 2: 4.2, 4: 5.5}
    a = adaptive_with(costs, 0.4)
    a.hits[0] = 40.0  # 1.4 tokens a round of one draft: 1.4 / 4.2 ms beats 1 / 4.4 ms
    assert a.block_ms is None and a.choose_k(3) == 1 and a.keep([0.3, 0.3], 1.0) > 0
    assert a.block_instead(3) and a._planned == 0  # once: a block, to measure a block's token
    a.block_timed(8, 8 * 2.4)
    assert a.plain_cost() == pytest.approx(2.4) and a.choose_k(3) == 0  # 1.4 / 4.2 ms < 1 / 2.4 ms
    assert a.keep([0.3, 0.3], 1.0) == 0  # a round's drafts: verified only where they beat a block's token
    a.block_timed(4, 4 * 4.0)  # (an EMA over blocks)
    assert 2.4 < a.block_ms < 4.0


def test_a_stalled_block_does_not_make_drafting_look_cheap():
    """One decode block that stalled (12 ms a token against 2.4) moves the plain price by a bounded step, so the
    plan still blocks; the price follows a real change block by block; a short block weighs less than a full
    one. (The old EMA took it to ~3.4 ms, where drafting looked worth it, and with no block run after it, nothing
    brought the price back for the rest of the reply.)"""
    a = adaptive_with({1: 4.4, 2: 4.2, 4: 5.5}, 0.4)
    a.hits[0] = 40.0  # 1.4 tokens a round of one draft at 4.2 ms: pays only against a block token over 3 ms
    a.block_timed(8, 8 * 2.4)
    a.block_timed(8, 8 * 12.0)
    assert a.block_ms <= 2.4 * 1.06 and a.choose_k(3) == 0
    for _ in range(40):  # the machine really slowed down: the price gets there
        a.block_timed(8, 8 * 4.0)
    assert a.block_ms == pytest.approx(4.0, rel=0.02)
    b, c = (adaptive_with({1: 4.4, 2: 4.2}, 0.4) for _ in range(2))
    for x in (b, c):
        x.block_timed(8, 8 * 2.4)
    b.block_timed(1, 3.0)
    c.block_timed(8, 8 * 3.0)
    assert 2.4 < b.block_ms < c.block_ms


def test_adaptive_probes_one_deeper_now_and_then():
    a = adaptive_with({1: 10.0, 2: 14.0, 8: 38.0}, 0.01)
    a.probe_every = 4
    assert [a.choose_k(5) for _ in range(8)] == [0, 0, 0, 1, 0, 0, 0, 1]
    a = adaptive_with({1: 10.0, 2: 14.0, 4: 22.0, 8: 38.0}, 0.5)
    a.probe_every = 3
    assert [a.choose_k(5) for _ in range(6)] == [1, 1, 2, 1, 1, 2]


def test_adaptive_probes_back_off_while_they_fail():
    """A probe whose explored draft is rejected doubles the decisions to the next one (up to PROBE_GAP_MAX);
    an accepted one halves them (down to probe_every)."""
    from engine.spec.adaptive import PROBE_GAP_MAX
    a = adaptive_with({1: 10.0, 2: 14.0, 8: 38.0}, 0.01)
    a.probe_every = 4
    assert [a.choose_k(5) for _ in range(4)] == [0, 0, 0, 1]
    a._probed(False)
    assert [a.choose_k(5) for _ in range(8)] == [0] * 7 + [1]  # 8 decisions to the next probe
    a._probed(False)
    a._probed(False)
    a._probed(False)
    assert a._gap == PROBE_GAP_MAX == 64
    a._probed(True)
    assert a._gap == 32
    a._probed(True)
    a._probed(True)
    a._probed(True)
    assert a._gap is None  # probe_every again
    assert [a.choose_k(5) for _ in range(4)] == [0, 0, 0, 1]


def test_rounds_cut_to_nothing_back_off_from_drafting():
    """A round whose drafts the confidences all cut paid its drafting for nothing: the next decisions run
    decode blocks without drafting (block_instead), twice as many after each such round (up to
    PROBE_GAP_MAX), and a round whose verify accepts a draft clears the back-off."""
    from engine.spec.adaptive import PROBE_GAP_MAX

    class Unsure(ListDrafter):
        sure = False

        def propose(self, context, k, features):
            out = super().propose(context, k, features)
            self.confidence = [0.95 if self.sure else 0.01] * len(out)
            return out
    inner = Unsure(list(range(200)))
    a = AdaptiveLength(inner, cost_table={1: 4.0, 2: 4.4, 4: 5.6})
    a.block_ms, a.tries, a.hits = 2.5, [100.0] * 4, [80.0] * 4  # history: drafting pays; the gate decides
    a.probe_every = 4

    def decide():  # one decision: True for a block planned without drafting
        if a.block_instead(3):
            a.blocked(1)
            return True
        drafts = a.propose(list(range(10)), 3, None)
        if not drafts:
            a.blocked(1)
        else:  # (the gate's now-and-then extra row of an unsure round: rejected)
            a.observe([9, *drafts] if inner.sure else [9], None)
        return False
    assert not decide()  # drafted, every draft cut (confidence 0.01) ...
    assert [decide() for _ in range(4)] == [True] * 4  # ... then probe_every decisions without drafting
    assert not decide()  # cut again: 8, then 16, ...
    assert [decide() for _ in range(8)] == [True] * 8
    assert not decide()
    drafted = sum(not decide() for _ in range(200))
    assert a._cut_gap == PROBE_GAP_MAX and drafted <= 8, drafted  # (of 200 decisions)
    inner.sure = True
    while decide():  # the back-off runs out; a round whose drafts are kept and accepted clears it
        pass
    assert a._cut_gap is None and not decide()


def test_adaptive_draft_cost_per_k():
    """A round's drafting is kept per k; a k not drafted yet is scaled from the nearest as (k + fixed) /
    (k0 + fixed), and the choice weighs it: an expensive fixed part favours longer drafts."""
    a = adaptive_with({1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0}, 0.6)
    a.draft_fixed, a.draft_by_k = 1.0, {3: 4.0}
    assert a.draft_cost(3) == 4.0 and a.draft_cost(1) == pytest.approx(2.0) and a.draft_cost(7) == pytest.approx(8.0)
    a.draft_fixed = 0.0
    assert a.draft_cost(1) == pytest.approx(4.0 / 3)
    cheap_steps = adaptive_with({1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0}, 0.6)
    cheap_steps.draft_by_k = {1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 2.5}
    fixed_part = adaptive_with({1: 10.0, 2: 11.0, 4: 13.0, 8: 17.0}, 0.6)
    fixed_part.draft_by_k = {1: 6.0, 2: 6.5, 3: 7.0, 4: 7.5, 5: 8.0}
    assert fixed_part.choose_k(5) > cheap_steps.choose_k(5) >= 1


def test_adaptive_unseen_positions_inherit_acceptance():
    a = adaptive_with({1: 10.0, 8: 17.0}, 0.9, n_pos=1)
    assert a.acceptance(3) == pytest.approx(a.acceptance(0)) and a.acceptance(0) > 0.88
    assert a.choose_k(7) == 7


@pytest.mark.parametrize("good_drafts", [True, False])
def test_adaptive_end_to_end_lossless_and_adapts(good_drafts):
    # Good: n-gram drafts on the near-certain counting pattern -> full-length drafts stay.
    # Bad: random drafts (right 1 time in 12) with a verify that costs 40% of a step per token -> it stops
    # drafting except for the occasional probe.
    sim = SimClock(FakeModel(noise=0.2), base=10.0, slope=4.0)
    want = plain_decode(sim, PROMPT, FakeChooser(), 120)
    inner = NgramDrafter() if good_drafts else ListDrafter([0] * 200, corrupt=1.0)
    drafter = AdaptiveLength(inner, clock=sim)
    got, rounds = spec_decode(sim, PROMPT, FakeChooser(), 120, drafter, 5)
    assert got == want
    late = sim.calls[-20:]  # T of the last forwards
    if good_drafts:
        assert late.count(6) >= 15 and accepted(rounds) > 80, late
    else:
        assert sum(t > 1 for t in late) <= 4, late


def test_confidence_keeps_the_drafts_that_pay():
    """A round keeps the first n drafts that maximise expected tokens per ms given the drafter's own
    confidences: an unsure first draft makes the round a plain step, a sure run is kept whole."""
    a = adaptive_with({1: 10.0, 2: 12.0, 4: 16.0, 8: 24.0}, 0.5)
    assert a.keep([0.95, 0.95, 0.95], draft_ms=1.0) == 3
    assert a.keep([0.95, 0.9, 0.05], draft_ms=1.0) == 2
    assert a.keep([0.05, 0.99, 0.99], draft_ms=1.0) == 0  # 1 + 0.05 (1 + ...) tokens never pay for the rows
    assert adaptive_with({}, 0.5).keep([0.01], draft_ms=1.0) == 1  # costs unknown: verify everything


def _verifying(a, conf):
    """Put `a` where a propose of len(conf) drafts with these confidences leaves it (its verify pending)."""
    from engine.spec.adaptive import Shadow
    a._this = Shadow(list(range(1, len(conf) + 1)), list(conf))
    a._shadows.append(a._this)
    a._pending = (len(conf), a.clock(), a.clock())


def test_confidence_calibration_is_learned():
    """A drafter sure of drafts the target keeps rejecting: the calibrated chance of its confidence falls."""
    a = adaptive_with({1: 10.0, 2: 12.0, 4: 16.0, 8: 24.0}, 0.5)
    assert a.chance(0.95) == pytest.approx(0.95)  # no evidence yet: the confidence itself
    for _ in range(40):
        _verifying(a, [0.95, 0.95])
        a.observe([5], None)  # the last token only: the first draft was rejected
    assert a.chance(0.95) < 0.2 and a.chance(0.35) == pytest.approx(0.35)
    assert a.conf_tries[9] > 0 and a.conf_tries[3] == 0  # the second draft was never tried


class ConfidentDrafter(ListDrafter):
    """ListDrafter that knows which of its drafts it corrupted (confidence 0.05) and which not (0.95)."""

    def propose(self, context, k, features):
        out = self.script[len(context):len(context) + k]
        bad = [self.rng.random() < self.corrupt for _ in out]
        self.confidence = [0.05 if b else 0.95 for b in bad]
        return [(t + 1) % self.vocab if b else t for t, b in zip(out, bad)]


@pytest.mark.parametrize("with_confidence", [True, False])
def test_confidence_gated_rounds_are_lossless_and_verify_fewer_wrong_rows(with_confidence):
    sim = SimClock(FakeModel(noise=0.2), base=10.0, slope=2.0)
    want = plain_decode(sim, PROMPT, FakeChooser(), 120)
    inner = ConfidentDrafter(PROMPT + want, corrupt=0.3, seed=1)
    if not with_confidence:
        inner.propose = functools.partial(ListDrafter.propose, inner)  # the same drafts, no confidence
        inner.corrupt = 0.3
    drafter = AdaptiveLength(inner, clock=sim)
    got, rounds = spec_decode(sim, PROMPT, FakeChooser(), 120, drafter, 4)
    assert got == want
    wasted = sum(r.drafted - r.accepted for r in rounds)  # verify rows of rejected drafts
    if with_confidence:
        assert wasted <= 12 and accepted(rounds) >= 50, (wasted, accepted(rounds))
    else:
        assert wasted > 20, wasted


def test_first_round_of_a_reply_does_not_price_drafting():
    """The first propose of a reply also runs the prompt's rest through a trained drafter: it is not what a
    round's drafting costs, and it must not be kept as the price of that k."""
    now = [0.0]

    class Slow(ListDrafter):
        def propose(self, context, k, features):
            now[0] += 0.025 if not self.observed[len(PROMPT):] else 0.001  # 25 ms once, then 1 ms
            return super().propose(context, k, features)

    a = AdaptiveLength(Slow(list(range(40))), clock=lambda: now[0], cost_table={1: 10.0, 2: 10.1, 4: 10.3})
    a.reset()
    a.observe(PROMPT, None)
    a.propose(PROMPT, 3, None)
    a.observe(PROMPT[-1:], None)
    assert a.draft_by_k == {}
    assert len(a.propose(PROMPT + [0], 3, None)) == 3
    assert a.draft_by_k == {3: pytest.approx(1.0)}


def test_calibration_is_shared_by_the_drafters_of_one_network():
    class Keyed(ListDrafter):
        def __init__(self, key):
            super().__init__([])
            self.calibration_key = key

    class Net:
        pass
    net, other = Net(), Net()
    a, b, c = AdaptiveLength(Keyed(net)), AdaptiveLength(Keyed(net)), AdaptiveLength(Keyed(other))
    _verifying(a, [0.95])
    a.observe([5], None)  # a reply learnt that its 0.95 drafts fail
    assert b.conf_tries[9] == 1.0 and b.chance(0.95) < 0.95  # the next reply of the same drafter knows it
    assert c.conf_tries[9] == 0.0 and AdaptiveLength(NgramDrafter()).conf_tries[9] == 0.0


class _BlockModel:
    """A model whose decode block emits 10, 11, ... and hands out hidden rows; a forward would be a failure."""

    def __init__(self):
        self.captured, self.blocks = {}, []

    def decode_block(self, token, pos0, cache, n, stop_ids, choice, capture=(), triggers=None):
        self.blocks.append((token, pos0, n, capture))
        self.triggers = triggers
        cache.length = pos0 + n
        self.captured = {layer: np.full((n, 4), float(layer)) for layer in capture}
        return list(range(10, 10 + n))

    def forward(self, *a, **kw):
        raise AssertionError("no verify pass expected")


class _BlockChooser:
    def forced_run(self):
        return ()

    def block_room(self, n):
        return n

    def block(self, n):
        return ("choice", n)

    def accepted(self, toks):
        return list(toks)


class _NoDrafts:
    """An adaptive-like drafter: block_instead says `ahead`; propose proposes nothing."""
    name, features_needed = "stub", (3,)

    def __init__(self, ahead):
        self.ahead, self.calls = ahead, []

    def reset(self):
        pass

    def block_instead(self, k, context=None):
        assert list(context) == [1, 2, 3]  # (the reply so far: what a lookup-first drafter looks up)
        self.calls.append(("block_instead", k))
        return self.ahead

    def propose(self, context, k, features):
        self.calls.append(("propose", k))
        return []

    def blocked(self, n):
        self.calls.append(("blocked", n))

    def may_block(self):
        return True

    def observe(self, tokens, features):
        self.calls.append(("observe", list(tokens), None if features is None else features[3].shape))


@pytest.mark.parametrize("ahead", [True, False])
def test_a_round_without_drafts_runs_a_decode_block(ahead):
    """Decided ahead (block_instead) or after a propose that kept nothing: the round is a decode block of the
    model's, the drafter told so first (blocked) and then shown the block's fed positions with their hidden
    rows; no verify pass. The reply's first token goes out alone (a plain one-token round)."""
    from engine.rounds import RoundContext
    from engine.spec.round import SpecRound

    class Cache:
        length = 3

        def truncate(self, n):
            self.length = n

    model, drafter = _BlockModel(), _NoDrafts(ahead)
    rnd = SpecRound(drafter, 3)(RoundContext(model, Cache(), [1, 2, 3], _BlockChooser(), 20, frozenset(), 2))
    assert rnd.block and rnd.tokens == list(range(10, 18)) and rnd.drafted == 0
    assert model.blocks == [(3, 2, 8, (3,))]
    assert drafter.calls == [("block_instead", 3)] + ([] if ahead else [("propose", 3)]) + [
        ("blocked", 8), ("observe", [3, *range(10, 17)], (8, 4))]
    with pytest.raises(AssertionError, match="no verify pass"):  # the reply's first token: no block
        SpecRound(_NoDrafts(ahead), 3)(RoundContext(model, Cache(), [1, 2, 3], _BlockChooser(), 20, frozenset(), 3))


def test_adaptive_blocks_only_once_its_costs_are_measured():
    """A fresh length explores a full-length round, then a one-token round to measure c(1): neither may be
    replaced by a decode block (a block in place of the second left c(1) unmeasured, and the length then
    planned no drafts for the rest of the reply: counting fell from 1.6x to 1.0x). Once measured, a plan of
    no drafts is a block, and the block's tokens advance the probe count."""
    a = adaptive_with({}, 0.01)
    assert not a.block_instead(3) and a._planned == 3  # explore: full length
    a.cost_ms[4] = 20.0
    assert not a.block_instead(3) and a._planned == 0 and not a.may_block()  # measure c(1): a real round
    a.cost_ms.update({1: 10.0, 2: 14.0})
    assert a.may_block() and a.block_instead(3)
    before = a._rounds
    a.blocked(8)
    assert a._rounds == before + 7 and a._planned is None


def test_adaptive_asks_for_its_first_block_once():
    """Once the verify costs are measured the length asks for one decode block, to learn a block's token; where
    the runner has none (the round verified one token instead, block_timed never came) it plans by choose_k
    from then on, probes included, instead of asking for a block every round (no drafts ever again)."""
    a = adaptive_with({1: 10.0, 2: 14.0, 4: 22.0}, 0.01)
    assert a.block_instead(3) and a._planned == 0 and a.block_ms is None  # the first block asked
    planned = []
    for _ in range(3 * a.probe_every):
        a.block_instead(3)
        planned.append(a._planned)
        a._planned = None
    assert max(planned) > 0  # probes drafted again (rounds of a plan of 0 drafts verify one token)
    a.block_timed(8, 8 * 9.0)
    assert a.block_ms == pytest.approx(9.0)


def test_a_new_replys_length_keeps_the_plain_price_its_drafter_measured():
    """The decode blocks' price is the machine's and the drafter's, kept per model and length across replies
    (each reply makes its drafter): a second reply's length does not ask for a first block to measure it again,
    and it prices "no drafts" at what the first reply's blocks measured; another model's, or another drafter's
    length, starts without one."""
    from engine.spec import make_drafter
    from engine.spec.lookup import lookup_first

    class Model:  # (weak-referenceable, as the engine's models)
        pass
    model, other = Model(), Model()
    first = make_drafter("ngram", model)
    first.cost_ms.update({1: 10.0, 2: 14.0, 4: 22.0})  # (the model's shared table: measured once)
    assert first.block_instead(3) and first.block_ms is None  # the process's first reply asks for its block
    first.block_timed(8, 8 * 9.0)
    second = make_drafter("ngram", model)
    assert second.block_ms == pytest.approx(9.0) and second.plain_cost() == pytest.approx(9.0)
    second.hits, second.tries = [0.0] * 4, [100.0] * 4  # drafts that never land: no drafts, a decode block
    assert second.block_instead(3) and not second._block_asked  # on the plan, not to measure a block's token
    second.block_timed(8, 8 * 11.0)  # its blocks move the kept price
    assert make_drafter("ngram", model).block_ms == pytest.approx(second.block_ms) and second.block_ms > 9.0
    assert make_drafter("ngram", other).block_ms is None
    lf = lookup_first(make_drafter("ngram", model), model)  # (its lookup lengths keep their own prices)
    assert lf.lookup.block_ms is None and lf.fresh.block_ms is None
    assert lf.lookup.plain_price is not lf.fresh.plain_price


class SureDrafter(ListDrafter):
    """ListDrafter with a confidence per draft (given per position) and a count of rows asked."""

    def __init__(self, script, conf):
        super().__init__(script)
        self.conf, self.asked = conf, []

    def propose(self, context, k, features):
        self.asked.append(k)
        out = super().propose(context, k, features)
        self.confidence = list(self.conf[:len(out)])
        return out


def test_shadow_rows_are_scored_against_the_reply():
    """A drafter with cheap extra rows (`shadow`) drafts past what a round verifies; each row is counted as
    accepted or not when the reply reaches it (a later round, a decode block), up to the first miss only."""
    script = PROMPT + [1, 2, 3, 4, 5, 6]
    for shadow, tried, hits in ((0, [1.0], [1.0]), (3, [1.0, 1.0, 1.0], [1.0, 1.0, 0.0])):
        inner = SureDrafter(script, [0.5] * 8)
        a = AdaptiveLength(inner, cost_table={1: 10.0, 2: 11.0}, shadow=shadow)
        a.gate = False
        a._planned = 1  # (block_instead decided this round verifies one draft)
        assert a.propose(PROMPT, 4, None) == [1] and inner.asked == [1 + shadow]
        a.observe([PROMPT[-1], 1], None)  # d1 accepted; the round's bonus token 2 goes out as the next last
        a.blocked(3)
        a.observe([2, 9, 4], None)  # a decode block: 2 (= d2), then 9 where the drafter said 3
        assert (a.tries, a.hits) == (tried, hits)
        assert a._shadows == []  # scored once, then gone
    a = AdaptiveLength(SureDrafter(script, [0.5] * 8), cost_table={1: 10.0, 2: 11.0}, shadow=3)
    a.gate, a._planned = False, 2
    a.propose(PROMPT, 4, None)
    a.observe([PROMPT[-1]], None)  # the verify rejected d1: known at once, the shadow is done
    assert (a.tries, a.hits, a._shadows) == ([1.0], [0.0], [])


def test_confidence_is_calibrated_per_position_for_marginal_rows():
    """conf_positions > 1 (DFlash's block rows: each row's confidence is a marginal): a position whose sure
    drafts keep failing gets its own low chance; the first position's bins are untouched."""
    script = PROMPT + [1, 2, 3, 4]
    a = AdaptiveLength(SureDrafter(script, [0.95, 0.95, 0.95]), cost_table={1: 10.0, 2: 10.1, 4: 10.3},
                       shadow=3, conf_positions=3)
    for _ in range(30):
        a.reset()
        a._planned = 3
        drafts = a.propose(PROMPT, 3, None)
        assert drafts == [1, 2, 3]  # sure and cheap: every row drafted is verified
        a.observe([PROMPT[-1], 1, 2], None)  # the third draft rejected
    assert a.chance(0.95, 0) > 0.9 and a.chance(0.95, 1) > 0.9 and a.chance(0.95, 2) < 0.2
    a.cost_ms = {1: 10.0, 2: 12.0, 4: 16.0}  # verify rows that cost: the third row is not worth its chance
    assert a.keep([0.95, 0.95, 0.95], draft_ms=1.0) == 2
    assert AdaptiveLength(SureDrafter(script, []), cost_table=a.cost_ms).keep([0.95] * 3, draft_ms=1.0) == 3


def test_a_verify_length_first_timing_is_left_out():
    """The process's first pass over t tokens runs cold: its time is not t's cost; the next one is, and a
    drafter of the same model (a later reply) records its own first pass."""
    now = [0.0]
    table: dict[int, float] = {}
    a = AdaptiveLength(ListDrafter(PROMPT + list(range(10))), clock=lambda: now[0], cost_table=table)
    for ms in (50.0, 10.0, 12.0):
        a.propose(PROMPT, 3, None)
        now[0] += ms / 1e3
        a.observe([PROMPT[-1], *PROMPT[len(PROMPT):]], None)
    # 3 drafts (T=4) explored twice: the first pass left out; then the one-token pass, T=1's first: left out
    assert table == {4: pytest.approx(10.0)}
    b = AdaptiveLength(ListDrafter(PROMPT + list(range(10))), clock=lambda: now[0], cost_table=table)
    b._planned = 3
    b.propose(PROMPT, 3, None)
    now[0] += 0.013
    b.observe([PROMPT[-1]], None)
    assert table == {4: pytest.approx(10.0 * 0.9 + 13.0 * 0.1)}  # counted: the table had seen T=4


def test_a_stalled_verify_pass_moves_its_cost_by_a_bounded_step():
    """A pass's time enters its T's cost at most OUTLIER times the cost so far (a stall of the host)."""
    from engine.spec.adaptive import OUTLIER, record_cost
    table = {4: 10.0}
    record_cost(table, 4, 300.0, 0.9)
    assert table[4] == pytest.approx(10.0 * 0.9 + OUTLIER * 10.0 * 0.1)
    record_cost(table, 4, 5.0, 0.9)  # a faster pass counts in full
    assert table[4] == pytest.approx(10.5 * 0.9 + 5.0 * 0.1)
    record_cost(table, 2, 7.0, 0.9)  # a length's first time: taken as it is
    assert table[2] == 7.0


def test_more_tokens_never_cost_less_in_the_table():
    """Entries a newer pass contradicts are brought into line: a longer pass priced under it is raised to it, a
    shorter one priced over it lowered to it (left over from passes long ago: the process's first, stalls)."""
    from engine.spec.adaptive import record_cost
    table = {1: 4.5, 2: 5.0, 4: 6.3, 5: 9.9, 6: 14.0, 11: 20.5, 16: 18.2}
    record_cost(table, 16, 18.2, 0.9)
    assert table == {1: 4.5, 2: 5.0, 4: 6.3, 5: 9.9, 6: 14.0, 11: 18.2, 16: 18.2}
    record_cost(table, 3, 6.8, 0.9)  # (a first pass over 3: T=4's 6.3 cannot be less)
    assert table[3] == 6.8 and table[4] == 6.8 and table[2] == 5.0
    costs = [table[t] for t in sorted(table)]
    assert costs == sorted(costs)


def test_rate_priced_keep_verifies_a_row_when_its_chance_beats_its_cost():
    """rate_keep: a row is worth verifying when its chance of being reached beats the rounds' rate x its
    verify cost; the per-round ratio runs the same unsure round one row longer."""
    a = AdaptiveLength(SureDrafter([], []), cost_table={1: 10.0, 2: 12.0, 4: 16.0})
    conf = [0.9, 0.75, 0.75]  # reached with 0.9, 0.675, 0.506; a row costs 2 ms
    assert a.keep(conf, draft_ms=1.0) == 3
    a.rate_keep = True
    assert a.keep(conf, draft_ms=1.0) == 3  # no rate measured yet: the ratio
    a._tok, a._ms = 3.0, 10.0  # 0.3 tokens a ms: a row must be reached with >= 0.6
    assert a.rate() == pytest.approx(0.3) and a.keep(conf, draft_ms=1.0) == 2
    a._tok = 0.5  # rounds slower than plain steps: priced at 1 / c(1) = 0.1, every row pays
    assert a.keep(conf, draft_ms=1.0) == 3
    a._tok = 10.0  # 1 token a ms: none pays, a plain step
    assert a.keep(conf, draft_ms=1.0) == 0


def test_a_drafter_that_stops_by_itself_drafts_to_the_maximum():
    """A drafter with `stop_below` (MTP) is asked for --draft-tokens whenever the plan drafts at all (it stops
    where its confidences say the rest would not be verified; keep cuts the rest); a plan of no drafts asks
    nothing, and a probe asks the one position deeper it explores."""
    class Stopping(SureDrafter):
        stop_below = 0.0

    script = PROMPT + [1, 2, 3, 4, 5]
    costs = {1: 10.0, 2: 10.1, 4: 10.3}
    inner = Stopping(script, [0.99] * 5)
    a = AdaptiveLength(inner, cost_table=dict(costs))
    a._planned = 1
    assert a.propose(PROMPT, 4, None) == [1, 2, 3, 4] and inner.asked == [4]
    assert a.stop_chance() > 0 and inner.stop_below == a.stop_chance()
    a.observe([PROMPT[-1], 1, 2, 3, 4], None)
    a._planned = 0
    assert a.propose(PROMPT, 4, None) == [] and inner.asked == [4]
    a.observe([PROMPT[-1]], None)
    a._planned, a._probe = 2, True  # (block_instead's probe one deeper: its flag stands)
    a.propose(PROMPT, 4, None)
    assert inner.asked[-1] == 2
    plain = SureDrafter(script, [0.99] * 5)  # no stop_below: drafts what the plan says
    b = AdaptiveLength(plain, cost_table=dict(costs))
    b._planned = 1
    b.propose(PROMPT, 4, None)
    assert plain.asked == [1]


class StoppingDrafter(SureDrafter):
    """SureDrafter that, like MTP, can stop mid-round (`stop_below`): AdaptiveLength drafts it to k_max."""
    stop_below = 0.0


def test_a_round_drafted_to_max_is_priced_at_what_such_rounds_cost():
    """Where a drafter drafts to k_max once a round drafts at all (draft_to_max: MTP), the plan's choice
    between drafting and a plain step prices the round at what such rounds measured, not at the k planned:
    one draft accepted 35% of the time pays for a 0.7 ms draft (1.35 tokens / 12.9 ms beats 1 / 10 ms) but not
    for the 1.8 ms the rounds drafting to the end cost (1.35 / 14 ms)."""
    costs = {1: 10.0, 2: 12.2, 4: 16.0}

    def planner(inner):
        a = AdaptiveLength(inner, cost_table=dict(costs))
        a.tries, a.hits, a.draft_by_k = [100.0] * 3, [35.0, 10.0, 10.0], {1: 0.7, 3: 1.8}
        return a
    a = planner(StoppingDrafter(PROMPT + list(range(40)), [0.9] * 8))
    assert a.choose_k(3) == 1  # nothing measured of rounds to the end: the planned k's own cost
    now = [0.0]
    a.clock = lambda: now[0]
    a._first = False  # (a reply's first round also runs its prompt's pairs: not a round's drafting)

    class Timed(StoppingDrafter):
        def propose(self, context, k, features):
            now[0] += 1.8e-3  # each round's drafting takes 1.8 ms
            return super().propose(context, k, features)
    a.inner = Timed(PROMPT + list(range(40)), [0.9] * 8)
    a._planned = 1
    a.propose(PROMPT, 3, None)
    assert a.inner.asked == [3] and a.to_max_ms == pytest.approx(1.8)  # drafted to k_max, its cost kept
    assert a.round_draft_cost(1, 3) == pytest.approx(1.8) and a.choose_k(3) == 0
    plain = planner(SureDrafter(PROMPT + list(range(40)), [0.9] * 8))  # no stop_below: drafts what it plans
    plain.to_max_ms = 1.8
    assert plain.round_draft_cost(1, 3) == pytest.approx(0.7) and plain.choose_k(3) == 1


def test_a_block_in_place_of_a_round_gets_the_drafters_triggers():
    """SpecRound's decode block ends where the drafter's block_triggers say (a lookup-first drafter: where the
    text repeats); a drafter without them gives the block none."""
    from engine.rounds import RoundContext
    from engine.spec.round import SpecRound

    class Cache:
        length = 3

        def truncate(self, n):
            self.length = n

    class Triggering(_NoDrafts):
        def block_triggers(self, context):
            return ("keys of", list(context))
    for drafter, want in ((_NoDrafts(True), None), (Triggering(True), ("keys of", [1, 2, 3]))):
        model = _BlockModel()
        SpecRound(drafter, 3)(RoundContext(model, Cache(), [1, 2, 3], _BlockChooser(), 20, frozenset(), 2))
        assert model.blocks and model.triggers == want
