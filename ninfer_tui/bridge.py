"""Engine worker thread -> Textual messages, and the cancel event back in.

The engine's generator runs in a thread. Stream text is *coalesced*: the thread appends deltas to a buffer
and posts one `StreamReady` only when none is pending. The UI drains the buffer, then keeps draining on a
timer (at most `stream_fps` renders a second) and only releases the pending flag when it finds the buffer
empty, so an idle stream shows its next token at once while a fast one costs a bounded number of renders.
The UI never lags behind decode, and on a small CPU it leaves the cores to the engine.
Stats messages replace older pending ones (`can_replace`), so they never queue up either.
"""
from __future__ import annotations

import threading
import time
import traceback
from typing import Callable

from textual.message import Message

from engine.config import GenerateRequest
from engine.errors import NinferError
from engine.events import FinalStats, Progress, ReasoningDelta, StepStats, TextDelta, ThinkingForced


class LoadProgress(Message):
    def __init__(self, progress: Progress):
        super().__init__()
        self.progress = progress

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, LoadProgress)


class EngineReady(Message):
    def __init__(self, engine, seconds: float):
        super().__init__()
        self.engine, self.seconds = engine, seconds


class EngineFailed(Message):
    def __init__(self, error: str):
        super().__init__()
        self.error = error


class StreamReady(Message):
    """Text is waiting in the bridge's buffer; call `bridge.drain()`."""

    def __init__(self, bridge: "ReplyBridge"):
        super().__init__()
        self.bridge = bridge


class ReplyStats(Message):
    def __init__(self, stats: StepStats | Progress, bridge: "ReplyBridge"):
        super().__init__()
        self.stats, self.bridge = stats, bridge

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, ReplyStats) and type(message.stats) is type(self.stats)


class WarmingNote(Message):
    """The engine is still warming up (Progress("compile") at a reply's start, Engine.warming): this reply runs
    slower than later ones will; `text` says why."""

    def __init__(self, text: str, bridge: "ReplyBridge"):
        super().__init__()
        self.text, self.bridge = text, bridge


class ReplyDone(Message):
    def __init__(self, bridge: "ReplyBridge", final: FinalStats | None, error: str | None):
        super().__init__()
        self.bridge, self.final, self.error = bridge, final, error


def error_line(exc: BaseException) -> str:
    """One line for the user: NinferError messages as they are, anything else with its type."""
    if isinstance(exc, NinferError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class ReplyBridge:
    """One reply: run `session.generate` in the calling (worker) thread and post to `target`."""

    def __init__(self, target, session, messages: list[dict], request: GenerateRequest, threads: int | None = None):
        self.target = target  # a Textual App/Widget (post_message is thread-safe)
        self.threads = threads  # CPU kernel threads for this worker thread (None: leave as is)
        self.session, self.messages, self.request = session, messages, request
        self.cancel = threading.Event()
        self._lock = threading.Lock()
        self._segments: list[tuple[str, object]] = []  # ("reasoning"|"answer", str) | ("forced", ThinkingForced)
        self._pending = False
        self.final: FinalStats | None = None
        self.started = time.perf_counter()

    def _push(self, kind: str, value) -> None:
        with self._lock:
            if self._segments and kind != "forced" and self._segments[-1][0] == kind:
                self._segments[-1] = (kind, self._segments[-1][1] + value)
            else:
                self._segments.append((kind, value))
            post = not self._pending
            self._pending = True
        if post:
            self.target.post_message(StreamReady(self))

    def drain(self) -> list[tuple[str, object]]:
        """Everything streamed since the last drain, merged by kind, in order (UI thread).

        The pending flag stays set: the UI promises to call `drain_or_release` later."""
        with self._lock:
            out, self._segments = self._segments, []
        return out

    def drain_or_release(self) -> list[tuple[str, object]]:
        """Drain; if nothing was buffered, clear the pending flag so the next delta posts at once (atomic)."""
        with self._lock:
            out, self._segments = self._segments, []
            if not out:
                self._pending = False
        return out

    def run(self) -> None:
        """Worker-thread body. Never raises: errors become ReplyDone(error=...)."""
        error = None
        try:
            if self.threads:
                set_worker_threads(self.threads)
            for ev in self.session.generate(self.messages, self.request, self.cancel):
                if isinstance(ev, TextDelta):
                    self._push("answer", ev.text)
                elif isinstance(ev, ReasoningDelta):
                    self._push("reasoning", ev.text)
                elif isinstance(ev, ThinkingForced):
                    self._push("forced", ev)
                elif isinstance(ev, Progress) and ev.stage == "compile":  # not replaced by a prefill Progress
                    self.target.post_message(WarmingNote(ev.message, self))
                elif isinstance(ev, (StepStats, Progress)):
                    self.target.post_message(ReplyStats(ev, self))
                elif isinstance(ev, FinalStats):
                    self.final = ev
        except Exception as e:  # surfaced through notify, never a crash of the UI
            error = error_line(e)
            if not isinstance(e, NinferError):
                traceback.print_exc()
        self.target.post_message(ReplyDone(self, self.final, error))


def cpu_threads() -> int:
    """Threads the CPU kernels may use (numba's pool size; 1 without numba)."""
    try:
        import numba
        return int(numba.config.NUMBA_NUM_THREADS)
    except ImportError:
        return 1


def set_worker_threads(n: int) -> None:
    """numba's thread count is per calling thread: set it in the worker thread that decodes."""
    try:
        import numba
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    except (ImportError, ValueError):
        pass


def reply_threads(args, reserve_core: bool) -> int | None:
    """Kernel threads for replies in the TUI: the user's --threads, else all cores but one for the UI
    (on machines with more than 2), so the UI thread never preempts a parallel kernel's worker."""
    if not args.backend.startswith("cpu"):  # cpu and its variants; the GPU backends ignore it
        return None
    if args.threads:
        return args.threads
    n = cpu_threads()
    return n - 1 if reserve_core and n > 2 else None


def engine_facts(engine, args) -> dict:
    """What the panel shows about a loaded engine (an engine.api.Engine, or engine.fake's ScriptedEngine):
    spec_modes is {mode: None | the reason it cannot run}. An engine that knows its own facts (a remote one:
    engine.remote) gives them itself."""
    from engine.config import SPEC_MODES
    if callable(own := getattr(engine, "facts", None)):
        return own()
    modes = engine.spec_modes()
    modes = {m: modes.get(m, "not reported by the engine") for m in SPEC_MODES}
    modes["off"] = None
    threads = args.threads
    if not threads and args.backend != "cuda":
        try:
            import numba
            # the pool size replies run with; get_num_threads() is per calling thread and the engine's
            # contention guard may have lowered it on whichever thread decoded last
            threads = numba.config.NUMBA_NUM_THREADS
        except ImportError:
            threads = "auto"
    return {
        "model": engine.name, "backend": args.backend, "threads": threads or "-", "kv_dtype": args.kv_dtype,
        "context_capacity": engine.capacity, "spec_modes": modes,
        "native_thinking": engine.thinking_kind == "native",
    }


def load_engine(target, args, loader: Callable) -> None:
    """Worker-thread body: `loader(args, progress=cb)` with progress posted to `target`."""
    t0 = time.perf_counter()
    try:
        engine = loader(args, progress=lambda p: target.post_message(LoadProgress(p)))
    except Exception as e:
        if not isinstance(e, NinferError):
            traceback.print_exc()
        target.post_message(EngineFailed(error_line(e)))
        return
    target.post_message(EngineReady(engine, time.perf_counter() - t0))
