"""Decode steps on all threads or on one, whichever is currently faster: `ContentionGuard`.

Our threads spin while they wait for each other (between the phases of a step: sync.wait_open; between
steps: numba_env's GOMP_SPINCOUNT), which makes the quiet step much faster than sleeping threads. When
another process is busy on one of the two cores, the second thread gets its core late and the phases that
need its work wait for it (measured: 6.5 -> 47 ms per step before the spin learned to yield, 8-9 ms since,
against ~7.5 ms for one thread alone on the free core). So the guard times the steps and runs the faster mode.

When to look at the other mode (a probe: PROBE steps run in it; its fastest step stands for it, not the
last: under contention a single step often lands on the busy core, measured 9.6 then 57.9 ms, and one
unlucky sample kept two collapsing threads for a whole period):
- on all threads, only when the process's CPU time per wall second in recent steps falls below
  SHARE x threads. A quiet two-thread step gets ~1.9 s of CPU per second of wall time, one with another
  process busy on a core ~1.0 (measured). So a quiet reply never runs a probe step: each costs ~2 ms
  more than a step on two threads, and two per reply were ~2% of a 64-token reply;
- on one thread, every `period` steps: its own CPU share cannot tell whether the other core came free.
After a probe that found the other mode clearly slower (by MARGIN) the period doubles, up to MAX_PERIOD;
when the faster mode changes it drops back to PERIOD.
"""
from __future__ import annotations

import time

import numba


class ContentionGuard:
    PERIOD = 32
    MAX_PERIOD = 256
    PROBE = 2
    MARGIN = 1.2  # a probe this much slower than the mode in use lets the period grow
    ALPHA = 0.3  # weight of the newest step in a moving average
    SHARE = 0.75  # all threads busy less than this share of the wall time: another process holds a core

    def __init__(self):
        self.full = None  # the caller's thread count, read at the first step
        self.avg = {}  # thread count -> moving average of its step time (s)
        self.cpu_share = None  # moving average of CPU seconds per wall second, steps on all threads
        self.best = None
        self.mode = None  # thread count of the current step
        self.counted = False
        self.probing = 0  # probe steps left in the current window
        self.probe_min = float("inf")  # fastest step of the current probe window
        self.period = self.PERIOD
        self.since = 0  # steps since the last probe window (or the first step)
        self.t0 = self.c0 = 0.0
        self.fallbacks = 0  # times one thread became the faster mode (stats, tests)
        self.probes = 0  # probe windows run (stats, tests)

    def _other(self) -> int:
        return 1 if self.best == self.full else self.full

    def _probe_due(self) -> bool:
        if self.since < self.period:
            return False
        if self.best != self.full:
            return True
        return self.cpu_share is not None and self.cpu_share < self.SHARE * self.full

    def before(self):
        if self.full is None:
            self.full = self.best = numba.get_num_threads()
        if self.full < 2:
            self.mode = None
            return
        if not self.probing and self._probe_due():
            self.probing, self.probe_min = self.PROBE, float("inf")
            self.probes += 1
        mode = self._other() if self.probing else self.best
        self.counted = mode == self.mode
        if mode != self.mode:
            numba.set_num_threads(mode)
        self.mode = mode
        self.since += 1
        self.c0, self.t0 = time.process_time(), time.perf_counter()

    def full_threads(self):
        """Before a multi-row pass (prefill, verify): the caller's thread count, not the decode choice."""
        if self.full is not None and self.mode is not None and self.mode != self.full:
            numba.set_num_threads(self.full)
            self.mode = self.full

    def block_limit(self) -> int:
        """The most steps the next call may run (a decode block: fused_forward): one while a probe window
        runs or is due, so that probes stay single steps; else no limit from here."""
        if self.full is None or self.full < 2 or not (self.probing or self._probe_due()):
            return 1 << 30
        return 1

    def after(self, steps: int = 1):
        """The call since `before` ran `steps` decode steps (a decode block runs several); each is taken as
        the call's time / steps."""
        if self.mode is None:
            return
        wall = time.perf_counter() - self.t0
        dt = wall / steps
        self.since += steps - 1
        if self.probing:  # the window's fastest step stands for the probed mode
            self.probe_min = min(self.probe_min, dt)
            self.probing -= 1
            if not self.probing:
                self.avg[self.mode] = self.probe_min
                self._decide()
            return
        if not self.counted:  # the step that resized the team is not averaged
            return
        old = self.avg.get(self.mode)
        self.avg[self.mode] = dt if old is None else (1 - self.ALPHA) * old + self.ALPHA * dt
        if self.mode == self.full and dt > 0:
            share = (time.process_time() - self.c0) / wall  # the call's CPU time over its wall time
            old = self.cpu_share
            self.cpu_share = share if old is None else (1 - self.ALPHA) * old + self.ALPHA * share

    def _decide(self):
        """A probe window ended: keep the faster mode; probe less often while the other is clearly slower."""
        other, best = self._other(), self.best
        self.since = 0
        if self.avg[other] < self.avg.get(best, float("inf")):
            self.fallbacks += other == 1
            self.best = other
            self.period = self.PERIOD
            self.cpu_share = None  # a fresh look at the full team's share when it runs again
        elif self.avg[other] > self.MARGIN * self.avg[best]:
            self.period = min(2 * self.period, self.MAX_PERIOD)
        else:
            self.period = self.PERIOD
