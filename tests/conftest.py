"""Shared fixtures: tiny random-weight GGUF models (one per architecture) and the default SmolLM2 file."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
if str(ROOT) not in sys.path:  # tests run from a checkout without an editable install
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """{arch: path} of tiny models written by tests/fixtures/make_tiny_models.py (seed 0) into a session tmp dir."""
    sys.path.insert(0, str(FIXTURES))
    try:
        from make_tiny_models import ARCHS, make_tiny_model
    finally:
        sys.path.remove(str(FIXTURES))
    out = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(out / f"tiny-{arch}.gguf", arch, seed=0) for arch in ARCHS}


@pytest.fixture(scope="session")
def make_tiny():
    """The `make_tiny_model(path, arch, seed=0, **overrides)` function, for tests that need variants."""
    sys.path.insert(0, str(FIXTURES))
    try:
        from make_tiny_models import make_tiny_model
    finally:
        sys.path.remove(str(FIXTURES))
    return make_tiny_model


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The installed default model (SmolLM2-135M-Instruct Q4_1); skips when it is not installed."""
    from engine.paths import default_model_path
    p = default_model_path()
    if p is None:
        pytest.skip("default model not installed (scripts/dev setup)")
    return p


def pytest_collection_finish(session):
    """Start the collected modules' long subprocess checks (their `BACKGROUND` jobs, tests/background.py)."""
    if session.config.option.collectonly:
        return
    import background
    jobs, seen = [], set()
    for item in session.items:
        mod = getattr(item, "module", None)
        if mod is None or mod in seen:
            continue
        seen.add(mod)
        jobs += [j for j in (make() for make in getattr(mod, "BACKGROUND", ())) if j is not None]
    if jobs:
        background.start(jobs)


def pytest_terminal_summary(terminalreporter):
    """The background checks' timeline (tests/background.py): what the second core did, and what tests waited."""
    import background
    lines = background.timeline()
    if lines:
        terminalreporter.section("background checks")
        for line in lines:
            terminalreporter.write_line(line)
