"""The live panel: decode tok/s (big digits + sparkline over the reply), latency, tokens, context, backend,
speculative decoding, thinking budget, sampling toggles and GPU telemetry.

Values come only from engine events (StepStats while decoding, FinalStats at the end); speculative figures
read "off" when the reply ran without speculation, never made-up numbers.
"""
from __future__ import annotations

from typing import TypeVar

from textual.containers import VerticalScroll
from textual.css.query import NoMatches
from textual.widget import Widget
from textual.widgets import Digits, Sparkline, Static

from engine.events import FinalStats, Progress, StepStats

from ..settings import ChatSettings
from ..telemetry import GpuSample

MAX_SPARK = 120  # points kept for the sparkline
W = TypeVar("W", bound=Widget)


class StatsPanel(VerticalScroll):
    """Right-hand panel. The app calls the `on_*` methods; each re-renders only its own section."""

    DEFAULT_CSS = """
    StatsPanel { width: 38; border-left: vkey $panel-lighten-2; padding: 0 1; }
    StatsPanel Digits { width: auto; color: $accent; }
    StatsPanel Sparkline { height: 2; margin-bottom: 1; }
    StatsPanel .section { margin-bottom: 1; }
    StatsPanel .title { color: $text-muted; text-style: bold; }
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.samples: list[float] = []
        self.step: StepStats | None = None
        self.final: FinalStats | None = None
        self.prefill: Progress | None = None
        self.settings: ChatSettings | None = None
        self.spec_modes: dict[str, str | None] = {}
        self.engine_info: dict = {}
        self.engine_failed = False  # the model did not load: the engine section says so instead of "loading..."
        self.native_thinking: bool | None = None  # the model's thinking: native, prompted (False), not known
        self.live = False

    def compose(self):
        yield Static("decode tok/s", classes="title")
        yield Digits("0.0", id="tps")
        yield Sparkline([], id="spark")
        yield Static("", id="reply", classes="section", markup=False)
        yield Static("", id="spec", classes="section", markup=False)
        yield Static("", id="thinking", classes="section", markup=False)
        yield Static("", id="sampling", classes="section", markup=False)
        yield Static("", id="engine", classes="section", markup=False)
        yield Static("GPU: reading...", id="gpu", classes="section", markup=False)

    def on_mount(self) -> None:
        self._render_all()

    # -- inputs ------------------------------------------------------------------------------------
    def start_reply(self) -> None:
        self.samples, self.step, self.final, self.prefill, self.live = [], None, None, None, True
        self._render_reply()
        self._render_spec()
        self._render_thinking()
        self._set_tps("0.0")
        self._set_spark([])

    def on_step(self, st: StepStats | Progress) -> None:
        if isinstance(st, Progress):
            self.prefill = st
            self._render_reply()
            return
        self.step = st
        self.samples.append(st.decode_tok_s)
        del self.samples[:-MAX_SPARK]
        self._set_tps(f"{st.decode_tok_s:.1f}")
        self._draw_spark()
        self._render_reply()
        self._render_thinking()
        if st.round_tokens > 1 or st.draft_ms or st.verify_ms:
            self._render_spec()

    def _draw_spark(self) -> None:
        # one point draws differently from a flat line of several; keep the look independent of coalescing
        del self.samples[:-MAX_SPARK]
        self._set_spark(self.samples * 2 if len(self.samples) == 1 else list(self.samples))

    def on_final(self, final: FinalStats | None) -> None:
        self.live = False
        if final is not None:
            self.final = final
            self._set_tps(f"{final.decode_tok_s:.1f}")
            if final.output_tokens:
                self.samples.append(final.decode_tok_s)  # the reply's figure ends the sparkline
                self._draw_spark()
            if final.context_capacity:
                self.engine_info["context_capacity"] = final.context_capacity
            self.engine_info.update(backend=final.backend, kv_dtype=final.kv_dtype)
        self._render_all()

    def on_settings(self, settings: ChatSettings, spec_modes: dict, native_thinking: bool | None) -> None:
        self.settings, self.spec_modes, self.native_thinking = settings, spec_modes, native_thinking
        self._render_spec()
        self._render_thinking()
        self._render_sampling()

    def on_engine(self, info: dict) -> None:
        self.engine_info.update(info)
        self._render_engine()
        self._render_reply()

    def on_engine_failed(self) -> None:
        self.engine_failed = True
        self._render_engine()

    def on_gpu(self, samples: list[GpuSample], reason: str) -> None:
        if not samples:
            text = f"GPU: no GPU\n  {reason}" if reason else "GPU: no GPU"
        else:
            text = "\n".join(line for s in samples for line in s.lines())
        self._set("gpu", text)

    # -- rendering ---------------------------------------------------------------------------------
    def _render_all(self) -> None:
        for fn in (self._render_reply, self._render_spec, self._render_thinking, self._render_sampling,
                   self._render_engine):
            fn()

    # At shutdown Textual removes the panel's children before the panel itself, and a timer or an engine
    # event can still arrive in between: a missing child means there is nothing left to draw on.
    def _child(self, wid: str, kind: type[W]) -> W | None:
        try:
            return self.query_one(f"#{wid}", kind)
        except NoMatches:
            return None

    def _set(self, wid: str, text: str) -> None:
        if (w := self._child(wid, Static)) is not None:
            w.update(text)

    def _set_tps(self, text: str) -> None:
        if (w := self._child("tps", Digits)) is not None:
            w.update(text)

    def _set_spark(self, data: list[float]) -> None:
        if (w := self._child("spark", Sparkline)) is not None:
            w.data = data

    def _render_reply(self) -> None:
        f, s, cap = self.final, self.step, self.engine_info.get("context_capacity") or 0
        lines = ["REPLY" + (" (live)" if self.live else "")]
        if f is not None:
            lines += [f"TTFT          {f.ttft_s * 1000:8.0f} ms",
                      f"prefill       {f.prefill_tok_s:8.1f} tok/s",
                      f"tokens in     {f.prompt_tokens:8d}" + (f"  ({f.cached_prompt_tokens} cached)"
                                                                if f.cached_prompt_tokens else ""),
                      f"tokens out    {f.output_tokens:8d}",
                      f"context       {f.prompt_tokens + f.output_tokens:>8d}/{cap or '?'}",
                      f"finish        {f.finish_reason:>8s}"]
        elif s is not None and s.ttft_s > 0:  # live: the prompt's figures are known from the first token
            lines += [f"TTFT          {s.ttft_s * 1000:8.0f} ms",
                      f"prefill       {s.prefill_tok_s:8.1f} tok/s",
                      f"tokens in     {s.prompt_tokens:8d}" + (f"  ({s.cached_prompt_tokens} cached)"
                                                               if s.cached_prompt_tokens else ""),
                      f"tokens out    {s.output_tokens:8d}",
                      f"context       {s.context_used:>8d}/{cap or '?'}"]
        elif s is not None:
            lines += ["TTFT               ...", f"tokens out    {s.output_tokens:8d}",
                      f"context       {s.context_used:>8d}/{cap or '?'}"]
        elif self.prefill is not None:
            p = self.prefill
            lines += [f"{p.stage:<13s} {p.done}/{p.total}"]
        else:
            lines += ["no reply yet"]
        self._set("reply", "\n".join(lines))

    def _render_spec(self) -> None:
        mode = self.settings.spec if self.settings else "off"
        f = self.final
        lines = [f"SPECULATIVE   next: {mode}"]
        for m, reason in self.spec_modes.items():
            if reason:
                lines.append(f"  {m}: unavailable ({reason})")
        ran = f.spec_mode if f is not None else (mode if self.live else "off")
        if f is not None and f.spec_mode != "off" and f.rounds:
            lines += [f"last reply    {f.spec_mode}",
                      f"acceptance    {f.acceptance:8.0%}",
                      f"tok/round     {f.tokens_per_round:8.2f}",
                      f"ms/round      {f.ms_per_round:8.2f}",
                      f"  draft       {f.draft_ms / f.rounds:8.2f}",
                      f"  verify      {f.verify_ms / f.rounds:8.2f}"]
            if f.per_position_accept:
                lines.append("per position  " + " ".join(f"{a:.0%}" for a in f.per_position_accept))
        elif self.live and self.step is not None and ran != "off" and (self.step.draft_ms or self.step.verify_ms):
            s = self.step
            lines += [f"this round    {s.round_tokens} tok",
                      f"  draft       {s.draft_ms:8.2f} ms", f"  verify      {s.verify_ms:8.2f} ms"]
        else:
            lines += ["last reply         off", "acceptance         off", "tok/round          off",
                      "ms/round           off"]
        self._set("spec", "\n".join(lines))

    def _render_thinking(self) -> None:
        st = self.settings
        if st is None:
            self._set("thinking", "THINKING")
            return
        mode = st.thinking_label(self.native_thinking)  # what the next reply does, not only the setting
        if st.thinking == "auto" and mode in ("on", "off"):  # the model's default (a budget sets "prompted")
            mode += " (auto)"
        used = self.step.reasoning_tokens if self.live and self.step else (
            self.final.reasoning_tokens if self.final else 0)
        lines = [f"THINKING      {mode}", f"reasoning     {used}/{st.budget_label()} tok"]
        if self.final is not None and self.final.thinking_forced:
            lines.append("close forced by the budget")
        self._set("thinking", "\n".join(lines))

    def _render_sampling(self) -> None:
        st = self.settings
        if st is None:
            return
        self._set("sampling", "\n".join([
            "SAMPLING",
            f"temp {st.temperature:g}  top-k {st.top_k}  top-p {st.top_p:g}  min-p {st.min_p:g}",
            f"penalties     {'on' if st.penalties_on else 'off'}",
            f"  presence {st.presence:g}  frequency {st.frequency:g}",
            f"max new       {st.max_new}"]))

    def _render_engine(self) -> None:
        e = self.engine_info
        if not e:
            self._set("engine", "ENGINE        " + ("failed to load (see the status line)" if self.engine_failed
                                                  else "loading..."))
            return
        self._set("engine", "\n".join([
            "ENGINE",
            f"model         {e.get('model', '?')}",
            f"backend       {e.get('backend', '?')}  threads {e.get('threads', '?')}",
            f"KV dtype      {e.get('kv_dtype', '?')}",
            f"context cap   {e.get('context_capacity') or '?'}"]))
