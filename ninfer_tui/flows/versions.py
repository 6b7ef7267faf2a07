"""Versions of a message: regenerate a reply, edit and resend a prompt (each a sibling in the store; the old
one is kept), and move between them (left / right on a focused message): the branch then goes through the
version shown and the next prompt continues it; the store keeps that as the chat's leaf, so a reopened chat
shows it."""
from __future__ import annotations

from engine.errors import NinferError

from ..widgets.chat import MessageView, PromptInput


class VersionsFlow:
    """ChatApp's part for regenerated replies and edited prompts (mixed into the app)."""

    _versions_hinted = False  # the keys that move between versions were named once this session

    async def action_regenerate(self) -> None:
        if self.generating or self.session is None:
            return
        if not self.chat.prepare_regenerate():
            self.notify("nothing to regenerate", severity="warning")
            return
        self._saving_notice()
        await self._rebuild_log(hint=False)
        await self._start_reply()

    def _path_index(self, view: MessageView) -> int | None:
        stored = view.stored
        return next((i for i, m in enumerate(self.chat.path) if stored and m.id == stored.id), None)

    def on_message_view_edit_requested(self, event: MessageView.EditRequested) -> None:
        if self.generating:
            self.notify("wait for the reply or press Esc first", severity="warning")
            return
        idx = self._path_index(event.view)
        if idx is None:
            return
        stored = event.view.stored
        self.edit_index = idx
        prompt = self.query_one("#prompt", PromptInput)
        prompt.load_text(stored.content)
        prompt.move_cursor(prompt.document.end)  # typing goes on after the text, as in the history keys
        prompt.focus()
        self.notify("editing: Enter resends as a new branch (the old one is kept)", timeout=4)

    async def on_message_view_version_requested(self, event: MessageView.VersionRequested) -> None:
        """Show the previous / next version of the focused message, with the newest continuation below it."""
        if self.generating:
            self.notify("wait for the reply or press Esc first", severity="warning")
            return
        idx = self._path_index(event.view)
        if idx is None:
            return
        try:
            shown = self.chat.switch_version(idx, event.step)
        except NinferError as e:
            self.notify(str(e), severity="error")
            return
        what = "prompt" if event.view.stored.role == "user" else "reply"
        if shown is None:
            at, count = event.view.version
            side = "first" if event.step < 0 else "last"
            self.notify(f"this {what} has no other version" if count < 2 else f"this is the {side} version "
                        f"({at}/{count})", timeout=2)
            return
        self.edit_index = None
        await self._rebuild_log()
        views = list(self.query(MessageView))
        if idx < len(views):
            views[idx].focus()  # the same place: the next press goes on from there
        self.notify(f"{what} version {shown[0]}/{shown[1]}", timeout=2)

    def _versions_hint(self, version: tuple[int, int]) -> None:
        """After the first regenerate of the session: say how to see the earlier version."""
        if version[1] < 2 or self._versions_hinted:
            return
        self._versions_hinted = True
        prev, nxt = (self.settings.keymap.get(b, k).split(",")[0].strip()
                     for b, k in (("version_prev", "left"), ("version_next", "right")))
        self.notify(f"reply {version[0]}/{version[1]}: the earlier versions are kept; shift+tab to the reply, then "
                    f"{prev} / {nxt} move between them (the next prompt continues the one shown)", timeout=8)
