"""Pilot tests of typing on a focused message (message keys vs typing), the settings screen's focus and
error wording, and the export's settings labels."""
from __future__ import annotations

import pytest
from textual.widgets import Input

from engine.fake import Script
from ninfer_tui.screens import SettingsScreen, in_field_words
from ninfer_tui.widgets.chat import PromptInput, ReplyView

from tui_helpers import ready, send, wait_for

pytestmark = pytest.mark.anyio
SIZE = (120, 40)


async def _focused_reply(pilot, copied: list):
    app = pilot.app
    app.copy_to_clipboard = copied.append
    await ready(pilot)
    await send(pilot, "code please")
    view = app.query(ReplyView).last()
    view.focus()
    await pilot.pause()
    return view


async def test_typing_on_a_focused_message_types_the_prompt(make_app):
    """A click on a message, then a prompt typed on: c and b copied over the clipboard at each letter, and the
    letters were lost. Typing goes to the input, the letters with it."""
    app = make_app(Script(answer="See:\n```\nA\n```\n"))
    copied = []
    async with app.run_test(size=SIZE) as pilot:
        await _focused_reply(pilot, copied)
        await pilot.press(*"can b", "space", *"be")
        prompt = app.query_one("#prompt", PromptInput)
        await wait_for(pilot, lambda: prompt.text == "can b be")
        await pilot.pause(0.5)  # past the window in which a held message key would act
        assert copied == [] and app.focused is prompt


async def test_a_paste_on_a_focused_message_goes_to_the_prompt(make_app):
    from textual import events
    app = make_app(Script(answer="ok"))
    copied = []
    async with app.run_test(size=SIZE) as pilot:
        view = await _focused_reply(pilot, copied)
        view.post_message(events.Paste("pasted text"))
        prompt = app.query_one("#prompt", PromptInput)
        await wait_for(pilot, lambda: prompt.text == "pasted text" and app.focused is prompt)


async def test_message_keys_never_act_while_the_prompt_holds_a_draft(make_app):
    app = make_app(Script(answer="See:\n```\nA\n```\n"))
    copied = []
    async with app.run_test(size=SIZE) as pilot:
        view = await _focused_reply(pilot, copied)
        prompt = app.query_one("#prompt", PromptInput)
        prompt.load_text("my draft ")
        prompt.move_cursor(prompt.document.end)
        view.focus()
        await pilot.pause()
        await pilot.press("c")
        await wait_for(pilot, lambda: prompt.text == "my draft c")
        await pilot.pause(0.5)
        assert copied == [] and app.focused is prompt


async def test_a_message_key_alone_still_acts(make_app):
    app = make_app(Script(answer="See:\n```\nA\n```\n"))
    copied = []
    async with app.run_test(size=SIZE) as pilot:
        view = await _focused_reply(pilot, copied)
        await pilot.press("b")
        await wait_for(pilot, lambda: copied == ["A"])
        await pilot.press("c", "tab")  # a navigation key right after: the c was a key, not typing
        await wait_for(pilot, lambda: copied == ["A", view.text])
        assert app.query_one("#prompt", PromptInput).text == ""


async def test_settings_screen_focuses_its_first_field_and_the_field_in_error(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f9")
        assert isinstance(app.screen, SettingsScreen)
        await pilot.pause()
        assert app.focused is app.screen.query_one("#set-temperature", Input)
        app.screen.query_one("#set-max_new", Input).value = "0"
        await pilot.press("ctrl+s")
        await pilot.pause()
        error = str(app.screen.query_one("#settings-error").render())
        assert error.startswith('"max new" must be >= 1') and "--" not in error
        assert app.focused is app.screen.query_one("#set-max_new", Input)


def test_engine_errors_name_the_settings_fields():
    assert in_field_words("--presence-penalty must be a finite number, got nan") == (
        '"presence" must be a finite number, got nan', "presence")
    assert in_field_words("--thinking-budget 64 leaves no room: it needs --max-new >= 80") == (
        '"budget" 64 leaves no room: it needs "max new" >= 80', "budget")
    assert in_field_words("--kv-capacity is too small") == ("--kv-capacity is too small", None)


async def test_export_labels_the_last_replys_settings_and_each_replys_own(make_app, tmp_path):
    """The front matter showed the last reply's settings as the chat's, though the first reply ran with
    other ones."""
    app = make_app(Script(answer="ok"), temperature=0.7)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first")
        app.settings.temperature = 0.2
        await send(pilot, "second")
        await pilot.press("ctrl+s")
        text = next((tmp_path / "data" / "exports").glob("*.md")).read_text()
    head, body = text.split("---")[1], text.split("---", 2)[2]
    assert "last_reply_settings:" in head and "temperature: 0.2" in head and "\nsettings:" not in head
    first, second = body.split("## User")[1:]
    assert "differ from the last reply's: temperature 0.7" in first and "differ" not in second


async def test_export_of_a_chat_with_one_setting_says_settings(make_app, tmp_path):
    app = make_app(Script(answer="ok"), temperature=0.7)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first")
        await send(pilot, "second")
        await pilot.press("ctrl+s")
        text = next((tmp_path / "data" / "exports").glob("*.md")).read_text()
    assert "\nsettings:\n" in text and "temperature: 0.7" in text and "differ" not in text
