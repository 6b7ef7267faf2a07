"""Versions of a message: regenerate a reply, edit and resend a prompt (each a sibling in the store; the old
one is kept)."""
from __future__ import annotations

from ..widgets.chat import MessageView, PromptInput


class VersionsFlow:
    """ChatApp's part for regenerated replies and edited prompts (mixed into the app)."""

    async def action_regenerate(self) -> None:
        if self.generating or self.session is None:
            return
        if not self.chat.prepare_regenerate():
            self.notify("nothing to regenerate", severity="warning")
            return
        self._saving_notice()
        await self._rebuild_log(hint=False)
        await self._start_reply()

    def on_message_view_edit_requested(self, event: MessageView.EditRequested) -> None:
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
