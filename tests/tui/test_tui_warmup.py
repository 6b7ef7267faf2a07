"""First start: the status line counts the seconds while the model loads (compiling kernels reports nothing
for a minute or more), and a reply on the engine's start-up tier (Progress("compile") first: Engine.warming)
says why it is slower, in the TUI and in plain mode."""
from __future__ import annotations

import io
import re
import threading

import pytest
from tui_helpers import ready, send, wait_for

from engine.config import EngineArgs
from engine.events import Progress
from engine.fake import Script, ScriptedEngine
from ninfer_tui.plain import PlainChat
from ninfer_tui.settings import ChatSettings

pytestmark = pytest.mark.anyio
SIZE = (110, 30)
NOTE = "the fast decode step is still compiling in the background (first start only)"


def _status(app) -> str:
    return str(app.query_one("#status").render())


def _elapsed(app) -> int | None:
    m = re.search(r"· (\d+) s ·", _status(app))
    return int(m.group(1)) if m else None


async def test_the_status_line_counts_the_seconds_of_a_long_compile(make_app):
    release = threading.Event()

    def slow_loader(args, progress=None):  # one progress event, then a long silence, as a cold compile
        progress(Progress("compile", 2, 3, "compiling kernels (first start only)"))
        release.wait(30)
        return ScriptedEngine.load(args, progress=progress)
    app = make_app(loader=slow_loader)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "compiling kernels (first start only)" in _status(app))
        first = _elapsed(app)
        assert first is not None, _status(app)
        await wait_for(pilot, lambda: (_elapsed(app) or 0) >= first + 1, timeout=5)  # ticks with no new event
        assert "compile [#############-------] 2/3" in _status(app)
        release.set()
        await ready(pilot)
        assert "loading" not in _status(app)
        seconds = _status(app)
        await pilot.pause(1.2)
        assert _status(app) == seconds  # the ticker stopped with the load


async def test_a_reply_on_the_start_up_tier_says_why_it_is_slower(make_app):
    script = Script(answer="one two three four", warming=NOTE, hold_after=2)
    app = make_app(script)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi", wait=False)
        await wait_for(pilot, lambda: "first start:" in _status(app))
        assert NOTE in _status(app)
        assert sum("This reply is slower" in n.message for n in app._notifications) == 1
        script.release.set()
        await wait_for(pilot, lambda: not app.generating)
        assert "first start:" not in _status(app)  # back to the chat's status when the reply ends
        await send(pilot, "again")
        assert sum("This reply is slower" in n.message for n in app._notifications) == 1  # said once


def test_plain_mode_says_it_too():
    out, err = io.StringIO(), io.StringIO()
    eng = ScriptedEngine(EngineArgs(), Script(answer="ok", warming=NOTE))
    chat = PlainChat(eng, ChatSettings.from_config({}), "fake", None, out=out, err=err, spec_modes=eng.spec_modes())
    chat.ask("hi")
    assert f"[first start: {NOTE}]" in err.getvalue() and out.getvalue() == "ok\n"
