"""The ninfer-chat Textual app: chat log + input on the left, the live stats panel on the right.

The model loads in a worker thread with visible progress; each reply runs in a worker thread through
`bridge.ReplyBridge`. Settings changed by keys apply from the next reply. Completed turns are saved to the
transcript store immediately. ChatApp holds the state and the layout; each flow is a mixin of its own in
flows/ (loading, a reply, the context limit, versions, chats, the panel, the setting keys); the keys are
keys.py. Choosing a model (flows/models.py) reloads the engine through the same load flow.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from textual.app import App
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Static

from engine.config import SPEC_MODES, EngineArgs
from engine.errors import NinferError

from . import bridge as br
from .chat import ChatState
from .flows.actions import SettingsActions
from .flows.chats import ChatsFlow
from .flows.loading import LoadFlow
from .flows.models import ModelsFlow
from .flows.overflow import ContextFlow
from .flows.panel import PanelFlow
from .flows.persona import PersonaFlow
from .flows.reply import ReplyFlow
from .flows.versions import VersionsFlow
from .keys import ACTIONS, MAIN_ONLY, keymap_problems
from .pacer import FramePacer
from .settings import ChatSettings
from .store import Store
from .telemetry import GpuTelemetry
from .themes import load_themes
from .widgets.chat import MessageView, PromptInput, PromptView, ReplyView
from .widgets.stats import StatsPanel

__all__ = ["ACTIONS", "ChatApp", "keymap_problems"]


class ChatApp(LoadFlow, ModelsFlow, ReplyFlow, ContextFlow, VersionsFlow, ChatsFlow, PanelFlow, PersonaFlow,
              SettingsActions, App):
    TITLE = "ninfer-chat"
    CSS = """
    #main { height: 1fr; }
    #chat-col { width: 1fr; }
    #status { height: 1; background: $panel; color: $text-muted; padding: 0 1; }
    #log { height: 1fr; padding: 0 1; }
    #prompt { height: auto; max-height: 10; min-height: 3; border: round $primary; }
    MessageView { height: auto; margin: 1 0 0 0; padding: 0 1; }
    MessageView:focus { background: $boost; border-left: thick $accent; }
    .who { color: $text-muted; }
    .prompt .who { color: $primary; }
    .reply .who { color: $secondary; }
    .reasoning { background: $surface; color: $text-muted; margin: 0; padding: 0; }
    .reply-footer { color: $text-muted; }
    .hint { color: $warning; margin: 1 0 0 0; padding: 0 1; }
    .answer { margin: 0; padding: 0; }
    .dialog { width: 70; max-width: 100%; height: auto; padding: 1 2; border: thick $accent; background: $surface; }
    .dialog Label { width: 1fr; margin-bottom: 1; }
    .dialog Horizontal { height: auto; }
    .system-note { color: $text-muted; margin: 1 0 0 0; padding: 0 1; border-left: thick $secondary; }
    ConfirmScreen, TextPromptScreen, HelpScreen, TranscriptsScreen, SettingsScreen, SystemPromptScreen {
        align: center middle; }
    #system-box TextArea { height: 10; }
    .system-field { height: 5; margin-bottom: 1; }
    #help-box { width: 90; height: 80%; border: thick $accent; background: $surface; }
    #transcripts-box { width: 100; height: 80%; border: thick $accent; background: $surface; padding: 0 1; }
    #settings-box { width: 80; height: 90%; border: thick $accent; background: $surface; padding: 0 1; }
    #settings-grid { grid-size: 2; grid-columns: 24 1fr; grid-rows: 3; height: auto; }
    #settings-grid Label { padding: 1 0 0 0; }
    """
    BINDINGS = [Binding(key, action, label, id=bid, show=show, priority=(bid != "stop"))
                for bid, action, label, key, show in ACTIONS]

    generating = reactive(False, bindings=True)

    def __init__(self, settings: ChatSettings, engine_args: EngineArgs, loader: Callable,
                 store: Store | None = None, store_error: str | None = None, model_name: str = "",
                 telemetry: GpuTelemetry | None = None, theme_dirs: list[Path] | None = None):
        super().__init__()
        self.settings = settings
        self.engine_args = engine_args
        self.loader = loader
        self.store, self.store_error = store, store_error
        self.model_name = model_name
        self.chat = ChatState(store, model_name, default_system=settings.system_prompt)
        self.engine = None
        self.session = None
        self.load_error: str | None = None  # why the model is not there, once loading failed
        self.spec_available: dict[str, str | None] = {m: None for m in SPEC_MODES}
        self.prompted_thinking = False  # the model has no native thinking markers (reasoning is prompted)
        self.native_thinking: bool | None = None  # None until the model is loaded
        self.bridge: br.ReplyBridge | None = None
        self.reply_view: ReplyView | None = None
        self.reply_settings: dict = {}
        self.edit_index: int | None = None
        self.telemetry = telemetry
        self._theme_dirs = theme_dirs
        self.theme_names: list[str] = []
        self.last_final = None
        self._after_reply = None
        self.replies_started = 0  # for tests and scripts: a reply began
        self._stats_latest = None
        self._frame_timer = None
        self.pacer = FramePacer(settings.stream_fps, settings.ui_cpu_budget)
        self._switch_default = sys.getswitchinterval()
        self._panel_choice: bool | None = None  # F8 this session: the user's choice over the terminal's width
        self._pending_context: int | None = None  # a context size to apply once the reply ends

    def compose(self):
        yield Static("loading model...", id="status", markup=False)
        with Horizontal(id="main"):
            with Vertical(id="chat-col"):
                yield VerticalScroll(id="log")
                yield PromptInput(id="prompt", placeholder="Ask anything (Enter sends, ctrl+j newline)")
            yield StatsPanel(id="stats")
        yield Footer()

    def on_mount(self) -> None:
        themes, warnings = load_themes(self._theme_dirs)
        for t in themes:
            self.register_theme(t)
        self.theme_names = [t.name for t in themes]
        for w in warnings:
            self.notify(w, severity="warning")
        self._apply_theme(self.settings.theme)
        if self.settings.keymap:
            self.set_keymap(self.settings.keymap)
            for problem in keymap_problems(self.settings.keymap):
                self.notify(problem, severity="warning", timeout=15)
        self.query_one("#log", VerticalScroll).anchor()
        self.call_later(self._show_system_note)  # a default system prompt from the config: say so from the start
        self._fit_panel()
        self._refresh_panel_settings()
        if self.store_error:
            self.notify(self.store_error + " - transcripts will not be saved this session", severity="error",
                        timeout=15)
        if self.telemetry is None:
            self.telemetry = GpuTelemetry()
        self._poll_gpu()
        self.set_interval(max(0.2, self.settings.telemetry_interval), self._poll_gpu)
        self.query_one("#prompt", PromptInput).focus()
        self._start_loading()

    def _apply_theme(self, name: str) -> None:
        if name in self.available_themes:
            self.theme = name
        else:
            self.notify(f"theme {name!r} not found; available: {', '.join(sorted(self.theme_names))}",
                        severity="warning")

    def _status(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    def _key(self, binding_id: str, default: str) -> str:
        """The first key of a binding as the user has it (F-keys in capitals, as the status line shows them)."""
        key = self.settings.keymap.get(binding_id, default).split(",")[0].strip()
        return key.upper() if re.fullmatch(r"f\d+", key) else key

    def _ready_status(self) -> None:
        conv = f"chat #{self.chat.conv_id}" if self.chat.conv_id else "new chat"
        folded = self._panel_choice is None and self.settings.show_stats and (panel := self._panel()) is not None \
            and not panel.display  # folded away for the width: say how to see it
        stats = f" · {self._key('toggle_stats', 'f8')} stats" if folded else ""
        self._status(f"{self.model_name} · {conv} · {self._key('help', 'f1')} help{stats} · ctrl+p commands")

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        if self.session is None:
            self.notify(f"no model: {self.load_error}" if self.load_error else "the model is still loading",
                        severity="error" if self.load_error else "warning")
            return
        if self.generating:
            self.notify("a reply is being generated; Esc stops it", severity="warning")
            return
        await self._send(event.text, event.raw)

    async def _send(self, text: str, raw: str | None = None) -> None:
        """Add the prompt to the chat and start its reply (`raw`: the input's text when it was sent)."""
        self.query_one("#prompt", PromptInput).clear_sent(raw if raw is not None else text)
        upto = self.edit_index
        if upto is None and self._unanswered():
            if text == self.chat.path[-1].content:  # the same prompt again: answer the one there
                await self._start_reply()
                return
            upto = len(self.chat.path) - 1  # never two prompts in a row: the new one is its next version
        try:
            if upto is not None:
                msg = self.chat.add_user(text, upto=upto)
                self.edit_index = None
                await self._rebuild_log(hint=False)
            else:
                msg = self.chat.add_user(text)
                await self._mount(PromptView(msg, version=self.chat.versions(msg)))
        except NinferError as e:
            self.query_one("#prompt", PromptInput).load_text(text)  # the prompt is not lost
            self.notify(str(e), severity="error")
            return
        self._saving_notice()
        await self._start_reply()

    def _saving_notice(self) -> None:
        """Say once that the open conversation stopped being saved (a write to the store failed)."""
        if (err := self.chat.take_save_error()) is not None:
            self.notify(err, severity="error", timeout=20)

    async def _mount(self, view: MessageView) -> None:
        log = self.query_one("#log", VerticalScroll)
        await log.mount(view)
        log.anchor()

    def _unanswered(self) -> bool:
        """The branch ends in a prompt with no reply (the app stopped before answering it: a crash, a kill)."""
        return bool(self.chat.path) and self.chat.path[-1].role == "user"

    def _unanswered_hint(self) -> str:
        regen = self.settings.keymap.get("regenerate", "ctrl+r").split(",")[0].strip()
        edit = self.settings.keymap.get("edit_prompt", "e").split(",")[0].strip()
        return (f"This prompt has no reply (the chat stopped before answering it): {regen} answers it, "
                f"{edit} on it edits it; a new prompt takes its place (it stays as a version).")

    async def _rebuild_log(self, hint: bool = True) -> None:
        """The log from the branch; `hint`: say so where it ends in an unanswered prompt (not when a reply to
        it starts next)."""
        log = self.query_one("#log", VerticalScroll)
        await log.remove_children()
        self.reply_view = None
        note = self._system_note()
        views = [note] if note is not None else []
        for m in self.chat.path:
            ver = self.chat.versions(m)
            views.append(PromptView(m, version=ver) if m.role == "user" else
                         ReplyView(m, prompted_thinking=self.prompted_thinking and bool(m.reasoning), version=ver))
        if views:
            await log.mount_all(views)
        if hint and self._unanswered() and not self.generating:
            await log.mount(Static(self._unanswered_hint(), id="unanswered", classes="hint", markup=False))
        log.anchor()

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action in MAIN_ONLY and isinstance(self.screen, Screen) and self.screen is not self.screen_stack[0]:
            return False
        if action == "stop":
            return self.generating
        if action == "regenerate":
            return None if self.generating or not self.chat.path else True
        return True

    def on_unmount(self) -> None:
        if self.bridge is not None:
            self.bridge.cancel.set()
            self._save_partial_reply()
        if self.telemetry is not None:
            self.telemetry.close()
