"""A chat's system prompt (persona): edited with its key (ctrl+t) or on the settings screen, stored with the
chat (ChatState.set_system_prompt), sent first from the next reply, shown atop the log."""
from __future__ import annotations

from textual.widgets import Static

from ..screens import SystemPromptScreen

SYSTEM_NOTE_CHARS = 300  # the note atop the log shows this much of a long system prompt


class PersonaFlow:
    """ChatApp's part for the system prompt (mixed into the app)."""

    def action_system_prompt(self) -> None:
        def done(text: str | None) -> None:
            if text is not None:
                self.call_later(self._set_system_prompt, text)
        self.push_screen(SystemPromptScreen(self.chat.system_prompt), done)

    async def _set_system_prompt(self, text: str) -> None:
        """Give the open chat this system prompt (from the next reply) and say so."""
        if text == self.chat.system_prompt:
            return
        self.chat.set_system_prompt(text)
        self._saving_notice()
        await self._show_system_note()
        what = "system prompt removed" if not text else "system prompt set"
        self.notify(what + (" (from the next reply)" if self.generating else ""), timeout=4)

    def _system_note(self) -> Static | None:
        """The note atop the log that shows the chat's system prompt (None when it has none)."""
        text = self.chat.system_prompt
        if not text:
            return None
        short = text if len(text) <= SYSTEM_NOTE_CHARS else text[:SYSTEM_NOTE_CHARS] + "..."
        key = self._key("system_prompt", "ctrl+t")
        return Static(f"System prompt ({key} to change): {short}", id="system-note", classes="system-note",
                      markup=False)

    async def _show_system_note(self) -> None:
        """Put the note atop the log in line with the chat's system prompt."""
        log = self.query_one("#log")
        for old in self.query("#system-note"):
            await old.remove()
        note = self._system_note()
        if note is not None:
            await (log.mount(note, before=0) if log.children else log.mount(note))
