"""Qwen3-style native thinking end to end through the `ninfer` CLI (a subprocess) on a tiny qwen3 model:
the template's enable_thinking switch, the thinking budget and its forced close, and where each part of the
reply goes (answer to stdout, reasoning and the report to stderr).

The tiny model has Qwen3's <think>/</think> added tokens and its template switch (tests/fixtures). Its random
weights never open a reasoning block by themselves, so the budget is exercised on a copy whose template opens
the block when thinking is on (as Qwen's thinking-only templates do: the assistant turn starts with
"<think>\\n"; with enable_thinking=false it is pre-closed, "<think>\\n\\n</think>\\n\\n", as Qwen3's own).
The units of the state machine are in test_thinking.py; this is the whole path: argv -> options -> plan ->
template -> prefill -> forced tokens -> channels -> report."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTE = "Considering the limited time by the user"  # the start of Qwen's budget message (engine.config)

OPENING_TEMPLATE = """{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}"""


def with_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of a GGUF with another chat template (every other key and tensor as it is)."""
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "tokenizer.chat_template"):
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    w.add_chat_template(template)
    for t in r.tensors:
        data = np.asarray(t.data)
        if t.tensor_type in (QT.F32, QT.F16):
            w.add_tensor(t.name, data)
        else:  # quantized and BF16 tensors: their bytes (rows, bytes per row), as the reader gives them
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def qwen3(make_tiny, tmp_path_factory) -> Path:
    """The tiny qwen3 model with an untied output head: with the tied one its greedy replies repeat the last
    prompt token (a newline here), so neither the reasoning nor the answer would hold a visible character."""
    head = (np.random.default_rng(101).standard_normal((461, 64)) * 0.5).astype(np.float32)
    return make_tiny(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3-untied.gguf", "qwen3", seed=1,
                     extra={"output.weight": head})


@pytest.fixture(scope="module")
def opening_qwen3(qwen3) -> Path:
    return with_template(qwen3, qwen3.with_name("tiny-qwen3-opens.gguf"), OPENING_TEMPLATE)


def ninfer(model: Path, tmp_path: Path, *args: str):
    """`python -m engine.oneshot MODEL --prompt ... --greedy --stats-json` -> (code, stdout, stderr, stats)."""
    stats = tmp_path / "stats.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMBA_NUM_THREADS="2", NINFER_CONFIG_DIR=str(ROOT / ".no-config"))
    r = subprocess.run([sys.executable, "-m", "engine.oneshot", str(model), "--prompt", "Why is the sea salty?",
                        "--greedy", "--stats-json", str(stats), *args], check=False, cwd=ROOT, env=env,
                       capture_output=True, timeout=300)
    out, err = r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")
    return r.returncode, out, err, (json.loads(stats.read_text(encoding="utf-8")) if stats.exists() else None)


def test_budget_forces_the_close_and_the_answer_follows(opening_qwen3, tmp_path):
    code, out, err, st = ninfer(opening_qwen3, tmp_path, "--max-new", "100", "--thinking-budget", "6")
    assert code == 0, err
    assert st["reasoning_tokens"] == 6 and st["thinking_forced"] and st["answer_tokens"] > 0
    assert st["reasoning_tokens"] + st["answer_tokens"] <= st["output_tokens"] <= 100
    # the answer on stdout only; the reasoning, the forced-close line and the report on stderr
    assert out.strip() and st["answer"].strip() and out.rstrip("\n") == st["answer"].rstrip("\n")
    assert "<think>" not in out and "</think>" not in out and NOTE not in out
    assert "[reasoning] " in err and "thinking budget reached after 6 tokens: close forced" in err
    assert "(reasoning 6, answer 26, close forced)" in err  # the report: 6 + the 68-token insert + 26 = 100
    assert st["reasoning"] and NOTE not in st["reasoning"]  # the insert is the engine's, not the model's reasoning


def test_no_thinking_uses_the_template_switch(opening_qwen3, tmp_path):
    code, out, err, st = ninfer(opening_qwen3, tmp_path, "--max-new", "8", "--no-thinking", "--print-token-ids")
    assert code == 0, err
    assert st["reasoning_tokens"] == 0 and not st["thinking_forced"] and st["answer_tokens"] == 8
    assert "[reasoning]" not in err and out.strip()


def test_budget_that_leaves_no_room_is_one_line(opening_qwen3, tmp_path):
    code, _out, err, st = ninfer(opening_qwen3, tmp_path, "--max-new", "10", "--thinking-budget", "8")
    assert code == 1 and st is None
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("[ninfer] ")]
    assert len(lines) == 1 and "--thinking-budget 8 leaves no room for the answer" in lines[0]


def test_model_that_does_not_open_answers_without_a_forced_close(qwen3, tmp_path):
    """Qwen3's own template with thinking on leaves the opening to the model; a model that answers straight
    away gets no reasoning and no forced insert, whatever the budget."""
    code, _out, err, st = ninfer(qwen3, tmp_path, "--max-new", "80", "--thinking-budget", "4")
    assert code == 0, err
    assert st["reasoning_tokens"] == 0 and not st["thinking_forced"] and st["answer_tokens"] == st["output_tokens"]
