"""Which chat is open: a new one, one from the transcripts, and exporting it."""
from __future__ import annotations

from functools import partial

from engine import paths
from engine.errors import NinferError

from ..screens import TranscriptsScreen
from ..widgets.stats import StatsPanel


class ChatsFlow:
    """ChatApp's part that opens and exports chats (mixed into the app)."""

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
