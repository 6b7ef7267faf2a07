"""Fixtures for the TUI tests: private config/data dirs, a scripted fake engine, an app factory."""
from __future__ import annotations

import pytest

from engine.config import EngineArgs


@pytest.fixture(autouse=True)
def _private_dirs(tmp_path, monkeypatch):
    """Every test gets its own user config and data dir (never the developer's real ones)."""
    monkeypatch.setenv("NINFER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("NINFER_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("NUMBA_NUM_THREADS", "2")


class NoGpu:
    """Telemetry stand-in: a fixed "no GPU" state (snapshots must not depend on the machine)."""

    available = False
    reason = "no NVIDIA driver/GPU (test)"

    def sample(self):
        return []

    def close(self):
        pass


@pytest.fixture
def make_app(tmp_path):
    """make_app(script=None, config=None, store=True, **settings overrides) -> (app, fake engine holder)."""
    from engine import paths
    from ninfer_tui.app import ChatApp
    from engine.fake import Script, ScriptedEngine
    from ninfer_tui.settings import ChatSettings
    from ninfer_tui.store import Store

    made = {}

    def factory(script: Script | None = None, store: bool = True, telemetry=None, loader=None, **overrides):
        script = script or Script()
        settings = ChatSettings.from_config(paths.load_config())
        for k, v in overrides.items():
            setattr(settings, k, v)

        def fake_loader(args, progress=None):
            made["engine"] = ScriptedEngine.load(args, progress=progress, script=script)
            return made["engine"]
        st = Store(tmp_path / "data" / "transcripts.db") if store else None
        app = ChatApp(settings, EngineArgs(), loader or fake_loader, store=st, model_name="fake-model",
                      telemetry=telemetry or NoGpu())
        app.made = made
        return app
    return factory


@pytest.fixture
def anyio_backend():
    return "asyncio"
