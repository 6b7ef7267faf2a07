"""Modal screens: help, confirmation, a one-line prompt, the transcripts browser, settings."""
from __future__ import annotations

import re
import time

from rich.text import Text
from textual import on
from textual.binding import Binding
from textual.markup import escape
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Label, Markdown, Select, Static, Switch, TextArea

from engine.config import SPEC_MODES
from engine.errors import NinferError

from .settings import THINKING_MODES, ChatSettings
from .store import Store, StoreError


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,f1", "dismiss", "Close", id="close_help")]

    def __init__(self, rows: list[tuple[str, str, str]]):
        super().__init__()
        self.rows = rows  # (keys, binding id, description)

    def compose(self):
        table = "\n".join(f"| `{k}` | {d} | `{i}` |" for k, i, d in self.rows)
        text = ("# ninfer-chat keys\n\n| key | action | keymap id |\n|---|---|---|\n" + table +
                "\n\nTab / shift+tab focus a message for the keys that say \"focused\"."
                "\n\nRemap any key in the `[keymap]` table of your config.toml "
                "(binding id = \"key\"). ctrl+p opens the command palette.")
        with VerticalScroll(id="help-box"):
            yield Markdown(text)


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("y", "yes", "Yes", id="confirm_yes"), Binding("n,escape", "no", "No", id="confirm_no")]

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(self.question, markup=False)  # it may quote a title the user typed
            with Horizontal():
                yield Button("Yes (y)", id="yes", variant="error")
                yield Button("No (n)", id="no")

    def action_yes(self) -> None:
        self.dismiss(True)

    def action_no(self) -> None:
        self.dismiss(False)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class TextPromptScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel", id="prompt_cancel")]

    def __init__(self, question: str, value: str = ""):
        super().__init__()
        self.question, self.value = question, value

    def compose(self):
        with Vertical(classes="dialog"):
            yield Label(self.question, markup=False)  # it may quote a title the user typed
            yield Input(self.value, id="answer")

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value)

    def action_cancel(self) -> None:
        self.dismiss(None)


class SystemPromptScreen(ModalScreen[str | None]):
    """Edit the open chat's system prompt (persona); dismisses with the new text (None: cancelled)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel", id="system_cancel"),
                Binding("ctrl+s", "save", "Save", id="system_save", priority=True)]

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def compose(self):
        with Vertical(classes="dialog", id="system-box"):
            yield Label("System prompt of this chat (a persona or instructions), sent before the conversation "
                        "from the next reply and stored with the chat; empty: none. ctrl+s save · esc cancel")
            yield TextArea(self.text, id="system-text", soft_wrap=True, show_line_numbers=False)

    def on_mount(self) -> None:
        area = self.query_one("#system-text", TextArea)
        area.focus()
        area.move_cursor(area.document.end)

    def action_save(self) -> None:
        self.dismiss(self.query_one("#system-text", TextArea).text.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)


class TranscriptsScreen(ModalScreen[int | None]):
    """List / search / open / rename / delete saved conversations. Dismisses with the id to open."""

    BINDINGS = [
        Binding("escape", "close", "Close", id="transcripts_close"),
        Binding("enter", "open", "Open", id="transcripts_open", priority=True),
        Binding("ctrl+r,f2", "rename", "Rename", id="transcripts_rename"),
        Binding("delete,ctrl+d", "delete", "Delete", id="transcripts_delete"),
        Binding("ctrl+f,slash", "search", "Search", id="transcripts_search", show=False),
    ]

    def __init__(self, store: Store):
        super().__init__()
        self.store = store

    def compose(self):
        with Vertical(id="transcripts-box"):
            yield Label("Transcripts  (enter open · ctrl+r rename · delete remove · type to search · esc close)")
            yield Input(placeholder="search titles and messages", id="search")
            yield DataTable(id="list", cursor_type="row", zebra_stripes=True)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("id", "title", "messages", "updated")
        self.refresh_list()

    def refresh_list(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        query = self.query_one("#search", Input).value
        try:
            convs = self.store.list_conversations(query)
        except Exception as e:  # a malformed FTS query: show it, keep the list usable
            self.notify(f"search: {e}", severity="warning")
            convs = []
        for c in convs:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
            # Text, not str: DataTable reads a str cell as markup, and a title like "what does [/b] do?" is not
            table.add_row(str(c.id), Text(c.title[:60]), str(c.n_messages), when, key=str(c.id))

    @on(Input.Changed, "#search")
    def _search(self) -> None:
        self.refresh_list()

    def _selected(self) -> int | None:
        table = self.query_one(DataTable)
        if table.row_count == 0:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key
        return int(key.value)

    def action_search(self) -> None:
        self.query_one("#search", Input).focus()

    def action_open(self) -> None:
        cid = self._selected()
        if cid is not None:
            self.dismiss(cid)

    def action_close(self) -> None:
        self.dismiss(None)

    def action_rename(self) -> None:
        cid = self._selected()
        if cid is None:
            return

        def done(title: str | None) -> None:
            if title:
                try:
                    self.store.rename(cid, title)
                except StoreError as e:
                    self.notify(f"not renamed: {e}", severity="error")
                self.refresh_list()
        self.app.push_screen(TextPromptScreen("New title:", self.store.conversation(cid).title), done)

    def action_delete(self) -> None:
        cid = self._selected()
        if cid is None:
            return
        title = self.store.conversation(cid).title

        def done(yes: bool | None) -> None:
            if yes:
                try:
                    self.store.delete(cid)
                except StoreError as e:
                    self.notify(f"not deleted: {e}", severity="error")
                else:
                    self.notify(f"deleted conversation {cid}")
                self.refresh_list()
        self.app.push_screen(ConfirmScreen(f"Delete conversation {cid} \u201c{title}\u201d? This cannot be undone."),
                             done)


# The engine's checks name command-line flags; the settings screen names its own fields instead.
FIELD_OF_FLAG = {"--temperature": "temperature", "--top-k": "top_k", "--top-p": "top_p", "--min-p": "min_p",
                 "--max-new": "max_new", "--presence-penalty": "presence", "--frequency-penalty": "frequency",
                 "--thinking-budget": "budget", "--draft-tokens": "draft_tokens", "--seed": "seed",
                 "--max-context": "max_context"}
FLAG_RE = re.compile(r"--[a-z][a-z-]*")


def field_label(name: str) -> str:
    return "context size" if name == "max_context" else name.replace("_", " ")


def in_field_words(message: str) -> tuple[str, str | None]:
    """An engine error with its flags named as the settings screen's fields, and the first such field."""
    first = None

    def sub(m: re.Match) -> str:
        nonlocal first
        name = FIELD_OF_FLAG.get(m.group(0))
        if name is None:
            return m.group(0)
        first = first or name
        return f'"{field_label(name)}"'
    return FLAG_RE.sub(sub, message), first


class SettingsScreen(ModalScreen[ChatSettings | None]):
    """Edit sampling, penalties, thinking, spec and theme; Save applies and writes the user config."""

    AUTO_FOCUS = "#set-temperature"  # the first field: typing edits it at once
    BINDINGS = [Binding("escape", "cancel", "Cancel", id="settings_cancel"),
                Binding("ctrl+s", "save", "Save", id="settings_save", priority=True)]

    NUMBERS = [("temperature", float), ("top_k", int), ("top_p", float), ("min_p", float), ("max_new", int),
               ("presence", float), ("frequency", float), ("budget", int), ("budget_step", int),
               ("draft_tokens", int)]

    def __init__(self, settings: ChatSettings, themes: list[str], context: int | None = None,
                 chat_system: str = ""):
        super().__init__()
        self.settings = settings
        self.themes = themes
        self.context = context  # the engine's context size now (None: no model yet)
        self.chat_system = chat_system  # the open chat's system prompt; set from its field on save
        self._bad_field: str | None = None  # the field the last error is about (focused for the fix)

    def compose(self):
        s = self.settings
        with VerticalScroll(id="settings-box"):
            yield Label("Settings (ctrl+s save to your config · esc cancel)", classes="title")
            with Grid(id="settings-grid"):
                for name, _ in self.NUMBERS:
                    yield Label(field_label(name))
                    yield Input(str(getattr(s, name)), id=f"set-{name}")
                yield Label("context size (tokens)")
                yield Input("" if self.context is None else str(self.context), id="set-max_context",
                            placeholder="as loaded", disabled=self.context is None)
                yield Label("seed (empty: random)")
                yield Input("" if s.seed is None else str(s.seed), id="set-seed")
                yield Label("penalties on")
                yield Switch(s.penalties_on, id="set-penalties_on")
                yield Label("thinking")
                yield Select([(m, m) for m in THINKING_MODES], value=s.thinking, allow_blank=False,
                             id="set-thinking")
                yield Label("speculative mode")
                yield Select([(m, m) for m in SPEC_MODES], value=s.spec, allow_blank=False, id="set-spec")
                yield Label("theme")
                themes = self.themes if s.theme in self.themes else self.themes + [s.theme]
                yield Select([(t, t) for t in themes], value=s.theme, allow_blank=False, id="set-theme")
                yield Label("show stats panel")
                yield Switch(s.show_stats, id="set-show_stats")
            yield Label("system prompt of this chat (stored with it; empty: none)")
            yield TextArea(self.chat_system, id="set-chat_system", classes="system-field", soft_wrap=True)
            yield Label("system prompt of new chats (saved to your config)")
            yield TextArea(s.system_prompt, id="set-system_prompt", classes="system-field", soft_wrap=True)
            with Horizontal():
                yield Button("Save", id="save", variant="primary")
                yield Button("Cancel", id="cancel")
            yield Static("", id="settings-error")

    def _collect(self) -> ChatSettings:
        import dataclasses
        new = dataclasses.replace(self.settings, keymap=dict(self.settings.keymap))
        for name, kind in self.NUMBERS:
            raw = self.query_one(f"#set-{name}", Input).value.strip()
            try:
                setattr(new, name, kind(raw))
            except ValueError:
                self._bad_field = name
                raise NinferError(f"{field_label(name)}: {raw!r} is not a valid {kind.__name__}") from None
        seed = self.query_one("#set-seed", Input).value.strip()
        try:
            new.seed = int(seed) if seed else None
        except ValueError:
            self._bad_field = "seed"
            raise NinferError(f"seed: {seed!r} is not an integer") from None
        context = self.query_one("#set-max_context", Input).value.strip()
        if self.context is not None and context:  # written to the config only once changed here
            try:
                size = int(context)
                new.max_context = size if size != self.context else new.max_context
            except ValueError:
                self._bad_field = "max_context"
                raise NinferError(f"context size: {context!r} is not an integer") from None
        if new.max_context is not None and new.max_context < 1:
            self._bad_field = "max_context"
            raise NinferError(f"context size must be >= 1, got {new.max_context}")
        if new.budget_step < 1:
            self._bad_field = "budget_step"
            raise NinferError(f"budget step must be >= 1 (the F5/F6 step), got {new.budget_step}")
        new.penalties_on = self.query_one("#set-penalties_on", Switch).value
        new.show_stats = self.query_one("#set-show_stats", Switch).value
        new.thinking = self.query_one("#set-thinking", Select).value
        new.spec = self.query_one("#set-spec", Select).value
        new.theme = self.query_one("#set-theme", Select).value
        new.system_prompt = self.query_one("#set-system_prompt", TextArea).text.strip()
        try:
            new.validate()
        except NinferError as e:  # the engine's checks speak of flags: say the field instead
            text, self._bad_field = in_field_words(str(e))
            raise NinferError(text) from None
        return new

    def action_save(self) -> None:
        self._bad_field = None
        try:
            new = self._collect()
        except NinferError as e:
            err = self.query_one("#settings-error", Static)
            err.update(f"[b red]{escape(str(e))}[/]")  # the text as typed
            err.scroll_visible()  # below the buttons: out of sight on a short terminal, so a toast says it too
            self.notify(f"not saved: {e}", severity="error", markup=False)
            if self._bad_field is not None:
                self.query_one(f"#set-{self._bad_field}", Input).focus()
            return
        self.chat_system = self.query_one("#set-chat_system", TextArea).text.strip()
        self.dismiss(new)

    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.action_save() if event.button.id == "save" else self.action_cancel()
