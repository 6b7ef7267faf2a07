"""Pilot helpers shared by the TUI tests."""
from __future__ import annotations

import time


async def wait_for(pilot, cond, timeout: float = 10.0, step: float = 0.02) -> None:
    """Let the app run until cond() is true (fails the test on timeout)."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        await pilot.pause(step)


async def ready(pilot) -> None:
    await wait_for(pilot, lambda: pilot.app.session is not None)


async def send(pilot, text: str, wait: bool = True, timeout: float = 10.0) -> None:
    app = pilot.app
    prompt = app.query_one("#prompt")
    prompt.load_text(text)
    started = app.replies_started
    await pilot.press("enter")
    await wait_for(pilot, lambda: app.replies_started > started)
    if wait:
        await wait_for(pilot, lambda: not app.generating, timeout=timeout)
        await pilot.pause()
