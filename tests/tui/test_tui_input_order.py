"""Keys that arrive in one burst (a fast typist, a paste without bracketed paste, a busy UI) act in the order
they were typed: Backspace and the other keys the prompt binds, and the keys typed after Enter."""
from __future__ import annotations

import pytest
from textual import events
from tui_helpers import ready, wait_for

from engine.fake import Script

pytestmark = pytest.mark.anyio
SIZE = (100, 30)


def _burst(app, keys) -> None:
    """Post keys to the app in one go, as the driver does with one read of the terminal (pilot.press waits
    for each key to be processed, which hides the order problem)."""
    for key in keys:
        char = {"backspace": "\x7f", "enter": "\r"}.get(key, key if len(key) == 1 else None)
        app.post_message(events.Key(key, char))


async def test_backspace_in_a_burst_deletes_what_was_typed_before_it(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        prompt = app.query_one("#prompt")
        _burst(app, [*"hello", "backspace", "backspace", "p"])
        await wait_for(pilot, lambda: len(prompt.text) >= 4)
        await pilot.pause(0.2)
        assert prompt.text == "help"  # Textual's own path gave "hell": the Backspaces landed after the "p"
        # the other keys the prompt binds too: the cursor moves before the letters after it are typed
        prompt.load_text("")
        _burst(app, [*"ac", "left", "b", "delete"])
        await wait_for(pilot, lambda: "b" in prompt.text)
        await pilot.pause(0.2)
        assert prompt.text == "ab"


async def test_keys_typed_after_enter_stay_in_the_prompt(make_app):
    app = make_app(Script(answer="ok"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        prompt = app.query_one("#prompt")
        _burst(app, [*"hi", "enter", *"next"])
        await wait_for(pilot, lambda: app.chat.path and app.chat.path[-1].role == "assistant")
        assert app.chat.path[0].content == "hi"
        assert prompt.text == "next"  # they were wiped with the sent prompt


async def test_a_remapped_prompt_key_acts_in_order_too(make_app, tmp_path):
    """The prompt's bindings are read with the keymap applied (Textual's binding ids)."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.update_keymap({"history_prev": "ctrl+up"})
        prompt = app.query_one("#prompt")
        await pilot.press(*"old", "enter")
        await wait_for(pilot, lambda: not app.generating and app.chat.path and app.chat.path[-1].role == "assistant")
        _burst(app, ["ctrl+up", *"!"])  # the last prompt recalled, then "!" after it
        await wait_for(pilot, lambda: "!" in prompt.text)
        await pilot.pause(0.2)
        assert prompt.text == "old!"
