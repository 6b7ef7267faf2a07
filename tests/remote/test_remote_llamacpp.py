"""The chat and engine.remote against a server no one here wrote: llama-cpp-python's OpenAI server
(`python -m llama_cpp.server`) on the default model, SmolLM2. Slow (it loads the model; on a busy 2-core machine
a token can take a second); skipped where llama-cpp-python[server] or the model is not installed."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from tui_helpers import ready, send, wait_for

from engine import options
from engine.events import FinalStats, TextDelta
from engine.remote import RemoteEngine, RemoteOptions

pytestmark = [pytest.mark.slow, pytest.mark.oracle]
USER = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_server(smollm2_path, tmp_path_factory):
    """The base URL of llama-cpp-python's server on SmolLM2 (stopped after the module)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python without its [server] extra")
    port = _free_port()
    log = tmp_path_factory.mktemp("llama_server") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(smollm2_path), "--model_alias", "smollm2",
             "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048", "--n_threads", "2",
             "--n_threads_batch", "2"], stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(url + "/models", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"llama_cpp.server did not start: {log.read_text(errors='replace')[-2000:]}")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def engine(llama_server):
    eng = RemoteEngine.connect(RemoteOptions(llama_server, timeout=300.0))
    yield eng
    eng.close()


def test_connect_stream_and_figures(engine):
    assert engine.server.kind == "llama-cpp-python" and engine.model_id == "smollm2"
    assert {"spec", "thinking", "budget", "context", "gpu"} <= set(engine.unavailable())
    events = list(engine.session().generate(USER, options.generate_request(None, temperature=0.0, max_new=8)))
    final = events[-1]
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert isinstance(final, FinalStats) and text.strip() and final.finish_reason == "length"
    assert final.output_tokens == 8 and final.ttft_s > 0 and final.decode_tok_s > 0 and final.backend == "remote"
    again = list(engine.session().generate(USER, options.generate_request(None, temperature=0.0, max_new=8)))
    assert "".join(e.text for e in again if isinstance(e, TextDelta)) == text  # greedy: the same reply


def test_stop_closes_the_stream(engine):
    cancel = threading.Event()
    out = []
    for ev in engine.session().generate(USER, options.generate_request(None, temperature=0.0, max_new=400), cancel):
        out.append(ev)
        if isinstance(ev, TextDelta) and not cancel.is_set():
            t0 = time.perf_counter()
            cancel.set()
    assert out[-1].finish_reason == "cancelled" and out[-1].output_tokens < 400
    assert time.perf_counter() - t0 < 5.0
    # the server takes the next request
    events = list(engine.session().generate(USER, options.generate_request(None, temperature=0.0, max_new=2)))
    assert events[-1].finish_reason == "length"


@pytest.mark.anyio
async def test_chat_on_llama_cpp_server(llama_server, remote_app):
    app = remote_app(llama_server, max_new=8, temperature=0.0)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot)
        assert app.model_name == f"smollm2 @ {llama_server}"
        assert any("llama-cpp-python's server" in n.message for n in app._notifications)
        await send(pilot, "What is the capital of France?", timeout=300)
        reply = app.chat.path[-1]
        assert reply.role == "assistant" and reply.content.strip() and app.last_final.output_tokens == 8
        await pilot.press("f4")
        await wait_for(pilot, lambda: any(n.message.startswith("thinking on/off (F4) is unavailable: llama-cpp-"
                                                               "python's server takes no chat_template_kwargs")
                                          for n in app._notifications))
        await pilot.press("f2")
        await wait_for(pilot, lambda: any("sets speculative decoding when it starts" in n.message
                                          for n in app._notifications))
