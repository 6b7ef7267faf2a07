"""Pilot tests of a chat reopened after a crash: it ends in a prompt that was never answered (the app died
between saving the prompt and saving its reply). The chat says so and how to answer it, and the next send
never puts two prompts in a row."""
from __future__ import annotations

import pytest

from engine.fake import Script
from ninfer_tui.store import Store

from tui_helpers import ready, send, wait_for

pytestmark = pytest.mark.anyio
SIZE = (120, 40)


def crashed_chat(tmp_path) -> int:
    """A saved chat whose last prompt has no reply, as a kill -9 mid-reply leaves it."""
    store = Store(tmp_path / "data" / "transcripts.db")
    conv = store.new_conversation("crashed", "fake-model")
    u1 = store.add_message(conv, "user", "first question")
    a1 = store.add_message(conv, "assistant", "first answer", u1)
    store.add_message(conv, "user", "the unanswered one", a1)
    return conv


def seen(msgs) -> str:
    return "seen: " + " | ".join(m["content"] for m in msgs)


async def _open(pilot, conv: int) -> None:
    await ready(pilot)
    await pilot.press("ctrl+o")
    await pilot.press("enter")
    await wait_for(pilot, lambda: pilot.app.chat.conv_id == conv)
    await pilot.pause()


async def test_reopened_chat_says_how_to_answer_its_last_prompt(make_app, tmp_path):
    conv = crashed_chat(tmp_path)
    app = make_app(Script(answer=seen))
    async with app.run_test(size=SIZE) as pilot:
        await _open(pilot, conv)
        hint = str(app.query_one("#unanswered").render())
        assert "no reply" in hint and "ctrl+r answers it" in hint
        assert any("ctrl+r answers it" in n.message for n in app._notifications)
        await pilot.press("ctrl+r")  # answers the prompt that is there
        await wait_for(pilot, lambda: not app.generating and app.chat.path[-1].role == "assistant")
        assert [m.role for m in app.chat.path] == ["user", "assistant", "user", "assistant"]
        assert app.chat.path[-1].content == "seen: first question | first answer | the unanswered one"
        assert not app.query("#unanswered")


async def test_a_new_prompt_takes_the_unanswered_ones_place(make_app, tmp_path):
    """Sending in a reopened chat used to append a second prompt after the unanswered one (two user messages
    in a row, sent to the model as such); the new prompt is now the next version of the unanswered one."""
    conv = crashed_chat(tmp_path)
    app = make_app(Script(answer=seen))
    async with app.run_test(size=SIZE) as pilot:
        await _open(pilot, conv)
        old = app.chat.path[-1]
        await send(pilot, "a new question")
        assert [m.role for m in app.chat.path] == ["user", "assistant", "user", "assistant"]
        assert app.chat.path[-1].content == "seen: first question | first answer | a new question"
        assert app.store.siblings(app.chat.path[2].id) == [old.id, app.chat.path[2].id]  # the old one is kept
        assert [m.role for m in app.store.branch(conv)] == ["user", "assistant", "user", "assistant"]
        assert not app.query("#unanswered")


async def test_sending_the_same_prompt_again_answers_it_once(make_app, tmp_path):
    conv = crashed_chat(tmp_path)
    app = make_app(Script(answer=seen))
    async with app.run_test(size=SIZE) as pilot:
        await _open(pilot, conv)
        await send(pilot, "the unanswered one")
        assert [m.content for m in app.chat.path][2:] == [
            "the unanswered one", "seen: first question | first answer | the unanswered one"]
        assert len(app.store.all_messages(conv)) == 4  # no duplicate prompt


async def test_an_answered_chat_has_no_hint(make_app, tmp_path):
    app = make_app(Script(answer="ok"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "q")
        conv = app.chat.conv_id
        await pilot.press("ctrl+n")
        await _open(pilot, conv)
        assert [m.role for m in app.chat.path] == ["user", "assistant"] and not app.query("#unanswered")
