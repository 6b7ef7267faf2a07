"""`ninfer-chat --list-models`, `--model NAME_OR_PATH` resolved from the same list, its one-line errors, and
plain mode recording the model file and its sha256 with a saved chat."""
from __future__ import annotations

import hashlib
import io
import shutil

import pytest

from engine.config import EngineArgs
from ninfer_tui.__main__ import main


@pytest.fixture
def machine(tmp_path, tiny_models, monkeypatch):
    """A config naming a model_dirs folder (two tiny models and a broken file); the machine's own caches
    hidden."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    d = tmp_path / "models"
    (d / "qwen").mkdir(parents=True)
    shutil.copy(tiny_models["llama"], d / "tiny-llama.gguf")
    shutil.copy(tiny_models["qwen3"], d / "qwen" / "tiny-qwen3.gguf")
    (d / "half.gguf").write_bytes(tiny_models["llama"].read_bytes()[:3000])
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'model_dirs = ["{d}"]\n')
    return d, cfg


def test_list_models(machine, capsys):
    _, cfg = machine
    assert main(["--list-models", "--config", str(cfg)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["name", "arch", "params", "size", "quant"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert {"tiny-llama.gguf", "qwen/tiny-qwen3.gguf", "half.gguf"} <= rows.keys()
    assert "qwen3" in rows["qwen/tiny-qwen3.gguf"] and rows["qwen/tiny-qwen3.gguf"].rstrip().endswith("model_dirs  yes")
    assert "no: truncated or damaged header (" in rows["half.gguf"]


def test_model_names_resolve_from_the_list(machine, monkeypatch):
    d, cfg = machine
    seen = {}

    def fake_plain(settings, args, loader, model_name, save=None):
        seen.update(model=args.model, name=model_name)
        return 0
    monkeypatch.setattr("ninfer_tui.plain.run_plain", fake_plain)
    assert main(["--plain", "--config", str(cfg), "--model", "tiny-qwen3"]) == 0
    assert seen == {"model": str(d / "qwen" / "tiny-qwen3.gguf"), "name": "qwen/tiny-qwen3.gguf"}
    assert main(["--plain", "--config", str(cfg), "tiny-llama"]) == 0  # the positional argument too
    assert seen["model"] == str(d / "tiny-llama.gguf")


@pytest.mark.parametrize(("argv", "want"), [
    (["--model", "nothing-like-it"], "ninfer-chat: no model named 'nothing-like-it' among the "),
    (["--model", "./gone.gguf"], "ninfer-chat: model file gone.gguf (from the argument) does not exist"),
    (["m.gguf", "--model", "x"], "ninfer-chat: two models given (m.gguf and --model x); give one"),
])
def test_model_errors_are_one_line(machine, capsys, argv, want):
    _, cfg = machine
    assert main(["--plain", "--config", str(cfg), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(want), err


def test_plain_mode_records_the_model_and_its_sha256(machine, monkeypatch):
    from engine import paths
    from engine.api import Engine
    from ninfer_tui.plain import run_plain
    from ninfer_tui.settings import ChatSettings
    from ninfer_tui.store import Store
    d, _ = machine
    model = d / "tiny-llama.gguf"
    settings = ChatSettings.from_config(paths.load_config())
    settings.max_new = 4
    stdin = io.TextIOWrapper(io.BytesIO(b"hello"), encoding="utf-8")
    loader = (lambda args, progress=None: Engine.load(args, progress=progress))
    assert run_plain(settings, EngineArgs(model=str(model), backend="ref"), loader, "tiny-llama.gguf", stdin=stdin,
                     save=True) == 0
    st = Store()
    conv = st.list_conversations()[0]
    assert conv.model_path == str(model.resolve())
    assert conv.model_sha256 == hashlib.sha256(model.read_bytes()).hexdigest()


def test_ninfer_and_ninfer_serve_take_the_same_names(machine, monkeypatch, capsys):
    """`ninfer NAME` and `ninfer-serve NAME` resolve a listed name as ninfer-chat does; an unknown name is one
    line. (The one-shot run is real: the tiny model on the reference backend.)"""
    from engine import oneshot
    from engine.serve import main as serve
    d, cfg = machine
    base = ["--config", str(cfg), "--backend", "ref", "--greedy", "--max-new", "3", "--prompt", "hi", "--quiet"]
    assert oneshot.main(["tiny-qwen3", *base]) == 0
    assert oneshot.main(["nothing-like-it", *base]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ninfer: error: no model named 'nothing-like-it' among the "), err

    loaded = []
    monkeypatch.setattr("engine.api.Engine.load", classmethod(lambda cls, a, **kw: loaded.append(a.model)))
    a = serve.build_parser().parse_args(["tiny-llama"])
    serve.load_engine(a, {"model_dirs": [str(d)]})
    assert loaded == [str(d / "tiny-llama.gguf")]
