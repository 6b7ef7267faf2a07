"""Decode tok/s seen through the TUI vs the same generation headless, alternating A-B-A-B in one process.

    PYTHONPATH=. .venv/bin/python probes/tui_overhead.py [--backend cpu] [--max-new 96] [--rounds 3]

Both sides use one loaded engine, a fresh session (no prefix reuse) and the same greedy request. The TUI side
runs the full app headless (Textual's headless driver: every frame is still composed and rendered, only not
written to a terminal) including Markdown streaming, the live panel and GPU telemetry polling.
Reported: the engine's decode tok/s of each run (FinalStats) and, for the TUI, the rate at which text
reached the screen (tokens / time from the first to the last streamed update). Target: TUI/headless >= 0.97.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import paths  # noqa: E402
from engine.api import Engine  # noqa: E402
from engine.config import EngineArgs  # noqa: E402
from engine.events import FinalStats  # noqa: E402
from ninfer_tui.app import ChatApp  # noqa: E402
from ninfer_tui.bridge import reply_threads  # noqa: E402
from ninfer_tui.settings import ChatSettings  # noqa: E402

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def headless(engine, settings) -> FinalStats:
    final = None
    for ev in engine.session().generate([{"role": "user", "content": PROMPT}], settings.request()):
        if isinstance(ev, FinalStats):
            final = ev
    return final


async def through_tui(engine, settings, args) -> tuple[FinalStats, float, float]:
    """One reply through the app. Returns (final stats, tok/s reaching the screen, UI-thread CPU share)."""
    marks: list[float] = []

    class TimedApp(ChatApp):
        async def _apply_segments(self, segments) -> None:
            await super()._apply_segments(segments)
            if any(kind == "answer" for kind, _ in segments):
                marks.append(time.perf_counter())

    app = TimedApp(settings, args, lambda a, progress=None: engine, store=None, model_name=engine.name)
    async with app.run_test(size=(140, 45)) as pilot:
        while app.session is None:
            await pilot.pause(0.05)
        app.query_one("#prompt").load_text(PROMPT)
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        await pilot.press("enter")
        while app.replies_started == 0 or app.generating:
            await asyncio.sleep(0.25)  # not pilot.pause: that forces extra screen refreshes
        cpu_share = (time.thread_time() - cpu0) / (time.perf_counter() - wall0)
        final = app.last_final
    shown = (final.answer_tokens - 1) / (marks[-1] - marks[0]) if len(marks) > 1 else 0.0
    return final, shown, cpu_share


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, help="engine threads (default: all)")
    ap.add_argument("--switch-ms", type=float, help="override the TUI's GIL switch interval while streaming")
    ap.add_argument("--budget", type=float, help="override ui_cpu_budget (share of one core)")
    ap.add_argument("--fps", type=float, help="override stream_fps")
    ap.add_argument("--no-reserve", action="store_true", help="decode on all cores in the TUI too")
    ns = ap.parse_args()
    cfg = paths.load_config()
    args = EngineArgs(model=ns.model, backend=ns.backend, threads=ns.threads)
    t0 = time.perf_counter()
    engine = Engine.load(args, config_model=cfg.get("model") or None)
    print(f"loaded {engine.name} on {ns.backend} in {time.perf_counter() - t0:.1f} s")
    settings = ChatSettings.from_config(cfg)
    settings.temperature, settings.max_new, settings.spec, settings.thinking = 0.0, ns.max_new, "off", "off"
    settings.reserve_ui_core = not ns.no_reserve
    for name, value in (("gil_switch_ms", ns.switch_ms), ("ui_cpu_budget", ns.budget), ("stream_fps", ns.fps)):
        if value is not None:
            setattr(settings, name, value)
    print(f"threads {ns.threads or 'all'} (TUI replies: {reply_threads(args, settings.reserve_ui_core) or 'all'}), GIL switch {settings.gil_switch_ms} ms, UI budget "
          f"{settings.ui_cpu_budget:.0%}, max {settings.stream_fps:g} fps")
    headless(engine, settings)  # warm-up (first-call effects out of the comparison)
    h, t, shown, cpu = [], [], [], []
    for r in range(ns.rounds):
        a = headless(engine, settings)
        b, s, c = asyncio.run(through_tui(engine, settings, args))
        h.append(a.decode_tok_s)
        t.append(b.decode_tok_s)
        shown.append(s)
        cpu.append(c)
        print(f"round {r + 1}: headless {a.decode_tok_s:7.2f} tok/s ({a.output_tokens} tok) | "
              f"TUI {b.decode_tok_s:7.2f} tok/s ({b.output_tokens} tok), on screen {s:7.2f} tok/s, "
              f"UI thread CPU {c:.1%} of one core | same output: {a.output_sha256 == b.output_sha256}")
    mh, mt, ms = statistics.median(h), statistics.median(t), statistics.median(shown)
    ratios = [b / a for a, b in zip(h, t)]
    print(f"median headless {mh:.2f} tok/s, TUI {mt:.2f} tok/s, on screen {ms:.2f} tok/s, "
          f"UI thread CPU {statistics.median(cpu):.1%}")
    print(f"TUI/headless = {mt / mh:.3f} (medians; per-round pairs {', '.join(f'{x:.2f}' for x in ratios)}); "
          f"on screen/headless = {ms / mh:.3f}; target >= 0.97")
    return 0


if __name__ == "__main__":
    sys.exit(main())
