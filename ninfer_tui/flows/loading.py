"""Loading the model in a worker thread: progress and the time so far in the status line (a first start
compiles the CPU kernels for a minute or more), the engine's facts in the panel."""
from __future__ import annotations

import time

from textual import work

from engine.errors import NinferError

from .. import bridge as br
from ..remote_ui import on_connected
from ..widgets.stats import StatsPanel


class LoadFlow:
    """ChatApp's part that loads the engine (mixed into the app)."""

    _load_started: float | None = None
    _load_progress = None  # the last engine.events.Progress of the load
    _load_ticker = None

    def _start_loading(self) -> None:
        """Load the engine; the status line counts the seconds until it is ready (it ticks between progress
        events: compiling kernels reports nothing for a minute)."""
        self._load_started = time.monotonic()
        self._load_ticker = self.set_interval(1.0, self._show_load)
        self._show_load()
        self._load_engine()

    @work(thread=True, group="load", exclusive=True)
    def _load_engine(self) -> None:
        br.load_engine(self, self.engine_args, self.loader)

    def on_load_progress(self, message: br.LoadProgress) -> None:
        self._load_progress = message.progress
        self._show_load()

    def _show_load(self) -> None:
        p = self._load_progress
        elapsed = f"{time.monotonic() - self._load_started:.0f} s" if self._load_started is not None else ""
        if p is None:
            self._status(f"loading {self.model_name}... {elapsed}")
            return
        frac = p.done / p.total if p.total else 0.0
        bar = "#" * int(20 * frac) + "-" * (20 - int(20 * frac))
        self._status(f"loading {self.model_name}: {p.stage} [{bar}] {p.done}/{p.total} · {elapsed} · {p.message}")

    def _stop_load_ticker(self) -> None:
        if self._load_ticker is not None:
            self._load_ticker.stop()
            self._load_ticker = None

    def on_engine_ready(self, message: br.EngineReady) -> None:
        self._stop_load_ticker()
        try:  # the session allocates the KV cache: a capacity this machine cannot hold fails here
            session = message.engine.session()
        except NinferError as e:
            self.on_engine_failed(br.EngineFailed(br.error_line(e)))
            return
        self.engine, self.session = message.engine, session
        on_connected(self, self.engine)  # a remote engine: the chat's name, settings it cannot take, what it lacks
        facts = br.engine_facts(self.engine, self.engine_args)
        self.spec_available = facts.pop("spec_modes")
        self.native_thinking = bool(facts.pop("native_thinking"))
        self.prompted_thinking = not self.native_thinking
        facts["model"] = facts["model"] or self.model_name
        self.query_one("#stats", StatsPanel).on_engine(facts)
        if self.settings.spec != "off" and self.spec_available.get(self.settings.spec):
            self.notify(f"spec {self.settings.spec}: {self.spec_available[self.settings.spec]}; using off",
                        severity="warning")
            self.settings.spec = "off"
        self._refresh_panel_settings()
        self._ready_status()
        self.notify(f"model ready in {message.seconds:.1f} s", timeout=3)
        self._on_model_ready()  # flows/models.py: the transcript's model record; after a switch, the chat

    def on_engine_failed(self, message: br.EngineFailed) -> None:
        self._stop_load_ticker()
        self.load_error = message.error
        self._status(f"model failed to load: {message.error}")
        self.query_one("#stats", StatsPanel).on_engine_failed()
        self.notify(message.error, severity="error", timeout=30)
        self._on_model_failed(message.error)  # flows/models.py: after a switch, back to the model before
