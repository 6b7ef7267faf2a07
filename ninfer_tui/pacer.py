"""Frame pacing for the streaming UI: render as often as `max_fps` allows while the UI thread stays under a
CPU budget, so the engine keeps (nearly) all the cores and the GIL.

Every render of a growing Markdown reply costs a layout pass; at decode speeds of tens to thousands of
tokens a second, rendering per token would take a core away from the engine. The pacer measures the UI
thread's own CPU time (`time.thread_time`, everything Textual does: layout, compositing, our handlers) over
the last frame interval and widens the interval when the share is over budget, narrowing it back when under.
"""
from __future__ import annotations

import time


class FramePacer:
    """Call `frame_done()` after each render (UI thread); it returns the delay before the next one."""

    def __init__(self, max_fps: float = 12.0, cpu_budget: float = 0.05, max_interval: float = 1.0):
        self.min_interval = 1.0 / max(1.0, max_fps)
        self.max_interval = max(max_interval, self.min_interval)
        self.budget = cpu_budget
        self.interval = self.min_interval
        self._cpu = time.thread_time()
        self._wall = time.perf_counter()
        self.next_at = 0.0  # perf_counter time before which no frame should start

    def restart(self) -> None:
        """A new reply: measure from now, keep the learned interval (the render cost is similar)."""
        self._cpu, self._wall = time.thread_time(), time.perf_counter()
        self.next_at = 0.0

    def frame_done(self) -> float:
        cpu, wall = time.thread_time(), time.perf_counter()
        dt = wall - self._wall
        if dt > 0:
            share = (cpu - self._cpu) / dt
            if share > self.budget:
                self.interval = min(self.max_interval, self.interval * min(2.0, share / self.budget))
            else:
                self.interval = max(self.min_interval, self.interval / 1.25)
        self._cpu, self._wall = cpu, wall
        self.next_at = wall + self.interval
        return self.interval

    def delay(self) -> float:
        """Seconds until a frame may start (at least 1 ms)."""
        return max(0.001, self.next_at - time.perf_counter())  # a Textual timer needs a delay > 0
