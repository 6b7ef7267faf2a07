"""The conversation being chatted: the current branch of messages, saved to the store as turns complete.

Shared by the TUI and plain mode. Works without a store (when the database could not be opened) so a broken
transcript file never stops the chat; messages then live in memory only. The same when a write fails midway
(a full disk): the open conversation goes on in memory from that message, and take_save_error() hands the
reason to the UI once.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path

from engine.errors import InputError
from engine.events import FinalStats

from .export import export_branch, export_to_file, write_export
from .store import Message, Store, StoreError


def stats_record(final: FinalStats | None) -> dict:
    """FinalStats as a JSON-able dict for the transcript (token ids dropped; derived figures added)."""
    if final is None:
        return {}
    d = dataclasses.asdict(final)
    d.pop("token_ids", None)
    d["per_position_accept"] = list(d.get("per_position_accept", ()))
    d.update(acceptance=final.acceptance, tokens_per_round=final.tokens_per_round,
             ms_per_round=final.ms_per_round)
    return d


def title_from(text: str) -> str:
    line = " ".join(text.split())
    return (line[:60] + "...") if len(line) > 60 else (line or "New chat")


def turns(path: list[Message]) -> list[list[Message]]:
    """A branch cut into turns: each prompt with the reply after it."""
    out: list[list[Message]] = []
    for m in path:
        if m.role == "user" or not out:
            out.append([m])
        else:
            out[-1].append(m)
    return out


class ChatState:
    """The open conversation: `path` is the branch shown (root -> leaf); `system_prompt` its persona (sent
    first as a system message, stored with the conversation; a new chat starts with `default_system`)."""

    def __init__(self, store: Store | None, model_name: str = "", default_system: str = ""):
        self.store = store
        self.model_name = model_name
        self.model_file: tuple[str, int, float] | None = None  # (path, size, mtime) replies come from now
        self.model_sha256 = ""  # its sha256, once known (set_model_sha256)
        self._model_id: int | None = None  # its models row in the store, added with the first reply
        self.default_system = default_system
        self.system_prompt = default_system
        self.conv_id: int | None = None
        self.path: list[Message] = []
        self._mem_ids = itertools.count(-1, -1)  # below every stored id: a branch may hold both
        self.unsaved = False  # a write failed: this conversation's next messages live in memory only
        self._save_error: str | None = None

    def new(self) -> None:
        self.conv_id, self.path, self.unsaved = None, [], False
        self.system_prompt = self.default_system

    def open(self, conv_id: int) -> None:
        if self.store is None:
            return
        system = self.store.conversation(conv_id).system_prompt
        self.path = self.store.branch(conv_id)
        self.conv_id, self.system_prompt, self.unsaved = conv_id, system, False

    def set_system_prompt(self, text: str) -> None:
        """This chat's system prompt from the next reply on ('' = none), saved with it where it is stored."""
        self.system_prompt = text.strip()
        if self.store is not None and self.conv_id is not None and not self.unsaved:
            try:
                self.store.set_system_prompt(self.conv_id, self.system_prompt)
            except StoreError as e:
                self._stop_saving(e)

    def set_model(self, name: str, path: str | None, sha256: str = "") -> None:
        """The model replies come from from now on: each reply records its file (the sha256 follows with
        set_model_sha256 where it is not known yet). `path` None: no local file (a remote or fake engine)."""
        self.model_name = name
        self.model_file, self.model_sha256, self._model_id = None, sha256, None
        if path:
            st = Path(path).stat()
            self.model_file = (str(Path(path).resolve()), st.st_size, st.st_mtime)

    def set_model_sha256(self, file: tuple[str, int, float], sha256: str) -> None:
        """The sha256 of a model file (a model_file tuple), computed in the background: recorded for the
        replies that came from it (also where the chat has switched model since)."""
        if file == self.model_file:
            self.model_sha256 = sha256
        if self.store is not None:
            try:
                self.store.set_model_sha256(*file, sha256)
            except StoreError as e:
                self._stop_saving(e)

    def _model_row(self) -> int | None:
        """The store's id of the current model file (added on first use)."""
        if self._model_id is None and self.model_file is not None and self.store is not None:
            self._model_id = self.store.model_record(self.model_name, *self.model_file, sha256=self.model_sha256)
        return self._model_id

    def take_save_error(self) -> str | None:
        """Why the open conversation stopped being saved, once (None when nothing new failed)."""
        err, self._save_error = self._save_error, None
        return err

    def _stop_saving(self, e: StoreError) -> None:
        self.unsaved, self._save_error = True, f"{e}; this conversation goes on unsaved"

    def system_messages(self) -> list[dict]:
        """The system prompt as the engine's first message ([] when there is none)."""
        return [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def engine_messages(self) -> list[dict]:
        """The branch as the engine's chat messages, after the system prompt (reasoning is not sent back to
        the model)."""
        return self.system_messages() + [{"role": m.role, "content": m.content} for m in self.path]

    def _add(self, role: str, content: str, parent_id: int | None, title: str | None = None, **kw) -> Message:
        if self.store is not None and not self.unsaved:
            try:
                if self.conv_id is None:
                    self.conv_id = self.store.new_conversation(title or title_from(content), self.model_name,
                                                               self.system_prompt)
                if kw.pop("this_model", False):
                    kw["model_id"] = self._model_row()
                mid = self.store.add_message(self.conv_id, role, content, parent_id, **kw)
                return self.store.message(mid)
            except StoreError as e:
                self._stop_saving(e)
        return Message(next(self._mem_ids), self.conv_id or 0, parent_id, role, content, time.time(),
                       kw.get("reasoning", ""), kw.get("reasoning_forced", False), kw.get("settings") or {},
                       kw.get("stats") or {}, kw.get("model_id"))

    def add_user(self, text: str, upto: int | None = None) -> Message:
        """Add a prompt after path[:upto] (upto=None: at the end; an index: edit & resend that prompt)."""
        if upto is not None:
            self.path = self.path[:upto]
        parent = self.path[-1].id if self.path else None
        msg = self._add("user", text, parent)
        self.path.append(msg)
        return msg

    def add_reply(self, answer: str, reasoning: str, forced: bool, settings: dict,
                  final: FinalStats | None, finish_reason: str | None = None) -> Message:
        """Save a finished (or stopped) reply as the child of the last prompt. `finish_reason` stands in
        for the final stats of a reply cut short before the engine reported them (the app quitting)."""
        parent = self.path[-1].id if self.path else None
        stats = stats_record(final) if final is not None or finish_reason is None else {"finish_reason": finish_reason}
        msg = self._add("assistant", answer, parent, reasoning=reasoning, reasoning_forced=forced,
                        settings=settings, stats=stats, this_model=True)
        self.path.append(msg)
        return msg

    def title(self) -> str:
        """The open conversation's title (its first prompt's where the store has none)."""
        if self.store is not None and self.conv_id is not None and not self.unsaved:
            try:
                return self.store.conversation(self.conv_id).title
            except StoreError:
                pass
        return title_from(next((m.content for m in self.path if m.role == "user"), ""))

    def carry_over(self, messages: list[Message], title: str) -> None:
        """Start a new conversation titled `title` holding copies of `messages` (the last turns of a chat that
        outgrew the context), each with its reasoning, settings and stats; the system prompt comes along."""
        system = self.system_prompt
        self.new()
        self.system_prompt = system
        for m in messages:
            parent = self.path[-1].id if self.path else None
            self.path.append(self._add(m.role, m.content, parent, title=title, reasoning=m.reasoning,
                                       reasoning_forced=m.reasoning_forced, settings=m.settings, stats=m.stats,
                                       model_id=m.model_id if m.id > 0 else None))

    def prepare_regenerate(self) -> bool:
        """Drop the last reply from the branch (it stays in the store as a sibling). False if nothing to redo."""
        if not self.path:
            return False
        if self.path[-1].role == "assistant":
            self.path.pop()
            if self.store is not None and self.conv_id is not None and self.path and not self.unsaved:
                try:
                    self.store.set_leaf(self.conv_id, self.path[-1].id)
                except StoreError as e:
                    self._stop_saving(e)
        return bool(self.path) and self.path[-1].role == "user"

    def drop_failed_prompt(self) -> Message | None:
        """Take the last prompt off the branch (its reply failed before a token: e.g. the prompt does not fit
        the context), so the next prompt does not carry it again; it stays in the store as a side branch."""
        if not self.path or self.path[-1].role != "user":
            return None
        msg = self.path.pop()
        if self.store is not None and self.conv_id is not None and not self.unsaved and msg.id > 0:
            try:
                self.store.set_leaf(self.conv_id, self.path[-1].id if self.path else None)
            except StoreError as e:
                self._stop_saving(e)
        return msg

    def export(self, fmt: str, directory: Path) -> tuple[Path, bool]:
        """Write the open conversation to `directory`: from the store, or, where the store could not take it
        (none, a failed write, nothing saved yet), the branch as shown. Returns (file, whether from memory)."""
        if not self.path:
            raise InputError("nothing to export yet")
        if self.store is not None and not self.unsaved and self.conv_id is not None:
            return export_to_file(self.store, self.conv_id, fmt, directory), False
        first = next((m.content for m in self.path if m.role == "user"), "")
        text = export_branch(self.path, title_from(first), self.model_name, fmt, self.system_prompt)
        return write_export(text, self.conv_id or "unsaved", fmt, directory), True

    def last_reply(self) -> Message | None:
        return next((m for m in reversed(self.path) if m.role == "assistant"), None)

    def switch_version(self, index: int, step: int) -> tuple[int, int] | None:
        """Show another version of path[index] (`step` -1: the previous one, +1: the next): the branch then
        goes through it, down its newest continuation, and is the conversation's (saved: a reopened chat
        shows it, the next prompt continues it). Returns its (1-based index, count); None where there is no
        version that way (or the chat is not stored). StoreError where the store cannot say or save it."""
        msg = self.path[index]
        if self.store is None or self.conv_id is None or self.unsaved or msg.id < 0:
            return None
        sib = self.store.siblings(msg.id)
        to = sib.index(msg.id) + step
        if not 0 <= to < len(sib):
            return None
        leaf = self.store.latest_leaf(sib[to])
        path = self.store.branch(self.conv_id, leaf)
        self.store.set_leaf(self.conv_id, leaf)
        self.path = path
        return to + 1, len(sib)

    def versions(self, msg: Message) -> tuple[int, int]:
        """(1-based index, count) of this message among its regenerated/edited versions."""
        if self.store is None or self.conv_id is None or msg.id < 0:
            return 1, 1
        sib = self.store.siblings(msg.id)
        return sib.index(msg.id) + 1, len(sib)
