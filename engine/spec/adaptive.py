"""Adaptive draft length: a drafter wrapper that drafts only as many tokens as pay for their verify cost.

Speculation is lossless whatever is drafted, but not free: a verify pass over T = k+1 tokens costs c(T), more
than a plain step c(1) on a CPU. With a_j the conditional acceptance of draft j (given d_1..d_{j-1} were
accepted), a round with k drafts yields E(k) = 1 + a_1 + a_1 a_2 + ... + a_1..a_k tokens on average, so the
best k maximises E(k) / (c(k+1) + d(k)), d(k) the drafting of k tokens, and may be 0 (a plain step) on text the drafter cannot
predict. Everything is measured online by the wrapper itself, from the calls the round already makes:
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
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Sequence

from .base import Drafter, Features

PRIOR_WEIGHT = 2.0  # pseudo-tries behind each position's prior
CONF_BINS = 10  # confidence bins of the online calibration (0-0.1, ..., 0.9-1)
CONF_DECAY = 0.98  # per update of a bin: calibration is the drafter's, it changes slowly

# Verify costs are a property of the model on this machine, not of a reply: drafters of the same model share
# one table (T -> ms), so a new reply does not start measuring from scratch.
_COST_TABLES: "weakref.WeakKeyDictionary[Any, dict[int, float]]" = weakref.WeakKeyDictionary()


# How a drafter's confidence maps to acceptance is a property of the drafter (its weights and head), not of
# a reply: adaptive wrappers of the same network (`inner.calibration_key`) share their bins across replies.
_CALIBRATIONS: weakref.WeakKeyDictionary[Any, tuple[list[float], list[float]]] = weakref.WeakKeyDictionary()


def shared_calibration(key: Any) -> tuple[list[float], list[float]]:
    """(hits, tries) per confidence bin, shared by every adaptive wrapper of the drafter network `key`."""
    fresh = ([0.0] * CONF_BINS, [0.0] * CONF_BINS)
    if key is None:
        return fresh
    try:
        return _CALIBRATIONS.setdefault(key, fresh)
    except TypeError:  # not weak-referenceable
        return fresh


def shared_cost_table(model: Any) -> dict[int, float]:
    """The verify-cost table (T -> EMA ms) shared by every adaptive drafter of `model`."""
    if model is None:
        return {}
    try:
        return _COST_TABLES.setdefault(model, {})
    except TypeError:  # not weak-referenceable
        return {}


class AdaptiveLength:
    """Wraps any drafter; implements the same protocol (engine.spec.base.Drafter)."""

    def __init__(self, inner: Drafter, decay: float = 0.9, probe_every: int = 8,
                 clock: Callable[[], float] = time.perf_counter, cost_table: dict[int, float] | None = None,
                 draft_fixed: float = 0.0):
        """draft_fixed: a round's drafting costs about (k + draft_fixed) draft steps (MTP: 1, its first step
        also runs the pairs fed since the last round; DFlash: 2, its block forward against the head's rows):
        how a k not yet drafted is scaled from the nearest one measured (draft_cost)."""
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
        self._pending: tuple[int, float] | None = None  # (n drafts, time propose returned)
        self._conf: list[float] = []  # the kept drafts' confidences (inner.confidence), for observe
        self._cut = 0  # rounds whose drafts the confidences cut short (every probe_every-th keeps one more)
        self._probe = False  # this round explores one position deeper (choose_k): no cut
        self.gate = True  # cut rounds by the drafter's confidence (False: by the acceptance history only)
        # the first round of a reply also runs what the drafter has not yet of the prompt (MTP: its pairs
        # since the last whole chunk): not a round's drafting cost. Kept, it priced that k at ~8x (24.6 ms
        # for 3 drafts against ~3) in the per-k table, which then steered rounds away from it.
        self._first = True
        # per confidence bin: decayed counts of accepted | tried, and of tried (shared: shared_calibration)
        self.conf_hits, self.conf_tries = shared_calibration(getattr(inner, "calibration_key", None))
        self._rounds = 0  # rounds decided on estimates, and tokens of the blocks run instead of rounds
        self._last_probe = 0  # the decision at which choose_k last explored one draft deeper
        self._planned: int | None = None  # the next propose's length, decided ahead (block_instead)

    def reset(self) -> None:
        """A new reply. Costs are the machine's and acceptance follows the text: both are kept (decayed)."""
        self.inner.reset()
        self._pending = None
        self._planned = None
        self._first = True

    # -- estimates -----------------------------------------------------------------------------------------
    def acceptance(self, j: int) -> float:
        """Conditional acceptance of draft position j (0-based). The prior is the previous position's estimate
        (weight PRIOR_WEIGHT; 0.5 for the first), so a position rarely tried does not look worse than the
        one before it: a run of right drafts tends to continue (a list, a quote, a loop)."""
        prior = self.acceptance(j - 1) if j > 0 else 0.5
        if j >= len(self.tries):
            return prior
        return (self.hits[j] + PRIOR_WEIGHT * prior) / (self.tries[j] + PRIOR_WEIGHT)

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

    def chance(self, conf: float) -> float:
        """Calibrated chance that a draft of this confidence is accepted (given the drafts before it were)."""
        b = min(max(int(conf * CONF_BINS), 0), CONF_BINS - 1)
        return (self.conf_hits[b] + PRIOR_WEIGHT * conf) / (self.conf_tries[b] + PRIOR_WEIGHT)

    def keep(self, conf: Sequence[float], draft_ms: float) -> int:
        """How many of a round's drafts (their confidences) to verify: the most expected tokens per ms of the
        round (its drafting, already spent, plus the verify pass); all of them while costs are unknown."""
        if 1 not in self.cost_ms or len(self.cost_ms) < 2:
            return len(conf)
        best_n, best = 0, 1.0 / (self.cost_ms[1] + draft_ms)
        expected, p = 1.0, 1.0
        for n in range(1, len(conf) + 1):
            p *= self.chance(conf[n - 1])
            expected += p
            rate = expected / (self.cost(n + 1) + draft_ms)
            if rate > best:
                best_n, best = n, rate
        return best_n

    def stop_chance(self) -> float:
        """A drafter that can stop mid-round (`inner.stop_below`) stops once the product of its drafts'
        confidences falls below this: half the cheapest verify row's cost in steps, a chance `keep` would
        not verify anyway (0 while costs are unknown: draft everything asked)."""
        if 1 not in self.cost_ms or len(self.cost_ms) < 2:
            return 0.0
        known = sorted(self.cost_ms)
        rows = [(self.cost_ms[b] - self.cost_ms[a]) / (b - a) for a, b in zip(known, known[1:])]
        return max(0.5 * min(rows) / self.cost_ms[1], 0.0)

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
        best_k, best = 0, 1.0 / self.cost_ms[1]
        expected, p = 1.0, 1.0
        for k in range(1, k_max + 1):
            p *= self.acceptance(k - 1)
            expected += p
            rate = expected / (self.cost(k + 1) + self.draft_cost(k))
            if rate > best:
                best_k, best = k, rate
        self._rounds += 1
        if best_k < k_max and self._rounds - self._last_probe >= self.probe_every:
            self._last_probe = self._rounds
            self._probe = True  # (propose verifies it whatever the drafter's confidence)
            return best_k + 1  # explore one position deeper: its acceptance may have changed
        return best_k

    # -- a round that drafts nothing: a decode block instead (engine.spec.round.SpecRound) -----------------
    def block_instead(self, k_max: int) -> bool:
        """Decide the next round's draft length now (choose_k; the next propose drafts that many): True when
        it is 0 on measured costs, so the round may emit plain tokens in a decode block rather than verify no
        drafts (a one-token round costs ~1.1x a token of a block: bench/results-verify.md). Not while the
        costs are still being measured (the first one-token round measures c(1))."""
        self._probe = False
        self._planned = self.choose_k(k_max)
        return self._planned == 0 and self.may_block()

    def may_block(self) -> bool:
        """Whether a round without drafts may be a decode block: once the verify costs are measured (until
        then a round without drafts is the one-token pass that measures c(1); a block in its place would
        leave it unmeasured, and the length would plan no drafts ever after)."""
        return 1 in self.cost_ms and len(self.cost_ms) >= 2

    def blocked(self, n: int) -> None:
        """The round ran a decode block of n tokens instead (after block_instead, or after a propose that kept
        no drafts): they count as n decisions toward the next probe, so a run of blocks explores as often per
        token as one-token rounds did; no verify pass to time."""
        self._planned = None
        self._pending = None  # (a propose that kept no drafts: its one-token verify did not run)
        self._conf = []
        self._rounds += max(n - 1, 0)

    # -- the drafter protocol ------------------------------------------------------------------------------
    def propose(self, context_tokens: Sequence[int], k: int, features: Features | None) -> list[int]:
        planned, self._planned = self._planned, None
        if planned is None:
            self._probe = False
            k_use = self.choose_k(k)
        else:  # decided by block_instead (its probe flag stands)
            k_use = min(planned, k)
        if self.gate and hasattr(self.inner, "stop_below"):
            self.inner.stop_below = self.stop_chance()
        t0 = self.clock()
        drafts = list(self.inner.propose(context_tokens, k_use, features)[:k_use]) if k_use > 0 else []
        t1 = self.clock()
        conf = list(getattr(self.inner, "confidence", None) or [])[:len(drafts)] if drafts and self.gate else []
        first, self._first = self._first, False
        if drafts and not first:
            n = len(drafts)
            self.draft_by_k[n] = self._ema(self.draft_by_k.get(n, 0.0), (t1 - t0) * 1e3, n not in self.draft_by_k)
            self.draft_ms = self.draft_by_k[n] / n
        if self.gate and conf and len(conf) == len(drafts) and not self._probe:
            n = self.keep(conf, (t1 - t0) * 1e3)
            if n < len(drafts):
                self._cut += 1
                if self._cut % self.probe_every == 0:
                    n += 1  # now and then one more: the calibration of less sure drafts is measured too
            drafts, conf = drafts[:n], conf[:n]
        self._conf = conf if len(conf) == len(drafts) else []
        self._pending = (len(drafts), t1)
        return drafts

    def observe(self, tokens: Sequence[int], features: Features | None) -> None:
        self.inner.observe(tokens, features)
        if self._pending is None:
            return  # prefill, not a round
        n, t1 = self._pending
        self._pending = None
        t = n + 1
        self.cost_ms[t] = self._ema(self.cost_ms.get(t, 0.0), (self.clock() - t1) * 1e3, t not in self.cost_ms)
        accepted = min(max(len(tokens) - 1, 0), n)
        while len(self.tries) < n:
            self.hits.append(0.0)
            self.tries.append(0.0)
        for j in range(min(accepted + 1, n)):  # positions 0..accepted were tried; 0..accepted-1 hit
            self.tries[j] = self.tries[j] * self.decay + 1.0
            self.hits[j] = self.hits[j] * self.decay + (1.0 if j < accepted else 0.0)
            if j < len(self._conf):
                b = min(max(int(self._conf[j] * CONF_BINS), 0), CONF_BINS - 1)
                self.conf_tries[b] = self.conf_tries[b] * CONF_DECAY + 1.0
                self.conf_hits[b] = self.conf_hits[b] * CONF_DECAY + (1.0 if j < accepted else 0.0)
        self._conf = []

    def _ema(self, old: float, new: float, first: bool) -> float:
        return new if first else old * self.decay + new * (1.0 - self.decay)
