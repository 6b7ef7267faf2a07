"""The live panel: decode tok/s (big digits + sparkline over the reply), latency, tokens, context, backend,
speculative decoding, thinking budget, sampling toggles and GPU telemetry.

Values come only from engine events (StepStats while decoding, FinalStats at the end); speculative figures
read "off" when the reply ran without speculation, never made-up numbers.
"""
from __future__ import annotations

import textwrap
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
PANEL_WIDTH = 32  # columns with the border, padding and scrollbar: every line below fits the 29 left (a 14-column
# label); a terminal too narrow for it folds the panel away (app.PANEL_MIN_COLUMNS)


def row(label: str, value: str) -> str:
    """One panel line: the label in 14 columns, the value after it (right-aligned numbers come formatted)."""
    return f"{label:<14s}{value}"


def prompt_rows(prompt: int, cached: int, prefill_tok_s: float) -> list[str]:
    """The prompt's figures. A prompt served from the cache (prefix reuse) but its last token has no prefill
    rate to show (it read 0.0 tok/s): it says "cached" instead."""
    rate = f"{prefill_tok_s:8.1f} tok/s" if prefill_tok_s > 0 else ("  cached" if cached else "       -")
    # 0: not known yet (a remote server counts the prompt only in its last chunk)
    lines = [row("prefill", rate), row("tokens in", f"{prompt:8d}" if prompt else "       -")]
    if cached:
        lines.append(row("  cached", f"{cached:8d}"))  # its own line: "76 (49 cached)" wrapped the panel
    return lines


def gpu_lines(s: GpuSample) -> list[str]:
    """One GPU in the panel's width (GpuSample.lines() is the wider form for logs)."""
    def f(v, fmt="{}"):
        return "n/a" if v is None else fmt.format(v)
    return [f"GPU{s.index} {s.name}",
            f"  SM clock {f(s.sm_clock_mhz)}/{f(s.sm_clock_max_mhz)} MHz",
            f"  util {f(s.util_pct)}%  temp {f(s.temp_c)} C",
            f"  power {f(s.power_w, '{:.0f}')}/{f(s.power_limit_w, '{:.0f}')} W",
            f"  memory {f(s.mem_used_gib, '{:.1f}')}/{f(s.mem_total_gib, '{:.1f}')} GiB",
            *textwrap.wrap(", ".join(s.throttle) or "none", PANEL_WIDTH - 3, initial_indent="  throttle: ",
                           subsequent_indent="    ")]


class StatsPanel(VerticalScroll):
    """Right-hand panel. The app calls the `on_*` methods; each re-renders only its own section."""

    DEFAULT_CSS = f"""
    StatsPanel {{ width: {PANEL_WIDTH}; border-left: vkey $panel-lighten-2; padding: 0 0 0 1;
                 scrollbar-size-vertical: 1; }}
    StatsPanel Digits {{ width: auto; color: $accent; }}
    StatsPanel Sparkline {{ height: 2; margin-bottom: 1; }}
    StatsPanel .section {{ margin-bottom: 1; }}
    StatsPanel .title {{ color: $text-muted; text-style: bold; }}
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
        self.reply_budget: int | None = None  # the reasoning budget the shown reply ran with

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
    def start_reply(self, budget: int | None = None) -> None:
        """A reply starts; `budget`: the reasoning budget it runs with (None: unlimited or no thinking)."""
        self.samples, self.step, self.final, self.prefill, self.live = [], None, None, None, True
        self.reply_budget = budget
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
            text = "\n".join(line for s in samples for line in gpu_lines(s))
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
            lines += [row("TTFT", f"{f.ttft_s * 1000:8.0f} ms"),
                      *prompt_rows(f.prompt_tokens, f.cached_prompt_tokens, f.prefill_tok_s),
                      row("tokens out", f"{f.output_tokens:8d}"),
                      row("context", f"{f.prompt_tokens + f.output_tokens:>8d}/{cap or '?'}"),
                      row("finish", f"{f.finish_reason:>8s}")]
        elif s is not None and s.ttft_s > 0:  # live: the prompt's figures are known from the first token
            lines += [row("TTFT", f"{s.ttft_s * 1000:8.0f} ms"),
                      *prompt_rows(s.prompt_tokens, s.cached_prompt_tokens, s.prefill_tok_s),
                      row("tokens out", f"{s.output_tokens:8d}"),
                      row("context", f"{s.context_used:>8d}/{cap or '?'}")]
        elif s is not None:
            lines += [row("TTFT", "     ..."), row("tokens out", f"{s.output_tokens:8d}"),
                      row("context", f"{s.context_used:>8d}/{cap or '?'}")]
        elif self.prefill is not None:
            p = self.prefill
            lines += [row(p.stage, f"{p.done}/{p.total}")]
        else:
            lines += ["no reply yet"]
        self._set("reply", "\n".join(lines))

    def _render_spec(self) -> None:
        mode = self.settings.spec if self.settings else "off"
        f = self.final
        lines = [row("SPECULATIVE", f"next: {mode}")]
        if unavailable := [m for m, reason in self.spec_modes.items() if reason]:
            lines.append(row("unavailable", ", ".join(unavailable)))  # F2 says why
        ran = f.spec_mode if f is not None else (mode if self.live else "off")
        if f is not None and f.spec_mode != "off" and f.rounds:
            n = max(f.rounds - f.block_rounds, 1)  # speculative rounds (decode blocks counted apart)
            lines += [f"last reply    {f.spec_mode}",
                      f"acceptance    {f.acceptance:8.0%}",
                      f"tok/round     {f.tokens_per_round:8.2f}",
                      f"ms/round      {f.ms_per_round:8.2f}",
                      f"  draft       {f.draft_ms / n:8.2f}",
                      f"  verify      {(f.verify_ms - f.block_ms) / n:8.2f}"]
            if f.lookup_rounds:  # rounds whose drafts prompt lookup made (engine.spec.lookup)
                lines.append(f"lookup tok    {f.lookup_tokens:8d}")
            if f.block_rounds:  # where drafting did not pay, plain decode blocks
                lines.append(f"no-draft tok  {f.block_tokens:8d}")
            if acc := [f"{a:.0%}" for a in f.per_position_accept]:
                lines.append("per position")
                lines += ["  " + " ".join(acc[i:i + 5]) for i in range(0, len(acc), 5)]
        elif f is not None and f.spec_mode != "off" and f.drafted:  # a remote server: drafts, but no rounds
            lines += [f"last reply    {f.spec_mode}", f"acceptance    {f.acceptance:8.0%}",
                      f"drafted       {f.drafted:8d}"]
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
        lines = [row("THINKING", mode)]
        if self.live or self.final is not None:
            # against the budget that reply ran with: F5/F6 since then change the next reply's only
            used = self.step.reasoning_tokens if self.live and self.step else (
                self.final.reasoning_tokens if self.final else 0)
            ran = self.reply_budget
            lines.append(row("reasoning", f"{used}/{ran or 'unlimited'} tok"))
            if (st.budget or None) != ran:
                lines.append(row("next budget", st.budget_label()))
        else:
            lines.append(row("budget", st.budget_label()))
        if self.final is not None and self.final.thinking_forced:
            lines.append("close forced by the budget")
        self._set("thinking", "\n".join(lines))

    def _render_sampling(self) -> None:
        st = self.settings
        if st is None:
            return
        self._set("sampling", "\n".join([
            "SAMPLING",
            f"temp {st.temperature:g}  top-k {st.top_k}", f"top-p {st.top_p:g}  min-p {st.min_p:g}",
            row("penalties", "on" if st.penalties_on else "off"),
            f"  presence {st.presence:g}  freq {st.frequency:g}",
            row("max new", str(st.max_new))]))

    def _render_engine(self) -> None:
        e = self.engine_info
        if not e:
            self._set("engine", row("ENGINE", "failed to load" if self.engine_failed else "loading..."))
            return
        self._set("engine", "\n".join([
            "ENGINE", str(e.get("model", "?")),  # a model name has a line of its own: names are long
            row("backend", f"{e.get('backend', '?')}  threads {e.get('threads', '?')}"),
            row("KV dtype", str(e.get("kv_dtype", "?"))),
            row("context cap", str(e.get("context_capacity") or "?"))]))
