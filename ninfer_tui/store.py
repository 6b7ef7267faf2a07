"""Transcripts in SQLite: conversations, parent-linked messages, reasoning apart, FTS5 search.

Every message is committed as soon as it is complete, so killing the app loses no finished turn. A
conversation keeps its system prompt (persona) and its current leaf: the branch shown, which regenerate, edit
and moving between versions change. Each reply records the model file it came from (name, path, size, mtime
and sha256, in the models table; the chat can switch model midway).
Regenerate and edit never overwrite: they add a sibling (same parent) and move the conversation's leaf, so
both versions stay. The schema is versioned with `PRAGMA user_version` and upgraded by MIGRATIONS; a file
that is not a database, one that fails SQLite's quick_check (a damaged page), or one written by a newer
ninfer-chat raises StoreError and is left untouched; so does a file whose disk or folder is read-only, unless
it is opened read-only (`--list`, `--export`), which then works.

Two ninfer-chat instances may share one file: every write is a BEGIN IMMEDIATE transaction, which takes the
write lock before anything is read and waits up to BUSY_TIMEOUT_S for the other writer. A deferred BEGIN
would not wait: its INSERT first reads (the FTS5 table loads its config), and SQLite refuses to upgrade a read
transaction to a write one at once (SQLITE_BUSY), without calling the busy handler, so a message was lost.
"""
from __future__ import annotations

import json
import os
import sqlite3
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from engine.errors import NinferError


class StoreError(NinferError):
    """The transcript database cannot be used (corrupt, newer version, unwritable); says what to do."""


_V1 = ("""
        CREATE TABLE conversations(
            id INTEGER PRIMARY KEY, title TEXT NOT NULL, model TEXT NOT NULL DEFAULT '',
            created REAL NOT NULL, updated REAL NOT NULL, leaf_id INTEGER);
        CREATE TABLE messages(
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            parent_id INTEGER REFERENCES messages(id) ON DELETE CASCADE,
            role TEXT NOT NULL, content TEXT NOT NULL, created REAL NOT NULL,
            settings TEXT, stats TEXT, spec_mode TEXT, finish_reason TEXT);
        CREATE INDEX messages_conv ON messages(conversation_id);
        CREATE TABLE reasoning(
            message_id INTEGER PRIMARY KEY REFERENCES messages(id) ON DELETE CASCADE,
            content TEXT NOT NULL, forced INTEGER NOT NULL DEFAULT 0);
""")


# Full-text search over message text, kept in sync by triggers (external-content FTS5 table).
_V2 = ("""
        CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', content_rowid='id');
        CREATE TRIGGER messages_ai AFTER INSERT ON messages BEGIN
            INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END;
        CREATE TRIGGER messages_ad AFTER DELETE ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content); END;
        CREATE TRIGGER messages_au AFTER UPDATE ON messages BEGIN
            INSERT INTO messages_fts(messages_fts, rowid, content) VALUES ('delete', old.id, old.content);
            INSERT INTO messages_fts(rowid, content) VALUES (new.id, new.content); END;
        INSERT INTO messages_fts(messages_fts) VALUES ('rebuild');
""")


# A system prompt (persona) per conversation; '' = none. Existing conversations keep everything and get ''.
_V3 = ("""
        ALTER TABLE conversations ADD COLUMN system_prompt TEXT NOT NULL DEFAULT '';
""")


# The model file each reply came from: its name, path, size, mtime and sha256 (filled in once the hash, computed
# in the background, is ready). A conversation's model_id is the model its last reply came from; rows from
# before have none (NULL).
_V4 = ("""
        CREATE TABLE models(
            id INTEGER PRIMARY KEY, name TEXT NOT NULL, path TEXT NOT NULL, size INTEGER NOT NULL,
            mtime REAL NOT NULL, sha256 TEXT NOT NULL DEFAULT '');
        CREATE UNIQUE INDEX models_file ON models(path, size, mtime);
        ALTER TABLE messages ADD COLUMN model_id INTEGER REFERENCES models(id);
        ALTER TABLE conversations ADD COLUMN model_id INTEGER REFERENCES models(id);
""")


MIGRATIONS = [_V1, _V2, _V3, _V4]  # SQL scripts; MIGRATIONS[i] upgrades version i -> i+1
SCHEMA_VERSION = len(MIGRATIONS)

# How long a write waits for another connection's write (another ninfer-chat on the same file) to finish.
BUSY_TIMEOUT_S = 10.0


def _locked_out(e: sqlite3.Error) -> bool:
    """The write lock stayed with another connection past the busy timeout."""
    return getattr(e, "sqlite_errorcode", None) in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def _statements(script: str) -> list[str]:
    """A migration script as its statements (a trigger's body stays whole: sqlite3.complete_statement)."""
    out, cur = [], ""
    for line in script.splitlines(keepends=True):
        cur += line
        if sqlite3.complete_statement(cur):
            out.append(cur.strip())
            cur = ""
    assert not cur.strip(), f"incomplete statement at the end of a migration: {cur!r}"
    return out


@dataclass
class Message:
    id: int
    conversation_id: int
    parent_id: int | None
    role: str
    content: str
    created: float
    reasoning: str = ""
    reasoning_forced: bool = False
    settings: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    model_id: int | None = None  # the model a reply came from (ModelRecord; None before schema 4, and prompts)


@dataclass
class Conversation:
    id: int
    title: str
    model: str
    created: float
    updated: float
    leaf_id: int | None
    n_messages: int = 0
    system_prompt: str = ""  # the chat's persona, sent first as a system message ('' = none)
    model_path: str = ""  # the file its last reply came from ('' before schema 4)
    model_sha256: str = ""  # that file's sha256 ('' until computed)


@dataclass
class ModelRecord:
    """A model file replies came from (schema 4's models table)."""
    id: int
    name: str
    path: str
    size: int
    mtime: float
    sha256: str = ""


def default_path() -> Path:
    from engine import paths
    return paths.user_data_dir() / "transcripts.db"


def _conversation(r: sqlite3.Row) -> Conversation:
    """A conversations row (with its message count `n`); a file opened read-only at an older schema version
    (no system_prompt column yet: --list, --export) reads as no system prompt."""
    keys = r.keys()
    system = r["system_prompt"] if "system_prompt" in keys else ""
    path, sha = (r["model_path"], r["model_sha256"]) if "model_path" in keys else ("", "")
    return Conversation(r["id"], r["title"], r["model"], r["created"], r["updated"], r["leaf_id"], r["n"],
                        system or "", path or "", sha or "")


def _json_dict(text) -> dict:
    """A message's settings or stats column as a dict; {} where the column was damaged outside ninfer-chat
    (the message itself still opens)."""
    try:
        d = json.loads(text or "{}")
    except (TypeError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


class Store:
    """One SQLite file. Opening validates it before anything is written.

    readonly=True (listing and exporting) opens an existing file without writing to it, also where its disk
    or folder is read-only; a file that does not exist yet is created as usual. A write waits up to
    busy_timeout_s for another connection's write to end."""

    def __init__(self, path: str | Path | None = None, readonly: bool = False,
                 busy_timeout_s: float = BUSY_TIMEOUT_S):
        self.path = Path(path) if path is not None else default_path()
        self.busy_timeout_s = busy_timeout_s
        memory = str(self.path) == ":memory:"
        self.readonly = readonly and not memory and self.path.exists()
        if not memory and not self.readonly:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(f"cannot create the transcript folder {self.path.parent} ({e.strerror or e}); "
                                 "check the path and permissions") from None
            if not (os.access(self.path.parent, os.W_OK) and (not self.path.exists() or os.access(self.path, os.W_OK))):
                raise StoreError(f"transcript database {self.path} cannot be written (its file or folder is "
                                 "read-only); fix the permissions or the disk (the file was not modified)")
        try:
            if self.readonly:  # immutable where the folder is read-only: SQLite cannot make its -shm file there
                flags = "mode=ro" + ("" if os.access(self.path.parent, os.W_OK) else "&immutable=1")
                self.db = sqlite3.connect(f"file:{urllib.parse.quote(str(self.path))}?{flags}", uri=True,
                                          isolation_level=None, check_same_thread=False, timeout=busy_timeout_s)
            else:
                self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False,
                                          timeout=busy_timeout_s)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open transcript database {self.path} ({e}); check the path and permissions")
        self.db.row_factory = sqlite3.Row
        self._check_and_migrate()

    def _corrupt(self, why) -> StoreError:
        return StoreError(f"transcript database {self.path} is corrupt or not a database ({why}); "
                          "move it aside to start a new one (it was not modified)")

    def _check_and_migrate(self) -> None:
        try:
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            self.db.execute("SELECT count(*) FROM sqlite_master").fetchone()
            problems = [r[0] for r in self.db.execute("PRAGMA quick_check(1)")]
        except sqlite3.OperationalError as e:
            self.db.close()
            raise StoreError(f"cannot read transcript database {self.path} ({e}); check its permissions and "
                             "disk (the file was not modified)") from None
        except sqlite3.DatabaseError as e:
            self.db.close()
            raise self._corrupt(e) from None
        if problems != ["ok"]:
            self.db.close()
            first = " ".join(problems[0].replace("*** in database main ***", "").split())
            raise self._corrupt(f"damaged: {first}")
        if version > SCHEMA_VERSION:
            self.db.close()
            raise StoreError(f"transcript database {self.path} has schema version {version}, newer than this "
                             f"ninfer-chat ({SCHEMA_VERSION}); upgrade ninfer-chat (the file was not modified)")
        if version > 0:
            have = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not {"conversations", "messages"} <= have:
                self.db.close()
                raise StoreError(f"transcript database {self.path} is missing its tables; move it aside "
                                 "to start a new one (it was not modified)")
        self._has_models = version >= 4  # the models table (an older file opened read-only has none)
        if self.readonly:
            return
        self._has_models = True  # upgraded below
        self.db.execute("PRAGMA foreign_keys = ON")
        if version < SCHEMA_VERSION:
            self._migrate()
        if str(self.path) != ":memory:":
            self.db.execute("PRAGMA journal_mode = WAL")

    def _migrate(self) -> None:
        """Upgrade to SCHEMA_VERSION, one transaction per step: a step's script and its version bump commit
        together or not at all. The version is read again under the write lock: another instance opening
        the same file at the same moment may have upgraded it meanwhile."""
        while True:
            v = None
            try:
                with self._tx():
                    v = self.db.execute("PRAGMA user_version").fetchone()[0]
                    if v >= SCHEMA_VERSION:
                        return
                    for stmt in _statements(MIGRATIONS[v]):
                        self.db.execute(stmt)
                    self.db.execute(f"PRAGMA user_version = {v + 1}")
            except sqlite3.Error as e:
                self.db.close()
                if _locked_out(e):  # another instance kept the write lock
                    raise StoreError(f"cannot upgrade transcript database {self.path}: {self._locked(e)}") from None
                step = f" to version {v + 1}" if v is not None else ""
                raise StoreError(f"cannot upgrade transcript database {self.path}{step} ({e})") from None

    def _tx(self):
        """A write transaction: BEGIN IMMEDIATE takes the write lock first, waiting for another writer (the
        busy timeout); a deferred BEGIN would fail at once where its first statement reads before it writes."""
        db = self.db

        class _Tx:
            def __enter__(self):
                db.execute("BEGIN IMMEDIATE")

            def __exit__(self, exc_type, *_):
                if exc_type is None:
                    try:
                        db.execute("COMMIT")
                    except sqlite3.Error:
                        if db.in_transaction:  # a commit that failed leaves nothing half-written behind
                            db.execute("ROLLBACK")
                        raise
                elif db.in_transaction:  # SQLite may have rolled back already (a full disk): keep its error
                    db.execute("ROLLBACK")
        return _Tx()

    def close(self) -> None:
        self.db.close()

    @property
    def version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    # -- conversations -----------------------------------------------------------------------------
    def _locked(self, e: sqlite3.Error) -> str:
        return (f"another program (another ninfer-chat?) kept it locked for over {self.busy_timeout_s:g} s ({e}); "
                "close the other program or retry")

    def _write_failed(self, e: sqlite3.Error) -> StoreError:
        """A write the database refused (a full disk, a read-only file, a damaged page) as one line saying
        what to do."""
        if self.readonly:
            return StoreError(f"transcript database {self.path} is open read-only; nothing was saved")
        if type(e) is sqlite3.DatabaseError or "malformed" in str(e):
            return StoreError(f"cannot save to the transcript database {self.path}: it is damaged ({e}); move "
                              "it aside to start a new one")
        if _locked_out(e):
            return StoreError(f"cannot save to the transcript database {self.path}: {self._locked(e)}")
        return StoreError(f"cannot save to the transcript database {self.path} ({e}); free some disk space or "
                          "check its permissions")

    def _rows(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        """A read; a file damaged after it was opened gives one StoreError line, not an sqlite3 traceback."""
        try:
            return self.db.execute(sql, args).fetchall()
        except sqlite3.OperationalError as e:
            if "fts5" in str(e) or "MATCH" in str(e):
                raise  # a search the user typed: the transcripts screen shows it
            raise StoreError(f"cannot read the transcript database {self.path} ({e}); check its disk and "
                             "permissions") from None
        except sqlite3.DatabaseError as e:
            raise StoreError(f"cannot read the transcript database {self.path}: it is damaged ({e}); move it "
                             "aside to start a new one") from None

    def _write(self, sql: str, args: tuple) -> sqlite3.Cursor:
        """One statement that writes (committed at once); a refused write is _write_failed's one line."""
        try:
            with self._tx():
                return self.db.execute(sql, args)
        except sqlite3.Error as e:
            raise self._write_failed(e) from None

    def new_conversation(self, title: str = "New chat", model: str = "", system_prompt: str = "") -> int:
        now = time.time()
        return self._write("INSERT INTO conversations(title, model, created, updated, system_prompt) "
                           "VALUES (?,?,?,?,?)", (title, model, now, now, system_prompt)).lastrowid

    def _conv_select(self) -> str:
        """SELECT of conversations with their message count (n) and, from schema 4 on, their model's file."""
        model = (", (SELECT path FROM models WHERE id=c.model_id) model_path, "
                 "(SELECT sha256 FROM models WHERE id=c.model_id) model_sha256") if self._has_models else ""
        return f"SELECT c.*, (SELECT count(*) FROM messages m WHERE m.conversation_id=c.id) n{model} FROM conversations c"

    def conversation(self, conv_id: int) -> Conversation:
        rows = self._rows(self._conv_select() + " WHERE id=?", (conv_id,))
        if not rows:
            raise StoreError(f"no conversation with id {conv_id}; `ninfer-chat --list` shows the ids")
        return _conversation(rows[0])

    def list_conversations(self, query: str | None = None, limit: int = 500) -> list[Conversation]:
        """Newest first; `query` searches titles and message text (FTS5 syntax, words are ANDed)."""
        sql = self._conv_select()
        args: tuple = ()
        if query and query.strip():
            words = " ".join('"' + w.replace('"', '""') + '"' for w in query.split())
            sql += (" WHERE c.title LIKE ? OR c.id IN (SELECT m.conversation_id FROM messages m "
                    "JOIN messages_fts f ON f.rowid = m.id WHERE messages_fts MATCH ?)")
            args = (f"%{query.strip()}%", words)
        sql += " ORDER BY c.updated DESC, c.id DESC LIMIT ?"
        rows = self._rows(sql, args + (limit,))
        return [_conversation(r) for r in rows]

    def rename(self, conv_id: int, title: str) -> None:
        self.conversation(conv_id)
        self._write("UPDATE conversations SET title=? WHERE id=?", (title.strip() or "Untitled", conv_id))

    def set_system_prompt(self, conv_id: int, text: str) -> None:
        """The conversation's system prompt from the next reply on ('' = none)."""
        self.conversation(conv_id)
        self._write("UPDATE conversations SET system_prompt=?, updated=? WHERE id=?", (text, time.time(), conv_id))

    def delete(self, conv_id: int) -> None:
        """Delete a conversation and its messages (foreign keys cascade)."""
        self.conversation(conv_id)
        self._write("DELETE FROM conversations WHERE id=?", (conv_id,))

    # -- messages ----------------------------------------------------------------------------------
    def add_message(self, conv_id: int, role: str, content: str, parent_id: int | None = None, *,
                    reasoning: str = "", reasoning_forced: bool = False, settings: dict | None = None,
                    stats: dict | None = None, created: float | None = None, model_id: int | None = None) -> int:
        """Append a complete message (committed before returning) and make it the conversation's leaf;
        `model_id` (a reply's model, model_record) becomes the conversation's model too."""
        now = created or time.time()
        stats = stats or {}
        try:
            with self._tx():
                cur = self.db.execute(
                    "INSERT INTO messages(conversation_id, parent_id, role, content, created, settings, stats, "
                    "spec_mode, finish_reason, model_id) VALUES (?,?,?,?,?,?,?,?,?,?)",
                    (conv_id, parent_id, role, content, now, json.dumps(settings or {}), json.dumps(stats),
                     stats.get("spec_mode"), stats.get("finish_reason"), model_id))
                mid = cur.lastrowid
                if reasoning or reasoning_forced:
                    self.db.execute("INSERT INTO reasoning(message_id, content, forced) VALUES (?,?,?)",
                                    (mid, reasoning, int(reasoning_forced)))
                self.db.execute("UPDATE conversations SET leaf_id=?, updated=? WHERE id=?",
                                (mid, time.time(), conv_id))
                if model_id is not None:
                    self.db.execute("UPDATE conversations SET model_id=?, model=(SELECT name FROM models WHERE "
                                    "id=?) WHERE id=?", (model_id, model_id, conv_id))
        except sqlite3.Error as e:
            raise self._write_failed(e) from None
        return mid

    def _message(self, r: sqlite3.Row) -> Message:
        return Message(r["id"], r["conversation_id"], r["parent_id"], r["role"], r["content"] or "", r["created"],
                       r["rcontent"] or "", bool(r["forced"]), _json_dict(r["settings"]), _json_dict(r["stats"]),
                       r["model_id"] if "model_id" in set(r.keys()) else None)

    # -- models ------------------------------------------------------------------------------------
    def model_record(self, name: str, path: str, size: int, mtime: float, sha256: str = "") -> int:
        """The id of the models row for this file as it is (path, size, mtime), added if new; a known
        sha256 is filled in."""
        try:
            with self._tx():
                self.db.execute("INSERT OR IGNORE INTO models(name, path, size, mtime) VALUES (?,?,?,?)",
                                (name, path, size, mtime))
                mid = self.db.execute("SELECT id FROM models WHERE path=? AND size=? AND mtime=?",
                                      (path, size, mtime)).fetchone()[0]
                if sha256:
                    self.db.execute("UPDATE models SET sha256=? WHERE id=?", (sha256, mid))
        except sqlite3.Error as e:
            raise self._write_failed(e) from None
        return mid

    def set_model_sha256(self, path: str, size: int, mtime: float, sha256: str) -> None:
        """The sha256 of a model file as it was (path, size, mtime), for every reply that came from it."""
        self._write("UPDATE models SET sha256=? WHERE path=? AND size=? AND mtime=?", (sha256, path, size, mtime))

    def models(self, conv_id: int) -> dict[int, ModelRecord]:
        """The models the conversation's replies came from, by id ({} before schema 4)."""
        if not self._has_models:
            return {}
        rows = self._rows("SELECT * FROM models WHERE id IN (SELECT model_id FROM messages WHERE conversation_id=? "
                          "UNION SELECT model_id FROM conversations WHERE id=?)", (conv_id, conv_id))
        return {r["id"]: ModelRecord(r["id"], r["name"], r["path"], r["size"], r["mtime"], r["sha256"]) for r in rows}

    _SELECT = ("SELECT m.*, r.content AS rcontent, r.forced AS forced FROM messages m "
               "LEFT JOIN reasoning r ON r.message_id = m.id")

    def message(self, msg_id: int) -> Message:
        rows = self._rows(self._SELECT + " WHERE m.id=?", (msg_id,))
        if not rows:
            raise StoreError(f"no message with id {msg_id}")
        return self._message(rows[0])

    def all_messages(self, conv_id: int) -> list[Message]:
        rows = self._rows(self._SELECT + " WHERE m.conversation_id=? ORDER BY m.id", (conv_id,))
        return [self._message(r) for r in rows]

    def branch(self, conv_id: int, leaf_id: int | None = None) -> list[Message]:
        """Messages from the root to `leaf_id` (default: the conversation's current leaf)."""
        if leaf_id is None:
            leaf_id = self.conversation(conv_id).leaf_id
        by_id = {m.id: m for m in self.all_messages(conv_id)}
        out = []
        while leaf_id is not None and leaf_id in by_id:
            out.append(by_id[leaf_id])
            leaf_id = by_id[leaf_id].parent_id
        return out[::-1]

    def siblings(self, msg_id: int) -> list[int]:
        """Ids of the versions of this message (same parent and role), oldest first."""
        m = self.message(msg_id)
        rows = self._rows(
            "SELECT id FROM messages WHERE conversation_id=? AND role=? AND parent_id IS ? ORDER BY id",
            (m.conversation_id, m.role, m.parent_id))
        return [r[0] for r in rows]

    def latest_leaf(self, msg_id: int) -> int:
        """The end of the newest branch below a message: from it, the newest child (highest id) at each step.
        Showing another version of a message continues where that version was last taken."""
        m = self.message(msg_id)
        children: dict[int, int] = {}
        for r in self._rows("SELECT id, parent_id FROM messages WHERE conversation_id=? AND parent_id IS NOT NULL",
                            (m.conversation_id,)):
            children[r[1]] = max(children.get(r[1], r[0]), r[0])
        leaf = msg_id
        while leaf in children:
            leaf = children[leaf]
        return leaf

    def set_times(self, conv_id: int, created: float, updated: float) -> None:
        """A conversation's creation and last-change times (an import keeps the exported ones)."""
        self._write("UPDATE conversations SET created=?, updated=? WHERE id=?", (created, updated, conv_id))

    def set_leaf(self, conv_id: int, msg_id: int | None) -> None:
        self._write("UPDATE conversations SET leaf_id=?, updated=? WHERE id=?", (msg_id, time.time(), conv_id))
