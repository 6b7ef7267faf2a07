"""The engine thread: one loaded model, one session, replies generated one at a time in arrival order.

A request becomes a `Job` (messages or token ids, a GenerateRequest, a cancel event). `EngineWorker.submit`
admits it when fewer than 1 + max_queue live jobs are held (the running one and those waiting; a waiting job
whose client left does not count), else raises `QueueFull` (the app answers 429). The engine thread takes the
jobs in order and posts what the session yields to the job's asyncio queue on the server's event loop:
("start", None) once the request was accepted by the engine, ("event", ev) per engine event, ("error", exc)
for a request the engine refused or a failure, and ("end", None) last, always.

Why one at a time: the engine has one KV cache per session and a decode step uses every core (or the GPU)
for one sequence; a batch would need a batched runner the engine does not have. Sharing one session also
keeps prefix reuse across requests (a client that resends a growing conversation prefills only its suffix).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..config import GenerateRequest
from ..events import FinalStats, ReasoningDelta, TextDelta, ThinkingForced

log = logging.getLogger("ninfer.serve")
FORWARDED = (TextDelta, ReasoningDelta, ThinkingForced, FinalStats)  # Progress and StepStats stay in the thread


class QueueFull(Exception):
    """More requests than the one running plus max_queue waiting."""


class ShuttingDown(Exception):
    """The server is stopping; no new work."""


@dataclass
class Job:
    """One reply to generate. kind "chat": `prompt` is a list of messages; "text": a string, tokenized as it is
    (special tokens parsed, BOS where the model wants one); "ids": a list of token ids."""

    prompt: list | str
    request: GenerateRequest
    loop: asyncio.AbstractEventLoop
    kind: str = "chat"
    cancel: threading.Event = field(default_factory=threading.Event)
    items: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)

    def post(self, kind: str, value=None) -> None:
        """From the engine thread: hand an item to the event loop (dropped once the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, value))
        except RuntimeError:
            pass


class EngineWorker:
    """Owns the engine's session and the thread that drives it (started by `start`, joined by `close`)."""

    def __init__(self, engine, max_queue: int = 8, on_final=None, on_wait=None):
        self.engine = engine
        self.session = engine.session()
        self.max_queue = max_queue
        self.on_final = on_final or (lambda st: None)  # called in the engine thread with each FinalStats
        self.on_wait = on_wait or (lambda s: None)  # ... with the seconds each job waited for the engine
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="ninfer-engine")

    # -- the server side ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def counts(self) -> tuple[int, int]:
        """(running, waiting) live jobs."""
        with self._cond:
            running = int(self._running is not None and not self._running.cancel.is_set())
            return running, sum(not j.cancel.is_set() for j in self._waiting)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            running, waiting = int(self._running is not None), sum(not j.cancel.is_set() for j in self._waiting)
            if running + waiting >= 1 + self.max_queue:
                raise QueueFull(f"{running} request running and {waiting} waiting (the queue holds "
                                f"{self.max_queue}); retry later")
            self._waiting.append(job)
            self._cond.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Cancel the running and waiting jobs and join the engine thread (it stops at the next step)."""
        with self._cond:
            self._closing = True
            for job in self._waiting:
                job.cancel.set()
            if self._running is not None:
                self._running.cancel.set()
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the engine thread did not stop within %.0f s", timeout)

    # -- the engine thread --------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closing:
                    self._cond.wait()
                if not self._waiting:
                    return
                job = self._running = self._waiting.popleft()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._running = None
                job.post("end")

    def _run(self, job: Job) -> None:
        if job.cancel.is_set():  # the client left while waiting, or the server is closing
            return
        self.on_wait(time.perf_counter() - job.submitted)
        try:
            if job.kind == "chat":
                events = self.session.generate(job.prompt, job.request, cancel=job.cancel)
            else:  # tokenized here, not on the event loop: a long prompt takes a while
                tok = self.engine.tokenizer
                ids = job.prompt if job.kind == "ids" else \
                    tok.encode(job.prompt, add_bos=bool(getattr(tok, "add_bos", False)))
                events = self.session.generate_ids(ids, job.request, cancel=job.cancel)
            job.post("start")
            for ev in events:
                if isinstance(ev, FinalStats):
                    self.on_final(ev)
                if isinstance(ev, FORWARDED):
                    job.post("event", ev)
        except Exception as e:
            if not _is_client_error(e):
                log.exception("a request failed in the engine")
            job.post("error", e)


def _is_client_error(e: Exception) -> bool:
    from ..errors import ConfigError, InputError
    return isinstance(e, (ConfigError, InputError))
