"""Snapshots of the main screens at a fixed size (pytest-textual-snapshot; update with --snapshot-update).

The fake engine reports virtual timings and the GPU panel a fixed "no GPU" state, so the figures are stable."""
from __future__ import annotations

import time

import pytest

from engine.fake import Script

from tui_helpers import ready, send, wait_for

SIZE = (130, 42)
ANSWER = ("Paris is the capital of **France**.\n\n```python\nprint('Paris')\n```\n\n"
          "- population: about 2.1 million\n- river: the Seine")


@pytest.fixture(autouse=True)
def _utc(monkeypatch):
    """Dates in the transcripts list are local time: pin the zone."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _app(make_app, **kw):
    return make_app(Script(answer=ANSWER, reasoning="The user asks about France. ", virtual_tok_s=50.0), **kw)


async def _steady(pilot):
    """Model loaded, and no blinking cursor (its phase would depend on timing)."""
    await ready(pilot)
    pilot.app.query_one("#prompt").cursor_blink = False


async def _after_reply(pilot):
    await _steady(pilot)
    await send(pilot, "What is the capital of France?")
    pilot.app.query_one("#prompt").cursor_blink = False  # the app turns blinking back on after a reply
    pilot.app.clear_notifications()
    await pilot.pause()


def _pinned(run_before):
    """The sparkline's shape depends on how many live samples the coalesced stream delivered (timing, load):
    pin it to a flat line so the snapshot shows only the layout. Its data is tested in test_tui_keys_panel."""
    async def run(pilot):
        await run_before(pilot)
        for spark in pilot.app.screen_stack[0].query("#spark"):
            spark.data = [50.0, 50.0]
        await pilot.pause()
    return run


def test_snapshot_chat_after_reply(make_app, snap_compare):
    assert snap_compare(_app(make_app), terminal_size=SIZE, run_before=_pinned(_after_reply))


def test_snapshot_chat_with_forced_reasoning(make_app, snap_compare):
    async def run_before(pilot):
        await _steady(pilot)
        await pilot.press("f2", "f3", "f6")
        await send(pilot, "Think first, then answer")
        reply = pilot.app.query("ReplyView").last()
        reply.query_one(".reasoning").collapsed = False  # show the forced-close mark
        pilot.app.query_one("#prompt").cursor_blink = False
        pilot.app.clear_notifications()
        await pilot.pause()
    assert snap_compare(_app(make_app, budget_step=3), terminal_size=SIZE, run_before=_pinned(run_before))


def test_snapshot_help(make_app, snap_compare):
    async def run_before(pilot):
        await _steady(pilot)
        pilot.app.clear_notifications()
        await pilot.press("f1")
    assert snap_compare(_app(make_app), terminal_size=SIZE, run_before=_pinned(run_before))


def test_snapshot_settings(make_app, snap_compare):
    async def run_before(pilot):
        await _steady(pilot)
        pilot.app.clear_notifications()
        await pilot.press("f9")
        for field in pilot.app.screen.query("Input, TextArea"):  # a focused field's cursor blinks: pin it
            field.cursor_blink = False
        await pilot.pause()
    assert snap_compare(_app(make_app), terminal_size=SIZE, run_before=_pinned(run_before))


def test_snapshot_transcripts(make_app, snap_compare):
    async def run_before(pilot):
        await _after_reply(pilot)
        pilot.app.store.db.execute("UPDATE conversations SET updated = 1767225600")  # fixed date in the list
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: pilot.app.screen.query("DataTable"))
        pilot.app.screen.query_one("#search").cursor_blink = False
        await pilot.pause()
    assert snap_compare(_app(make_app), terminal_size=SIZE, run_before=_pinned(run_before))
