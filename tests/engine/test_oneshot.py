"""`ninfer` CLI: streams and reports (fake engine in-process), bad input as one line without a traceback
(subprocess), end to end on the tiny qwen3 model (template switch) and on SmolLM2 (slow)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.api import Engine
from engine.oneshot import fix_argv_text, main, read_messages
from engine.errors import InputError
from engine.fake import FakeModel, FakeTokenizer, script_policy, thinking_policy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_user_config(monkeypatch, tmp_path):
    """In-process runs must not read the machine's user config."""
    monkeypatch.setenv("NINFER_CONFIG_DIR", str(tmp_path / "config"))


def fake_factory(policy, native=False):
    def factory(eargs, config_model, progress):
        tok = FakeTokenizer(native_thinking=native)
        return Engine.from_parts(FakeModel(tok, policy), tok, eargs, name="fake")
    return factory


def cli(*args, env_extra=None, timeout=120):
    """Run `python -m engine.oneshot` in a subprocess -> (exit code, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMBA_NUM_THREADS="2", NINFER_CONFIG_DIR=str(ROOT / ".no-config"))
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-m", "engine.oneshot", *args], cwd=ROOT, env=env, capture_output=True,
                       timeout=timeout)
    return r.returncode, r.stdout.decode("utf-8", "replace"), r.stderr.decode("utf-8", "replace")


def assert_one_line_error(code, err, *needles):
    assert code == 1, err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("[ninfer] ")]  # progress is fine
    assert len(lines) == 1 and lines[0].startswith("ninfer: error: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


# -- in-process, fake engine --------------------------------------------------------------------------------
def test_answer_to_stdout_report_to_stderr(capsys, tmp_path):
    stats = tmp_path / "s.json"
    code = main(["--prompt", "hi", "--greedy", "--stats-json", str(stats), "--print-token-ids"],
                fake_factory(script_policy("Paris.")))
    out, err = capsys.readouterr()
    assert code == 0 and out == "Paris.\n"
    assert "[ninfer] prompt" in err and "finish stop" in err and "token ids:" in err
    d = json.loads(stats.read_text(encoding="utf-8"))
    assert d["answer"] == "Paris." and d["finish_reason"] == "stop" and d["token_ids"][-1] == 2
    assert d["output_tokens"] == len(d["token_ids"]) and len(d["output_sha256"]) == 64


def test_reasoning_to_stderr_answer_to_stdout(capsys, tmp_path):
    stats = tmp_path / "s.json"
    code = main(["--prompt", "hi", "--thinking-budget", "4", "--max-new", "300", "--stats-json", str(stats)],
                fake_factory(thinking_policy(close_after=None)))
    out, err = capsys.readouterr()
    assert code == 0 and out == "Paris.\n"
    assert "hmm hmm hmm hmm" in err and "close forced" in err and "hmm" not in out
    d = json.loads(stats.read_text(encoding="utf-8"))
    assert d["reasoning_tokens"] == 4 and d["thinking_forced"] and d["reasoning"] == " hmm" * 4


def test_reasoning_effort_is_a_share_of_max_new(capsys, tmp_path):
    stats = tmp_path / "s.json"
    main(["--prompt", "hi", "--reasoning-effort", "low", "--max-new", "400", "--stats-json", str(stats)],
         fake_factory(thinking_policy(close_after=None)))
    assert json.loads(stats.read_text())["reasoning_tokens"] == 100


def test_reasoning_effort_shrinks_to_leave_the_answer_room(capsys, tmp_path):
    """--reasoning-effort with a small --max-new: the share would leave no room for the close insert and an
    answer (it failed naming a --thinking-budget the user never gave); the budget shrinks instead, and only a
    --max-new that cannot hold the insert at all is an error, naming --reasoning-effort."""
    from engine.config import ThinkingParams
    from engine.thinking import plan_thinking
    need = plan_thinking(ThinkingParams(budget=0), FakeTokenizer(), 10_000).min_tokens()  # insert + 1 answer
    stats = tmp_path / "s.json"
    max_new = need + 6  # medium: half of it would not fit
    code = main(["--prompt", "hi", "--reasoning-effort", "medium", "--max-new", str(max_new), "--stats-json",
                 str(stats)], fake_factory(thinking_policy(close_after=None)))
    err = capsys.readouterr().err
    assert code == 0, err
    d = json.loads(stats.read_text())
    assert d["reasoning_tokens"] == 6 and d["answer_tokens"] >= 1 and d["thinking_forced"]
    code = main(["--prompt", "hi", "--reasoning-effort", "low", "--max-new", str(need - 1)],
                fake_factory(thinking_policy(close_after=None)))
    assert_one_line_error(code, capsys.readouterr().err, "--reasoning-effort", f"at least {need}")


def test_budget_too_large_is_one_line(capsys):
    code = main(["--prompt", "hi", "--thinking-budget", "48", "--max-new", "50"],
                fake_factory(thinking_policy(close_after=None)))
    assert_one_line_error(code, capsys.readouterr().err, "--thinking-budget 48", "--max-new")


@pytest.mark.parametrize("args,needles", [
    (["--seed", "-1"], ("--seed must be in [0, 2^63), got -1", "leave it out")),
    (["--temperature", "nan"], ("--temperature must be a finite number",)),
    (["--top-p", "nan"], ("--top-p must be a finite number",)),
    (["--presence-penalty", "inf"], ("--presence-penalty must be a finite number",)),
    (["--top-p", "0"], ("--top-p must be in (0, 1]",)),
    (["--min-p", "2"], ("--min-p must be in [0, 1]",)),
    (["--kv-capacity", "0"], ("--kv-capacity must be in 1..", "got 0")),  # 0 used to mean the default
    # numbers past any context: an OverflowError / a 4 TiB allocation traceback before
    (["--kv-capacity", "9000000000000000000000"], ("--kv-capacity must be in 1..16777216",)),
    (["--max-context", "9000000000000000000"], ("--max-context must be in 1..16777216",)),
    (["--prefill-chunk", "2000000000"], ("--prefill-chunk must be in 1..16777216",)),
    # a tiny temperature overflowed the scaled logits: random text or a ZeroDivisionError
    (["--temperature", "1e-40"], ("--temperature must be 0 (greedy) or >= 1e-06",)),
    (["--draft-tokens", "3"], ("--draft-tokens needs a speculative mode",)),  # as NInfer: no --spec, no drafts
    (["--lm-head-draft"], ("--lm-head-draft", "needs --spec mtp or --spec dflash")),
    (["--no-thinking", "--thinking-budget", "8"], ("--no-thinking leaves nothing",)),  # was taken in silence
    (["--no-thinking", "--reasoning-effort", "low"], ("--no-thinking leaves nothing",)),
    (["--spec", "ngram", "--lm-head-draft"], ("needs --spec mtp or --spec dflash",)),
    (["--spec-lookup", "2"], ("--spec-lookup", "needs --spec mtp or --spec dflash")),
    (["--spec", "mtp", "--spec-lookup", "-1"], ("--spec-lookup must be a whole number >= 0",)),
])
def test_option_values_out_of_range_are_one_line(capsys, args, needles):
    """Sampling options that cannot mean anything (a negative seed used to be a numpy traceback, NaN was
    taken): one line naming the option."""
    code = main(["--prompt", "hi", *args], fake_factory(script_policy("x")))
    assert_one_line_error(code, capsys.readouterr().err, *needles)


def test_too_long_prompt_is_one_line(capsys):
    code = main(["--prompt", "word " * 100, "--max-context", "32"], fake_factory(script_policy("x")))
    assert_one_line_error(code, capsys.readouterr().err, "context")


def test_stop_string_and_system(capsys, tmp_path):
    code = main(["--prompt", "hi", "--greedy", "--system", "be brief", "--stop", "ris"],
                fake_factory(script_policy("Paris.")))
    out, err = capsys.readouterr()
    assert code == 0 and out == "Pa\n" and "stop string 'ris'" in err


def test_no_thinking_uses_the_template_switch(capsys, tmp_path):
    stats = tmp_path / "s.json"
    main(["--prompt", "hi", "--no-thinking", "--stats-json", str(stats)],
         fake_factory(thinking_policy(close_after=2), native=True))
    d = json.loads(stats.read_text())
    assert d["reasoning_tokens"] == 0 and d["answer"] == "Paris."


def test_nfc_and_surrogate_escaped_argv():
    decomposed = "Cafe\u0301 日本"
    assert fix_argv_text(decomposed, "--prompt") == "Caf\u00e9 日本"
    escaped = "日本".encode("utf-8").decode("ascii", "surrogateescape")  # how a non-UTF-8 locale passes it
    if os.fsencode(escaped) == "日本".encode("utf-8"):
        assert fix_argv_text(escaped, "--prompt") == "日本"
    with pytest.raises(InputError):
        fix_argv_text(b"\xff\xfe".decode("ascii", "surrogateescape"), "--prompt")


def test_messages_file_forms(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "e\u0301"}]}), encoding="utf-8")
    assert read_messages(str(f)) == [{"role": "user", "content": "\u00e9"}]
    f.write_text('[{"role": "user"}]', encoding="utf-8")
    with pytest.raises(InputError, match="message 0"):
        read_messages(str(f))


# -- subprocess: bad input never shows a traceback ----------------------------------------------------------
def test_missing_messages_file():
    code, out, err = cli("--messages", "/nonexistent/m.json")
    assert_one_line_error(code, err, "no such file")


def test_invalid_json(tmp_path):
    f = tmp_path / "m.json"
    f.write_text('[{"role": "user", "content": "hi"', encoding="utf-8")
    code, out, err = cli("--messages", str(f))
    assert_one_line_error(code, err, "not valid JSON", "line 1")


def test_invalid_utf8(tmp_path):
    f = tmp_path / "m.json"
    f.write_bytes(b'[{"role": "user", "content": "caf\xe9"}]')
    code, out, err = cli("--messages", str(f))
    assert_one_line_error(code, err, "not valid UTF-8", "0xe9")


def test_kv_capacity_below_max_context():
    code, out, err = cli("--prompt", "hi", "--max-context", "512", "--kv-capacity", "256")
    assert_one_line_error(code, err, "--kv-capacity 256", "--max-context 512")


def test_missing_model_file():
    code, out, err = cli("/nonexistent/model.gguf", "--prompt", "hi")
    assert_one_line_error(code, err, "does not exist")


def test_argparse_errors_exit_2():
    code, out, err = cli("--prompt", "hi", "--kv-dtype", "f8")
    assert code == 2 and "Traceback" not in err
    code, out, err = cli()
    assert code == 2 and "--prompt" in err


# -- end to end on real models ------------------------------------------------------------------------------
def test_tiny_qwen3_prompt_too_long_and_template_switch(tiny_models, tmp_path):
    path = str(tiny_models["qwen3"])
    code, out, err = cli(path, "--prompt", "hello " * 40, "--max-context", "16")
    assert_one_line_error(code, err, "context")
    stats = tmp_path / "s.json"
    code, out, err = cli(path, "--prompt", "日本 hello", "--greedy", "--max-new", "4", "--no-thinking",
                         "--stats-json", str(stats), env_extra={"LC_ALL": "C"})
    assert code == 0, err
    assert json.loads(stats.read_text())["output_tokens"] == 4


@pytest.mark.slow
def test_smollm2_capital_of_france(smollm2_path):
    # The bare question ("What is the capital of France?") makes this 135M model ramble in French under
    # llama.cpp too (greedy: the same 48 tokens as ours, checked with llama-cpp-python 0.3.36); asked for one
    # word, both answer "The capital of France is Paris."
    code, out, err = cli("--prompt", "What is the capital of France? Answer in one word.", "--greedy", "--max-new", "48",
                         timeout=600)
    assert code == 0, err
    assert "Paris" in out


@pytest.mark.slow
def test_smollm2_prompted_thinking_budget(smollm2_path, tmp_path):
    stats = tmp_path / "s.json"
    code, out, err = cli("--prompt", "A train travels 60 km in 1.5 hours. What is its average speed? Explain "
                         "your reasoning.", "--greedy", "--max-new", "160", "--thinking-budget", "48",
                         "--stats-json", str(stats), timeout=900)
    assert code == 0, err
    d = json.loads(stats.read_text())
    assert d["reasoning_tokens"] <= 48 and d["answer"].strip() and out.strip()


@pytest.mark.parametrize("text,want", [
    ('[sampling]\ntemperature = "hot"\n', "[sampling] temperature = 'hot' must be a number"),
    ("[sampling]\ntemprature = 0.5\n", "unknown key [sampling] temprature (did you mean temperature?)"),
    ("[samplng]\ntop_k = 3\n", "unknown section [samplng] (did you mean [sampling]?)"),
    ("[engine]\nprefix_reuse = 1\n", "[engine] prefix_reuse = 1 must be true or false"),
    ("[sampling]\ntop_k = 2.5\n", "[sampling] top_k = 2.5 must be an integer"),
    ("sampling = 3\n", "sampling = 3 must be a table"),
    ("[model]\npath = 'x.gguf'\n", "model must be a string, not a table"),
])
def test_config_typos_and_wrong_types_are_one_line(capsys, tmp_path, text, want):
    """A config key that config.toml does not list, or a value of another type than its default's: one line
    naming it (and the key meant, when one is close), before anything loads (ninfer-chat: tests/tui)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(text, encoding="utf-8")
    assert main(["--prompt", "hi", "--config", str(cfg)], fake_factory(script_policy("x"))) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and want in err and str(cfg) in err, err


def test_config_accepts_every_default_and_the_optional_keys(tmp_path):
    """config.toml itself, and the keys it leaves out (engine threads and limits, a seed, thinking markers),
    pass the check; an integer where a number is wanted too."""
    from engine import paths
    defaults = paths.load_defaults()
    paths.check_config(defaults, defaults, "config.toml")
    paths.check_config({"engine": {"threads": 2, "max_context": 512, "kv_capacity": 1024, "devices": [0, 1]},
                        "sampling": {"seed": 7, "temperature": 1}, "ui": {"stream_fps": 30},
                        "thinking": {"open_marker": "<t>", "close_marker": "</t>"}}, defaults, "x.toml")


def test_config_defaults_and_flag_override(capsys, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[sampling]\nmax_new = 5\n[thinking]\nmode = "on"\nbudget = 2\n', encoding="utf-8")
    stats = tmp_path / "s.json"
    fac = fake_factory(thinking_policy(close_after=None))
    assert main(["--prompt", "hi", "--config", str(cfg), "--max-new", "200", "--stats-json", str(stats)], fac) == 0
    d = json.loads(stats.read_text())
    assert d["reasoning_tokens"] == 2 and d["thinking_forced"]  # [thinking] from the config file
    assert main(["--prompt", "hi", "--config", str(cfg), "--no-thinking", "--stats-json", str(stats)],
                fake_factory(script_policy("x" * 50))) == 0
    d = json.loads(stats.read_text())
    assert d["output_tokens"] == 5 and d["reasoning_tokens"] == 0  # max_new from the config


def test_unreadable_inputs_are_one_line(capsys, tmp_path):
    """A folder as --config, JSON nested past Python's recursion limit, a lone UTF-16 surrogate in a message:
    tracebacks before (IsADirectoryError, RecursionError, the tokenizer's TypeError)."""
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000)
    lone = tmp_path / "lone.json"
    lone.write_text('[{"role": "user", "content": "hi\\ud800"}]')
    for args, needle in ((["--prompt", "hi", "--config", str(tmp_path)], "cannot be read"),
                         (["--messages", str(deep)], "nested too deeply"),
                         (["--messages", str(lone)], "lone UTF-16 surrogate")):
        code = main(args, fake_factory(script_policy("x")))
        assert_one_line_error(code, capsys.readouterr().err, needle)


def test_usage_errors_and_a_stats_path_that_cannot_be_written_are_one_line(capsys, tmp_path):
    """An unknown option: one line (argparse printed its usage block first). --stats-json that names a folder
    or nothing: refused before the reply (the reply ran, then the write failed)."""
    with pytest.raises(SystemExit) as e:
        main(["--prompt", "hi", "--bogus"], fake_factory(script_policy("x")))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "unrecognized arguments: --bogus" in err
    for bad in (str(tmp_path), ""):
        code = main(["--prompt", "hi", "--stats-json", bad], fake_factory(script_policy("never shown")))
        out, err = capsys.readouterr()
        assert_one_line_error(code, err, "--stats-json", "file to write")
        assert "never shown" not in out


@pytest.mark.parametrize("text,want", [("[engine]\nthreads = 0\n", "--threads must be >= 1, got 0 (from [engine]"),
                                       ('[thinking]\nmode = "maybe"\n', "[thinking] mode = 'maybe'"),
                                       ("[thinking]\nbudget = -5\n", "[thinking] budget = -5")])
def test_config_values_out_of_range_are_one_line(capsys, tmp_path, text, want):
    """Config values of the right type but no meaning: refused in one line (they were taken in silence)."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(text, encoding="utf-8")
    code = main(["--prompt", "hi", "--config", str(cfg)], fake_factory(script_policy("x")))
    assert_one_line_error(code, capsys.readouterr().err, want)


def test_report_counts_a_replys_decode_blocks_apart():
    """The one-shot report's spec line: speculative rounds and their figures, the decode blocks run where
    drafting did not pay on a note of their own (none without them)."""
    from engine.events import FinalStats
    from engine.oneshot import format_report
    base = dict(finish_reason="stop", prompt_tokens=5, output_tokens=40, reasoning_tokens=0, answer_tokens=40,
                cached_prompt_tokens=0, ttft_s=0.1, prefill_tok_s=50.0, decode_tok_s=100.0, wall_s=0.5,
                output_sha256="0" * 64, spec_mode="mtp", rounds=10, drafted=6, accepted=3, draft_ms=6.0,
                verify_ms=60.0)
    line = format_report(FinalStats(**base, block_rounds=4, block_tokens=28, block_ms=24.0)).splitlines()[1]
    assert "spec mtp: 6 rounds, 2.00 tok/round" in line and "7.0 ms/round" in line
    assert "(+ 4 decode blocks, 28 tok, where drafting did not pay)" in line
    assert "decode blocks" not in format_report(FinalStats(**base))
    line = format_report(FinalStats(**base, lookup_rounds=3, lookup_tokens=11)).splitlines()[1]
    assert "; 3 of the rounds by lookup (11 tok)" in line
    assert "by lookup" not in format_report(FinalStats(**base))
