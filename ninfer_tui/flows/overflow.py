"""A chat that outgrew the context: warn before the dead end, offer a new chat carrying the last turns that
fit, change the context size without a restart, and give a prompt whose reply failed back to the input."""
from __future__ import annotations

from typing import Callable

from textual.containers import VerticalScroll
from textual.widgets import Static

from engine.errors import NinferError

from .. import bridge as br
from ..chat import turns
from ..screens import ConfirmScreen, in_field_words
from ..widgets.chat import PromptInput
from ..widgets.stats import StatsPanel


class ContextFlow:
    """ChatApp's part for the context limit (mixed into the app)."""

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
        """Whether these messages and the prompt `text` fit the context with room for a reply (after the
        chat's system prompt)."""
        prompt = self.session.prompt_tokens([*self.chat.system_messages(), *msgs, {"role": "user", "content": text}],
                                            self.settings.request())
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
        try:
            keep = self._last_turns_fitting(all_turns, lambda msgs: self._fits(msgs, text))
        except NinferError as e:
            self.notify(in_field_words(str(e))[0], severity="error", timeout=10)
            return
        context = self.engine.max_context
        if await self._carry_over(all_turns, keep, lambda was, old_id: (
                f"Continued from {was}: the last {keep} of {len(all_turns)} turns came along; the earlier ones "
                f"no longer fit the context of {context} tokens.")):
            await self._send(text)

    @staticmethod
    def _last_turns_fitting(all_turns: list, fits: Callable[[list[dict]], bool]) -> int:
        """How many of the chat's last whole turns `fits` takes (their messages as role / content dicts)."""
        keep = 0
        while keep < len(all_turns) and fits([{"role": m.role, "content": m.content}
                                              for t in all_turns[-(keep + 1):] for m in t]):
            keep += 1
        return keep

    async def _carry_over(self, all_turns: list, keep: int, note: Callable[[str, int | None], str]) -> bool:
        """Continue in a new chat holding the last `keep` of all_turns, its log rebuilt, with a notice on top and
        in a toast: note(was, old id) ("chat #N" or "the chat"). False where the transcripts refused (said)."""
        old_id, title = self.chat.conv_id, self.chat.title()
        carried = [m for t in all_turns[len(all_turns) - keep:] for m in t] if keep else []
        try:
            self.chat.carry_over(carried, f"{title} (continued)")
        except NinferError as e:
            self.notify(str(e), severity="error")
            return False
        self.edit_index = None
        await self._rebuild_log()
        text = note(f"chat #{old_id}" if old_id else "the chat", old_id)
        log = self.query_one("#log", VerticalScroll)
        hint = Static(text, id="carried", classes="hint", markup=False)
        await (log.mount(hint, before=0) if log.children else log.mount(hint))
        self.notify(text, timeout=15)
        self._ready_status()
        self._saving_notice()
        return True

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
