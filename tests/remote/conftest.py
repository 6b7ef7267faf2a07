"""Fixtures of tests/remote: private config and data dirs, ninfer-serve on loopback (fake engines, or the tiny
random-weight llama on the numpy reference backend), and a chat app factory pointed at an endpoint."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("starlette")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tui"))  # tui_helpers (wait_for, ready, send)


@pytest.fixture(autouse=True)
def _private_dirs(tmp_path, monkeypatch):
    """Every test gets its own user config and data dir, and no API key from the environment."""
    monkeypatch.setenv("NINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("NINFER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("NUMBA_NUM_THREADS", "2")
    monkeypatch.delenv("NINFER_API_KEY", raising=False)


@contextlib.contextmanager
def serving(engine, model_id: str = "tiny", **settings):
    """ninfer-serve's app for `engine` on a free loopback port: yields (base URL, app)."""
    from engine.serve.app import ServeSettings, create_app
    from engine.serve.main import background
    app = create_app(engine, ServeSettings(model_id=model_id, **settings))
    with background(app) as url:
        yield url, app


@pytest.fixture
def serve():
    return serving


@pytest.fixture(scope="session")
def tiny_engine(tiny_models):
    """The tiny llama (random weights, a real BPE tokenizer and chat template) on the numpy reference backend:
    the real generation loop at ~500 tok/s, no compile step."""
    from engine.api import Engine
    from engine.config import EngineArgs
    return Engine.load(EngineArgs(model=str(tiny_models["llama"]), backend="ref", max_context=4096))


@pytest.fixture
def remote_app(tmp_path):
    """remote_app(url, api_key=None, model=None, store=True, after_connect=None, **settings) -> ChatApp on the
    endpoint, built as `ninfer-chat --endpoint URL` builds it (after_connect(engine) may change the engine)."""
    from engine import paths
    from engine.config import EngineArgs
    from engine.remote import RemoteOptions
    from ninfer_tui.app import ChatApp
    from ninfer_tui.remote_ui import RemoteTelemetry, remote_loader
    from ninfer_tui.settings import ChatSettings
    from ninfer_tui.store import Store

    def factory(url, api_key=None, model=None, store=True, after_connect=None, **overrides):
        settings = ChatSettings.from_config(paths.load_config())
        for k, v in overrides.items():
            setattr(settings, k, v)
        opts = RemoteOptions(url, api_key=api_key, model=model, timeout=30.0)
        connect, name = remote_loader(opts)

        def loader(args, progress=None):
            engine = connect(args, progress)
            if after_connect is not None:
                after_connect(engine)
            return engine
        st = Store(tmp_path / "data" / "transcripts.db") if store else None
        return ChatApp(settings, EngineArgs(), loader, store=st, model_name=name,
                       telemetry=RemoteTelemetry(url))
    return factory
