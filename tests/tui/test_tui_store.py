"""Transcript store: schema migrations, corrupt/newer databases left untouched, parent links, FTS search,
kill safety, Markdown/JSON export and JSON import."""
from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.errors import InputError
from ninfer_tui.export import export_json, export_markdown, import_json
from ninfer_tui.store import MIGRATIONS, SCHEMA_VERSION, Store, StoreError


def _chat(st: Store) -> tuple[int, list[int]]:
    c = st.new_conversation("Capital question", "smol.gguf")
    u = st.add_message(c, "user", "What is the capital of France?")
    a1 = st.add_message(c, "assistant", "Paris.", u, reasoning="France -> Paris", settings={"temperature": 0.7},
                        stats={"finish_reason": "stop", "spec_mode": "off", "output_tokens": 2, "decode_tok_s": 9.5})
    a2 = st.add_message(c, "assistant", "It is Paris.", u, reasoning="again", reasoning_forced=True,
                        settings={"temperature": 0.2}, stats={"finish_reason": "stop", "spec_mode": "ngram"})
    return c, [u, a1, a2]


def test_new_db_has_latest_schema_and_fts(tmp_path):
    st = Store(tmp_path / "t.db")
    assert st.version == SCHEMA_VERSION == len(MIGRATIONS)
    c, (u, a1, a2) = _chat(st)
    assert [x.id for x in st.list_conversations("capital")] == [c]
    assert [x.id for x in st.list_conversations("Paris")] == [c]  # message text, not only titles
    assert st.list_conversations("bananas") == []


def test_migrates_a_version_1_database_keeping_data(tmp_path):
    p = tmp_path / "old.db"
    db = sqlite3.connect(p)
    db.executescript(MIGRATIONS[0] + "\nPRAGMA user_version = 1;")
    db.execute("INSERT INTO conversations(id, title, model, created, updated) VALUES (1, 'old', '', 0, 0)")
    db.execute("INSERT INTO messages(conversation_id, role, content, created) VALUES (1, 'user', 'zebra facts', 0)")
    db.commit()
    db.close()
    st = Store(p)
    assert st.version == SCHEMA_VERSION
    assert [c.title for c in st.list_conversations("zebra")] == ["old"]  # FTS index rebuilt over old rows


def test_corrupt_database_is_reported_and_not_modified(tmp_path):
    p = tmp_path / "t.db"
    junk = b"this is not a database at all" * 200
    p.write_bytes(junk)
    with pytest.raises(StoreError, match="corrupt or not a database.*not modified"):
        Store(p)
    assert p.read_bytes() == junk


def _damaged_db(tmp_path):
    """A real transcript file with a page in its middle overwritten (the header stays valid)."""
    p = tmp_path / "t.db"
    st = Store(p)
    for i in range(40):
        c = st.new_conversation(f"chat {i}")
        st.add_message(c, "user", f"question {i} " + "words " * 300)
    st.close()
    data = bytearray(p.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    assert len(data) >= 8 * page
    data[3 * page:4 * page] = b"\xa5" * page
    p.write_bytes(bytes(data))
    return p


def test_a_damaged_page_is_reported_at_open_and_not_modified(tmp_path):
    """A file whose header is fine but whose pages are not: refused at open (quick_check), before anything is
    written (it used to take new messages into the damaged file, and an export then raised a traceback)."""
    p = _damaged_db(tmp_path)
    before = p.read_bytes()
    with pytest.raises(StoreError, match="corrupt or not a database .*damaged.*move it aside.*not modified") as e:
        Store(p)
    assert "\n" not in str(e.value)
    with pytest.raises(StoreError, match="corrupt or not a database"):
        Store(p, readonly=True)
    assert p.read_bytes() == before


def test_damage_found_after_opening_is_one_line(tmp_path):
    """Reads of a file damaged while open raise StoreError (the app shows it), not sqlite3's error."""
    st = Store(tmp_path / "t.db")
    c, _ = _chat(st)

    class Broken:
        def execute(self, *a):
            raise sqlite3.DatabaseError("database disk image is malformed")
    st.db = Broken()
    for read in (lambda: st.conversation(c), lambda: st.list_conversations(), lambda: st.branch(c),
                 lambda: st.all_messages(c), lambda: st.message(1)):
        with pytest.raises(StoreError, match="it is damaged .*move it aside"):
            read()


def test_a_read_only_disk_is_not_called_corrupt(tmp_path, monkeypatch):
    """On a read-only disk (os.access says so; SQLite then cannot write its -shm file), opening to write says
    it is read-only and touches nothing; opening read-only (--list, --export) reads the conversations."""
    import ninfer_tui.store as store_mod
    p = tmp_path / "t.db"
    st = Store(p)
    c, _ = _chat(st)
    st.close()
    before = p.read_bytes()
    real_access = store_mod.os.access
    monkeypatch.setattr(store_mod.os, "access", lambda f, mode: False if mode & store_mod.os.W_OK else
                        real_access(f, mode))
    with pytest.raises(StoreError, match="cannot be written .*read-only.*not modified"):
        Store(p)
    ro = Store(p, readonly=True)
    assert [x.title for x in ro.list_conversations()] == ["Capital question"]
    assert [m.content for m in ro.branch(c)] == ["What is the capital of France?", "It is Paris."]
    with pytest.raises(StoreError, match="read-only; nothing was saved"):
        ro.rename(c, "x")
    ro.close()
    assert p.read_bytes() == before and not (tmp_path / "t.db-shm").exists()


def test_newer_version_is_reported_and_not_modified(tmp_path):
    p = tmp_path / "t.db"
    db = sqlite3.connect(p)
    db.execute("CREATE TABLE future(x)")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    db.commit()
    db.close()
    before = p.read_bytes()
    with pytest.raises(StoreError, match="newer than this ninfer-chat"):
        Store(p)
    assert p.read_bytes() == before


def test_parent_links_keep_both_versions_and_branch(tmp_path):
    st = Store(tmp_path / "t.db")
    c, (u, a1, a2) = _chat(st)
    assert st.siblings(a2) == [a1, a2]
    assert [m.id for m in st.branch(c)] == [u, a2]  # the leaf moved to the regenerated reply
    assert [m.id for m in st.branch(c, a1)] == [u, a1]
    m = st.message(a2)
    assert m.reasoning == "again" and m.reasoning_forced and m.settings == {"temperature": 0.2}
    assert st.message(u).reasoning == ""  # reasoning is stored apart, only for replies that have it


def test_committed_rows_survive_a_kill(tmp_path):
    """Another connection (as after a crash) sees each message as soon as add_message returns."""
    p = tmp_path / "t.db"
    st = Store(p)
    c = st.new_conversation("x")
    st.add_message(c, "user", "saved at once")
    other = sqlite3.connect(p)
    assert other.execute("SELECT content FROM messages").fetchall() == [("saved at once",)]


def test_writes_to_a_read_only_database_are_one_line(tmp_path):
    """Rename, delete and a new message on a database opened read-only (as a full disk or a read-only file
    would refuse them): StoreError saying what to do, and nothing changed."""
    st = Store(tmp_path / "t.db")
    c, _ = _chat(st)
    st.db.execute("PRAGMA query_only = ON")
    for write in (lambda: st.rename(c, "x"), lambda: st.delete(c), lambda: st.add_message(c, "user", "y"),
                  lambda: st.new_conversation("z"), lambda: st.set_leaf(c, None)):
        with pytest.raises(StoreError, match="cannot save to the transcript database .*; free some disk space"):
            write()
    st.db.execute("PRAGMA query_only = OFF")
    assert [x.title for x in st.list_conversations()] == [st.conversation(c).title]
    assert st.conversation(c).leaf_id is not None and not st.db.in_transaction


def test_a_damaged_stats_column_still_opens(tmp_path):
    """Settings or stats edited into invalid JSON (or a JSON list) outside ninfer-chat: the messages open with
    empty stats, the text intact."""
    st = Store(tmp_path / "t.db")
    c, _ = _chat(st)
    st.db.execute("UPDATE messages SET stats='{broken', settings='[1, 2]'")
    path = st.branch(c)
    assert [m.content for m in path] and all(m.stats == {} and m.settings == {} for m in path)


def test_rename_delete(tmp_path):
    st = Store(tmp_path / "t.db")
    c, _ = _chat(st)
    st.rename(c, "  New title ")
    assert st.conversation(c).title == "New title"
    st.delete(c)
    assert st.list_conversations() == []
    assert st.db.execute("SELECT count(*) FROM messages").fetchone()[0] == 0
    assert st.db.execute("SELECT count(*) FROM reasoning").fetchone()[0] == 0
    with pytest.raises(StoreError, match="--list"):
        st.conversation(c)


def test_export_markdown_front_matter_and_reasoning(tmp_path):
    st = Store(tmp_path / "t.db")
    c, _ = _chat(st)
    md = export_markdown(st, c)
    head = md.split("---")[1]
    assert 'model: "smol.gguf"' in head and "temperature: 0.2" in head
    assert "It is Paris." in md and "close forced" in md and "Paris." in md
    assert "France -> Paris" not in md  # the other branch is not in the Markdown view


def test_json_roundtrip_keeps_the_tree(tmp_path):
    st = Store(tmp_path / "t.db")
    c, _ = _chat(st)
    doc = export_json(st, c)
    c2 = import_json(st, doc)
    assert c2 != c
    a, b = json.loads(doc), json.loads(export_json(st, c2))
    strip = (lambda d: [(m["role"], m["content"], m["reasoning"], m["reasoning_forced"], m["settings"], m["stats"])
                        for m in d["messages"]])
    assert strip(a) == strip(b)
    assert [m.content for m in st.branch(c2)] == [m.content for m in st.branch(c)]
    assert (b["created"], b["updated"]) == (a["created"], a["updated"])  # not the time of the import
    assert [m["created"] for m in b["messages"]] == [m["created"] for m in a["messages"]]


@pytest.mark.parametrize("text,msg", [("{", "not valid JSON"), ('{"a": 1}', "not a ninfer-chat"),
                                      ('{"format": "ninfer-chat-transcript", "messages": '
                                       '[{"id": 1, "parent_id": 7, "role": "user", "content": "x"}]}', "unknown parent")])
def test_import_rejects_bad_json(tmp_path, text, msg):
    with pytest.raises(InputError, match=msg):
        import_json(Store(tmp_path / "t.db"), text)


@pytest.mark.parametrize("messages,msg", [
    ('[{"id": 1, "role": "user", "content": "x"}, {"id": 2, "role": "wizard", "content": "y"}]',
     r"message 2 \(id 2\) has no valid role/content; the file is damaged \(nothing was imported\)"),
    ('[{"role": "user", "content": "x"}, {"role": "assistant"}]', r"message 2 has no valid role/content"),
    ('[{"id": 1, "role": "user", "content": "x"}, 7]', r"message 2 has no valid"),
])
def test_a_damaged_import_adds_nothing(tmp_path, messages, msg):
    """A message that is damaged after good ones: the error names it by position, and no empty or half
    chat is left behind (one used to be, per failed import)."""
    st = Store(tmp_path / "t.db")
    with pytest.raises(InputError, match=msg):
        import_json(st, '{"format": "ninfer-chat-transcript", "version": 1, "messages": ' + messages + "}")
    assert st.list_conversations() == []


def test_an_import_the_disk_cannot_hold_leaves_no_half_chat(tmp_path):
    st = Store(tmp_path / "t.db")
    st.db.execute(f"PRAGMA max_page_count = {st.db.execute('PRAGMA page_count').fetchone()[0] + 2}")
    msgs = [{"id": i, "parent_id": i - 1 if i else None, "role": "user", "content": "x" * 3000} for i in range(40)]
    with pytest.raises(StoreError, match="database or disk is full"):
        import_json(st, json.dumps({"format": "ninfer-chat-transcript", "version": 1, "messages": msgs}))
    assert st.list_conversations() == []


def test_import_of_a_newer_format_says_to_upgrade(tmp_path):
    st = Store(tmp_path / "t.db")
    with pytest.raises(InputError, match=r"version 99 is newer than this ninfer-chat reads \(1\); upgrade"):
        import_json(st, '{"format": "ninfer-chat-transcript", "version": 99, "messages": []}')
    assert st.list_conversations() == []


# -- two instances on one file ----------------------------------------------------------------------------
_WRITER = r"""
import sys, time
from pathlib import Path
from ninfer_tui.store import Store
path, tag, n, go, open_first = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5] == "1"
st = Store(path) if open_first else None
Path(f"{go}.{tag}").touch()  # ready
while not go.exists():  # all start at once
    time.sleep(0.002)
st = st or Store(path)
conv = st.new_conversation(tag)
for i in range(n):
    st.add_message(conv, "user", f"{tag} {i}")
"""


def _writers(tmp_path, n, tags=("a", "b"), open_first=True):
    """Processes that each add n messages to one new chat of tmp_path/t.db, started at the same moment (after
    opening the file, or opening it then) -> their exit codes and stderr."""
    go = tmp_path / "go"
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "t.db"), t, str(n), str(go),
                               "1" if open_first else "0"], cwd=root, stderr=subprocess.PIPE, text=True)
             for t in tags]
    deadline = time.time() + 60
    while not all((tmp_path / f"go.{t}").exists() for t in tags) and time.time() < deadline:
        time.sleep(0.01)
    go.touch()
    errs = [p.communicate(timeout=120)[1] for p in procs]
    return [p.returncode for p in procs], errs


def test_two_instances_writing_at_once_lose_nothing(tmp_path):
    """Two processes add 300 messages each to one file at the same moment: every message is saved. (A
    deferred BEGIN lost one: the first INSERT of a connection reads the FTS5 config, and SQLite refuses to
    upgrade that read to a write at once, without waiting for the busy timeout.)"""
    codes, errs = _writers(tmp_path, 300)
    assert codes == [0, 0], errs
    st = Store(tmp_path / "t.db")
    for c in st.list_conversations():
        assert [m.content for m in st.all_messages(c.id)] == [f"{c.title} {i}" for i in range(300)]
    assert sorted(c.title for c in st.list_conversations()) == ["a", "b"]


def test_instances_creating_the_file_at_once_all_start(tmp_path):
    """Four instances open a new file at the same moment: one sets the schema up, the others wait and see it
    done (each used to run the migrations too, and stop with "table conversations already exists")."""
    codes, errs = _writers(tmp_path, 1, tags="abcd", open_first=False)
    assert codes == [0] * 4, errs
    st = Store(tmp_path / "t.db")
    assert st.version == SCHEMA_VERSION and sorted(c.title for c in st.list_conversations()) == list("abcd")


def test_a_write_waits_for_another_instances_write(tmp_path):
    """Another connection holds the write lock for 0.3 s: a new Store's first message waits for it and is
    saved (it used to fail at once with "database is locked" and was dropped)."""
    import threading
    p = tmp_path / "t.db"
    first = Store(p)
    c = first.new_conversation("mine")
    first.close()
    st = Store(p)
    other = sqlite3.connect(p, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO conversations(title, model, created, updated) VALUES ('other', '', 0, 0)")
    threading.Timer(0.3, lambda: other.execute("COMMIT")).start()
    st.add_message(c, "user", "kept")  # this connection's first message: the FTS5 table is read first
    assert [m.content for m in st.all_messages(c)] == ["kept"]
    assert sorted(x.title for x in st.list_conversations()) == ["mine", "other"]


def test_a_lock_held_past_the_timeout_is_named(tmp_path):
    """A write that still finds the file locked after the busy timeout says so (it used to say to free some
    disk space), and leaves no transaction open."""
    p = tmp_path / "t.db"
    Store(p).close()
    st = Store(p, busy_timeout_s=0.2)
    c = st.new_conversation("mine")
    other = sqlite3.connect(p, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    for write in (lambda: st.add_message(c, "user", "y"), lambda: st.rename(c, "x")):
        with pytest.raises(StoreError, match=r"another program \(another ninfer-chat\?\) kept it locked for "
                                             r"over 0.2 s \(database is locked\)") as e:
            write()
        assert "disk space" not in str(e.value) and not st.db.in_transaction
    other.execute("ROLLBACK")
    st.add_message(c, "user", "now")
    assert [m.content for m in st.all_messages(c)] == ["now"]


def test_an_upgrade_that_finds_the_file_locked_says_so(tmp_path):
    """A version-1 file another connection keeps write-locked past the timeout: the upgrade names the lock,
    and the file stays at version 1."""
    p = tmp_path / "old.db"
    db = sqlite3.connect(p)
    db.executescript(MIGRATIONS[0] + "\nPRAGMA user_version = 1;")
    db.close()
    other = sqlite3.connect(p, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(StoreError, match=r"cannot upgrade transcript database .*: another program \(another "
                                         r"ninfer-chat\?\) kept it locked for over 0.2 s \(database is locked\)"):
        Store(p, busy_timeout_s=0.2)
    other.execute("ROLLBACK")
    assert Store(p).version == SCHEMA_VERSION
