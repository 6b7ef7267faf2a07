"""engine/bench/serve_load.py end to end on the fake engine: a ninfer-serve subprocess, concurrent streaming clients,
nothing lost, a full queue refused with 429, the server stopped."""
from __future__ import annotations

import json

from serve_helpers import openai  # noqa: F401 - skips the module without the serve extra

from engine.bench import serve_load


def test_load_test_loses_nothing(capsys):
    assert serve_load.main(["--fake", "--clients", "3", "--requests", "2", "--max-tokens", "8",
                            "--", "--fake-delay", "0.002"]) == 0
    out = capsys.readouterr()
    s = json.loads(out.out)
    assert (s["requests"], s["ok"], s["identical"], s["rejected_429"]) == (6, 6, 6, 0)
    assert s["tokens_per_reply"] == 8 and s["ttft_s"]["p50"] <= s["latency_s"]["p50"]
    assert "server stopped" in out.err


def test_load_test_beyond_the_queue_counts_429s(capsys):
    assert serve_load.main(["--fake", "--clients", "4", "--requests", "1", "--max-tokens", "20", "--max-queue", "0",
                            "--", "--fake-delay", "0.01"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["rejected_429"] >= 1 and s["ok"] + s["rejected_429"] == 4 and s["identical"] == s["ok"]


def test_percentile():
    assert serve_load.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert serve_load.percentile([1.0, 2.0], 0.99) == 1.99
