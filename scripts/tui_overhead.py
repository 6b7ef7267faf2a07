"""Decode tok/s seen through the TUI vs the same generation headless, alternating A-B-A-B in one process.

    PYTHONPATH=. .venv/bin/python scripts/tui_overhead.py [--backend cpu] [--max-new 96] [--rounds 3]

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
from ninfer_tui.settings import ChatSettings  # noqa: E402

PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def headless(engine, settings) -> FinalStats:
    final = None
    for ev in engine.session().generate([{"role": "user", "content": PROMPT}], settings.request()):
        if isinstance(ev, FinalStats):
            final = ev
    return final


async def through_tui(engine, settings, args) -> tuple[FinalStats, float]:
    app = ChatApp(settings, args, lambda a, progress=None: engine, store=None, model_name=engine.name)
    marks: list[float] = []
    async with app.run_test(size=(140, 45)) as pilot:
        while app.session is None:
            await pilot.pause(0.05)
        orig = app.on_stream_ready

        async def timed(message):
            await orig(message)
            marks.append(time.perf_counter())
        app.on_stream_ready = timed
        app.query_one("#prompt").load_text(PROMPT)
        await pilot.press("enter")
        while app.replies_started == 0 or app.generating:
            await pilot.pause(0.05)
        final = app.last_final
    shown = (final.output_tokens - 1) / (marks[-1] - marks[0]) if len(marks) > 1 else 0.0
    return final, shown


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ns = ap.parse_args()
    cfg = paths.load_config()
    args = EngineArgs(model=ns.model, backend=ns.backend)
    t0 = time.perf_counter()
    engine = Engine.load(args, config_model=cfg.get("model") or None)
    print(f"loaded {engine.name} on {ns.backend} in {time.perf_counter() - t0:.1f} s")
    settings = ChatSettings.from_config(cfg)
    settings.temperature, settings.max_new, settings.spec, settings.thinking = 0.0, ns.max_new, "off", "off"
    headless(engine, settings)  # warm-up (first-call effects out of the comparison)
    h, t, shown = [], [], []
    for r in range(ns.rounds):
        a = headless(engine, settings)
        b, s = asyncio.run(through_tui(engine, settings, args))
        h.append(a.decode_tok_s)
        t.append(b.decode_tok_s)
        shown.append(s)
        print(f"round {r + 1}: headless {a.decode_tok_s:7.2f} tok/s ({a.output_tokens} tok) | "
              f"TUI {b.decode_tok_s:7.2f} tok/s ({b.output_tokens} tok), on screen {s:7.2f} tok/s "
              f"| same output: {a.output_sha256 == b.output_sha256}")
    mh, mt, ms = statistics.median(h), statistics.median(t), statistics.median(shown)
    print(f"median headless {mh:.2f} tok/s, TUI {mt:.2f} tok/s, on screen {ms:.2f} tok/s")
    print(f"TUI/headless = {mt / mh:.3f} (engine decode rate), {ms / mh:.3f} (text reaching the screen); "
          f"target >= 0.97")
    return 0


if __name__ == "__main__":
    sys.exit(main())
