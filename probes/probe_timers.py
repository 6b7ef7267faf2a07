"""Timers the probes put around an object's methods or a module's functions (not a probe itself)."""
from __future__ import annotations

import time


def time_calls(obj, name: str, totals: dict, label: str):
    """Replace obj.name by a wrapper that adds each call's seconds to totals[label] (a defaultdict(float) or a
    dict holding the label); returns the original."""
    orig = getattr(obj, name)

    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return orig(*args, **kw)
        finally:
            totals[label] += time.perf_counter() - t0
    setattr(obj, name, timed)
    return orig
