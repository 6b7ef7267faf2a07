"""Pilot tests of the keys (spec/penalties/thinking/budget/new/export/settings/help/transcripts, remapping)
and of the live stats panel."""
from __future__ import annotations

import tomllib

import pytest
from textual.widgets import DataTable, Digits, Input, Label

from engine import paths
from engine.fake import Script
from ninfer_tui.screens import ConfirmScreen, HelpScreen, SettingsScreen, TranscriptsScreen
from ninfer_tui.telemetry import GpuSample
from ninfer_tui.widgets.stats import StatsPanel

from tui_helpers import ready, send, wait_for

pytestmark = pytest.mark.anyio
SIZE = (120, 40)


def panel_text(app, wid: str) -> str:
    return str(app.query_one(StatsPanel).query_one(f"#{wid}").render())


async def test_spec_cycle_skips_unavailable_and_applies_next_reply(make_app):
    app = make_app(Script(answer="x y z"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert "unavailable   mtp, dflash" in panel_text(app, "spec")  # F2 says why (below)
        await send(pilot, "a")
        assert "acceptance         off" in panel_text(app, "spec")  # spec off: "off", not numbers
        await pilot.press("f2")
        assert app.settings.spec == "ngram" and "next: ngram" in panel_text(app, "spec")
        await send(pilot, "b")
        assert app.made["engine"].requests[-1].spec == "ngram"
        spec = panel_text(app, "spec")
        assert "last reply    ngram" in spec and "acceptance" in spec and "33%" in spec  # fake: 1 of 3
        await pilot.press("f2")  # mtp and dflash unavailable -> back to off, reasons shown
        assert app.settings.spec == "off"
        assert any("no MTP head" in n.message for n in app._notifications)


async def test_penalties_thinking_budget_keys(make_app):
    app = make_app(Script(answer="ok"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f3")
        assert app.settings.penalties_on and "penalties     on" in panel_text(app, "sampling")
        await send(pilot, "a")
        s = app.made["engine"].requests[-1].sampling
        assert (s.presence_penalty, s.frequency_penalty) == (app.settings.presence, app.settings.frequency) != (0, 0)
        await pilot.press("f3")
        await send(pilot, "b")
        s = app.made["engine"].requests[-1].sampling
        assert (s.presence_penalty, s.frequency_penalty) == (0.0, 0.0)
        await pilot.press("f4")  # auto on a model without native thinking did not think: now it does
        assert app.settings.thinking == "on" and "THINKING      on (prompted)" in panel_text(app, "thinking")
        await pilot.press("f4")
        assert app.settings.thinking == "off" and "THINKING      off" in panel_text(app, "thinking")
        await pilot.press("f6", "f6")
        assert app.settings.budget == 2 * app.settings.budget_step and app.settings.thinking == "on"
        thinking = panel_text(app, "thinking")  # the last reply ran without a budget; the next one has it
        assert "reasoning     0/unlimited tok" in thinking and f"next budget   {app.settings.budget}" in thinking
        await pilot.press("f5")
        await send(pilot, "c")
        t = app.made["engine"].requests[-1].thinking
        assert t.enabled is True and t.budget == app.settings.budget_step


@pytest.mark.parametrize("native", [False, True])
async def test_first_thinking_press_changes_what_the_model_does(make_app, native):
    """F4 went auto -> off first, which changed nothing on a model without native thinking (auto does not
    think there): the first press now turns to the opposite of what auto does, and the panel shows what the
    next reply will do, not only the setting."""
    app = make_app(Script(answer="ok", reasoning="hmm ", native_thinking=native))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        before = "on (auto)" if native else "off (auto)"
        assert f"THINKING      {before}" in panel_text(app, "thinking")
        await pilot.press("f4")
        await send(pilot, "a")
        thinks = app.made["engine"].requests[-1].thinking.enabled
        assert thinks is (not native)
        assert bool(app.chat.path[-1].reasoning) is (not native)  # the reply did change
        after = "off" if native else "on (prompted)"
        assert panel_text(app, "thinking").splitlines()[0] == f"THINKING      {after}"
        assert any(n.message.startswith(f"thinking {after}") for n in app._notifications)


def _keymap_app(make_app, keymap_toml: str):
    """An app over a user config holding this [keymap] section."""
    cfg = paths.user_config_path()
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text("[keymap]\n" + keymap_toml)
    return make_app(Script(answer="ok"))


async def test_keymap_from_config_remaps(make_app, tmp_path):
    app = _keymap_app(make_app, 'spec_cycle = "ctrl+g"\n')
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f2")
        assert app.settings.spec == "off"  # the old key no longer cycles
        await pilot.press("ctrl+g")
        assert app.settings.spec == "ngram"


async def test_keymap_clash_and_broken_key_are_warned(make_app):
    """A key bound to two actions and a key that is not one: a warning each at start, the chat runs."""
    from ninfer_tui.app import keymap_problems
    assert keymap_problems({}) == []
    assert keymap_problems({"spec_cycle": "ctrl+g", "regenerate": "f2"}) == []  # f2 was freed first
    app = _keymap_app(make_app, 'regenerate = "f2"\nquit = "ctrl+"\n')
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        warned = [n.message for n in app._notifications if n.message.startswith("keymap:")]
        assert sorted(warned) == sorted(["keymap: f2 is bound to both regenerate and spec_cycle; give one of them "
                                         "another key",
                                         "keymap: quit = 'ctrl+' is not a key list (e.g. \"ctrl+r\" or \"f2,ctrl+k\")"])
        await send(pilot, "still chatting")
        assert app.chat.path[-1].content == "ok"


async def test_live_panel_values(make_app):
    app = make_app(Script(answer="one two three four five", hold_after=3))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert "context cap   2048" in panel_text(app, "engine")
        await send(pilot, "go", wait=False)
        await wait_for(pilot, lambda: "tokens out           3" in panel_text(app, "reply"))
        live = panel_text(app, "reply")
        assert "(live)" in live
        assert "TTFT" in live and " ms" in live and "prefill" in live and "tokens in" in live  # not "...": known
        app.made["engine"].script.release.set()
        await wait_for(pilot, lambda: not app.generating)
        reply = panel_text(app, "reply")
        final = app.last_final
        assert f"tokens out    {final.output_tokens:8d}" in reply and "TTFT" in reply and "prefill" in reply
        assert f"{final.prompt_tokens + final.output_tokens}/2048" in reply
        assert str(app.query_one("#tps", Digits).value) == f"{final.decode_tok_s:.1f}"
        assert len(app.query_one("#spark").data) >= 1  # stats messages replace each other: >= 1 point


async def test_gpu_states(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert "no GPU" in panel_text(app, "gpu")
        s = GpuSample(0, "H200", 1500, 1980, 300.0, 700.0, 50, 10.0, 141.0, 90, ["sw-power"])
        app.query_one(StatsPanel).on_gpu([s], "")
        text = panel_text(app, "gpu")
        assert "SM clock 1500/1980 MHz" in text and "power 300/700 W" in text and "sw-power" in text


async def test_panel_updates_after_its_children_are_gone(make_app):
    """At shutdown Textual removes the panel's children first; a telemetry tick or an engine event that
    arrives in between must not raise (CI once failed on exactly that)."""
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        panel = app.query_one(StatsPanel)
        await panel.remove_children()
        app._poll_gpu()
        panel.start_reply()
        panel.on_final(None)


async def test_export_writes_file(make_app, tmp_path):
    app = make_app(Script(answer="exported answer"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "export me")
        await pilot.press("ctrl+s")
        files = list((tmp_path / "data" / "exports").glob("*.md"))
        assert len(files) == 1
        text = files[0].read_text()
        assert text.startswith("---\n") and "model: \"fake-model\"" in text and "exported answer" in text


async def test_settings_screen_saves_user_config(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f9")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#set-temperature", Input).value = "0.25"
        app.screen.query_one("#set-theme").value = "ninfer-light"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        assert app.settings.temperature == 0.25 and app.theme == "ninfer-light"
        saved = tomllib.loads(paths.user_config_path().read_text())
        assert saved["sampling"]["temperature"] == 0.25 and saved["ui"]["theme"] == "ninfer-light"
        # an invalid value keeps the screen open with a message
        await pilot.press("f9")
        app.screen.query_one("#set-top_p", Input).value = "7"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen)
        assert '"top p" must be in' in str(app.screen.query_one("#settings-error").render())  # the field
        assert any("not saved:" in n.message and '"top p"' in n.message for n in app._notifications), \
            [n.message for n in app._notifications]  # seen on any screen size
        # text that looks like markup is shown as typed, not parsed (a stray closing tag used to raise)
        app.screen.query_one("#set-top_p", Input).value = "[/b]0.5[x]"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen) and app.is_running
        assert "'[/b]0.5[x]' is not a valid float" in str(app.screen.query_one("#settings-error").render())


async def test_help_lists_bindings(make_app):
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        ids = [r[1] for r in app.screen.rows]
        for bid in ("spec_cycle", "penalties", "thinking", "budget_up", "budget_down", "new_chat",
                    "transcripts", "export", "settings", "help", "quit", "stop", "regenerate", "send",
                    "edit_prompt", "copy_message", "copy_code"):
            assert bid in ids
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_status_line_names_the_remapped_help_key(make_app):
    app = _keymap_app(make_app, 'help = "f12"\n')
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        status = str(app.query_one("#status").render())
        assert "F12 help" in status and "F1 help" not in status


async def test_every_action_has_binding_id_and_palette_entry(make_app):
    from ninfer_tui.app import ACTIONS
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        ids = {b.id for b in app.BINDINGS}
        titles = {c.title for c in app.get_system_commands(app.screen)}
        for bid, _, label, _, _ in ACTIONS:
            assert bid in ids and label in titles


async def test_transcripts_browser_open_rename_delete(make_app):
    app = make_app(Script(answer=lambda m: "reply to " + m[-1]["content"]))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "apples")
        first = app.chat.conv_id
        await pilot.press("ctrl+n")
        await send(pilot, "bananas")
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, TranscriptsScreen)
        table = app.screen.query_one(DataTable)
        assert table.row_count == 2
        app.screen.query_one("#search", Input).value = "apples"
        await pilot.pause()
        assert table.row_count == 1
        table.focus()
        await pilot.press("ctrl+r")
        app.screen.query_one("#answer", Input).value = "Fruit talk"
        await pilot.press("enter")
        await pilot.pause()
        assert app.store.conversation(first).title == "Fruit talk"
        await pilot.press("enter")  # open
        await wait_for(pilot, lambda: app.chat.conv_id == first)
        assert [m.content for m in app.chat.path] == ["apples", "reply to apples"]
        await send(pilot, "more")  # continue the opened chat
        assert app.store.conversation(first).n_messages == 4
        await pilot.press("ctrl+o")
        app.screen.query_one(DataTable).focus()
        await pilot.press("delete")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert len(app.store.list_conversations()) == 2
        app.store.db.execute("PRAGMA query_only = ON")  # the database refuses writes (a full disk, read-only)
        await pilot.press("delete")
        await pilot.press("y")
        await pilot.pause()
        assert isinstance(app.screen, TranscriptsScreen) and len(app.store.list_conversations()) == 2
        assert any(n.message.startswith("not deleted: cannot save") for n in app._notifications)
        app.store.db.execute("PRAGMA query_only = OFF")
        await pilot.press("delete")
        await pilot.press("y")
        await pilot.pause()
        assert len(app.store.list_conversations()) == 1


async def test_a_title_that_looks_like_markup_is_shown_as_typed(make_app):
    """A first prompt about markup ("[/b]") becomes a title the transcripts table, the delete question and the
    rename prompt show as typed (a str cell or Label parses markup: the stray closing tag raised)."""
    app = make_app(Script(answer="ok"))
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "what does [/b] close in [b]BBCode[/b]?")
        await pilot.press("ctrl+o")
        table = app.screen.query_one(DataTable)
        assert str(table.get_row_at(0)[1]) == "what does [/b] close in [b]BBCode[/b]?"
        table.focus()
        await pilot.press("delete")
        assert isinstance(app.screen, ConfirmScreen)
        assert "[/b] close in [b]BBCode[/b]" in str(app.screen.query_one(Label).render())
        await pilot.press("n")
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert app.is_running and app.screen.query_one(Input).value.startswith("what does [/b]")


async def test_reply_is_saved_when_the_panel_is_already_gone(make_app):
    """A reply that ends while the screen is being torn down (the stats panel already removed) is still
    stored: the panel update is skipped, not raised before the save."""
    script = Script(answer="one two three four", hold_after=2)
    app = make_app(script)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "go", wait=False)
        await wait_for(pilot, lambda: app.query(StatsPanel) and app.reply_view is not None
                       and app.reply_view.text == "one two ")
        await app.query_one(StatsPanel).remove()
        script.release.set()
        await wait_for(pilot, lambda: not app.generating)
        saved = app.chat.path[-1]
        assert saved.role == "assistant" and saved.content == "one two three four"
