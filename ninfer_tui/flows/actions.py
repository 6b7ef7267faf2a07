"""The key actions that change settings for the next reply (F2-F6, F9), copy, help and the command palette."""
from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from textual.app import SystemCommand

from engine.errors import NinferError

from ..keys import ACTIONS, help_rows
from ..remote_ui import refuse, unavailable
from ..screens import HelpScreen, SettingsScreen
from ..settings import ChatSettings, save_user_settings


class SettingsActions:
    """ChatApp's part for the setting keys (mixed into the app)."""

    def _after_change(self, text: str) -> None:
        self._refresh_panel_settings()
        self.notify(text + (" (from the next reply)" if self.generating else ""), timeout=3)

    def action_spec_cycle(self) -> None:
        if refuse(self, "spec"):  # a remote server that sets its speculation itself
            return
        mode, skipped = self.settings.next_spec(self.spec_available)
        extra = f"; unavailable: {'; '.join(skipped)}" if skipped else ""
        self._after_change(f"speculative decoding: {mode}{extra}")

    def action_penalties(self) -> None:
        self.settings.toggle_penalties()
        self._after_change(f"penalties {self.settings.penalties_label()}")

    def action_thinking(self) -> None:
        if refuse(self, "thinking"):
            return
        self.settings.toggle_thinking(self.native_thinking)
        label = self.settings.thinking_label(self.native_thinking)
        note = ": this model has no native thinking" if label.endswith("(prompted)") else ""
        self._after_change(f"thinking {label}{note}")

    def action_budget(self, direction: int) -> None:
        if refuse(self, "budget"):
            return
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

    def action_settings(self) -> None:
        def done(new: ChatSettings | None) -> None:
            if new is None:
                return
            self.settings.__dict__.update(new.__dict__)
            self.chat.default_system = new.system_prompt
            if screen.chat_system != self.chat.system_prompt:
                self.call_later(self._set_system_prompt, screen.chat_system)
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
        context = self.engine.max_context if self.session is not None and not unavailable(self.engine, "context") \
            else None  # a remote server's context is set where it runs: the field is disabled
        screen = SettingsScreen(self.settings, sorted(self.theme_names), context, self.chat.system_prompt)
        self.push_screen(screen, done)

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            return
        self.push_screen(HelpScreen(help_rows(self.settings.keymap)))

    def get_system_commands(self, screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for bid, action, label, key, _ in ACTIONS:
            yield SystemCommand(label, f"{self.settings.keymap.get(bid, key)} · id {bid}",
                                partial(self.run_action, action))
