"""Pilot tests of the chat screen with the scripted fake engine: streaming, reasoning, input, stop,
regenerate, edit & resend, copy."""
from __future__ import annotations

import pytest
from textual.widgets import Collapsible, Markdown

from engine.fake import Script
from ninfer_tui.store import Store
from ninfer_tui.widgets.chat import PromptView, ReplyView, code_blocks

from tui_helpers import ready, send, wait_for

pytestmark = pytest.mark.anyio
SIZE = (120, 40)


async def test_streams_markdown_and_saves_turn(make_app, tmp_path):
    app = make_app(Script(answer="Hello **world**\n\n```py\nx = 1\n```\nend", delay=0.002))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        view = app.query(ReplyView).last()
        assert view.text == "Hello **world**\n\n```py\nx = 1\n```\nend"
        md = view.query_one(".answer", Markdown)
        assert "world" in md.source and "x = 1" in md.source  # rendered from the full text after stop
        assert [m.role for m in app.chat.path] == ["user", "assistant"]
        footer = str(view.query_one(".reply-footer").render())
        assert "tok/s" in footer
    # committed immediately: a fresh connection sees both messages with stats and settings
    st = Store(tmp_path / "data" / "transcripts.db")
    conv = st.list_conversations()[0]
    msgs = st.branch(conv.id)
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].stats["finish_reason"] == "stop" and msgs[1].settings["spec"] == "off"


async def test_stream_is_coalesced(make_app, monkeypatch):
    """Many tokens reach the UI in far fewer messages/renders than tokens, and none is lost."""
    from ninfer_tui.app import ChatApp
    app = make_app(Script(answer="w " * 400, delay=0.001))
    seen, writes = [], []
    orig, orig_apply = ChatApp.on_stream_ready, ChatApp._apply_segments

    def counting(self, message):
        seen.append(1)
        orig(self, message)

    async def apply(self, segments):
        writes.append(len(segments))
        await orig_apply(self, segments)
    monkeypatch.setattr(ChatApp, "on_stream_ready", counting)
    monkeypatch.setattr(ChatApp, "_apply_segments", apply)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "go")
        assert app.query(ReplyView).last().text == "w " * 400
    assert 1 <= len(seen) < 100 and len(writes) < 100


async def test_reasoning_collapses_when_answer_starts_and_forced_mark(make_app):
    app = make_app(Script(reasoning="a b c d e f g h i j ", answer="The answer."), budget=4, thinking="on")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "think")
        view = app.query(ReplyView).last()
        coll = view.query_one(".reasoning", Collapsible)
        assert coll.display and coll.collapsed  # folded away once the answer started
        assert "close forced" in coll.title
        assert view.reasoning.startswith("a b c d ") and "budget of 4 reasoning tokens reached" in view.reasoning
        assert view.text == "The answer."
        saved = app.chat.path[-1]
        assert saved.reasoning_forced and "a b c d" in saved.reasoning and saved.content == "The answer."
        assert app.made["engine"].requests[-1].thinking.budget == 4


async def test_no_reasoning_section_without_thinking(make_app):
    app = make_app(Script(answer="plain"), thinking="off")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "x")
        assert not app.query(ReplyView).last().query_one(".reasoning", Collapsible).display


async def _held_after_three(pilot):
    """Send a prompt and wait until the reply holds after its first three words (Script(hold_after=3))."""
    await ready(pilot)
    await send(pilot, "go", wait=False)
    view = pilot.app.query(ReplyView).last()
    await wait_for(pilot, lambda: view.text == "one two three ")
    return view


async def test_escape_stops_and_keeps_text(make_app):
    script = Script(answer="one two three four five six", hold_after=3)
    app = make_app(script)
    async with app.run_test(size=SIZE) as pilot:
        view = await _held_after_three(pilot)
        await pilot.press("escape")
        await wait_for(pilot, lambda: not app.generating)
        assert view.text == "one two three "
        saved = app.chat.path[-1]
        assert saved.content == "one two three " and saved.stats["finish_reason"] == "cancelled"


async def test_regenerate_keeps_both_versions(make_app):
    replies = iter(["first reply", "second reply"])
    app = make_app(Script(answer=lambda msgs: next(replies)))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "q")
        first = app.chat.path[-1]
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: app.chat.path[-1].content == "second reply" and not app.generating)
        second = app.chat.path[-1]
        assert second.parent_id == first.parent_id and second.id != first.id
        assert app.store.siblings(second.id) == [first.id, second.id]
        views = app.query(ReplyView)
        assert len(views) == 1 and views.last().version == (2, 2)
        # the engine saw the same conversation (without the discarded reply)
        assert app.made["engine"].requests and len(app.query(PromptView)) == 1


async def test_edit_and_resend_branches(make_app):
    app = make_app(Script(answer=lambda msgs: "echo: " + msgs[-1]["content"]))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first question")
        await send(pilot, "second question")
        old_first = app.chat.path[0]
        app.query(PromptView).first().focus()
        await pilot.press("e")  # a message key acts once no other letter follows (it is not typing)
        prompt = app.query_one("#prompt")
        await wait_for(pilot, lambda: prompt.text == "first question")
        assert app.edit_index == 0
        await pilot.press("backspace", "backspace", "backspace", "backspace", "backspace", "backspace", "backspace",
                          "backspace", *"edited question")  # the cursor starts at the end of the text
        assert prompt.text == "first edited question"
        prompt.load_text("edited question")
        prompt.focus()
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.generating and app.chat.path[-1].role == "assistant")
        assert [m.content for m in app.chat.path] == ["edited question", "echo: edited question"]
        assert app.store.siblings(app.chat.path[0].id) == [old_first.id, app.chat.path[0].id]
        assert len(app.store.all_messages(app.chat.conv_id)) == 6  # the old branch is kept


async def test_input_newline_history_and_enter(make_app):
    app = make_app(Script(answer="ok"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("a", "ctrl+j", "b")
        prompt = app.query_one("#prompt")
        assert prompt.text == "a\nb"
        await pilot.press("enter")
        await wait_for(pilot, lambda: not app.generating and len(app.chat.path) == 2)
        assert app.chat.path[0].content == "a\nb" and prompt.text == ""
        await pilot.press("up")
        assert prompt.text == "a\nb"


async def test_keys_in_a_burst_keep_their_order(make_app):
    """Keys that arrive together (a paste without bracketed paste, typing while the UI is busy): Enter, a
    priority binding, used to run before the characters ahead of it reached the input, and sent nothing (or a
    cut prompt) while the text stayed behind."""
    from textual import events
    app = make_app(Script(answer="ok"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        for ch in "hello there":
            app.post_message(events.Key("space" if ch == " " else ch, ch))
        app.post_message(events.Key("enter", "\r"))
        await wait_for(pilot, lambda: len(app.chat.path) == 2 and not app.generating)
        assert [m.content for m in app.chat.path] == ["hello there", "ok"]
        assert app.query_one("#prompt").text == ""
        for key, ch in (("a", "a"), ("ctrl+j", "\n"), ("b", "b")):  # the newline key in a burst: in its place
            app.post_message(events.Key(key, ch))
        await wait_for(pilot, lambda: app.query_one("#prompt").text == "a\nb")


async def test_copy_message_and_code_blocks(make_app):
    app = make_app(Script(answer="See:\n```\nA\n```\nand\n```sh\nB\n```\n"))
    copied = []
    async with app.run_test(size=SIZE) as pilot:
        app.copy_to_clipboard = copied.append
        await ready(pilot)
        await send(pilot, "code please")
        view = app.query(ReplyView).last()
        view.focus()
        for n, key in enumerate("cbb", 1):  # a message key acts once no other letter follows (not typing)
            await pilot.press(key)
            await wait_for(pilot, lambda n=n: len(copied) == n)
        await pilot.press("f7")  # copy the last reply from anywhere
    assert copied == [view.text, "A", "B", view.text]


def test_code_blocks_parser():
    assert code_blocks("x\n```py\na\nb\n```\ny\n~~~\nc\n~~~\n") == ["a\nb", "c"]
    assert code_blocks("no code") == []


async def test_engine_error_is_notified_not_crashing(make_app):
    from engine.errors import InputError
    app = make_app(Script(fail_with=InputError("the prompt is too long; shorten it")))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "x")
        assert not app.generating
        assert any("too long" in n.message for n in app._notifications)


async def test_a_prompt_whose_reply_fails_at_once_goes_back_to_the_input(make_app):
    """A reply that fails before its first token (a prompt over the context): the prompt returns to the input
    box and leaves the branch, so the next prompt does not carry it and fail the same way (it used to)."""
    from engine.errors import InputError
    script = Script(answer=lambda msgs: "seen: " + " | ".join(m["content"] for m in msgs),
                    fail_with=InputError("the prompt is 9000 tokens but the context is 4096"))
    app = make_app(script)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "a very long paste")
        await wait_for(pilot, lambda: app.query_one("#prompt").text == "a very long paste")
        assert app.chat.path == [] and not app.query(ReplyView)
        script.fail_with = None
        app.query_one("#prompt").load_text("")
        await send(pilot, "short")
        assert [m.content for m in app.chat.path] == ["short", "seen: short"]
        assert [m.content for m in app.store.branch(app.chat.conv_id)] == ["short", "seen: short"]


async def test_kv_cache_that_cannot_be_allocated_is_a_load_error(make_app):
    """An engine whose session (its KV cache) cannot be made: the status line and a notification say why, the
    panel's engine section stops saying "loading...", and the app keeps running without a session."""
    from engine.errors import ConfigError
    from engine.fake import ScriptedEngine

    class NoRoom(ScriptedEngine):
        def session(self):
            raise ConfigError("a KV cache of 100000000 positions cannot be allocated here; lower --kv-capacity")
    app = make_app(loader=lambda args, progress=None: NoRoom.load(args, progress=progress, script=Script()))
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: any("kv-capacity" in n.message for n in app._notifications))
        assert app.session is None and app.is_running
        assert "ENGINE        failed to load" in str(app.query_one("#engine").render())
        app.query_one("#prompt").load_text("x")
        await pilot.press("enter")
        assert any(n.message.startswith("no model: a KV cache") for n in app._notifications)


async def test_new_chat_while_generating_stops_first(make_app):
    script = Script(answer="a b c d e f", hold_after=2)
    app = make_app(script)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "go", wait=False)
        await wait_for(pilot, lambda: app.query(ReplyView).last().text == "a b ")
        conv = app.chat.conv_id
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: not app.generating and app.chat.conv_id is None)
        assert len(app.query(ReplyView)) == 0
        assert app.store.branch(conv)[-1].content == "a b "  # the stopped reply went to its own chat


async def test_reply_finishes_while_a_modal_screen_is_open(make_app):
    script = Script(answer="one two three four", hold_after=2)
    app = make_app(script)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "go", wait=False)
        await wait_for(pilot, lambda: app.query(ReplyView).last().text == "one two ")
        await pilot.press("f1")
        script.release.set()
        await wait_for(pilot, lambda: not app.generating)
        await pilot.press("escape")
        assert app.chat.path[-1].content == "one two three four"
        assert "tokens out" in str(app.query_one("#reply").render())


async def test_quit_mid_reply_saves_the_text_so_far(make_app, tmp_path):
    """ctrl+q while a reply streams stops it and saves it as Esc does (it used to vanish from the transcript)."""
    from ninfer_tui.store import Store
    app = make_app(Script(answer="one two three four five six", hold_after=3))
    async with app.run_test(size=SIZE) as pilot:
        await _held_after_three(pilot)
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: not app.is_running)
    store = Store(tmp_path / "data" / "transcripts.db")
    conv = store.list_conversations()[0]
    saved = store.branch(conv.id)
    assert [m.role for m in saved] == ["user", "assistant"]
    assert saved[-1].content == "one two three " and saved[-1].stats["finish_reason"] == "cancelled"


async def test_quit_saves_the_reply_even_when_the_engine_does_not_stop(make_app, tmp_path, monkeypatch):
    """An engine that ignores the cancel does not keep the app open nor lose the text: after QUIT_WAIT_S the
    text so far is saved and the app exits."""
    import ninfer_tui.flows.reply as reply_mod
    from ninfer_tui.store import Store
    monkeypatch.setattr(reply_mod, "QUIT_WAIT_S", 0.2)
    script = Script(answer="one two three four five six", hold_after=3)
    app = make_app(script)
    async with app.run_test(size=SIZE) as pilot:
        await _held_after_three(pilot)
        app.bridge.cancel = __import__("threading").Event()  # the stop never reaches the engine
        await pilot.press("ctrl+q")
        await wait_for(pilot, lambda: app.bridge is None)  # saved by the fallback, not by the engine's end
        script.release.set()  # let the test's engine thread end
    saved = Store(tmp_path / "data" / "transcripts.db").branch(1)
    assert saved[-1].role == "assistant" and saved[-1].content == "one two three "
    assert saved[-1].stats == {"finish_reason": "cancelled"}
