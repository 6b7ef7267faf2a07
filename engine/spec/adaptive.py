"""Adaptive draft length: a drafter wrapper that drafts only as many tokens as pay for their verify cost.

Speculation is lossless whatever is drafted, but not free: a verify pass over T = k+1 tokens costs c(T), more
than a plain step c(1) on a CPU. With a_j the conditional acceptance of draft j (given d_1..d_{j-1} were
accepted), a round with k drafts yields E(k) = 1 + a_1 + a_1 a_2 + ... + a_1..a_k tokens on average, so the
best k maximises E(k) / (c(k+1) + d(k)), d(k) the drafting of k tokens, and may be 0 (a plain step) on text the
drafter cannot predict. Everything is measured online by the wrapper itself, from the calls the round already makes:
`propose` (drafts, draft time) then `observe` (the kept tokens: accepted = len(tokens) - 1; the time since
`propose` returned = the verify pass). Estimates are exponential moving averages, so they follow the text
(a counting list vs free prose) and the machine. `--draft-tokens N` stays the upper bound.

Per round, a trained drafter also says how sure it is: `inner.confidence` (set by its propose) holds each
draft's probability under the drafter (the softmax top of its logits). Those are calibrated online into
acceptance chances (CONF_BINS bins of confidence, hits over tries, the confidence itself as the prior) and
the round keeps the first n drafts that maximise (1 + P_1 + ... + P_n) / (c(n+1) + its drafting), P_j the
chance that drafts 1..j are all accepted: a round whose first draft is a guess becomes a plain step (its
verify rows cost more than they would win), a confident one keeps its drafts. Measured on held-out chat
with the MTP drafter (bench/results-verify.md): first drafts under 0.2 confidence were accepted 10% of the
time, over 0.8 95%.

A round's drafts are scored against the reply as it comes (`_score`): draft j counts as accepted iff the reply's
token there equals it, which is exactly the verify's rule (the chooser draws the same token either way). So
a drafter with cheap extra rows (`shadow`: DFlash drafts its whole block) has every row it drafted scored,
verified or not, and each position's acceptance (and, per position, its confidence calibration) is learnt
at every round instead of one position deeper per probe. A verify length's first timing in the process is
left out of the cost table (a cold pass: buffers grown, first calls).
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..rounds import block_size
from .base import Drafter, Features

PRIOR_WEIGHT = 2.0  # pseudo-tries behind each position's prior
PROBE_GAP_MAX = 64  # the most decisions between probes (AdaptiveLength._gap)
CONF_BINS = 10  # confidence bins of the online calibration (0-0.1, ..., 0.9-1)
CONF_DECAY = 0.98  # per update of a bin: calibration is the drafter's, it changes slowly
# A measured time enters a running cost at most this many times the cost so far (bounded_step): a decode block's
# time per token the plain price (block_timed), a verify pass's its T's cost (record_cost). One stalled block
# (another process, ~7-12 ms a token against ~4.5) moved the price far enough that rounds looked worth drafting,
# and then, no block running, nothing brought it back (held-out chat, sampled: trained-drafter rounds at 1.24
# tokens, 5.5 ms each).
OUTLIER = 1.5


def bounded_step(old: float, new: float, w: float) -> float:
    """A running cost `old` moved a share w of the way to a measured `new`, which counts at most OUTLIER x old."""
    return old + w * (min(new, OUTLIER * old) - old)

# Verify costs are a property of the model on this machine, not of a reply: drafters of the same model share
# one table (T -> ms), so a new reply does not start measuring from scratch.
_COST_TABLES: "weakref.WeakKeyDictionary[Any, dict[int, float]]" = weakref.WeakKeyDictionary()


def record_cost(table: dict[int, float], t: int, ms: float, decay: float) -> None:
    """A verify pass over t tokens took ms: table[t]'s EMA follows it (decay; bounded_step: a stalled pass counts
    at most OUTLIER times the cost so far), and every other entry is brought into line with it, since a pass over
    more tokens never costs less. A length the rounds no longer verify kept whatever its last passes cost: in one
    process of the held-out chat benchmark (sampled, MTP3 + lookup) the first replies' passes, slow while the
    process warmed up, and a stalled one (30.7 ms) left T=5 / 6 / 11 at 9.9 / 14.0 / 20.5 ms for the whole run where
    T=4 read 6.3 and T=16 18.2: lookup rounds priced long drafts too high, and the negative slope made stop_chance 0."""
    old = table.get(t)
    new = ms if old is None else bounded_step(old, ms, 1.0 - decay)
    table[t] = new
    for u, c in table.items():
        if (u > t and c < new) or (u < t and c > new):
            table[u] = new


# What a token of a decode block costs (AdaptiveLength.block_timed, the drafter's following of the block included)
# is the machine's and the drafter's too, not a reply's: each length of a drafter of the model keeps its price
# across replies (shared_plain_price), where a new reply's length spent its first decode block measuring it again
# (count300_plain_en: 8 of 122 tokens at plain speed, before every reply's drafting rounds).
@dataclass(eq=False)
class PlainPrice:
    """EMA ms per token of the decode blocks a length ran in place of rounds (block_timed); None until one ran."""

    ms: float | None = None


_PLAIN_PRICES: "weakref.WeakKeyDictionary[Any, dict[str, PlainPrice]]" = weakref.WeakKeyDictionary()


def shared_plain_price(model: Any, key: str) -> PlainPrice:
    """The plain price of the length `key` (a drafter's name, and which of its lengths) of `model`'s drafters."""
    return _kept(_PLAIN_PRICES, model, {}).setdefault(key, PlainPrice())


def shared_costs(model: Any, key: str) -> dict[str, Any]:
    """AdaptiveLength's keyword arguments that keep its measured costs across replies: `model`'s verify cost
    table (one for all its drafters) and the decode-block price of the length `key`."""
    return dict(cost_table=shared_cost_table(model), plain_price=shared_plain_price(model, key))


# How a drafter's confidence maps to acceptance is a property of the drafter (its weights and head), not of
# a reply: adaptive wrappers of the same network (`inner.calibration_key`) share their bins across replies.
_CALIBRATIONS: weakref.WeakKeyDictionary[Any, tuple[list[float], list[float]]] = weakref.WeakKeyDictionary()


def shared_calibration(key: Any, positions: int = 1) -> tuple[list[float], list[float]]:
    """(hits, tries) per confidence bin (per draft position: bin b of position j at j * CONF_BINS + b, where
    `positions` > 1), shared by every adaptive wrapper of the drafter network `key`."""
    return _kept(_CALIBRATIONS, key, ([0.0] * CONF_BINS * positions, [0.0] * CONF_BINS * positions))


def shared_cost_table(model: Any) -> dict[int, float]:
    """The verify-cost table (T -> EMA ms) shared by every adaptive drafter of `model`."""
    return _kept(_COST_TABLES, model, {})


def _kept(registry: weakref.WeakKeyDictionary, owner: Any, fresh: Any) -> Any:
    """registry[owner], `fresh` the first time (kept while owner lives: the tables above); `fresh` itself, shared
    with nobody, where owner is None or cannot be weak-referenced."""
    if owner is None:
        return fresh
    try:
        return registry.setdefault(owner, fresh)
    except TypeError:  # not weak-referenceable
        return fresh


@dataclass(eq=False)
class Shadow:
    """A round's drafted rows waiting to be scored against the reply (`AdaptiveLength._score`)."""

    drafts: list[int]
    conf: list[float] | None  # their confidences, to calibrate (None: not calibrated here)
    seen: list[int] = field(default_factory=list)  # the reply's tokens after the round's first position so far
    rejected: int | None = None  # the first rejected draft's position, where the round's verify told


class AdaptiveLength:
    """Wraps any drafter; implements the same protocol (engine.spec.base.Drafter)."""

    # keep(): price a verify row at the rounds' measured rate (tokens per ms: maximise E(n) - rate x c(n+1), a
    # row verified when its chance beats its cost in tokens) instead of maximising each round's own E(n) /
    # c(n+1), which stops a sure round early and runs an unsure one long. DFlash's rows: count300 +0.1x
    # (bench/results-spec-dflash.md); MTP's counting read 0.05x lower with it, within its spread: left off.
    rate_keep = False
    gate = True  # cut rounds by the drafter's confidence (False: by the acceptance history only)
    # A drafter that stops mid-round by its own confidences (`inner.stop_below`: MTP) drafts up to k_max in a
    # round the plan drafts at all, and `keep` cuts what is not worth its verify row: the plan (choose_k, on the
    # acceptance history) then only decides draft or block. MTP3, four A-B rounds: count300_en 2.44-2.84 ->
    # 2.98-3.35 tokens/round, 1.42-1.54x -> 1.53-1.70x; count300_plain_en and held-out chat within the spread.
    # The plan prices such a round at what rounds drafted to the end measured (round_draft_cost), not at the k
    # it planned: on chat it drafted one-draft plans at ~0.7 ms that cost ~1.8 (bench/results-spec-mtp.md).
    draft_to_max = True

    def __init__(self, inner: Drafter, decay: float = 0.9, probe_every: int = 8,
                 clock: Callable[[], float] = time.perf_counter, cost_table: dict[int, float] | None = None,
                 draft_fixed: float = 0.0, shadow: int = 0, conf_positions: int = 1,
                 plain_price: PlainPrice | None = None):
        """draft_fixed: a round's drafting costs about (k + draft_fixed) draft steps (MTP: 1, its first step
        also runs the pairs fed since the last round; DFlash: 2, its block forward against the head's rows):
        how a k not yet drafted is scaled from the nearest one measured (draft_cost).
        shadow: drafts asked beyond the ones a round verifies, only to be scored against the reply as it
        comes (a drafter whose extra rows are cheap: DFlash's block has them anyway); see `_score`. With the
        confidence gate, such a drafter's rows are all candidates for the verify (`keep`), not only choose_k's.
        conf_positions: calibrate confidences per draft position (up to this many; the last bins serve deeper
        ones) where a row's confidence is its marginal, not given the drafts before it (DFlash's block rows),
        instead of one table for all positions (MTP's chained drafts).
        plain_price: where the decode blocks' price is kept (shared_plain_price: across replies); None: this
        length's own."""
        self.inner = inner
        self.name = inner.name
        self.features_needed = inner.features_needed
        self.decay, self.probe_every, self.clock = decay, probe_every, clock
        self.hits: list[float] = []  # per draft position j: decayed count of accepted | tried
        self.tries: list[float] = []  # per draft position j: decayed count of tried (d_1..d_{j-1} accepted)
        self.cost_ms = cost_table if cost_table is not None else {}  # T -> EMA ms of a verify pass over T
        self.draft_ms = 0.0  # drafting time per drafted token (of the last k drafted)
        self.draft_by_k: dict[int, float] = {}  # k -> EMA ms of a round's drafting
        self.draft_fixed = draft_fixed
        self.to_max_ms: float | None = None  # EMA ms of a round's drafting when it drafts to k_max (draft_to_max)
        self._pending: tuple[int, float] | None = None  # (n drafts, time propose returned)
        self._cut = 0  # rounds whose drafts the confidences cut short (every probe_every-th keeps one more)
        self._probe = False  # this round explores one position deeper (choose_k): no cut
        # the first round of a reply also runs what the drafter has not yet of the prompt (MTP: its pairs
        # since the last whole chunk): not a round's drafting cost. Kept, it priced that k at ~8x (24.6 ms
        # for 3 drafts against ~3) in the per-k table, which then steered rounds away from it.
        self._first = True
        # per confidence bin: decayed counts of accepted | tried, and of tried (shared: shared_calibration)
        self.conf_positions = max(conf_positions, 1)
        self.conf_hits, self.conf_tries = shared_calibration(getattr(inner, "calibration_key", None),
                                                             self.conf_positions)
        self._rounds = 0  # rounds decided on estimates, and tokens of the blocks run instead of rounds
        self._last_probe = 0  # the decision at which choose_k last explored one draft deeper
        # decisions between such probes: probe_every, doubled (up to PROBE_GAP_MAX) after each probe whose
        # explored draft was rejected, halved (down to probe_every) after one that was accepted (_probed)
        self._gap: int | None = None  # (None: probe_every)
        self._probing: int | None = None  # drafts verified by the round in flight when it is a probe
        # A round whose drafts the confidences cut to none paid its drafting for nothing (held-out chat with
        # DFlash: ~3 of 4 rounds, a block draft of ~1.5 ms before each 8-token decode block). After such a
        # round the next probe_every decisions run decode blocks without drafting (block_instead), twice as many
        # after each further such round (`_cut_gap`: the next window, up to PROBE_GAP_MAX), back to probe_every
        # after a round whose verify accepts a draft.
        self._cut_gap: int | None = None
        self._idle_until = 0  # the decision (_rounds) before which block_instead drafts nothing
        self._planned: int | None = None  # the next propose's length, decided ahead (block_instead)
        self.shadow = shadow
        self._shadows: list[Shadow] = []  # rounds' drafts not yet scored against the reply
        self._this: Shadow | None = None  # the shadow of the round in flight (propose -> observe)
        # verify lengths whose first timing was left out: a pass over t tokens the table has never seen ran
        # cold (measured: the first round's 8-token pass priced T=8 ~2 ms over its later passes, and kept
        # rounds from ever verifying 7 drafts again to correct it)
        self._cold: set[int] = set()
        self._tok = self._ms = 0.0  # decayed tokens and ms of the rounds (rate)
        # EMA ms per token of the decode blocks run in place of rounds (block_timed, block_ms): what a token costs
        # when nothing is drafted. A one-token verify round (cost_ms[1]) costs far more than that where a step is
        # cheap: 4.4 ms against 2.4 on an AVX-512 Xeon (the pass after a drafting round, its logits, the round's
        # bookkeeping), and priced at it, drafting looked better than blocks on chat where it ran 0.66x.
        self.plain_price = plain_price if plain_price is not None else PlainPrice()
        # block_instead asked for that first block: asked once. Where none runs (a runner without decode blocks:
        # the round verifies one token instead and block_timed never comes), asking again every round planned
        # no drafts for the rest of the reply (a CI run of the tiny model drafted none in 40 tokens).
        self._block_asked = False

    def reset(self) -> None:
        """A new reply. Costs are the machine's and acceptance follows the text: this length keeps both (decayed);
        the verify costs and the decode-block price also outlive it (shared per model: the engine makes a new
        length for each reply, whose acceptance starts from the prior)."""
        self.inner.reset()
        self._pending = None
        self._planned = None
        self._probing = None
        self._first = True
        for sh in self._shadows:  # what the last reply showed of them (the rest is unknown)
            self._score(sh, final=True)
        self._shadows, self._this = [], None

    # -- estimates -----------------------------------------------------------------------------------------
    def acceptance(self, j: int) -> float:
        """Conditional acceptance of draft position j (0-based). The prior is the previous position's estimate
        (weight PRIOR_WEIGHT; 0.5 for the first), so a position rarely tried does not look worse than the
        one before it: a run of right drafts tends to continue (a list, a quote, a loop)."""
        prior = self.acceptance(j - 1) if j > 0 else 0.5
        if j >= len(self.tries):
            return prior
        return (self.hits[j] + PRIOR_WEIGHT * prior) / (self.tries[j] + PRIOR_WEIGHT)

    @property
    def block_ms(self) -> float | None:
        """The decode blocks' ms per token (plain_price), None until a block ran."""
        return self.plain_price.ms

    @block_ms.setter
    def block_ms(self, ms: float | None) -> None:
        self.plain_price.ms = ms

    def plain_cost(self) -> float:
        """Estimated ms of a token when a round drafts nothing: a decode block's (measured) where rounds may
        block, else the one-token verify pass's."""
        if self.block_ms is not None and self.may_block():
            return self.block_ms
        return self.cost_ms[1]

    def cost(self, t: int) -> float | None:
        """Estimated ms of a verify pass over t tokens: measured, else linear inter/extrapolation."""
        if t in self.cost_ms:
            return self.cost_ms[t]
        known = sorted(self.cost_ms)
        if len(known) < 2:
            return None
        lo = max((x for x in known if x < t), default=None)
        hi = min((x for x in known if x > t), default=None)
        if lo is None:
            lo, hi = known[0], known[1]
        elif hi is None:
            lo, hi = known[-2], known[-1]
        slope = (self.cost_ms[hi] - self.cost_ms[lo]) / (hi - lo)
        return max(self.cost_ms[lo] + slope * (t - lo), 1e-6)

    def draft_cost(self, k: int) -> float:
        """Estimated ms of a round's drafting with k drafts: measured, else scaled from the nearest k measured
        as (k + draft_fixed) / (k0 + draft_fixed); 0 before any."""
        if k in self.draft_by_k:
            return self.draft_by_k[k]
        if not self.draft_by_k:
            return 0.0
        k0 = min(self.draft_by_k, key=lambda j: abs(j - k))
        return self.draft_by_k[k0] * (k + self.draft_fixed) / (k0 + self.draft_fixed)

    def chance(self, conf: float, j: int = 0) -> float:
        """Calibrated chance that a draft of this confidence at position j is accepted (given the drafts before
        it were)."""
        b = self._bin(conf, j)
        return (self.conf_hits[b] + PRIOR_WEIGHT * conf) / (self.conf_tries[b] + PRIOR_WEIGHT)

    def _bin(self, conf: float, j: int) -> int:
        return min(max(int(conf * CONF_BINS), 0), CONF_BINS - 1) + CONF_BINS * min(j, self.conf_positions - 1)

    def keep(self, conf: Sequence[float], draft_ms: float) -> int:
        """How many of a round's drafts (their confidences) to verify: the most expected tokens per ms of the
        round (its drafting, already spent, plus the verify pass), or with `rate_keep` the most expected
        tokens less the verify's ms at the rounds' rate; all of them while costs are unknown."""
        if not self.rate_known():
            return len(conf)
        lam = self.rate() if self.rate_keep else None
        plain = self.plain_cost()  # what keeping no draft runs instead (a decode block, or one-token verify)
        if lam is not None:  # E(n) - lam c(n+1): a row is verified when its chance beats the rate's price
            lam = max(lam, 1.0 / plain)
            best_n, best = 0, 1.0 - lam * plain
        else:
            best_n, best = 0, 1.0 / (plain + draft_ms)
        expected, p = 1.0, 1.0
        for n in range(1, len(conf) + 1):
            p *= self.chance(conf[n - 1], n - 1)
            expected += p
            value = expected - lam * self.cost(n + 1) if lam is not None else expected / (self.cost(n + 1) + draft_ms)
            if value > best:
                best_n, best = n, value
        return best_n

    def rate(self) -> float | None:
        """Tokens per ms of the rounds so far (decayed): what a ms of verify is worth."""
        return self._tok / self._ms if self._ms > 0 else None

    def stop_chance(self) -> float:
        """A drafter that can stop mid-round (`inner.stop_below`) stops once the product of its drafts'
        confidences falls below this: half the cheapest verify row's cost in steps, a chance `keep` would
        not verify anyway (0 while costs are unknown: draft everything asked)."""
        if not self.rate_known():
            return 0.0
        known = sorted(self.cost_ms)
        rows = [(self.cost_ms[b] - self.cost_ms[a]) / (b - a) for a, b in zip(known, known[1:])]
        return max(0.5 * min(rows) / self.plain_cost(), 0.0)

    def choose_k(self, k_max: int) -> int:
        """The draft length with the most expected tokens per ms (k_max until costs are known)."""
        if k_max <= 0:
            return 0
        if not self.cost_ms:
            return k_max  # explore: a full-length pass first ...
        if 1 not in self.cost_ms:
            return 0  # ... then one plain step, so the two ends of the cost line are measured
        if len(self.cost_ms) < 2:
            return k_max
        best_k, _ = self.best_plan(k_max)
        self._rounds += 1
        if best_k < k_max and self._rounds - self._last_probe >= (self._gap or self.probe_every):
            self._last_probe = self._rounds
            self._probe = True  # (propose verifies it whatever the drafter's confidence)
            return best_k + 1  # explore one position deeper: its acceptance may have changed
        return best_k

    def best_plan(self, k_max: int) -> tuple[int, float]:
        """(k, expected tokens per ms) of the best round of up to k_max drafts on the acceptance history and the
        measured costs (k = 0: no drafts, a token at plain_cost); needs the verify costs of T = 1 and one more."""
        best_k, best = 0, 1.0 / self.plain_cost()
        expected, p = 1.0, 1.0
        for k in range(1, k_max + 1):
            p *= self.acceptance(k - 1)
            expected += p
            rate = expected / (self.cost(k + 1) + self.round_draft_cost(k, k_max))
            if rate > best:
                best_k, best = k, rate
        return best_k, best

    def rate_known(self) -> bool:
        """Whether best_plan can price rounds: the verify costs of T = 1 and of another T are measured."""
        return 1 in self.cost_ms and len(self.cost_ms) >= 2

    def shadow_drafts(self, drafts: Sequence[int]) -> None:
        """Drafts this one made for the round in flight that another drafter's drafts replaced: scored against
        the reply as it comes (its acceptance history learns from them), not verified (engine.spec.lookup)."""
        if drafts:
            self._this = Shadow(list(drafts), None)
            self._shadows.append(self._this)

    def round_draft_cost(self, k: int, k_max: int) -> float:
        """Estimated ms of the drafting of a round planned at k: what its drafts cost (draft_cost), or where
        the drafter drafts to k_max once a round drafts at all (draft_to_max), what such rounds measured."""
        cost = self.draft_cost(self.drafted(k, k_max))
        return max(cost, self.to_max_ms) if self.to_max_ms is not None and self._drafts_to_max() else cost

    def _drafts_to_max(self) -> bool:
        return self.draft_to_max and self.gate and hasattr(self.inner, "stop_below")

    def drafted(self, k: int, k_max: int) -> int:
        """Drafts asked of the drafter for a round that verifies k: k and the shadow rows beyond it."""
        return min(k + self.shadow, k_max) if k > 0 else 0

    # -- a round that drafts nothing: a decode block instead (engine.spec.round.SpecRound) -----------------
    def block_instead(self, k_max: int, context: Sequence[int] | None = None) -> bool:
        """Decide the next round's draft length now (choose_k; the next propose drafts that many): True when
        it is 0 on measured costs, so the round may emit plain tokens in a decode block rather than verify no
        drafts (a one-token round costs ~1.1x a token of a block: bench/results-verify.md). Not while the
        costs are still being measured (the first one-token round measures c(1)); the first round after them
        is a block, which measures what a token costs in one (block_timed, plain_cost). `context` (the reply so
        far) is for wrappers that look at the text (engine.spec.lookup); the length does not."""
        self._probe = False
        if self.block_ms is None and self.may_block() and not self._block_asked:
            self._block_asked = True  # once: what a token costs in a block (plain_cost), where one runs
            self._planned = 0
            return True
        if self._rounds < self._idle_until and self.may_block():  # backing off after rounds cut to nothing
            self._rounds += 1
            self._planned = 0
            return True
        self._planned = self.choose_k(k_max)
        return self._planned == 0 and self.may_block()

    def stand_down(self) -> None:
        """The round in flight verifies another drafter's drafts (engine.spec.lookup): forget this one's plan
        and any propose of it that drafted nothing; what the round feeds it observes as the reply going on."""
        self._planned = None
        self._pending = None
        self._probing = None

    def may_block(self) -> bool:
        """Whether a round without drafts may be a decode block: once the verify costs are measured (until
        then a round without drafts is the one-token pass that measures c(1); a block in its place would
        leave it unmeasured, and the length would plan no drafts ever after)."""
        return self.rate_known()

    def blocked(self, n: int) -> None:
        """The round ran a decode block of n tokens instead (after block_instead, or after a propose that kept
        no drafts): they count as n decisions toward the next probe, so a run of blocks explores as often per
        token as one-token rounds did; no verify pass to time."""
        self._planned = None
        self._pending = None  # (a propose that kept no drafts: its one-token verify did not run)
        # (self._this stays: the rows the propose drafted are scored against the block's tokens)
        self._rounds += max(n - 1, 0)

    def block_timed(self, n: int, ms: float) -> None:
        """A decode block of n tokens took ms, the drafter's following of it included (SpecRound._run_block):
        the plain price follows it, a block of few tokens weighing less and no block raising it by more than
        OUTLIER times at once (bounded_step)."""
        if n <= 0:
            return
        per = ms / n
        if self.block_ms is None:
            self.block_ms = per
            return
        full = block_size()
        w = (1.0 - self.decay) * min(n, full) / full
        self.block_ms = bounded_step(self.block_ms, per, w)

    def _probed(self, reached: bool) -> None:
        """A probe round's outcome (its explored draft accepted or not): the next probe comes after half the
        last gap (at least probe_every), or twice it (at most PROBE_GAP_MAX). On text the drafter cannot
        predict (chat) probes that keep failing cost a verify row and their drafting each; a success bringing
        the gap straight back to probe_every let the one probe in ~3 that held-out chat accepts keep ~100
        rounds a 16-prompt run drafting at 1.26 tokens a round. Halved and doubled, the gap climbs where probes
        succeed less than half the time and falls where they succeed more."""
        self._probing = None
        if reached:
            half = (self._gap or self.probe_every) // 2
            self._gap = None if half <= self.probe_every else half
        else:
            self._gap = self._longer(self._gap)

    def _longer(self, gap: int | None) -> int:
        """A back-off gap (None: probe_every decisions) doubled, up to PROBE_GAP_MAX."""
        return min(2 * (gap or self.probe_every), PROBE_GAP_MAX)

    # -- the drafter protocol ------------------------------------------------------------------------------
    def propose(self, context_tokens: Sequence[int], k: int, features: Features | None) -> list[int]:
        planned, self._planned = self._planned, None
        if planned is None:
            self._probe = False
            k_use = self.choose_k(k)
        else:  # decided by block_instead (its probe flag stands)
            k_use = min(planned, k)
        to_max = False
        if self.gate and hasattr(self.inner, "stop_below"):
            self.inner.stop_below = self.stop_chance()
            if self._drafts_to_max() and k_use > 0 and not self._probe:
                k_use, to_max = k, True  # it stops where its confidences say the rest would not be verified
        k_draft = self.drafted(k_use, k)
        t0 = self.clock()
        drafted = list(self.inner.propose(context_tokens, k_draft, features)[:k_draft]) if k_draft > 0 else []
        t1 = self.clock()
        conf = list(getattr(self.inner, "confidence", None) or [])[:len(drafted)] if drafted and self.gate else []
        first, self._first = self._first, False
        if drafted and not first:
            n = len(drafted)
            self.draft_by_k[n] = self._ema(self.draft_by_k.get(n, 0.0), (t1 - t0) * 1e3, n not in self.draft_by_k)
            self.draft_ms = self.draft_by_k[n] / n
            if to_max:
                self.to_max_ms = self._ema(self.to_max_ms or 0.0, (t1 - t0) * 1e3, self.to_max_ms is None)
        gated = self.gate and bool(conf) and len(conf) == len(drafted)
        if gated and self.shadow:  # any of the rows drafted, by their calibrated chances
            drafts = drafted[:self.keep(conf, (t1 - t0) * 1e3)]
        else:
            drafts, conf = drafted[:k_use], conf[:k_use]
            if gated and not self._probe:
                n = self.keep(conf, (t1 - t0) * 1e3)
                if n < len(drafts):
                    self._cut += 1
                    if self._cut % self.probe_every == 0:
                        n += 1  # now and then one more: the calibration of less sure drafts is measured too
                drafts, conf = drafts[:n], conf[:n]
        if drafted and not drafts:  # drafted, and every draft cut: back off (block_instead)
            self._idle_until = self._rounds + (self._cut_gap or self.probe_every)
            self._cut_gap = self._longer(self._cut_gap)
        self._pending = (len(drafts), t1, t0)
        self._probing = len(drafts) if self._probe and drafts else None
        # scored against the reply, with the confidences to calibrate: every row drafted (a shadow drafter), or
        # the drafts verified (the rest were cut: the acceptance history is of the kept ones)
        shadow, conf = (drafted, conf) if self.shadow else (drafts, conf[:len(drafts)])
        self._this = Shadow(shadow, conf if gated else None) if shadow else None
        if self._this is not None:
            self._shadows.append(self._this)
        return drafts

    def observe(self, tokens: Sequence[int], features: Features | None) -> None:
        self.inner.observe(tokens, features)
        if self._pending is None:  # prefill (no shadows yet), a decode block: the reply goes on
            this, self._this = self._this, None
            self._observed(tokens, this)
            return
        n, t1, t0 = self._pending
        self._pending = None
        t = n + 1
        now = self.clock()
        self._tok = self._tok * self.decay + len(tokens)
        self._ms = self._ms * self.decay + (now - t0) * 1e3
        if t in self.cost_ms or t in self._cold:
            record_cost(self.cost_ms, t, (now - t1) * 1e3, self.decay)
        else:  # the process's first pass over t tokens (buffers grown, first calls): not its cost
            self._cold.add(t)
        accepted = min(max(len(tokens) - 1, 0), n)
        if accepted:  # drafting paid again: no back-off after the next cut round but the first
            self._cut_gap = None
        if self._probing is not None:
            self._probed(accepted >= self._probing)
        this, self._this = self._this, None
        if this is not None and accepted < n:
            this.rejected = accepted  # the verify told where the first rejected draft was
        self._observed(tokens, this)

    def _observed(self, tokens: Sequence[int], this: Shadow | None = None) -> None:
        """More of the reply: the tokens fed by a round (`this` = its own drafts' shadow, whose first fed token
        is the round's last context token, not a reply token after it), a decode block, a prefill; then score
        every shadow the reply now decides."""
        for sh in self._shadows:
            sh.seen.extend(int(t) for t in (tokens[1:] if sh is this else tokens))
        self._shadows = [sh for sh in self._shadows if not self._score(sh)]

    def _score(self, sh: Shadow, final: bool = False) -> bool:
        """Score a round's drafts against the reply: the conditional acceptance of position j (d_1..d_j
        emitted, given d_1..d_{j-1} were) is counted at every position the reply has reached, the verified
        ones and the shadow rows beyond them alike (a shadow row is accepted exactly when the reply's token
        there equals it: verification keeps a draft iff the chooser draws it). True when done: a mismatch
        found, every draft reached, or `final` (what is known so far is counted)."""
        drafts, seen, rejected, conf = sh.drafts, sh.seen, sh.rejected, sh.conf
        n = len(drafts)
        reach = 0
        while reach < min(n, len(seen)) and seen[reach] == drafts[reach]:
            reach += 1
        if rejected is not None and reach >= rejected:
            reach, miss = rejected, True
        else:
            miss = reach < min(n, len(seen))
        if not (miss or reach >= n or final):
            return False
        tried = min(reach + (1 if miss else 0), n)
        while len(self.tries) < tried:
            self.hits.append(0.0)
            self.tries.append(0.0)
        for j in range(tried):
            self.tries[j] = self.tries[j] * self.decay + 1.0
            self.hits[j] = self.hits[j] * self.decay + (1.0 if j < reach else 0.0)
            if conf is not None:
                b = self._bin(conf[j], j)
                self.conf_tries[b] = self.conf_tries[b] * CONF_DECAY + 1.0
                self.conf_hits[b] = self.conf_hits[b] * CONF_DECAY + (1.0 if j < reach else 0.0)
        return True

    def _ema(self, old: float, new: float, first: bool) -> float:
        return new if first else old * self.decay + new * (1.0 - self.decay)
