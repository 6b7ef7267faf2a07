"""`ninfer --endpoint` and `ninfer-chat --endpoint` (plain mode, flag checks) against ninfer-serve on loopback
over fake engines, in-process: the answer on stdout, the report on stderr, options that do not go with an
endpoint as one line, and [remote] endpoint in the config."""
from __future__ import annotations

import io
import json
import sys

import pytest

from engine.fake import fake_engine, script_policy, thinking_policy
from engine.oneshot import main as ninfer
from ninfer_tui.__main__ import main as ninfer_chat

ANSWER = "Paris is the capital of France."


def test_ninfer_on_an_endpoint(serve, capsys, tmp_path):
    with serve(fake_engine(script_policy(ANSWER), delay_s=0.002), model_id="tiny") as (url, _):
        stats = tmp_path / "stats.json"
        assert ninfer(["--endpoint", url, "--prompt", "Capital of France?", "--greedy", "--stats-json", str(stats)]) == 0
        out, err = capsys.readouterr()
        assert out == ANSWER + "\n"
        assert f"[ninfer] load: tiny on ninfer-serve at {url}" in err and "| finish stop" in err
        assert "decode " in err and "ttft " in err
        d = json.loads(stats.read_text())
        assert d["answer"] == ANSWER and d["model"] == f"tiny @ {url}" and d["backend"] == "remote"
        # the same from [remote] in a config file, with the model named
        cfg = tmp_path / "remote.toml"
        cfg.write_text(f'[remote]\nendpoint = "{url}"\nmodel = "tiny"\n')
        assert ninfer(["--config", str(cfg), "--prompt", "Capital?", "--greedy", "-q"]) == 0
        assert capsys.readouterr().out == ANSWER + "\n"


def test_ninfer_spec_and_reasoning_on_ninfer_serve(serve, capsys):
    eng = fake_engine(thinking_policy(answer="Paris.", close_after=2), native_thinking=True)
    with serve(eng) as (url, _):
        assert ninfer(["--endpoint", url, "--prompt", "Capital?", "--greedy", "--spec", "ngram"]) == 0
    out, err = capsys.readouterr()
    assert out == "Paris.\n" and "[reasoning]  hmm hmm" in err and "spec ngram:" in err


@pytest.mark.parametrize(("argv", "want"), [
    (["--backend", "cpu"], "--backend does not go with --endpoint: it configures a model run here"),
    (["--kv-dtype", "int8"], "--kv-dtype does not go with --endpoint"),
    (["--print-token-ids"], "--print-token-ids does not go with --endpoint: a remote server streams text"),
    (["model.gguf"], "--endpoint runs the model on a server; drop the MODEL path or --endpoint"),
    (["--endpoint", "localhost:8080"], "--endpoint 'localhost:8080' is not an http(s) URL"),
])
def test_ninfer_options_that_do_not_go_with_an_endpoint(capsys, argv, want):
    base = [] if "--endpoint" in argv else ["--endpoint", "http://127.0.0.1:9/v1"]
    assert ninfer([*base, *argv, "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ninfer: error: ") and want in err[0], err


def test_ninfer_model_name_needs_an_endpoint(capsys):
    assert ninfer(["--model-name", "m", "--prompt", "hi"]) == 1
    assert "--model-name and --api-key go with a remote --endpoint" in capsys.readouterr().err


def test_chat_plain_mode_on_an_endpoint(serve, monkeypatch, capsys):
    with serve(fake_engine(script_policy(ANSWER)), model_id="tiny") as (url, _):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Capital of France?\n"), encoding="utf-8"))
        assert ninfer_chat(["--plain", "--endpoint", url, "--model", "tiny", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert ANSWER in out and "tok/s" in err


@pytest.mark.parametrize(("argv", "want"), [
    (["--endpoint", "http://h/v1", "--fake"], "--endpoint runs the model on a server; drop --fake or --endpoint"),
    (["--endpoint", "http://h/v1", "m.gguf"], "drop the GGUF path or --endpoint"),
    (["--model", "m", "--fake"], "--fake loads no model; drop --model or --fake"),
    (["--api-key", "k"], "--api-key goes with a remote --endpoint URL"),
    (["--endpoint", "ftp://h"], "--endpoint 'ftp://h' is not an http(s) URL"),
])
def test_chat_flags_that_do_not_go_together(capsys, argv, want):
    assert ninfer_chat(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ninfer-chat: ") and want in err[0], err


def test_chat_cannot_reach_the_endpoint_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hi\n"), encoding="utf-8"))
    assert ninfer_chat(["--plain", "--endpoint", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ninfer-chat: cannot reach http://127.0.0.1:9/v1") and "check the URL" in err[-1]
