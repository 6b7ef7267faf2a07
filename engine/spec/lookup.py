"""Lookup first: n-gram drafts where the context's last tokens occurred before, a trained drafter's otherwise.

The two are complementary (../shared/REFERENCE.md section 9, bench/results-spec.md): a trained drafter (MTP,
DFlash) wins the first positions of new text, prompt lookup (engine.spec.ngram) wins long continuations once
the text repeats (a list, a quote, code, a loop of digits). Each source keeps its own adaptive length
(engine.spec.adaptive: its acceptance history, its drafting cost; the verify cost table is the model's,
shared), so a round of n-gram drafts is priced by what n-gram rounds gained, not by the trained drafter's
acceptance, and the other way round.

A round: where the index matches the context's last `min_match` (or more) tokens, the lookup's best round
promises at least the trained drafter's tokens per ms (`lookup_pays`: each on its own history) and its length
plans drafts, the round verifies the lookup's drafts; otherwise it is the trained drafter's round as it runs
alone (its drafts, or a decode block where it plans none), and the lookup's drafts, not verified, are scored
against the reply all the same (`AdaptiveLength.shadow_drafts`), so its history follows the text. Both see
every fed position (`observe`), so the trained drafter's state (MTP's pairs, DFlash's context rows) follows
rounds it did not draft. The lookup keeps two lengths: one for rounds that start a copy (`fresh`) and one for
rounds that go on with one (after a lookup round that kept a draft). A decode block in place of a round ends
where the lookup would match (`block_triggers`, engine/triggers.py).
"""
from __future__ import annotations

from typing import Sequence

from .adaptive import AdaptiveLength
from .base import Features
from .ngram import NgramDrafter

MIN_MATCH = 3  # the fewest last tokens of the context whose earlier occurrence drafts (n-gram's n_min)
MAX_MATCH = 5  # the longest suffix the index looks up (longest first: the most specific continuation)
# The most drafts a lookup round verifies, whatever the trained drafter's length (--draft-tokens; 15 is also its
# ceiling): a text that repeats repeats for long, and a verify row of a sure draft pays where the trained
# drafter's deeper ones do not. Its adaptive length plans each round's drafts on the measured verify costs.
# bench/results-spec-mtp.md, "Lookup rounds of up to 7, then 15": count300_en MTP3 1.76-1.85x (3) -> 2.00-2.42x
# (7) -> 2.56-2.81x (15), DFlash7 2.24-2.62x -> 2.52-2.99x; count300_plain_en and held-out chat the same.
LOOKUP_DRAFTS = 15


class LookupFirst:
    """engine.spec.base.Drafter over a trained drafter's adaptive length and an n-gram one's."""

    def __init__(self, drafter: AdaptiveLength, lookup: AdaptiveLength, lookup_drafts: int = 0,
                 fresh: AdaptiveLength | None = None):
        self.drafter, self.lookup = drafter, lookup
        # fresh: the lookup's length for a round that starts a repetition (the round before verified no lookup
        # drafts); `lookup` prices the rounds that go on with one. A first match is a weaker guess than a copy
        # under way (held-out chat: 2.1 tokens a round against 3.5), and one history for both planned the first
        # rounds as long as the copies'. None: one length for both.
        self.fresh = fresh if fresh is not None else lookup
        self._going = False  # the last round verified lookup drafts and kept one
        self.lookup_drafts = lookup_drafts  # the most drafts a lookup round verifies, if more than the round's k
        self.drafter_k: int | None = None  # the trained drafter's length (round_length; None: the round's k)
        self.k_round = lookup_drafts  # the most drafts a round verifies (round_length)
        self.triggers = True  # decode blocks end where the lookup would draft (block_triggers; False: A-B runs)
        self.name = drafter.name
        self.features_needed = drafter.features_needed
        self.source: AdaptiveLength | None = None  # which one drafted the round in flight
        # block_instead's verdict on the next round, (context length, k), (a match, lookup_pays): its propose
        # takes it rather than asking the index and pricing both lengths again
        self._ahead: tuple[tuple[int, int], tuple[bool, bool]] | None = None

    def reset(self) -> None:
        self.drafter.reset()
        for a in self._lengths():
            a.reset()
        self._going = False
        self.source = None
        self._ahead = None

    def bind_target(self, model, cache) -> None:
        bind = getattr(self.drafter, "bind_target", None)  # (DFlash reads the target's cache)
        if bind is not None:
            bind(model, cache)

    @property
    def from_lookup(self) -> bool:
        """Whether the round in flight verifies the lookup's drafts (engine.rounds.Round.lookup)."""
        return self.source is not None and self.source is not self.drafter

    def _lengths(self) -> tuple[AdaptiveLength, ...]:
        return (self.lookup,) if self.fresh is self.lookup else (self.lookup, self.fresh)

    def _lk(self) -> AdaptiveLength:
        """The lookup's length for the next round: going on with a copy, or starting one (fresh)."""
        return self.lookup if self._going else self.fresh

    def round_length(self, k: int) -> int:
        """The most drafts a round may verify, the trained drafter drafting up to k (--draft-tokens) and the lookup
        up to lookup_drafts where that is more."""
        self.drafter_k, self.k_round = k, max(k, self.lookup_drafts)
        return self.k_round

    def _k(self, k: int) -> int:
        """The trained drafter's length in a round of up to k drafts."""
        return k if self.drafter_k is None else min(k, self.drafter_k)

    def matches(self, context: Sequence[int]) -> bool:
        """Whether the index holds an earlier occurrence of the context's last tokens (min_match or more)."""
        return bool(self.lookup.inner.propose(context, 1))

    # -- a round that drafts nothing: the trained drafter's decode block (engine.spec.round.SpecRound) ---------
    def block_instead(self, k_max: int, context: Sequence[int] | None = None) -> bool:
        """False where the lookup may draft (a match, and lookup_pays), else the trained drafter's decision; the
        verdict is kept for the round's propose (_ahead)."""
        if context is None:
            return self.drafter.block_instead(self._k(k_max))
        matched = self.matches(context)
        pays = matched and self.lookup_pays(k_max)
        self._ahead = ((len(context), k_max), (matched, pays))
        return False if pays else self.drafter.block_instead(self._k(k_max))

    def block_triggers(self, context: Sequence[int]):
        """Where a decode block in place of a round should end early (engine.triggers): after three tokens that
        occurred before in the context, where the next round may draft by lookup. None where the lookup does
        not draft from three matched tokens (min_match 3), or where its rounds do not pay (lookup_pays)."""
        if not self.triggers or self.lookup.inner.n_min != 3 or not self.lookup_pays(max(self.k_round, 1)):
            return None
        return self.lookup.inner.trigger_keys(context)

    def may_block(self) -> bool:
        return self.drafter.may_block()

    def blocked(self, n: int) -> None:
        self.drafter.blocked(n)
        self._going = False

    def block_timed(self, n: int, ms: float) -> None:
        """What a token of a decode block costs: every length prices "no drafts" at it."""
        self.drafter.block_timed(n, ms)
        for a in self._lengths():
            a.block_timed(n, ms)

    # -- the drafter protocol ----------------------------------------------------------------------------------
    def lookup_pays(self, k: int) -> bool:
        """Whether the lookup's best round promises at least the trained drafter's tokens per ms (each on its own
        acceptance history and drafting cost; True until both can price rounds)."""
        lk = self._lk()
        if not (lk.rate_known() and self.drafter.rate_known()):
            return True
        return lk.best_plan(k)[1] >= self.drafter.best_plan(self._k(k))[1]

    def propose(self, context_tokens: Sequence[int], k: int, features: Features | None) -> list[int]:
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == (len(context_tokens), k):  # block_instead's verdict on this round
            matched, pays = ahead[1]
        else:
            matched = self.matches(context_tokens)
            pays = matched and self.lookup_pays(k)
        lk = self._lk()
        drafts = lk.propose(context_tokens, k, None) if pays and k > 0 else []
        if drafts:
            self.drafter.stand_down()  # (a plan block_instead made is for a round it does not draft)
            self.source = lk
            return drafts
        lk.stand_down()
        if matched and k > 0:  # the lookup's drafts, scored against the reply all the same
            lk.shadow_drafts(lk.inner.propose(context_tokens, k))
        self.source = self.drafter
        return self.drafter.propose(context_tokens, self._k(k), features)

    def observe(self, tokens: Sequence[int], features: Features | None) -> None:
        """All follow the reply; the one whose drafts were verified also learns from the round."""
        self.drafter.observe(tokens, features)
        for a in self._lengths():
            a.observe(tokens, None)
        self._going = self.from_lookup and len(tokens) > 1
        self.source = None


def lookup_first(drafter: AdaptiveLength, model=None, min_match: int = MIN_MATCH,
                 drafts: int = LOOKUP_DRAFTS, fresh: bool = True) -> LookupFirst:
    """`drafter` (an adaptive length over a trained drafter) with n-gram drafts first where the context's last
    min_match+ tokens occurred before, up to `drafts` a round (or the round's k where that is more); the lookup's
    length shares the model's verify cost table."""
    from .adaptive import shared_costs
    ngram = NgramDrafter(n_min=min_match, n_max=max(min_match, MAX_MATCH))

    def length(which: str) -> AdaptiveLength:  # (each length's decode-block price its own, kept across replies)
        return AdaptiveLength(ngram, **shared_costs(model, f"{drafter.name}:{which}"))
    return LookupFirst(drafter, length("lookup"), drafts, length("fresh") if fresh else None)
