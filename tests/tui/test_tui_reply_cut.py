"""A reply cut inside a character (issue 48 item 2), as each front end shows and keeps it: `ninfer`'s stdout,
`ninfer-chat --plain`'s stdout and the transcript it saves. The engine drops the cut character
(engine/reply_text.py; tests/engine/test_generate.py checks the events); these check that no front end makes
its own U+FFFD from the tokens."""
from __future__ import annotations

import io

from engine.api import Engine
from engine.config import EngineArgs
from engine.fake import FakeModel, FakeTokenizer, fake_engine, script_policy
from engine.oneshot import main as ninfer
from ninfer_tui.plain import PlainChat
from ninfer_tui.settings import ChatSettings
from ninfer_tui.store import Store

SMILE = "ab🙂🙂"  # the fake tokenizer spells 🙂 as 4 byte tokens: max_new 4 cuts it after 2 bytes


def test_ninfer_prints_no_cut_character(capsys):
    def factory(eargs, config_model, progress):
        tok = FakeTokenizer()
        return Engine.from_parts(FakeModel(tok, script_policy(SMILE)), tok, eargs, name="fake")
    assert ninfer(["--prompt", "hi", "--greedy", "--max-new", "4"], factory) == 0
    out, err = capsys.readouterr()
    assert out == "ab\n" and "finish length" in err


def test_plain_shows_and_saves_no_cut_character(tmp_path):
    settings = ChatSettings.from_config({"sampling": {"temperature": 0.0, "max_new": 4}})
    out, err = io.StringIO(), io.StringIO()
    store = Store(tmp_path / "t.db")
    chat = PlainChat(fake_engine(script_policy(SMILE), args=EngineArgs(max_context=256)), settings, "fake",
                     store, out=out, err=err)
    final = chat.ask("hi")
    assert final.finish_reason == "length" and out.getvalue() == "ab\n"
    conv = store.list_conversations()[0]
    assert [m.content for m in store.branch(conv.id)] == ["hi", "ab"]
