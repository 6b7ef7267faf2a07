"""Pilot tests of the stats panel's fit: its width by the terminal's, lines that never wrap, a cached prompt,
the budget a reply ran with."""
from __future__ import annotations

import pytest
from textual.widgets import Static

from engine.events import FinalStats
from engine.fake import Script
from ninfer_tui.telemetry import GpuSample
from ninfer_tui.widgets.stats import PANEL_WIDTH, StatsPanel

from tui_helpers import ready, send, wait_for

pytestmark = pytest.mark.anyio


def final(**kw) -> FinalStats:
    base = {"finish_reason": "stop", "prompt_tokens": 76, "output_tokens": 20, "reasoning_tokens": 0,
            "answer_tokens": 20, "cached_prompt_tokens": 49, "ttft_s": 0.05, "prefill_tok_s": 540.0,
            "decode_tok_s": 30.0, "wall_s": 1.0, "output_sha256": "", "context_capacity": 4096}
    return FinalStats(**(base | kw))


def panel_text(app, wid: str) -> str:
    return str(app.query_one(StatsPanel).query_one(f"#{wid}").render())


async def test_panel_folds_away_on_a_narrow_terminal(make_app):
    """At 80x24 the fixed 38-column panel left the chat 40 columns: below PANEL_MIN_COLUMNS it folds away
    (F8 still shows it, narrower), and it comes back where the terminal is wide."""
    app = make_app(Script(answer="ok"))
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        panel = app.query_one(StatsPanel)
        assert not panel.display and app.query_one("#chat-col").size.width == 80
        assert "F8 stats" in str(app.query_one("#status").render())  # how to see it
        await pilot.press("f8")
        await pilot.pause()
        assert panel.display and panel.outer_size.width == PANEL_WIDTH <= 32
        assert app.query_one("#chat-col").size.width == 80 - PANEL_WIDTH
        await pilot.press("f8")
        await pilot.pause()
        assert not panel.display
    app = make_app(Script(answer="ok"))
    async with app.run_test(size=(80, 24)) as pilot:
        await ready(pilot)
        panel = app.query_one(StatsPanel)
        await pilot.resize_terminal(130, 40)
        await wait_for(pilot, lambda: panel.display)
        await pilot.pause()
        assert "F8 stats" not in str(app.query_one("#status").render())
        assert panel.outer_size.width == PANEL_WIDTH and app.query_one("#chat-col").size.width == 130 - PANEL_WIDTH
        await pilot.resize_terminal(90, 30)
        await wait_for(pilot, lambda: not panel.display)


async def test_no_panel_line_wraps(make_app):
    """Every section's lines fit the panel's width, with large figures ("tokens in 76 (49 cached)" wrapped):
    a section is as many rows high as it has lines."""
    app = make_app(Script(answer="ok"))
    async with app.run_test(size=(130, 40)) as pilot:  # taller than the terminal: with its scrollbar
        await ready(pilot)
        panel = app.query_one(StatsPanel)
        app.settings.spec = "ngram"
        app.settings.budget = 4096
        app._refresh_panel_settings()
        panel.start_reply(budget=4096)
        panel.on_final(final(prompt_tokens=130000, cached_prompt_tokens=129000, output_tokens=1000,
                             reasoning_tokens=900, context_capacity=131072, spec_mode="ngram", rounds=10,
                             drafted=70, accepted=40, draft_ms=1.0, verify_ms=9.0, finish_reason="cancelled",
                             per_position_accept=(0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3), thinking_forced=True))
        panel.on_gpu([GpuSample(0, "NVIDIA H200", 1500, 1980, 300.0, 700.0, 50, 10.0, 141.0, 90,
                                ["sw-power", "hw-slowdown"])], "")
        await pilot.pause()
        assert panel.max_scroll_y > 0  # the scrollbar takes its column
        assert "  cached        129000" in panel_text(app, "reply")
        for static in panel.query(Static).results(Static):
            lines = str(static.render()).splitlines()
            if static.display and lines:
                assert static.size.height == len(lines), (static.id, lines)  # no line took two rows


async def test_spec_panel_counts_a_replys_decode_blocks_apart(make_app):
    """A speculative reply that ran decode blocks where drafting did not pay: tok/round and ms/round are per
    speculative round, and the blocks' tokens get a line of their own (none without blocks)."""
    app = make_app(Script(answer="ok"))
    async with app.run_test(size=(130, 40)) as pilot:
        await ready(pilot)
        panel = app.query_one(StatsPanel)
        panel.start_reply()
        panel.on_final(final(spec_mode="mtp", output_tokens=40, rounds=10, drafted=6, accepted=3, draft_ms=6.0,
                             verify_ms=60.0, block_rounds=4, block_tokens=28, block_ms=24.0))
        spec = panel_text(app, "spec")
        assert "tok/round         2.00" in spec and "ms/round          7.00" in spec, spec
        assert "  draft           1.00" in spec and "  verify          6.00" in spec and "no-draft tok        28" in spec
        panel.on_final(final(spec_mode="mtp", output_tokens=40, rounds=10, drafted=6, accepted=3))
        spec = panel_text(app, "spec")
        assert "tok/round         4.00" in spec and "no-draft" not in spec and "lookup" not in spec
        panel.on_final(final(spec_mode="dflash", output_tokens=40, rounds=10, drafted=6, accepted=3,
                             lookup_rounds=2, lookup_tokens=9))
        assert "lookup tok           9" in panel_text(app, "spec")


async def test_a_fully_cached_prompt_says_cached_not_zero_speed(make_app):
    app = make_app(Script(answer="ok"))
    async with app.run_test(size=(130, 40)) as pilot:
        await ready(pilot)
        panel = app.query_one(StatsPanel)
        panel.start_reply()
        panel.on_final(final(prompt_tokens=50, cached_prompt_tokens=49, prefill_tok_s=0.0))
        reply = panel_text(app, "reply")
        assert "prefill         cached" in reply and "0.0 tok/s" not in reply
        panel.on_final(final(prompt_tokens=50, cached_prompt_tokens=10, prefill_tok_s=400.0))
        assert "prefill          400.0 tok/s" in panel_text(app, "reply")


async def test_reasoning_is_shown_against_the_budget_the_reply_ran_with(make_app):
    """F5 after a reply used to rewrite its line as "reasoning 8/4" (the next reply's budget)."""
    app = make_app(Script(reasoning="a b c d e f g h i j k l ", answer="done"), budget=8, budget_step=4,
                   thinking="on")
    async with app.run_test(size=(130, 40)) as pilot:
        await ready(pilot)
        assert "budget        8" in panel_text(app, "thinking")  # no reply yet: the next one's budget
        await send(pilot, "think")
        assert app.last_final.reasoning_tokens == 8
        assert "reasoning     8/8 tok" in panel_text(app, "thinking")
        await pilot.press("f5")
        await wait_for(pilot, lambda: app.settings.budget == 4)
        text = panel_text(app, "thinking")
        assert "reasoning     8/8 tok" in text and "next budget   4" in text
