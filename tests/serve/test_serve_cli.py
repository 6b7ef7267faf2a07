"""`ninfer-serve`'s command line: one-line errors with status 1 before any model loads, and the API key file."""
from __future__ import annotations

import socket

from serve_helpers import openai  # noqa: F401 - skips the module without the serve extra

from engine.serve import main as serve_main


def test_bad_options_are_one_line_errors(capsys, tmp_path):
    assert serve_main.main(["--fake", "--max-queue", "-1"]) == 1
    assert capsys.readouterr().err.strip() == "ninfer-serve: error: --max-queue must be >= 0, got -1"
    empty = tmp_path / "key.txt"
    empty.write_text("\n")
    assert serve_main.main(["--fake", "--api-key-file", str(empty)]) == 1
    assert "its first line is empty" in capsys.readouterr().err
    assert serve_main.main(["--fake", "--api-key-file", str(tmp_path / "missing")]) == 1
    assert "cannot read it" in capsys.readouterr().err


def test_a_taken_port_fails_before_the_model_loads(capsys, monkeypatch):
    def no_load(*args):
        raise AssertionError("the model loaded before the port was checked")
    monkeypatch.setattr(serve_main, "load_engine", no_load)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert serve_main.main(["--fake", "--port", str(s.getsockname()[1])]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("ninfer-serve: error: cannot listen on 127.0.0.1:") and "\n" not in err


def test_api_key_from_file_or_environment(tmp_path, monkeypatch):
    key = tmp_path / "key.txt"
    key.write_text("  abc123  \nignored\n")
    a = serve_main.build_parser().parse_args(["--api-key-file", str(key)])
    assert serve_main.api_key(a) == "abc123"
    monkeypatch.setenv("NINFER_API_KEY", "from-env")
    assert serve_main.api_key(serve_main.build_parser().parse_args([])) == "from-env"
    monkeypatch.setenv("NINFER_API_KEY", "")
    assert serve_main.api_key(serve_main.build_parser().parse_args([])) is None
    assert serve_main.is_loopback("127.0.0.1") and serve_main.is_loopback("::1")
    assert not serve_main.is_loopback("0.0.0.0")
