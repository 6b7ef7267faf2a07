"""ninfer-serve on the default model (slow): a greedy streamed reply equals the engine's own reply to the same
request, and the final chunk carries the real engine's stats."""
from __future__ import annotations

import pytest
from serve_helpers import USER, client, serve

from engine import options
from engine.events import FinalStats, TextDelta

pytestmark = pytest.mark.slow


def test_default_model_stream_equals_the_engine(smollm2_path):
    from engine.api import Engine
    engine = Engine.load(options.engine_args(None, model=str(smollm2_path), max_context=512))
    req = options.generate_request(None, temperature=0.0, max_new=24)
    direct = [ev for ev in engine.session().generate(USER, req)]
    want = "".join(ev.text for ev in direct if isinstance(ev, TextDelta))
    final = direct[-1]
    assert isinstance(final, FinalStats) and want
    with serve(engine, model_id="smollm2") as (url, _):
        chunks = list(client(url, timeout=120).chat.completions.create(
            model="smollm2", messages=USER, temperature=0, max_tokens=24, stream=True))
    got = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert got == want
    last = next(ch for ch in chunks if ch.choices and ch.choices[0].finish_reason)
    assert last.usage.completion_tokens == final.output_tokens
    t = last.model_extra["timings"]
    assert t["decode_tok_s"] > 0 and t["ttft_ms"] > 0 and t["backend"] == "cpu"
