"""The ninfer-chat Textual app: chat log + input on the left, the live stats panel on the right.

The model loads in a worker thread with visible progress; each reply runs in a worker thread through
`bridge.ReplyBridge`. Settings changed by keys apply from the next reply. Completed turns are saved to the
transcript store immediately.
"""
from __future__ import annotations

import re
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Iterable

from textual import on, work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.css.query import NoMatches
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Static

from engine import paths
from engine.config import SPEC_MODES, EngineArgs
from engine.errors import NinferError

from . import bridge as br
from .chat import ChatState, turns
from .pacer import FramePacer
from .screens import ConfirmScreen, HelpScreen, SettingsScreen, TranscriptsScreen, in_field_words
from .settings import ChatSettings, save_user_settings
from .store import Store
from .telemetry import GpuTelemetry
from .themes import load_themes
from .widgets.chat import MessageView, PromptInput, PromptView, ReplyView, footer_line
from .widgets.stats import StatsPanel

# (binding id, action, footer label, default key, shown in footer)
ACTIONS = [
    ("stop", "stop", "Stop", "escape", True),
    ("regenerate", "regenerate", "Regenerate", "ctrl+r", True),
    ("spec_cycle", "spec_cycle", "Spec", "f2", True),
    ("penalties", "penalties", "Penalties", "f3", True),
    ("thinking", "thinking", "Think", "f4", True),
    ("budget_down", "budget(-1)", "Budget -", "f5", False),
    ("budget_up", "budget(1)", "Budget +", "f6", False),
    ("copy_reply", "copy_reply", "Copy reply", "f7", False),
    ("toggle_stats", "toggle_stats", "Stats panel", "f8", False),
    ("settings", "settings", "Settings", "f9", False),
    ("new_chat", "new_chat", "New chat", "ctrl+n", False),
    ("transcripts", "transcripts", "Transcripts", "ctrl+o", True),
    ("export", "export", "Export", "ctrl+s", False),
    ("help", "help", "Help", "f1", True),
    ("quit", "quit", "Quit", "ctrl+q", True),
]
# Shown/used only on the chat screen (priority so that the focused TextArea cannot swallow them).
MAIN_ONLY = {a for _, a, *_ in ACTIONS} - {"quit", "help"}
PROMPT_KEYS = {"send": "enter", "newline": "ctrl+j,shift+enter"}  # the prompt's own keys (PromptInput)
PANEL_MIN_COLUMNS = 100  # a narrower terminal folds the stats panel away (F8 shows it): the chat keeps the width
QUIT_WAIT_S = 3.0  # quitting mid-reply: how long the engine gets to stop before the text so far is saved


def keymap_problems(keymap: dict[str, str]) -> list[str]:
    """What is wrong with a [keymap] (keys that are not keys, a key bound to two actions), a line each."""
    out, owner = [], {}
    defaults = {bid: key for bid, _, _, key, _ in ACTIONS} | PROMPT_KEYS
    for bid, default in defaults.items():
        value = keymap.get(bid, default)
        for key in (k.strip() for k in value.split(",")):
            if not key or key.startswith("+") or key.endswith("+"):
                out.append(f"keymap: {bid} = {value!r} is not a key list (e.g. \"ctrl+r\" or \"f2,ctrl+k\")")
                break
            if key in owner:
                out.append(f"keymap: {key} is bound to both {owner[key]} and {bid}; give one of them another key")
            owner.setdefault(key, bid)
    return out


class ChatApp(App):
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
    ConfirmScreen, TextPromptScreen, HelpScreen, TranscriptsScreen, SettingsScreen { align: center middle; }
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
        self.chat = ChatState(store, model_name)
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

    # -- layout ------------------------------------------------------------------------------------
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
        self._load_engine()

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

    # -- engine loading ----------------------------------------------------------------------------
    @work(thread=True, group="load", exclusive=True)
    def _load_engine(self) -> None:
        br.load_engine(self, self.engine_args, self.loader)

    def on_load_progress(self, message: br.LoadProgress) -> None:
        p = message.progress
        frac = p.done / p.total if p.total else 0.0
        bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
        self._status(f"loading {self.model_name}: {p.stage} [{bar}] {p.done}/{p.total} {p.message}")

    def on_engine_ready(self, message: br.EngineReady) -> None:
        try:  # the session allocates the KV cache: a capacity this machine cannot hold fails here
            session = message.engine.session()
        except NinferError as e:
            self.on_engine_failed(br.EngineFailed(br.error_line(e)))
            return
        self.engine, self.session = message.engine, session
        facts = br.engine_facts(self.engine, self.engine_args)
        self.spec_available = facts.pop("spec_modes")
        self.native_thinking = bool(facts.pop("native_thinking"))
        self.prompted_thinking = not self.native_thinking
        facts["model"] = facts["model"] or self.model_name
        self.query_one("#stats", StatsPanel).on_engine(facts)
        if self.settings.spec != "off" and self.spec_available.get(self.settings.spec):
            self.notify(f"spec {self.settings.spec}: {self.spec_available[self.settings.spec]}; using off",
                        severity="warning")
            self.settings.spec = "off"
        self._refresh_panel_settings()
        self._ready_status()
        self.notify(f"model ready in {message.seconds:.1f} s", timeout=3)

    def on_engine_failed(self, message: br.EngineFailed) -> None:
        self.load_error = message.error
        self._status(f"model failed to load: {message.error}")
        self.query_one("#stats", StatsPanel).on_engine_failed()
        self.notify(message.error, severity="error", timeout=30)

    # -- sending and streaming ---------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def _submitted(self, event: PromptInput.Submitted) -> None:
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

    async def _start_reply(self) -> None:
        for hint in self.query("#unanswered"):
            await hint.remove()
        request = self.settings.request()
        self.reply_settings = self.settings.as_record()
        prompted = self.prompted_thinking and bool(request.thinking.enabled)
        self.reply_view = ReplyView(prompted_thinking=prompted)
        await self._mount(self.reply_view)
        self.bridge = br.ReplyBridge(self, self.session, self.chat.engine_messages(), request,
                                     threads=br.reply_threads(self.engine_args, self.settings.reserve_ui_core))
        self.generating = True
        self.replies_started += 1
        self.pacer.restart()
        # a blinking cursor repaints the screen twice a second: not while the engine needs the CPU
        self.query_one("#prompt", PromptInput).cursor_blink = False
        # The engine thread holds the GIL inside its kernels; when the UI thread takes it between two
        # kernels, a short switch interval hands it back sooner (Python's default is 5 ms).
        self._switch_default = sys.getswitchinterval()
        if self.settings.gil_switch_ms > 0:
            sys.setswitchinterval(self.settings.gil_switch_ms / 1000.0)
        self.query_one("#stats", StatsPanel).start_reply(request.thinking.budget)
        self.run_worker(self.bridge.run, thread=True, exclusive=True, group="reply", exit_on_error=False)

    async def _apply_segments(self, segments) -> None:
        view = self.reply_view
        for kind, value in segments:
            if kind == "answer":
                await view.write_answer(value)
            elif kind == "reasoning":
                await view.write_reasoning(value)
            else:
                await view.mark_forced(value.reasoning_tokens, value.inserted_text)

    # -- frames: text and live stats are rendered together, paced by the UI-thread CPU budget ----------
    def on_stream_ready(self, message: br.StreamReady) -> None:
        if message.bridge is self.bridge:
            self._kick_frame()

    def on_reply_stats(self, message: br.ReplyStats) -> None:
        if message.bridge is self.bridge:
            self._stats_latest = message.stats  # newer stats replace older ones, never queue
            self._kick_frame()

    def _kick_frame(self) -> None:
        if self._frame_timer is None:
            self._frame_timer = self.set_timer(self.pacer.delay(), self._frame)

    async def _frame(self) -> None:
        """Render what arrived since the last frame. While data keeps coming, frames follow each other at
        the paced interval; when the buffer is found empty the bridge is released (next delta posts)."""
        self._frame_timer = None
        bridge = self.bridge
        if bridge is None or self.reply_view is None:
            return
        segments = bridge.drain_or_release()
        stats, self._stats_latest = self._stats_latest, None
        if segments:
            await self._apply_segments(segments)
        panel = self._panel()
        if stats is not None and panel is not None:
            panel.on_step(stats)
        if segments or stats is not None:
            self._frame_timer = self.set_timer(self.pacer.frame_done(), self._frame)

    async def on_reply_done(self, message: br.ReplyDone) -> None:
        if message.bridge is not self.bridge:
            return
        view = self.reply_view
        await self._apply_segments(message.bridge.drain())
        final = message.final
        self.last_final = final
        from .chat import stats_record
        await view.finish(footer_line(stats_record(final)) if final else (message.error or ""))
        if (panel := self._panel()) is not None:  # None while shutting down; the reply is still saved below
            panel.on_final(final)
        if message.error:
            overflow = None
            if final is None and not view.text and not view.reasoning:
                overflow = self._overflow(message.bridge)
                await self._return_failed_prompt()
            if overflow is None:  # the engine names its flags; the chat's settings screen has these fields
                self.notify(in_field_words(message.error)[0], severity="error", timeout=10)
            else:
                self._offer_new_chat(*overflow)
        elif final is not None and final.finish_reason == "cancelled":
            self.notify("stopped; the text so far is kept", timeout=3)
        if view.text or view.reasoning or final is not None:
            try:
                view.stored = self.chat.add_reply(view.text, view.reasoning, view.forced, self.reply_settings, final)
                view.set_version(self.chat.versions(view.stored))
                self._saving_notice()
            except NinferError as e:
                self.notify(f"could not save the reply: {e}", severity="error")
        if final is not None and not view.text and final.finish_reason != "cancelled":
            detail = final.stop_reason_detail or final.finish_reason
            self.notify(f"the reply has no answer text ({detail})", severity="warning")
        if final is not None:
            self._context_warning(final.prompt_tokens + final.output_tokens)
        self.bridge, self.generating = None, False
        if self._pending_context is not None:
            self._apply_context(self._pending_context)
        self.query_one("#prompt", PromptInput).cursor_blink = True
        sys.setswitchinterval(self._switch_default)
        self._ready_status()
        after, self._after_reply = self._after_reply, None
        if after is not None:
            await after()

    # -- a chat that outgrew the context ---------------------------------------------------------
    def _overflow(self, bridge: br.ReplyBridge) -> tuple[int, int] | None:
        """(prompt tokens, context size) where the failed reply's prompt did not fit the context, else None."""
        count = getattr(self.session, "prompt_tokens", None)
        if count is None or self.engine is None:
            return None
        try:
            n = len(count(bridge.messages, bridge.request))
        except NinferError:
            return None
        return (n, self.engine.max_context) if n >= self.engine.max_context else None

    def _reply_room(self) -> int:
        """Context positions kept free for a reply when choosing what fits (a quarter at most)."""
        return min(self.settings.max_new, self.engine.max_context // 4)

    def _context_warning(self, used: int) -> None:
        """Warn before the dead end: the chat leaves less than a reply's room of the context."""
        if self.engine is None or used + self._reply_room() <= self.engine.max_context:
            return
        self.notify(f"the context is nearly full ({used} of {self.engine.max_context} tokens): a prompt that "
                    f"does not fit offers a new chat with the last turns; {self._key('settings', 'f9')} settings "
                    "can raise the context size", severity="warning", timeout=10)

    def _fits(self, msgs: list[dict], text: str) -> bool:
        """Whether these messages and the prompt `text` fit the context with room for a reply."""
        prompt = self.session.prompt_tokens([*msgs, {"role": "user", "content": text}], self.settings.request())
        return len(prompt) + self._reply_room() <= self.engine.max_context

    def _offer_new_chat(self, tokens: int, context: int) -> None:
        """The prompt in the input did not fit with the chat: offer a new chat with the last turns that fit
        (or, where the prompt alone is too long, say what can be done)."""
        settings_key = self._key("settings", "f9")
        text = self.query_one("#prompt", PromptInput).text.strip()
        try:
            alone = self._fits([], text)
        except NinferError as e:  # the settings changed since (a budget max_new cannot hold)
            self.notify(in_field_words(str(e))[0], severity="error", timeout=10)
            return
        if not alone:
            self.notify(f"the prompt alone does not fit the context of {context} tokens with room for a reply: "
                        f"shorten it, or raise the context size ({settings_key} settings)", severity="error",
                        timeout=15)
            return
        question = (f"This chat with the new prompt is {tokens} tokens, more than the context of {context}. "
                    "Continue in a new chat that carries the last turns that fit? (n: the prompt stays in the "
                    f"input; {settings_key} settings can raise the context size)")

        async def answered(yes: bool | None) -> None:
            prompt = self.query_one("#prompt", PromptInput)
            if yes and prompt.text.strip():
                await self._continue_in_new_chat(prompt.text.strip())
        self.push_screen(ConfirmScreen(question), answered)

    async def _continue_in_new_chat(self, text: str) -> None:
        """Start a new chat with the last whole turns of this one that fit the context with `text` and room
        for a reply, say so, and send `text` there."""
        if self.session is None or self.engine is None:
            return
        all_turns = turns(self.chat.path)
        keep = 0
        try:
            while keep < len(all_turns) and self._fits([{"role": m.role, "content": m.content}
                                                        for t in all_turns[-(keep + 1):] for m in t], text):
                keep += 1
        except NinferError as e:
            self.notify(in_field_words(str(e))[0], severity="error", timeout=10)
            return
        context = self.engine.max_context
        old_id, title = self.chat.conv_id, self.chat.title()
        carried = [m for t in all_turns[len(all_turns) - keep:] for m in t] if keep else []
        try:
            self.chat.carry_over(carried, f"{title} (continued)")
        except NinferError as e:
            self.notify(str(e), severity="error")
            return
        self.edit_index = None
        await self._rebuild_log()
        was = f"chat #{old_id}" if old_id else "the chat"
        note = (f"Continued from {was}: the last {keep} of {len(all_turns)} turns came along; the earlier ones "
                f"no longer fit the context of {context} tokens.")
        log = self.query_one("#log", VerticalScroll)
        hint = Static(note, id="carried", classes="hint", markup=False)
        await (log.mount(hint, before=0) if log.children else log.mount(hint))
        self.notify(note, timeout=15)
        self._ready_status()
        self._saving_notice()
        await self._send(text)

    def _apply_context(self, size: int) -> None:
        """Give the running engine this context size (a new session where the KV cache must grow)."""
        self._pending_context = None
        if self.engine is None or self.session is None or size == self.engine.max_context:
            return
        if self.generating:
            self._pending_context = size
            self.notify(f"context size {size}: from when this reply ends", timeout=4)
            return
        try:
            session = self.engine.with_context(size, self.session)
        except NinferError as e:
            self.notify(f"context size not changed: {in_field_words(str(e))[0]}", severity="error", timeout=15)
            return
        grown = session is not self.session
        self.session = session
        self.query_one("#stats", StatsPanel).on_engine({"context_capacity": self.engine.capacity})
        note = " (a new KV cache: the next reply reads the whole chat again)" if grown else ""
        self.notify(f"context size {size} tokens{note}", timeout=6)

    async def _return_failed_prompt(self) -> None:
        """A reply that failed before its first token (a prompt over the context, an engine error): the prompt
        goes back to the input box and off the branch, so the chat is not stuck re-sending it."""
        msg = self.chat.drop_failed_prompt()
        if msg is None:
            return
        self.reply_view = None
        await self._rebuild_log()
        prompt = self.query_one("#prompt", PromptInput)
        if not prompt.text.strip():
            prompt.load_text(msg.content)
            prompt.move_cursor(prompt.document.end)

    # -- actions -----------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple) -> bool | None:
        if action in MAIN_ONLY and isinstance(self.screen, Screen) and self.screen is not self.screen_stack[0]:
            return False
        if action == "stop":
            return self.generating
        if action == "regenerate":
            return None if self.generating or not self.chat.path else True
        return True

    def action_stop(self) -> None:
        if self.bridge is not None:
            self.bridge.cancel.set()

    async def action_regenerate(self) -> None:
        if self.generating or self.session is None:
            return
        if not self.chat.prepare_regenerate():
            self.notify("nothing to regenerate", severity="warning")
            return
        self._saving_notice()
        await self._rebuild_log(hint=False)
        await self._start_reply()

    def _after_change(self, text: str) -> None:
        self._refresh_panel_settings()
        self.notify(text + (" (from the next reply)" if self.generating else ""), timeout=3)

    def action_spec_cycle(self) -> None:
        mode, skipped = self.settings.next_spec(self.spec_available)
        extra = f"; unavailable: {'; '.join(skipped)}" if skipped else ""
        self._after_change(f"speculative decoding: {mode}{extra}")

    def action_penalties(self) -> None:
        self.settings.toggle_penalties()
        self._after_change(f"penalties {self.settings.penalties_label()}")

    def action_thinking(self) -> None:
        self.settings.toggle_thinking(self.native_thinking)
        label = self.settings.thinking_label(self.native_thinking)
        note = ": this model has no native thinking" if label.endswith("(prompted)") else ""
        self._after_change(f"thinking {label}{note}")

    def action_budget(self, direction: int) -> None:
        self.settings.change_budget(direction)
        label = self.settings.thinking_label(self.native_thinking)
        self._after_change(f"thinking budget {self.settings.budget_label()} (thinking {label})")

    def action_copy_reply(self) -> None:
        reply = self.chat.last_reply()
        if reply is None:
            self.notify("no reply to copy yet", severity="warning")
            return
        self.copy_to_clipboard(reply.content)
        self.notify(f"copied the last reply ({len(reply.content)} characters)", timeout=2)

    def action_toggle_stats(self) -> None:
        panel = self.query_one("#stats", StatsPanel)
        self._panel_choice = not panel.display
        self._fit_panel()

    def _fit_panel(self, width: int | None = None) -> None:
        """Show the stats panel where the settings want it and the terminal (`width` columns, default the
        app's) has room for it, or as F8 last chose."""
        if (panel := self._panel()) is None:
            return
        wide = (width or self.size.width) >= PANEL_MIN_COLUMNS
        panel.display = self._panel_choice if self._panel_choice is not None else self.settings.show_stats and wide
        if self.session is not None and not self.generating:
            self._ready_status()

    def on_resize(self, event) -> None:
        self._fit_panel(event.size.width)  # runs before App's own handler records the new size

    async def _when_idle(self, fn) -> None:
        """Run `fn` now, or stop the reply and run it once the reply is saved (never mixes two chats)."""
        if self.generating:
            self._after_reply = fn
            self.action_stop()
        else:
            await fn()

    async def action_new_chat(self) -> None:
        async def go() -> None:
            self.chat.new()
            self.edit_index = None
            await self._rebuild_log()
            self.query_one("#stats", StatsPanel).start_reply()
            self.query_one("#stats", StatsPanel).on_final(None)
            self._ready_status()
        await self._when_idle(go)

    def action_transcripts(self) -> None:
        if self.store is None:
            self.notify(self.store_error or "no transcript store", severity="error")
            return

        async def opened(conv_id: int | None) -> None:
            if conv_id is not None:
                await self._when_idle(partial(self.open_chat, conv_id))
        self.push_screen(TranscriptsScreen(self.store), opened)

    async def open_chat(self, conv_id: int) -> None:
        """Show a saved conversation; one that ends in an unanswered prompt says how to answer it."""
        try:
            self.chat.open(conv_id)
        except NinferError as e:
            self.notify(str(e), severity="error")
            return
        self.edit_index = None
        await self._rebuild_log()
        self._ready_status()
        if self._unanswered():
            self.notify(self._unanswered_hint(), timeout=15)

    def action_export(self) -> None:
        if not self.chat.path:
            self.notify("nothing to export yet", severity="warning")
            return
        try:
            out, in_memory = self.chat.export(self.settings.export_format, paths.user_data_dir() / "exports")
        except (NinferError, OSError) as e:
            self.notify(f"export failed: {e}", severity="error")
            return
        note = " (the conversation as shown: it is not in the transcripts)" if in_memory else ""
        self.notify(f"exported to {out}{note}", timeout=8)

    def action_settings(self) -> None:
        def done(new: ChatSettings | None) -> None:
            if new is None:
                return
            self.settings.__dict__.update(new.__dict__)
            self._apply_theme(new.theme)
            self._panel_choice = None  # the saved choice applies again (where the width allows)
            self._fit_panel()
            if new.max_context is not None:
                self._apply_context(new.max_context)
            try:
                where = save_user_settings(self.settings)
            except (NinferError, OSError) as e:
                self.notify(f"settings applied but not saved: {e}", severity="error")
                return
            self._after_change(f"settings saved to {where}")
        context = self.engine.max_context if self.session is not None else None
        self.push_screen(SettingsScreen(self.settings, sorted(self.theme_names), context), done)

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        rows = []
        keymap = self.settings.keymap
        for bid, _, label, key, _ in ACTIONS:
            rows.append((keymap.get(bid, key), bid, label))
        rows += [(keymap.get("send", "enter"), "send", "Send the prompt"),
                 (keymap.get("newline", "ctrl+j,shift+enter"), "newline", "New line in the prompt"),
                 ("up", "history_prev", "Previous prompt (on an empty input)"),
                 (keymap.get("edit_prompt", "e,enter"), "edit_prompt", "Edit & resend the focused prompt"),
                 (keymap.get("copy_message", "c"), "copy_message", "Copy the focused message"),
                 (keymap.get("copy_code", "b"), "copy_code", "Copy the focused message's code block")]
        self.push_screen(HelpScreen(rows))

    def get_system_commands(self, screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for bid, action, label, key, _ in ACTIONS:
            yield SystemCommand(label, f"{self.settings.keymap.get(bid, key)} · id {bid}",
                                partial(self.run_action, action))

    # -- helpers -----------------------------------------------------------------------------------
    def _refresh_panel_settings(self) -> None:
        self.query_one("#stats", StatsPanel).on_settings(self.settings, self.spec_available,
                                                         self.native_thinking)

    async def _rebuild_log(self, hint: bool = True) -> None:
        """The log from the branch; `hint`: say so where it ends in an unanswered prompt (not when a reply to
        it starts next)."""
        log = self.query_one("#log", VerticalScroll)
        await log.remove_children()
        self.reply_view = None
        views = []
        for m in self.chat.path:
            ver = self.chat.versions(m)
            views.append(PromptView(m, version=ver) if m.role == "user" else
                         ReplyView(m, prompted_thinking=self.prompted_thinking and bool(m.reasoning), version=ver))
        if views:
            await log.mount_all(views)
        if hint and self._unanswered() and not self.generating:
            await log.mount(Static(self._unanswered_hint(), id="unanswered", classes="hint", markup=False))
        log.anchor()

    @on(MessageView.EditRequested)
    def _edit(self, event: MessageView.EditRequested) -> None:
        if self.generating:
            self.notify("wait for the reply or press Esc first", severity="warning")
            return
        stored = event.view.stored
        idx = next((i for i, m in enumerate(self.chat.path) if stored and m.id == stored.id), None)
        if idx is None:
            return
        self.edit_index = idx
        prompt = self.query_one("#prompt", PromptInput)
        prompt.load_text(stored.content)
        prompt.move_cursor(prompt.document.end)  # typing goes on after the text, as in the history keys
        prompt.focus()
        self.notify("editing: Enter resends as a new branch (the old one is kept)", timeout=4)

    def _poll_gpu(self) -> None:
        panel = self._panel()
        if panel is None:  # shutting down: the chat screen is gone
            return
        tel = self.telemetry
        panel.on_gpu(tel.sample() if tel is not None else [], tel.reason if tel else "")

    def _panel(self) -> StatsPanel | None:
        try:
            return self.screen_stack[0].query_one("#stats", StatsPanel) if self.screen_stack else None
        except NoMatches:
            return None

    async def action_quit(self) -> None:
        """Quit; a reply still streaming is stopped and saved first, as Esc would (QUIT_WAIT_S at most)."""
        if not self.generating or self.bridge is None:
            self.exit()
            return

        async def leave() -> None:
            self.exit()
        self._after_reply = leave
        self.action_stop()
        self.set_timer(QUIT_WAIT_S, self._quit_now)

    def _quit_now(self) -> None:
        self._save_partial_reply()
        self.exit()

    def _save_partial_reply(self) -> None:
        """Save what a reply has streamed so far, without waiting for the engine (the app is going away)."""
        bridge, view = self.bridge, self.reply_view
        if bridge is None or view is None or getattr(view, "stored", None) is not None:
            return
        self.bridge = None  # a ReplyDone still on its way is ignored: the reply is saved here, once
        text, reasoning = view.text, view.reasoning
        for kind, value in bridge.drain():
            if kind == "answer":
                text += value
            elif kind == "reasoning":
                reasoning += value
        if text or reasoning:
            try:
                self.chat.add_reply(text, reasoning, view.forced, self.reply_settings, None, "cancelled")
            except NinferError:
                pass  # the chat already said saving had stopped; nothing left to tell on the way out

    def on_unmount(self) -> None:
        if self.bridge is not None:
            self.bridge.cancel.set()
            self._save_partial_reply()
        if self.telemetry is not None:
            self.telemetry.close()
