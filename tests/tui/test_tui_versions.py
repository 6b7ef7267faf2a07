"""Moving between versions: after regenerate the reply shows [2/2]; left / right on a focused message show
another version (a reply, or an edited prompt with the replies below it), the next prompt continues the
version shown, and the transcript keeps it (a reopened chat shows it)."""
from __future__ import annotations

import itertools

import pytest
from tui_helpers import ready, send, wait_for

from engine import paths
from engine.fake import Script
from ninfer_tui.chat import ChatState
from ninfer_tui.keys import help_rows
from ninfer_tui.store import Store
from ninfer_tui.widgets.chat import PromptView, ReplyView

pytestmark = pytest.mark.anyio
SIZE = (110, 40)


def _numbered():
    n = itertools.count(1)
    return Script(answer=lambda msgs: f"reply {next(n)} to {msgs[-1]['content']}")


async def _regenerated(pilot):
    """A chat of one prompt whose reply was regenerated once: (first reply, second reply)."""
    app = pilot.app
    await ready(pilot)
    await send(pilot, "q")
    first = app.chat.path[-1]
    await pilot.press("ctrl+r")
    await wait_for(pilot, lambda: not app.generating and app.chat.path[-1].id != first.id)
    await pilot.pause()
    return first, app.chat.path[-1]


async def test_left_and_right_move_between_regenerated_replies(make_app):
    app = make_app(_numbered())
    async with app.run_test(size=SIZE) as pilot:
        first, second = await _regenerated(pilot)
        assert app.query(ReplyView).last().version == (2, 2)
        assert any("the earlier versions are kept" in n.message for n in app._notifications)
        app.query(ReplyView).last().focus()
        await pilot.press("left")
        await wait_for(pilot, lambda: app.chat.path[-1].id == first.id)
        view = app.query(ReplyView).last()
        assert view.version == (1, 2) and view.text == "reply 1 to q" and app.focused is view
        assert app.store.conversation(app.chat.conv_id).leaf_id == first.id  # kept in the transcript
        await pilot.press("left")  # no earlier one: says so, changes nothing
        await pilot.pause()
        assert app.chat.path[-1].id == first.id
        assert any("this is the first version (1/2)" in n.message for n in app._notifications)
        await pilot.press("right")
        await wait_for(pilot, lambda: app.chat.path[-1].id == second.id)
        assert app.query(ReplyView).last().version == (2, 2)


async def test_the_next_prompt_continues_the_version_shown_and_a_reopen_shows_it(make_app):
    app = make_app(_numbered())
    async with app.run_test(size=SIZE) as pilot:
        first, _ = await _regenerated(pilot)
        app.query(ReplyView).last().focus()
        await pilot.press("left")
        await wait_for(pilot, lambda: app.chat.path[-1].id == first.id)
        app.query_one("#prompt").focus()
        await send(pilot, "more")
        assert [m.content for m in app.chat.path] == ["q", "reply 1 to q", "more", "reply 3 to more"]
        assert app.chat.path[2].parent_id == first.id
        conv_id = app.chat.conv_id
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.chat.conv_id is None)
        await app.open_chat(conv_id)
        await pilot.pause()
        assert [m.content for m in app.chat.path] == ["q", "reply 1 to q", "more", "reply 3 to more"]
        assert [v.version for v in app.query(ReplyView)] == [(1, 2), (1, 1)]


async def test_an_edited_prompts_versions_bring_their_own_replies(make_app):
    app = make_app(_numbered())
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first")
        await send(pilot, "second")
        old = [m.content for m in app.chat.path]
        app.query(PromptView).first().focus()
        await pilot.press("e")
        prompt = app.query_one("#prompt")
        await wait_for(pilot, lambda: prompt.text == "first")
        prompt.load_text("edited")
        prompt.focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.generating and app.chat.path[-1].role == "assistant"
                       and app.chat.path[0].content == "edited")
        await pilot.pause()
        assert app.query(PromptView).first().version == (2, 2)
        app.query(PromptView).first().focus()
        await pilot.press("left")  # the old prompt, and the whole branch that followed it
        await wait_for(pilot, lambda: app.chat.path[0].content == "first")
        assert [m.content for m in app.chat.path] == old
        await pilot.press("right")
        await wait_for(pilot, lambda: app.chat.path[0].content == "edited")
        assert [m.content for m in app.chat.path] == ["edited", "reply 3 to edited"]


async def test_a_reply_without_versions_says_so(make_app):
    app = make_app(Script(answer="only"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "q")
        app.query(ReplyView).last().focus()
        await pilot.press("right")
        await pilot.pause()
        assert any("this reply has no other version" in n.message for n in app._notifications)


def test_switching_picks_the_newest_continuation_and_is_saved(tmp_path):
    st = Store(tmp_path / "t.db")
    chat = ChatState(st, "m")
    u = chat.add_user("q")
    a1 = chat.add_reply("one", "", False, {}, None, "stop")
    chat.add_user("follow-up")
    chat.add_reply("later", "", False, {}, None, "stop")
    chat.path = chat.path[:1]  # regenerate the first reply
    a2 = chat.add_reply("two", "", False, {}, None, "stop")
    assert chat.versions(a2) == (2, 2)
    assert chat.switch_version(1, -1) == (1, 2)
    assert [m.content for m in chat.path] == ["q", "one", "follow-up", "later"]  # where version 1 was taken
    reopened = ChatState(Store(tmp_path / "t.db"), "m")
    reopened.open(chat.conv_id)
    assert [m.content for m in reopened.path] == ["q", "one", "follow-up", "later"]
    assert chat.switch_version(1, -1) is None and chat.switch_version(0, 1) is None  # none that way
    assert chat.switch_version(1, 1) == (2, 2) and [m.id for m in chat.path] == [u.id, a2.id]
    assert a1.id != a2.id


async def test_the_version_keys_are_remappable(make_app):
    """[keymap] version_prev / version_next (and the other message keys) are config keys like the app's."""
    cfg = paths.user_config_path()
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text('[keymap]\nversion_prev = "ctrl+b"\ncopy_message = "y"\n')
    app = make_app(_numbered())
    async with app.run_test(size=SIZE) as pilot:
        first, _ = await _regenerated(pilot)
        assert any("ctrl+b / right move between them" in n.message for n in app._notifications)
        app.query(ReplyView).last().focus()
        await pilot.press("ctrl+b")
        await wait_for(pilot, lambda: app.chat.path[-1].id == first.id)
        assert ("y", "copy_message", "Copy the focused message") in help_rows(app.settings.keymap)
