"""Pilot tests of a chat that outgrew the context (issue 48, item 3): the chat offers to continue in a new
one carrying the last turns that fit, and says so; the context size changes in the settings without a
restart (a new KV cache where it must grow)."""
from __future__ import annotations

import tomllib

import pytest
from textual.widgets import Input

from engine import paths
from engine.config import EngineArgs
from engine.fake import fake_engine, script_policy
from ninfer_tui.screens import ConfirmScreen, SettingsScreen

from tui_helpers import ready, send, wait_for

pytestmark = pytest.mark.anyio
SIZE = (120, 40)
PROMPTS = ["a" * 70, "b" * 70, "c" * 70]  # ~78 tokens each in the fake tokenizer: the third overflows 256


def loader(made, **args):
    def load(engine_args, progress=None):
        made["engine"] = fake_engine(script_policy("Short answer here."), args=EngineArgs(**args))
        return made["engine"]
    return load


async def _overflowing(pilot):
    """Two turns, then a third prompt that does not fit: the question is open."""
    app = pilot.app
    await ready(pilot)
    await send(pilot, PROMPTS[0])
    await send(pilot, PROMPTS[1])
    await send(pilot, PROMPTS[2])
    await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
    return app.chat.conv_id


async def test_a_chat_that_outgrew_the_context_continues_in_a_new_one(make_app):
    """A full context was a dead end: every prompt failed with "raise --max-context"."""
    made = {}
    app = make_app(loader=loader(made, max_context=256))
    async with app.run_test(size=SIZE) as pilot:
        old = await _overflowing(pilot)
        question = str(app.screen.query_one("Label").render())
        assert "more than the context of 256" in question and "new chat" in question
        await pilot.press("y")
        await wait_for(pilot, lambda: app.chat.conv_id != old and not app.generating
                       and app.chat.path and app.chat.path[-1].role == "assistant")
        assert [m.content for m in app.chat.path] == [PROMPTS[1], "Short answer here.", PROMPTS[2],
                                                      "Short answer here."]
        note = str(app.query_one("#carried").render())
        assert "the last 1 of 2 turns came along" in note and f"chat #{old}" in note
        assert app.store.conversation(app.chat.conv_id).title.endswith("(continued)")
        assert [m.content for m in app.store.branch(old)][::2] == PROMPTS[:2]  # the old chat is as it was
        assert not any("--max-context" in n.message for n in app._notifications)


async def test_no_keeps_the_chat_and_the_prompt(make_app):
    made = {}
    app = make_app(loader=loader(made, max_context=256))
    async with app.run_test(size=SIZE) as pilot:
        old = await _overflowing(pilot)
        await pilot.press("n")
        await pilot.pause()
        assert app.chat.conv_id == old and app.query_one("#prompt").text == PROMPTS[2]
        assert len(app.chat.path) == 4


async def test_a_prompt_too_long_on_its_own_is_said_without_the_offer(make_app):
    made = {}
    app = make_app(loader=loader(made, max_context=256))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "x" * 300)
        await wait_for(pilot, lambda: any("prompt alone does not fit" in n.message for n in app._notifications))
        assert not isinstance(app.screen, ConfirmScreen) and app.query_one("#prompt").text == "x" * 300


async def test_the_context_size_grows_in_the_settings_without_a_restart(make_app):
    made = {}
    app = make_app(loader=loader(made, max_context=256))
    async with app.run_test(size=SIZE) as pilot:
        old = await _overflowing(pilot)
        await pilot.press("n")
        session = app.session
        await pilot.press("f9")
        assert isinstance(app.screen, SettingsScreen)
        field = app.screen.query_one("#set-max_context", Input)
        assert field.value == "256"
        field.value = "1024"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        engine = made["engine"]
        assert (engine.max_context, engine.capacity) == (1024, 1024)
        assert app.session is not session and app.session.cache.capacity == 1024  # a cache that holds it
        app.query_one("#prompt").focus()
        await pilot.press("enter")  # the prompt left in the input now fits, in the same chat
        await wait_for(pilot, lambda: not app.generating and len(app.chat.path) == 6)
        assert app.chat.conv_id == old and app.chat.path[-2].content == PROMPTS[2]
        saved = tomllib.loads(paths.user_config_path().read_text())
        assert saved["engine"]["max_context"] == 1024


async def test_a_context_size_within_the_kv_capacity_keeps_the_session(make_app):
    made = {}
    app = make_app(loader=loader(made, max_context=128, kv_capacity=512))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hi")
        session = app.session
        await pilot.press("f9")
        app.screen.query_one("#set-max_context", Input).value = "400"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: made["engine"].max_context == 400)
        assert app.session is session and made["engine"].capacity == 512
        await send(pilot, "again")
        assert app.last_final.cached_prompt_tokens > 0  # the cache and its tokens were kept


async def test_settings_saved_without_touching_the_context_size_do_not_write_it(make_app):
    made = {}
    app = make_app(loader=loader(made, max_context=256))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f9")
        app.screen.query_one("#set-temperature", Input).value = "0.3"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        assert "engine" not in tomllib.loads(paths.user_config_path().read_text())
        assert made["engine"].max_context == 256


async def test_a_context_size_whose_cache_cannot_be_allocated_changes_nothing(make_app):
    from engine.errors import ConfigError
    made = {}
    app = make_app(loader=loader(made, max_context=256))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        session, engine = app.session, made["engine"]

        def no_room():
            raise ConfigError("a KV cache of 100000 positions cannot be allocated here; lower --kv-capacity or "
                              "--max-context")
        engine.session = no_room
        await pilot.press("f9")
        app.screen.query_one("#set-max_context", Input).value = "100000"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: any("context size not changed" in n.message for n in app._notifications))
        assert (engine.max_context, engine.capacity) == (256, 256) and app.session is session
        error = next(n.message for n in app._notifications if "context size not changed" in n.message)
        assert '"context size"' in error and "--max-context" not in error
        await send(pilot, "still works")
        assert app.chat.path[-1].role == "assistant"


@pytest.mark.parametrize("context,warned", [(256, True), (1024, False)])
async def test_a_nearly_full_context_is_said_before_the_dead_end(make_app, context, warned):
    made = {}
    app = make_app(loader=loader(made, max_context=context))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, PROMPTS[0])
        assert not any("nearly full" in n.message for n in app._notifications)
        await send(pilot, PROMPTS[1])  # ~200 tokens used: less than a reply's room (64) is left of 256
        assert any(f"nearly full ({app.last_final.prompt_tokens + app.last_final.output_tokens} of {context}"
                   in n.message for n in app._notifications) is warned
