"""Settings and config write-back, themes as data, plain mode (piped stdin, slash-commands), and the
transcript commands that work without the TUI (--list, --export, --import)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from engine import paths
from engine.config import EngineArgs
from engine.errors import ConfigError
from ninfer_tui.__main__ import main
from engine.fake import Script, ScriptedEngine
from ninfer_tui.plain import PlainChat
from ninfer_tui.settings import ChatSettings, save_user_settings
from ninfer_tui.store import Store
from ninfer_tui.themes import BUILTIN_THEMES, load_themes

ROOT = Path(__file__).resolve().parents[2]


def test_repo_config_defaults_parse_and_build_a_request():
    s = ChatSettings.from_config(paths.load_config())
    r = s.request()
    assert r.spec == "off" and r.sampling.presence_penalty == 0.0 and r.thinking.budget is None
    assert {"send", "stop", "spec_cycle", "penalties", "thinking", "budget_up", "budget_down", "new_chat",
            "transcripts", "export", "settings", "help", "quit"} <= set(s.keymap)


def test_settings_toggles():
    s = ChatSettings.from_config({})
    assert s.next_spec({"off": None, "ngram": None, "mtp": "no head", "dflash": "no drafter"}) == ("ngram", [])
    mode, skipped = s.next_spec({"off": None, "ngram": None, "mtp": "no head", "dflash": "no drafter"})
    assert mode == "off" and skipped == ["mtp: no head", "dflash: no drafter"]
    s.toggle_penalties()
    assert s.request().sampling.frequency_penalty == s.frequency
    s.change_budget(1)
    assert s.request().thinking.budget == s.budget_step and s.request().thinking.enabled is True
    s.change_budget(-5)
    assert s.request().thinking.budget is None


def test_bad_config_value_is_one_clear_error():
    with pytest.raises(ConfigError, match="temperature"):
        ChatSettings.from_config({"sampling": {"temperature": "hot"}})
    with pytest.raises(ConfigError, match="spec mode 'fast'"):
        ChatSettings.from_config({"spec": {"mode": "fast"}})
    with pytest.raises(ConfigError, match="--draft-tokens must be 1..15, got 40"):  # a reply's verify pass
        ChatSettings.from_config({"spec": {"mode": "ngram", "draft_tokens": 40}})


def test_save_user_settings_merges_and_reloads():
    p = paths.user_config_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text('model = "/x.gguf"\n[keymap]\nquit = "ctrl+x"\n')
    s = ChatSettings.from_config(paths.load_config())
    s.temperature, s.spec, s.penalties_on = 0.3, "ngram", True
    save_user_settings(s)
    data = tomllib.loads(p.read_text())
    assert data["model"] == "/x.gguf" and data["keymap"]["quit"] == "ctrl+x"  # their keys kept
    again = ChatSettings.from_config(paths.load_config())
    assert (again.temperature, again.spec, again.penalties_on) == (0.3, "ngram", True)


def test_themes_load_as_data_and_bad_files_warn(tmp_path):
    themes, warnings = load_themes()
    names = {t.name for t in themes}
    assert {"ninfer-dark", "ninfer-light", "ninfer-high-contrast"} <= names and not warnings
    assert len(list(BUILTIN_THEMES.glob("*.toml"))) >= 3
    user = paths.user_config_dir() / "themes"
    user.mkdir(parents=True)
    (user / "mine.toml").write_text('name = "mine"\nprimary = "#ff0000"\ndark = false\n')
    (user / "broken.toml").write_text('name = "broken"\nprimary = "not a color"\n')
    themes, warnings = load_themes()
    assert "mine" in {t.name for t in themes}
    assert len(warnings) == 1 and "broken.toml" in warnings[0]


def _plain(script: Script, store=None) -> tuple[PlainChat, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    eng = ScriptedEngine(EngineArgs(), script)
    return PlainChat(eng, ChatSettings.from_config({}), "fake", store, out=out, err=err, spec_modes=eng.spec_modes()), out, err


def test_plain_commands_and_reply(tmp_path):
    chat, out, err = _plain(Script(answer="the answer", reasoning="hmm hmm hmm hmm "), Store(tmp_path / "t.db"))
    chat.command("/spec")
    chat.command("/spec mtp")
    chat.command("/penalties")
    chat.command("/budget 2")
    assert chat.settings.spec == "ngram" and chat.settings.penalties_on and chat.settings.budget == 2
    assert "unavailable (no MTP head" in err.getvalue()
    final = chat.ask("hello")
    assert out.getvalue() == "the answer\n"
    assert "hmm hmm" in err.getvalue() and "budget of 2 reasoning tokens reached" in err.getvalue()
    assert final.thinking_forced and chat.chat.path[-1].reasoning_forced
    chat.command("/regen")
    assert len(chat.store.siblings(chat.chat.path[-1].id)) == 2
    chat.command("/export json")
    assert "exported to" in err.getvalue()
    chat.command("/nope")
    assert "unknown command /nope" in err.getvalue()
    for bad in ("/budget -5", "/budget x"):  # -5 used to mean unlimited in silence
        chat.command(bad)
        assert err.getvalue().rstrip().endswith("is not a number >= 0 (0 = unlimited; + or - to step)")
    assert chat.settings.budget == 2
    chat.command("/quit")
    assert chat.quit


def test_config_typo_is_one_line_before_the_chat_starts(tmp_path, capsys):
    """ninfer-chat reads config files through the same check as ninfer (engine.paths.check_config)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text("[ui]\nshow_stat = false\n", encoding="utf-8")
    assert main(["--fake", "--plain", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key [ui] show_stat (did you mean show_stats?)" in err, err


def test_plain_mode_goes_on_when_the_disk_fills(tmp_path):
    """A full disk midway (SQLite's max_page_count): one error line, then the chat goes on in memory."""
    st = Store(tmp_path / "t.db")
    chat, out, err = _plain(Script(answer="the answer " * 300), st)
    chat.ask("first")
    st.db.execute(f"PRAGMA max_page_count = {st.db.execute('PRAGMA page_count').fetchone()[0]}")
    chat.ask("second " * 500)
    chat.ask("third")
    assert err.getvalue().count("this conversation goes on unsaved") == 1
    assert [m.role for m in chat.chat.path] == ["user", "assistant"] * 3
    assert out.getvalue().count("\n") == 3 and out.getvalue().startswith("the answer")  # three replies shown
    assert st.list_conversations()[0].n_messages == 2


def test_plain_piped_stdin_that_is_not_utf8_is_one_line():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "ninfer_tui", "--plain", "--fake", "--fake-delay", "0"],
                       input=b"hello \xff\xfe world\n", capture_output=True, timeout=60, cwd=ROOT, env=env)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ("ninfer-chat: stdin is not valid UTF-8 (byte 0xff at offset 6); "
                                            "pipe UTF-8 text")


def test_plain_piped_stdin_answers_one_prompt():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "ninfer_tui", "--plain", "--fake", "--fake-delay", "0"],
                       input="What is up?\n", capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    assert "Here is a short answer to **What is up?**" in r.stdout
    assert "tok/s" in r.stderr  # the stats line goes to stderr, keeping stdout the answer only


def test_list_export_import_without_tui(tmp_path, capsys):
    st = Store()
    c = st.new_conversation("Saved chat", "m.gguf")
    u = st.add_message(c, "user", "q?")
    st.add_message(c, "assistant", "a!", u, stats={"finish_reason": "stop"})
    st.close()
    assert main(["--list"]) == 0
    assert "Saved chat" in capsys.readouterr().out
    assert main(["--export", str(c)]) == 0
    md = capsys.readouterr().out
    assert md.startswith("---\n") and "## User" in md and "a!" in md
    out = tmp_path / "c.json"
    assert main(["--export", str(c), "--format", "json", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["title"] == "Saved chat"
    assert main(["--import", str(out)]) == 0
    assert "imported as conversation" in capsys.readouterr().out
    assert main(["--export", "999"]) == 2
    assert "no conversation with id 999" in capsys.readouterr().err


def test_import_and_export_errors_are_one_line(tmp_path, capsys):
    """A binary or missing file to import, an export path that cannot be written: one line each, saying what
    to do, and nothing is added to or taken from the store."""
    st = Store()
    c = st.new_conversation("Kept", "m.gguf")
    st.add_message(c, "user", "q?")
    st.close()
    (tmp_path / "model.gguf").write_bytes(b"GGUF\x03\x00\xff\xfe" * 50)
    for args, want in ((["--import", str(tmp_path / "model.gguf")], "is not UTF-8 text"),
                       (["--import", str(tmp_path / "missing.json")], "cannot read"),
                       (["--export", str(c), "-o", str(tmp_path / "no" / "dir" / "c.md")], "cannot write")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and want in err, err
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert "Kept" in out and out.count("\n") == 1


def test_corrupt_db_cli_message(capsys):
    p = paths.user_data_dir() / "transcripts.db"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"garbage" * 100)
    assert main(["--list"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "corrupt" in err
    assert p.read_bytes() == b"garbage" * 100


def test_a_damaged_page_in_the_db_is_one_line_for_list_and_export(capsys):
    """A transcript file with a valid header and a damaged page: --list and --export say so in one line (they
    printed sqlite3's traceback) and leave the file as it was."""
    p = paths.user_data_dir() / "transcripts.db"
    st = Store(p)
    for i in range(40):
        st.add_message(st.new_conversation(f"chat {i}"), "user", "words " * 300)
    st.close()
    data = bytearray(p.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[3 * page:4 * page] = b"\xa5" * page
    p.write_bytes(bytes(data))
    for args in (["--list"], ["--export", "1"]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "corrupt" in err and "move it aside" in err, err
    assert p.read_bytes() == bytes(data)


def test_export_options_without_export_are_a_usage_error(capsys):
    """--format or -o alone used to start the chat, ignoring them."""
    for args in (["--format", "json"], ["-o", "x.md"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2 and "go with --export" in capsys.readouterr().err


def test_engine_flags_the_error_hints_name_are_accepted():
    """The engine's hints ("raise --max-context", "--kv-capacity") name flags ninfer-chat takes too; they
    override the config's [engine] keys."""
    from ninfer_tui.__main__ import build_parser, engine_args_from
    ns = build_parser().parse_args(["--max-context", "8192", "--kv-capacity", "9000", "--kv-dtype", "int8"])
    args = engine_args_from(paths.load_config(), ns)
    assert (args.max_context, args.kv_capacity, args.kv_dtype) == (8192, 9000, "int8")
    args = engine_args_from(paths.load_config(), build_parser().parse_args([]))
    assert (args.max_context, args.kv_capacity, args.kv_dtype) == (None, None, "f16")


def test_plain_failed_prompt_leaves_the_branch_and_an_unsaved_chat_exports(tmp_path):
    """Plain mode: a prompt whose reply fails at once is not kept on the branch (the next one would carry it
    and fail too); /export writes a chat that has no store from memory."""
    from engine.errors import InputError
    script = Script(answer=lambda msgs: "seen: " + " | ".join(m["content"] for m in msgs),
                    fail_with=InputError("the prompt is 9000 tokens but the context is 4096"))
    chat, out, err = _plain(script, None)
    chat.ask("a very long paste")
    assert "context is 4096" in err.getvalue() and "not added to the conversation" in err.getvalue()
    assert chat.chat.path == []
    script.fail_with = None
    chat.ask("short")
    assert [m.content for m in chat.chat.path] == ["short", "seen: short"]
    chat.command("/export md")
    assert "not in the transcripts" in err.getvalue()
    files = list((paths.user_data_dir() / "exports").glob("chat-unsaved-*.md"))
    assert len(files) == 1 and "seen: short" in files[0].read_text()


def _piped(monkeypatch, data: bytes):
    """sys.stdin as a pipe holding `data` (isatty False)."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


@pytest.mark.parametrize("data", [b"", b"  \n\n"])
def test_plain_piped_empty_stdin_says_so_before_loading_the_model(tmp_path, monkeypatch, capsys, data):
    """`ninfer-chat --plain < /dev/null`: one line and status 2, and no model is loaded for it (it used to
    load the model first: seconds, minutes on a cold cache)."""
    import ninfer_tui.__main__ as cli
    loads = []
    monkeypatch.setattr(cli, "real_loader", lambda args, progress=None: loads.append(args) or 1 / 0)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    _piped(monkeypatch, data)
    assert main([str(model), "--plain"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ninfer-chat: no prompt on stdin"), err
    assert loads == []
    _piped(monkeypatch, b"hi \xff")  # not UTF-8: also said before the load
    assert main([str(model), "--plain"]) == 2 and loads == []
    assert "not valid UTF-8" in capsys.readouterr().err


def test_plain_piped_prompts_are_saved_only_when_asked(monkeypatch, capsys):
    """A piped one-shot run stays out of the transcripts list (each used to add a chat to it); --save keeps
    it."""
    def run(*extra, prompt=b"What is up?\n"):
        _piped(monkeypatch, prompt)
        assert main(["--plain", "--fake", "--fake-delay", "0", *extra]) == 0
        assert "Here is a short answer" in capsys.readouterr().out

    def saved():
        db = paths.user_data_dir() / "transcripts.db"
        return [c.title for c in Store(db).list_conversations()] if db.exists() else []
    run()
    run("--no-save", prompt=b"not this one\n")
    assert saved() == []
    run("--save", prompt=b"keep this one\n")
    assert saved() == ["keep this one"]


def test_plain_piped_prompts_are_saved_when_the_config_says_so(monkeypatch, capsys, tmp_path):
    """[ui] save_piped = true keeps piped one-shot runs (config.toml: false); --no-save still wins."""
    config = tmp_path / "extra.toml"
    config.write_text("[ui]\nsave_piped = true\n")
    for extra, prompt in (([], b"kept by the config\n"), (["--no-save"], b"not this one\n")):
        _piped(monkeypatch, prompt)
        assert main(["--plain", "--fake", "--fake-delay", "0", "--config", str(config), *extra]) == 0
        assert "Here is a short answer" in capsys.readouterr().out
    db = paths.user_data_dir() / "transcripts.db"
    assert [c.title for c in Store(db).list_conversations()] == ["kept by the config"]


def test_help_documents_saving():
    from ninfer_tui.__main__ import build_parser
    text = " ".join(build_parser().format_help().split())
    assert "--save, --no-save keep this chat in the transcripts" in text and "saved only with --save" in text


def test_no_save_runs_the_tui_without_transcripts(monkeypatch):
    import ninfer_tui.app as app_mod
    seen = []

    class App:
        def __init__(self, settings, args, loader, store=None, store_error=None, model_name=""):
            seen.append((store, store_error))

        def run(self):
            pass
    monkeypatch.setattr(app_mod, "ChatApp", App)
    assert main(["--fake", "--no-save"]) == 0 and seen.pop() == (None, None)
    assert main(["--fake"]) == 0 and isinstance(seen.pop()[0], Store)
