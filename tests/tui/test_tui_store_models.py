"""Store schema 4: the model file each reply came from (name, path, size, mtime, sha256). A version-3 file is
upgraded keeping everything and opens read-only as it is; exports carry the models and an import restores
them."""
from __future__ import annotations

import json
import sqlite3

from ninfer_tui.chat import ChatState
from ninfer_tui.export import export_json, export_markdown, import_json
from ninfer_tui.store import MIGRATIONS, Store


def _v3_file(path):
    db = sqlite3.connect(path)
    db.executescript("".join(MIGRATIONS[:3]) + "\nPRAGMA user_version = 3;")
    db.execute("INSERT INTO conversations(id, title, model, created, updated, system_prompt) "
               "VALUES (1, 'old chat', 'smol.gguf', 0, 0, 'be brief')")
    db.execute("INSERT INTO messages(id, conversation_id, role, content, created) VALUES (1, 1, 'user', 'hi', 0)")
    db.execute("INSERT INTO messages(id, conversation_id, parent_id, role, content, created) "
               "VALUES (2, 1, 1, 'assistant', 'hello', 0)")
    db.execute("UPDATE conversations SET leaf_id=2")
    db.commit()
    db.close()


def test_a_version_3_file_opens_read_only_as_it_is_and_upgrades_keeping_everything(tmp_path):
    p = tmp_path / "v3.db"
    _v3_file(p)
    ro = Store(p, readonly=True)  # --list / --export on an old file: nothing written, nothing missing
    c = ro.conversation(1)
    assert (c.title, c.model, c.model_path, c.model_sha256, c.n_messages) == ("old chat", "smol.gguf", "", "", 2)
    assert [m.model_id for m in ro.branch(1)] == [None, None] and ro.models(1) == {}
    assert "model_file" not in export_markdown(ro, 1) and ro.version == 3
    ro.close()
    st = Store(p)
    assert st.version == 4
    assert [m.content for m in st.branch(1)] == ["hi", "hello"] and st.conversation(1).system_prompt == "be brief"
    assert st.conversation(1).model_path == "" and st.list_conversations()[0].title == "old chat"


def test_replies_record_their_model_and_the_sha256_follows(tmp_path):
    st = Store(tmp_path / "t.db")
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"a" * 10)
    b.write_bytes(b"b" * 20)
    chat = ChatState(st, "a-model")
    chat.set_model("a-model", str(a))
    chat.add_user("q1")
    chat.add_reply("r1", "", False, {}, None)
    chat.set_model_sha256(chat.model_file, "aa" * 32)  # computed after the reply was saved
    file_a = chat.model_file
    chat.set_model("b-model", str(b), sha256="bb" * 32)  # a switch: known hash
    chat.add_user("q2")
    chat.add_reply("r2", "", False, {}, None)
    msgs = st.all_messages(chat.conv_id)
    models = st.models(chat.conv_id)
    assert [m.model_id is not None for m in msgs] == [False, True, False, True]
    assert [(models[m.model_id].name, models[m.model_id].sha256) for m in msgs if m.model_id] == \
        [("a-model", "aa" * 32), ("b-model", "bb" * 32)]
    c = st.conversation(chat.conv_id)
    assert (c.model, c.model_path, c.model_sha256) == ("b-model", str(b.resolve()), "bb" * 32)
    # the same file again (another chat, a later session) is the same row; a changed file is a new one
    again = st.model_record("a-model", *file_a)
    assert again == next(m.model_id for m in msgs if m.model_id and models[m.model_id].name == "a-model")
    assert st.model_record("a-model", file_a[0], file_a[1] + 1, file_a[2]) != again

    md = export_markdown(st, chat.conv_id)
    assert f'model_file: "{b.resolve()}"' in md and f'model_sha256: "{"bb" * 32}"' in md
    assert f"*model: a-model ({a.resolve()}, sha256 {'aa' * 32})*" in md  # the reply from the model before
    doc = json.loads(export_json(st, chat.conv_id))
    assert doc["model_sha256"] == "bb" * 32 and doc["messages"][1]["model"]["sha256"] == "aa" * 32
    assert "model" not in doc["messages"][0]
    new = import_json(st, json.dumps(doc))
    back = st.models(new)
    assert sorted((r.name, r.sha256) for r in back.values()) == [("a-model", "aa" * 32), ("b-model", "bb" * 32)]
    assert st.conversation(new).model_sha256 == "bb" * 32


def test_a_chat_without_a_local_file_records_no_model(tmp_path):
    st = Store(tmp_path / "t.db")
    chat = ChatState(st, "served @ http://x")
    chat.set_model("served @ http://x", None)
    chat.add_user("q")
    chat.add_reply("r", "", False, {}, None)
    assert [m.model_id for m in st.all_messages(chat.conv_id)] == [None, None]
    assert st.conversation(chat.conv_id).model == "served @ http://x"
