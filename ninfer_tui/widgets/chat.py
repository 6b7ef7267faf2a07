"""Chat widgets: the prompt input, a prompt bubble, a reply (reasoning collapsible + streamed Markdown answer).

Messages are focusable (tab / shift+tab, a click): `c` copies the message, `b` copies its code blocks one
after the other, `e` (on a prompt) loads it into the input to edit and resend, left / right show the previous /
next version of a regenerated reply or an edited prompt. Typing on a focused message
is typing a prompt: the characters go to the input, and those letters are not message keys then (a click on
a message and a prompt typed on used to copy over the clipboard at each c or b).
"""
from __future__ import annotations

import re

from textual import events, on
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.reactive import reactive
from textual.widgets import Collapsible, Markdown, Static, TextArea

from ..store import Message as StoredMessage

TYPING_WINDOW_S = 0.3  # a message key followed this soon by a letter that is not one was typing, not a key
FENCE_RE = re.compile(r"^(```|~~~)[^\n]*\n(.*?)^\1\s*$", re.S | re.M)


def code_blocks(text: str) -> list[str]:
    """Contents of the fenced code blocks of a Markdown text, in order."""
    return [m.group(2).rstrip("\n") for m in FENCE_RE.finditer(text)]


class PromptInput(TextArea):
    """Multi-line input: Enter sends, ctrl+j (or shift+enter where the terminal reports it) adds a newline,
    Up on an empty prompt recalls history."""

    BINDINGS = [
        Binding("enter", "submit", "Send", priority=True, id="send"),
        Binding("ctrl+j,shift+enter", "newline", "Newline", show=False, priority=True, id="newline"),
        Binding("up", "history_prev", "History", show=False, id="history_prev"),
        Binding("down", "history_next", show=False, id="history_next"),
    ]

    class Submitted(Message):
        def __init__(self, text: str, raw: str | None = None):
            super().__init__()
            self.text = text  # stripped
            self.raw = text if raw is None else raw  # as it stood in the input

    def __init__(self, **kw):
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kw)
        self.prompt_history: list[str] = []
        self._hist_pos: int | None = None

    def action_submit(self) -> None:
        # A priority binding runs as the app receives the key, while the keys typed before it may still wait
        # in this widget's queue (a fast burst: a paste without bracketed paste, a busy UI): read the text
        # after them, or Enter sends a cut prompt, or none.
        self.call_later(self._submit_now)

    def _submit_now(self) -> None:
        raw = self.text
        text = raw.strip()
        if not text:
            return
        if not self.prompt_history or self.prompt_history[-1] != text:
            self.prompt_history.append(text)
        self._hist_pos = None
        self.post_message(self.Submitted(text, raw))

    def clear_sent(self, raw: str | None) -> None:
        """Take the text that was sent out of the input, keeping what was typed after it: the keys after
        Enter in a burst reach this widget before the app takes the prompt (they were wiped)."""
        rest = self.text[len(raw):] if raw and self.text.startswith(raw) else ""
        self.load_text(rest)
        self.move_cursor(self.document.end)

    async def _on_key(self, event: events.Key) -> None:
        """A key bound on this widget (Backspace, Delete, the arrows, ctrl+w ...) acts here, in the order the
        keys were typed. Textual runs a widget's non-priority bindings only once the key has bubbled up to
        the App (App._on_key), one message queue per ancestor later, while the keys after it are inserted
        by this widget meanwhile: in a burst (a fast typist, a paste without bracketed paste, a busy UI)
        "hello", 2 x Backspace, "p" gave "hell". Bare Input and TextArea do the same; the upstream report
        is docs/upstream-textual-backspace.md. Priority bindings (Enter) still run at the App, queued here
        by call_later (action_submit)."""
        if not event.is_printable and await self._own_binding(event.key):
            event.stop()
            event.prevent_default()  # not Widget._on_key's key_ methods either, as a handled binding
            return
        await super()._on_key(event)

    async def _own_binding(self, key: str) -> bool:
        """Run this widget's non-priority binding for `key` (the app's keymap applied), as App._check_bindings
        would; False when none ran (the key goes on as before: typed text, or up the DOM)."""
        chain = self.screen._binding_chain  # [(node, its bindings after the keymap)], the focused node first
        if not chain or chain[0][0] is not self:
            return False
        for binding in chain[0][1].key_to_bindings.get(key, ()):
            if not binding.priority and await self.app.run_action(binding.action, self):
                return True
        return False

    def action_newline(self) -> None:
        # priority too, then queued like submit: it lands between the keys typed before and after it
        self.call_later(self._newline_now)

    def _newline_now(self) -> None:
        start, end = self.selection
        self._replace_via_keyboard("\n", start, end)

    def action_history_prev(self) -> None:
        if self.prompt_history and (not self.text or self._hist_pos is not None) and self.cursor_location[0] == 0:
            self._hist_pos = len(self.prompt_history) - 1 if self._hist_pos is None else max(0, self._hist_pos - 1)
            self.load_text(self.prompt_history[self._hist_pos])
            self.move_cursor(self.document.end)
        else:
            self.action_cursor_up()

    def action_history_next(self) -> None:
        last_row = self.document.line_count - 1
        if self._hist_pos is not None and self.cursor_location[0] == last_row:
            self._hist_pos += 1
            if self._hist_pos >= len(self.prompt_history):
                self._hist_pos = None
                self.load_text("")
            else:
                self.load_text(self.prompt_history[self._hist_pos])
                self.move_cursor(self.document.end)
        else:
            self.action_cursor_down()


class MessageView(Vertical, can_focus=True):
    """Base for a prompt or a reply in the chat log."""

    BINDINGS = [
        Binding("c", "copy", "Copy message", id="copy_message"),
        Binding("b", "copy_code", "Copy code block", id="copy_code"),
        Binding("left", "version(-1)", "Previous version", id="version_prev"),
        Binding("right", "version(1)", "Next version", id="version_next"),
    ]

    class EditRequested(Message):
        def __init__(self, view: "MessageView"):
            super().__init__()
            self.view = view

    class VersionRequested(Message):
        """Show another version of this message (step -1: the previous one, +1: the next)."""

        def __init__(self, view: "MessageView", step: int):
            super().__init__()
            self.view, self.step = view, step

    def __init__(self, stored: StoredMessage | None, text: str = "", **kw):
        super().__init__(**kw)
        self.stored = stored
        self.text = stored.content if stored else text
        self._code_index = 0
        self._held: tuple[str, str, object] | None = None  # a message key held back: (character, action, timer)

    # -- typing on a focused message goes to the prompt ------------------------------------------------
    def _prompt(self) -> PromptInput | None:
        found = self.screen.query(PromptInput)
        return found.first() if found else None

    def _type_into_prompt(self, text: str) -> None:
        prompt = self._prompt()
        if prompt is None:
            return
        prompt.insert(text)
        prompt.focus()

    def _run_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held[2].stop()
            self.call_later(self.run_action, held[1])

    def on_paste(self, event: events.Paste) -> None:
        """A paste on a focused message is a paste into the prompt (it was dropped)."""
        event.stop()
        self._run_held()
        self._type_into_prompt(event.text)

    def on_key(self, event: events.Key) -> None:
        """Printable keys: typing goes to the prompt. A message key (c, b, e, as remapped) acts only when it
        is not part of typing: never while the prompt holds a draft, and otherwise after TYPING_WINDOW_S
        without another letter (one arriving first makes both text of the prompt)."""
        active = self.screen.active_bindings.get(event.key)
        message_key = active is not None and isinstance(active.node, MessageView) and active.enabled
        if self._held is not None:
            if event.is_printable and not message_key:
                held, self._held = self._held, None
                held[2].stop()
                event.stop()
                event.prevent_default()
                self._type_into_prompt(held[0] + (event.character or ""))
                return
            self._run_held()  # another message key or a navigation key: the held one was meant as a key
        if not event.is_printable or event.character is None:
            return
        event.stop()
        event.prevent_default()
        prompt = self._prompt()
        if message_key and not (prompt is not None and prompt.text.strip()):
            self._held = (event.character, active.binding.action, self.set_timer(TYPING_WINDOW_S, self._run_held))
            return
        self._type_into_prompt(event.character)

    def action_version(self, step: int) -> None:
        self.post_message(self.VersionRequested(self, step))

    def action_copy(self) -> None:
        self.app.copy_to_clipboard(self.text)
        self.app.notify(f"copied the message ({len(self.text)} characters)", timeout=2)

    def action_copy_code(self) -> None:
        blocks = code_blocks(self.text)
        if not blocks:
            self.app.notify("this message has no code block", severity="warning", timeout=2)
            return
        i = self._code_index % len(blocks)
        self._code_index += 1
        self.app.copy_to_clipboard(blocks[i])
        self.app.notify(f"copied code block {i + 1}/{len(blocks)}", timeout=2)


class PromptView(MessageView):
    BINDINGS = [Binding("e,enter", "edit", "Edit & resend", id="edit_prompt")]

    def __init__(self, stored: StoredMessage | None, text: str = "", version: tuple[int, int] = (1, 1), **kw):
        super().__init__(stored, text, classes="prompt", **kw)
        self.version = version

    def compose(self):
        v = f"  [{self.version[0]}/{self.version[1]}]" if self.version[1] > 1 else ""
        yield Static(f"[b]You[/b]{v}", classes="who")
        yield Static(self.text, classes="body", markup=False)

    def action_edit(self) -> None:
        self.post_message(self.EditRequested(self))


class ReplyView(MessageView):
    """A reply: reasoning (collapsible, collapsed once the answer starts) above the streamed answer."""

    streaming = reactive(False)

    def __init__(self, stored: StoredMessage | None = None, prompted_thinking: bool = False,
                 version: tuple[int, int] = (1, 1), **kw):
        super().__init__(stored, classes="reply", **kw)
        self.reasoning = stored.reasoning if stored else ""
        self.forced = stored.reasoning_forced if stored else False
        self.prompted = prompted_thinking
        self.version = version
        self._answer_stream = None
        self._reason_stream = None
        self.footer_text = ""

    def compose(self):
        v = f"  [{self.version[0]}/{self.version[1]}]" if self.version[1] > 1 else ""
        yield Static(f"[b]Assistant[/b]{v}", classes="who")
        coll = Collapsible(Markdown(self.reasoning, classes="reasoning-md"), title=self._reason_title(),
                           collapsed=bool(self.text), classes="reasoning")
        coll.display = bool(self.reasoning) or self.forced
        yield coll
        yield Markdown(self.text, classes="answer")
        yield Static(self._footer_from_stored(), classes="reply-footer", markup=False)

    def set_version(self, version: tuple[int, int]) -> None:
        """Show "[2/3]" when this reply has regenerated siblings."""
        self.version = version
        v = f"  [{version[0]}/{version[1]}]" if version[1] > 1 else ""
        self.query_one(".who", Static).update(f"[b]Assistant[/b]{v}")

    def _reason_title(self) -> str:
        kind = "Reasoning (prompted)" if self.prompted else "Reasoning"
        return kind + ("  [budget reached: close forced]" if self.forced else "")

    def _footer_from_stored(self) -> str:
        st = self.stored.stats if self.stored else {}
        if not st:
            return ""
        return footer_line(st)

    # -- streaming (called by the app, UI thread) --------------------------------------------------
    async def write_reasoning(self, text: str) -> None:
        coll = self.query_one(".reasoning", Collapsible)
        if not coll.display:
            coll.display = True
            coll.collapsed = False
        if self._reason_stream is None:
            self._reason_stream = Markdown.get_stream(self.query_one(".reasoning-md", Markdown))
        self.reasoning += text
        await self._reason_stream.write(text)

    async def mark_forced(self, reasoning_tokens: int, inserted: str) -> None:
        """A visible mark where the thinking budget forced the close."""
        self.forced = True
        mark = f"\n\n---\n**[budget of {reasoning_tokens} reasoning tokens reached: close forced]**\n"
        await self.write_reasoning(mark)
        self.query_one(".reasoning", Collapsible).title = self._reason_title()

    async def write_answer(self, text: str) -> None:
        if self._answer_stream is None:
            coll = self.query_one(".reasoning", Collapsible)
            if coll.display:
                coll.collapsed = True  # the answer started: fold the reasoning away
            self._answer_stream = Markdown.get_stream(self.query_one(".answer", Markdown))
        self.text += text
        await self._answer_stream.write(text)

    async def finish(self, footer: str) -> None:
        """Stop the streams and render the full text once (MarkdownStream can differ on rare fences)."""
        for stream, md, full in ((self._reason_stream, ".reasoning-md", self.reasoning),
                                 (self._answer_stream, ".answer", self.text)):
            if stream is not None:
                await stream.stop()
                await self.query_one(md, Markdown).update(full)
        self._answer_stream = self._reason_stream = None
        self.footer_text = footer
        self.query_one(".reply-footer", Static).update(footer)

    @on(Collapsible.Toggled)
    def _keep_focus(self, event) -> None:
        event.stop()


def footer_line(st: dict) -> str:
    """One line under a finished reply: tokens, speed, finish reason, spec mode."""
    parts = [f"{st.get('output_tokens', 0)} tok", f"{st.get('decode_tok_s', 0.0):.1f} tok/s",
             f"ttft {st.get('ttft_s', 0.0) * 1000:.0f} ms"]
    if st.get("reasoning_tokens"):
        parts.append(f"reasoning {st['reasoning_tokens']}")
    if st.get("spec_mode", "off") != "off":
        parts.append(f"spec {st['spec_mode']} acc {st.get('acceptance', 0.0):.0%}")
    fin = st.get("finish_reason", "")
    if fin and fin != "stop":
        parts.append(fin + (f" ({st['stop_reason_detail']})" if st.get("stop_reason_detail") else ""))
    return "  ·  ".join(parts)
