"""A reply: started in a worker thread through bridge.ReplyBridge, rendered in paced frames (text and live
stats together), saved when it ends; quitting mid-reply saves the text so far."""
from __future__ import annotations

import sys

from engine.errors import NinferError

from .. import bridge as br
from ..chat import stats_record
from ..screens import in_field_words
from ..widgets.chat import PromptInput, ReplyView, footer_line
from ..widgets.stats import StatsPanel

QUIT_WAIT_S = 3.0  # quitting mid-reply: how long the engine gets to stop before the text so far is saved


class ReplyFlow:
    """ChatApp's part that runs replies (mixed into the app)."""

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

    _warming_said = False  # the first-start note was shown as a notice once this session

    def on_warming_note(self, message: br.WarmingNote) -> None:
        """A reply on the engine's start-up tier (the first start): the status line says why it is slower
        until the reply ends; the first time also as a notice."""
        if message.bridge is not self.bridge:
            return
        self._status(f"first start: {message.text}")
        if not self._warming_said:
            self._warming_said = True
            self.notify(f"This reply is slower: {message.text}.", timeout=10)

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
                self._versions_hint(view.version)
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

    def action_stop(self) -> None:
        if self.bridge is not None:
            self.bridge.cancel.set()

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
