"""`ninfer-chat --plain`: a line interface with prompt-toolkit for plain SSH, screen readers and logs.

Same settings and transcripts as the TUI; the TUI's keys are slash-commands here (/help lists them).
Enter sends, Esc then Enter (alt+enter) inserts a newline, Up/Down walk the history (kept in the data dir).
Ctrl+C stops a reply and keeps its text. With stdin not a terminal, one prompt is read from it (and checked
before the model loads), answered on stdout (reasoning on stderr) and the program exits; such one-shot runs
stay out of the transcripts unless --save asks for them.
"""
from __future__ import annotations

import queue
import sys
import threading
from typing import Callable

from engine import paths
from engine.config import SPEC_MODES
from engine.errors import NinferError
from engine.events import FinalStats, Progress, ReasoningDelta, TextDelta, ThinkingForced

from .chat import ChatState, stats_record
from .settings import ChatSettings
from .widgets.chat import footer_line

HELP = """commands:
  /spec [off|ngram|mtp|dflash]   cycle or set speculative decoding
  /penalties                     toggle presence/frequency penalties
  /think [on|off|auto]           toggle or set thinking
  /budget [N|+|-]                thinking budget (0 = unlimited)
  /regen                         regenerate the last reply
  /system [TEXT|clear]           show, set or clear this chat's system prompt (persona)
  /new                           start a new chat
  /list                          saved conversations;  /open ID  continue one
  /export [md|json]              write the chat to the exports folder
  /settings                      show the current settings
  /quit                          leave (also ctrl+d)"""


class PlainChat:
    """The chat loop without a screen. `out`/`err` are text streams; `engine` is loaded already."""

    def __init__(self, engine, settings: ChatSettings, model_name: str, store=None, out=None, err=None,
                 spec_modes: dict | None = None):
        self.engine, self.settings = engine, settings
        self.session = engine.session()
        self.store = store
        self.chat = ChatState(store, model_name, default_system=settings.system_prompt)
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.spec_modes = spec_modes or {m: None for m in SPEC_MODES}
        self.quit = False

    def say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    # -- commands ----------------------------------------------------------------------------------
    def command(self, line: str) -> None:
        """Run one slash-command; errors are printed as one line."""
        parts = line[1:].split()
        name, arg = (parts[0].lower() if parts else ""), (parts[1] if len(parts) > 1 else None)
        s = self.settings
        try:
            if name in ("quit", "exit", "q"):
                self.quit = True
            elif name == "help":
                self.say(HELP)
            elif name == "spec":
                if arg is None:
                    mode, skipped = s.next_spec(self.spec_modes)
                    self.say(f"spec: {mode}" + (f" (unavailable: {'; '.join(skipped)})" if skipped else ""))
                elif arg not in SPEC_MODES:
                    self.say(f"/spec: {arg!r} is not one of {', '.join(SPEC_MODES)}")
                elif self.spec_modes.get(arg):
                    self.say(f"/spec {arg}: unavailable ({self.spec_modes[arg]})")
                else:
                    s.spec = arg
                    self.say(f"spec: {arg}")
            elif name == "penalties":
                s.toggle_penalties()
                self.say(f"penalties {s.penalties_label()}")
            elif name in ("think", "thinking"):
                if arg in ("on", "off", "auto"):
                    s.thinking = arg
                else:
                    s.toggle_thinking()
                self.say(f"thinking {s.thinking}")
            elif name == "budget":
                if arg in ("+", "up"):
                    s.change_budget(1)
                elif arg in ("-", "down"):
                    s.change_budget(-1)
                elif arg is not None:
                    try:
                        budget = int(arg)
                    except ValueError:
                        budget = -1
                    if budget < 0:
                        self.say(f"/budget: {arg!r} is not a number >= 0 (0 = unlimited; + or - to step)")
                        return
                    s.budget = budget
                    if s.budget and s.thinking == "off":
                        s.thinking = "on"
                self.say(f"thinking budget {s.budget_label()} (thinking {s.thinking})")
            elif name == "system":
                text = line.strip()[len(parts[0]) + 1:].strip()
                if text:
                    self.chat.set_system_prompt("" if text.lower() == "clear" else text)
                    self._saving_notice()
                shown = self.chat.system_prompt
                self.say(f"system prompt: {shown}" if shown else "no system prompt")
            elif name == "new":
                self.chat.new()
                self.say("new chat")
            elif name == "list":
                if self.store is None:
                    self.say("transcripts are not available")
                for c in (self.store.list_conversations() if self.store else []):
                    self.say(f"{c.id:6d}  {c.n_messages:4d} msgs  {c.title}")
            elif name == "open":
                if self.store is None or arg is None or not arg.isdigit():
                    self.say("/open ID (see /list)")
                    return
                self.chat.open(int(arg))
                for m in self.chat.path:
                    self.say(f"[{m.role}] {m.content}")
            elif name == "export":
                self._export(arg or s.export_format)
            elif name in ("regen", "regenerate"):
                if self.chat.prepare_regenerate():
                    self._saving_notice()
                    self.reply()
                else:
                    self.say("nothing to regenerate")
            elif name == "settings":
                self.say("  ".join(f"{k}={v}" for k, v in s.as_record().items()))
            else:
                self.say(f"unknown command /{name}; /help lists them")
        except NinferError as e:
            self.say(f"error: {e}")

    def _export(self, fmt: str) -> None:
        where = paths.user_data_dir() / "exports"
        if not self.chat.path:
            self.say("nothing to export yet")
            return
        try:
            out, in_memory = self.chat.export(fmt, where)
        except OSError as e:
            self.say(f"error: export failed ({e.strerror or e}); free some disk space or check {where}")
            return
        self.say(f"exported to {out}" + (" (the conversation as shown: it is not in the transcripts)"
                                         if in_memory else ""))

    # -- a turn ------------------------------------------------------------------------------------
    def ask(self, text: str) -> FinalStats | None:
        self.chat.add_user(text)
        self._saving_notice()
        return self.reply()

    def _saving_notice(self) -> None:
        if (err := self.chat.take_save_error()) is not None:
            self.say(f"error: {err}")

    def reply(self) -> FinalStats | None:
        """Stream one reply: answer to `out`, reasoning to `err`. Ctrl+C stops it and keeps the text."""
        request = self.settings.request()
        record = self.settings.as_record()
        cancel = threading.Event()
        events: queue.Queue = queue.Queue(maxsize=1024)
        done = object()
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                for ev in self.session.generate(self.chat.engine_messages(), request, cancel):
                    events.put(ev)
            except BaseException as e:  # reported in the main thread
                errors.append(e)
            events.put(done)

        threading.Thread(target=worker, daemon=True).start()
        answer, reasoning, forced, final = [], [], False, None
        while True:
            try:
                ev = events.get()
            except KeyboardInterrupt:
                cancel.set()
                continue
            if ev is done:
                break
            if isinstance(ev, TextDelta):
                answer.append(ev.text)
                self.out.write(ev.text)
                self.out.flush()
            elif isinstance(ev, ReasoningDelta):
                reasoning.append(ev.text)
                self.err.write(ev.text)
                self.err.flush()
            elif isinstance(ev, ThinkingForced):
                forced = True
                self.err.write(f"\n[budget of {ev.reasoning_tokens} reasoning tokens reached: close forced]\n")
            elif isinstance(ev, Progress) and ev.stage == "compile":  # Engine.warming: why this one is slower
                self.say(f"[first start: {ev.message}]")
            elif isinstance(ev, FinalStats):
                final = ev
        self.out.write("\n")
        self.out.flush()
        if errors:
            e = errors[0]
            self.say(f"error: {e}" if isinstance(e, NinferError) else f"error: {type(e).__name__}: {e}")
            if not (answer or reasoning or final is not None) and self.chat.drop_failed_prompt() is not None:
                self.say("(that prompt was not added to the conversation)")  # else every later one fails too
        if answer or reasoning or final is not None:
            self.chat.add_reply("".join(answer), "".join(reasoning), forced, record, final)
            self._saving_notice()
        if final is not None:
            self.say(f"[{footer_line(stats_record(final))}]")
        return final

    def toolbar(self) -> str:
        s = self.settings
        return (f" spec {s.spec} | penalties {'on' if s.penalties_on else 'off'} | thinking {s.thinking} "
                f"budget {s.budget_label()} | /help")


def run_plain(settings: ChatSettings, args, loader: Callable, model_name: str, stdin=None,
              save: bool | None = None) -> int:
    """Entry point of --plain. Returns the exit status. `save` (--save / --no-save) keeps the chat in the
    transcripts; None: yes in a terminal, and for a piped prompt as [ui] save_piped says (off by default:
    one-shot runs would fill the list)."""
    from .bridge import engine_facts
    from .store import Store, StoreError
    stdin = stdin or sys.stdin
    piped = not stdin.isatty()
    text = None
    if piped:  # read and checked first: loading the model takes seconds (minutes on a cold cache)
        text = _read_piped(stdin)
        if text is None:
            return 2
        if not text:
            print("ninfer-chat: no prompt on stdin; pipe one in (echo 'a question' | ninfer-chat --plain) or "
                  "run it in a terminal", file=sys.stderr)
            return 2
    if save is None:
        save = settings.save_piped if piped else True
    engine = loader(args, progress=lambda p: print(f"{p.stage} {p.done}/{p.total} {p.message}",
                                                   file=sys.stderr, flush=True))
    store = None
    if save:
        try:
            store = Store()
        except StoreError as e:
            print(f"ninfer-chat: {e} - transcripts will not be saved", file=sys.stderr)
    facts = engine_facts(engine, args)
    chat = PlainChat(engine, settings, model_name, store, spec_modes=facts["spec_modes"])
    record = _record_model(chat.chat, getattr(engine, "model_path", None)) if store is not None else None
    try:
        if text is not None:
            final = chat.ask(text)
            return 0 if final is not None and final.finish_reason != "error" else 1
        return _interactive(chat)
    finally:
        if record is not None:
            record()


def _record_model(chat: ChatState, path: str | None):
    """Record the model file with each reply; its sha256 is hashed meanwhile in a thread (cached per file) and
    recorded by the returned function, called at the end (it waits for the hash: seconds for GBs, once)."""
    from engine.models.digest import hash_in_background
    try:
        chat.set_model(chat.model_name, path)
    except OSError:
        return None
    if chat.model_file is None:
        return None
    file, result = chat.model_file, []
    thread = hash_in_background(file[0], lambda sha, _error: result.append(sha))

    def record() -> None:
        thread.join()
        if result and result[0]:
            chat.set_model_sha256(file, result[0])
    return record


def _read_piped(stdin) -> str | None:
    """The prompt piped to stdin, stripped and NFC; None after one line on stderr when it is not UTF-8."""
    import unicodedata
    raw = stdin.buffer.read() if hasattr(stdin, "buffer") else stdin.read().encode("utf-8", "surrogateescape")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        print(f"ninfer-chat: stdin is not valid UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}); pipe UTF-8 "
              "text", file=sys.stderr)
        return None
    return unicodedata.normalize("NFC", text.strip())


def _interactive(chat: PlainChat) -> int:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.key_binding import KeyBindings

    kb = KeyBindings()

    @kb.add("escape", "enter")
    def _newline(event):
        event.current_buffer.insert_text("\n")

    hist = paths.user_data_dir() / "plain_history"
    hist.parent.mkdir(parents=True, exist_ok=True)
    ps = PromptSession(history=FileHistory(str(hist)), key_bindings=kb, bottom_toolbar=chat.toolbar)
    chat.say(f"ninfer-chat plain mode · {chat.chat.model_name} · /help for commands · ctrl+d quits")
    while not chat.quit:
        try:
            line = ps.prompt("you> ")
        except KeyboardInterrupt:
            continue
        except EOFError:
            break
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            chat.command(line)
        else:
            chat.ask(line)
    return 0
