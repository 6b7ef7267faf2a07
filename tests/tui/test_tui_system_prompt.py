"""A system prompt (persona) per chat: stored with the conversation (an older database is upgraded keeping
everything), sent first to the engine, edited with ctrl+t and on the settings screen (where the one new chats
start with is set too), shown atop the log and in exports, carried into a continued chat, /system in plain
mode."""
from __future__ import annotations

import io
import json
import shutil
import sqlite3
import tomllib

import pytest
from textual.widgets import TextArea
from tui_helpers import ready, send, wait_for

from engine import paths
from engine.config import EngineArgs
from engine.fake import Script, ScriptedEngine
from ninfer_tui.chat import ChatState
from ninfer_tui.export import export_json, export_markdown, import_json
from ninfer_tui.plain import PlainChat
from ninfer_tui.screens import SettingsScreen, SystemPromptScreen
from ninfer_tui.settings import ChatSettings
from ninfer_tui.store import MIGRATIONS, SCHEMA_VERSION, Store

pytestmark = pytest.mark.anyio
SIZE = (110, 40)
PIRATE = "You are a pirate. Answer in one line."


def _seen_system(msgs: list[dict]) -> str:
    """The fake model's answer: the system message it was sent, if any."""
    return "system: " + (msgs[0]["content"] if msgs and msgs[0]["role"] == "system" else "none")


def test_a_version_2_database_is_upgraded_keeping_everything(tmp_path):
    p = tmp_path / "v2.db"
    db = sqlite3.connect(p)
    db.executescript(MIGRATIONS[0] + MIGRATIONS[1] + "\nPRAGMA user_version = 2;")
    db.execute("INSERT INTO conversations(id, title, model, created, updated, leaf_id) VALUES (1, 'old', 'm', 5, 6, 2)")
    db.execute("INSERT INTO messages(id, conversation_id, role, content, created) VALUES (1, 1, 'user', 'zebra', 5)")
    db.execute("INSERT INTO messages(id, conversation_id, parent_id, role, content, created) "
               "VALUES (2, 1, 1, 'assistant', 'stripes', 6)")
    db.commit()
    db.close()
    before = tmp_path / "v2-copy.db"
    shutil.copy(p, before)
    ro = Store(before, readonly=True)  # --list / --export read an old file as it is: no system prompt
    assert ro.version == 2 and [(c.title, c.system_prompt) for c in ro.list_conversations()] == [("old", "")]
    st = Store(p)
    assert st.version == SCHEMA_VERSION
    conv = st.conversation(1)
    assert (conv.title, conv.model, conv.created, conv.updated, conv.leaf_id, conv.system_prompt) == \
        ("old", "m", 5, 6, 2, "")
    assert [m.content for m in st.branch(1)] == ["zebra", "stripes"]
    assert [c.id for c in st.list_conversations("zebra")] == [1]  # the search index is still there
    st.set_system_prompt(1, PIRATE)
    st.close()
    assert Store(p).conversation(1).system_prompt == PIRATE


def test_the_chat_state_sends_stores_carries_and_exports_it(tmp_path):
    st = Store(tmp_path / "t.db")
    chat = ChatState(st, "m", default_system=PIRATE)
    assert chat.engine_messages() == [{"role": "system", "content": PIRATE}]
    chat.add_user("hi")
    chat.add_reply("arr", "", False, {}, None, "stop")
    assert st.conversation(chat.conv_id).system_prompt == PIRATE
    assert chat.engine_messages()[0] == {"role": "system", "content": PIRATE} and len(chat.engine_messages()) == 3
    md = export_markdown(st, chat.conv_id)
    assert f"system_prompt: {json.dumps(PIRATE)}" in md and f"## System\n\n{PIRATE}\n" in md
    doc = export_json(st, chat.conv_id)
    assert json.loads(doc)["system_prompt"] == PIRATE
    assert st.conversation(import_json(st, doc)).system_prompt == PIRATE
    legacy = json.loads(doc)
    del legacy["system_prompt"]  # a file exported before it existed imports with none
    assert st.conversation(import_json(st, json.dumps(legacy))).system_prompt == ""
    chat.carry_over(chat.path[-2:], "continued")
    assert chat.system_prompt == PIRATE and st.conversation(chat.conv_id).system_prompt == PIRATE
    chat.set_system_prompt("  ")
    assert chat.engine_messages()[0]["role"] == "user" and st.conversation(chat.conv_id).system_prompt == ""
    chat.new()
    assert chat.system_prompt == PIRATE  # a new chat starts with the default again
    unsaved = ChatState(None, "m")
    unsaved.set_system_prompt(PIRATE)
    unsaved.add_user("hi")
    out, in_memory = unsaved.export("md", tmp_path / "exports")  # not in the store: the branch as shown
    assert in_memory and f"## System\n\n{PIRATE}" in out.read_text()


async def test_ctrl_t_sets_the_chats_system_prompt_and_the_engine_gets_it(make_app):
    app = make_app(Script(answer=_seen_system))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "first")
        assert app.chat.path[-1].content == "system: none"
        await pilot.press("ctrl+t")
        await wait_for(pilot, lambda: isinstance(app.screen, SystemPromptScreen))
        app.screen.query_one("#system-text", TextArea).load_text(PIRATE)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.chat.system_prompt == PIRATE)
        await wait_for(pilot, lambda: bool(app.query("#system-note")))
        assert PIRATE in str(app.query_one("#system-note").render())
        await send(pilot, "second")
        assert app.chat.path[-1].content == f"system: {PIRATE}"
        conv_id = app.chat.conv_id
        assert app.store.conversation(conv_id).system_prompt == PIRATE
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.chat.conv_id is None)
        assert app.chat.system_prompt == "" and not app.query("#system-note")
        await app.open_chat(conv_id)  # reopened: the chat's own system prompt again
        await pilot.pause()
        assert app.chat.system_prompt == PIRATE and app.query("#system-note")
        await send(pilot, "third")
        assert app.chat.path[-1].content == f"system: {PIRATE}"


async def test_the_settings_screen_edits_this_chats_and_new_chats_system_prompt(make_app):
    app = make_app(Script(answer=_seen_system))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f9")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        app.screen.query_one("#set-chat_system", TextArea).load_text("Be brief.")
        app.screen.query_one("#set-system_prompt", TextArea).load_text(PIRATE)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.chat.system_prompt == "Be brief.")
        saved = tomllib.loads(paths.user_config_path().read_text())
        assert saved["ui"]["system_prompt"] == PIRATE and app.settings.system_prompt == PIRATE
        await send(pilot, "q")
        assert app.chat.path[-1].content == "system: Be brief."
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: app.chat.conv_id is None)
        assert PIRATE in str(app.query_one("#system-note").render())
        await send(pilot, "q")
        assert app.chat.path[-1].content == f"system: {PIRATE}"  # new chats start with the configured one


def test_plain_mode_system_command(tmp_path):
    out, err = io.StringIO(), io.StringIO()
    eng = ScriptedEngine(EngineArgs(), Script(answer=_seen_system))
    st = Store(tmp_path / "t.db")
    chat = PlainChat(eng, ChatSettings.from_config({}), "fake", st, out=out, err=err, spec_modes=eng.spec_modes())
    chat.command(f"/system {PIRATE}")
    assert f"system prompt: {PIRATE}" in err.getvalue()
    chat.ask("hi")
    assert f"system: {PIRATE}" in out.getvalue()
    assert st.conversation(chat.chat.conv_id).system_prompt == PIRATE
    chat.command("/system clear")
    assert err.getvalue().rstrip().endswith("no system prompt") and chat.chat.system_prompt == ""
