"""ninfer-serve under misuse: a client that disconnects cancels its reply, a full queue answers 429, the API key,
the OpenAI error shape for every bad request (the server keeps serving), and a SIGTERM that leaves no process.
Fake engines, loopback only, every wait bounded."""
from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from serve_helpers import USER, client, health, openai, raw, serve, wait_for

from engine.config import EngineArgs
from engine.fake import Script, ScriptedEngine, fake_engine, script_policy

ROOT = Path(__file__).resolve().parents[2]


def held_engine(hold_after: int = 2) -> ScriptedEngine:
    """Answers a few tokens, then holds until script.release is set or the reply is cancelled."""
    return ScriptedEngine(EngineArgs(), Script(answer="one two three four five", reasoning="", hold_after=hold_after))


def record_finals(app) -> list:
    finals, worker = [], app.state.worker
    observe = worker.on_final
    worker.on_final = lambda st: (finals.append(st), observe(st))
    return finals


def assert_error_shape(body, status_code: int, code: str | None = None):
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    if code is not None:
        assert err["code"] == code, err


def test_stream_disconnect_cancels_the_reply():
    eng = held_engine()
    with serve(eng) as (url, app):
        finals = record_finals(app)
        stream = client(url).chat.completions.create(model="fake", messages=USER, stream=True)
        it, text = iter(stream), ""
        while text != "one two ":  # two tokens (one chunk or two), then the engine holds
            text += next(it).choices[0].delta.content or ""
            assert len(text) <= len("one two "), text
        stream.close()
        wait_for(lambda: finals and finals[-1].finish_reason == "cancelled", what="the reply to be cancelled")
        assert health(url)["running"] == 0
        assert not eng.script.release.is_set()  # nothing but the disconnect ended it
        eng.script.hold_after = None
        r = client(url).chat.completions.create(model="fake", messages=USER)  # the engine is free again
        assert r.choices[0].message.content == "one two three four five"


def test_non_streaming_disconnect_cancels_the_reply():
    eng = held_engine()
    with serve(eng, disconnect_poll_s=0.05) as (url, app):
        finals = record_finals(app)
        with pytest.raises(openai.APITimeoutError):
            client(url, timeout=0.5).chat.completions.create(model="fake", messages=USER)
        wait_for(lambda: finals and finals[-1].finish_reason == "cancelled", what="the reply to be cancelled")
        assert health(url) == {"status": "ok", "running": 0, "waiting": 0}


def test_queue_full_answers_429_and_the_queued_requests_finish():
    eng = held_engine(hold_after=1)
    with serve(eng, max_queue=1) as (url, _):
        running = client(url).chat.completions.create(model="fake", messages=USER, stream=True)
        it = iter(running)
        next(it), next(it)  # generating, and holding
        queued: dict = {}
        t = threading.Thread(target=lambda: queued.setdefault(
            "r", client(url).chat.completions.create(model="fake", messages=USER)))
        t.start()
        wait_for(lambda: health(url)["waiting"] == 1, what="the second request to wait")
        with pytest.raises(openai.RateLimitError) as exc:
            client(url).chat.completions.create(model="fake", messages=USER)
        assert exc.value.status_code == 429 and exc.value.response.headers["retry-after"] == "1"
        assert_error_shape(exc.value.response.json(), 429, "rate_limit_exceeded")
        eng.script.release.set()
        text = "".join(ch.choices[0].delta.content or "" for ch in it if ch.choices)
        t.join(10)
        assert not t.is_alive() and queued["r"].choices[0].message.content == "one two three four five"
        assert text == "two three four five"
        metrics = raw(url.removesuffix("/v1"), "/metrics", method="GET")[1]
    assert 'ninfer_requests_total{endpoint="chat",status="429"} 1.0' in metrics


def test_api_key():
    with serve(fake_engine(script_policy("ok")), api_key="s3cret-key") as (url, _):
        with pytest.raises(openai.AuthenticationError) as exc:
            client(url, api_key="wrong").chat.completions.create(model="fake", messages=USER)
        assert_error_shape(exc.value.response.json(), 401, "invalid_api_key")
        status, body, _ = raw(url, "/models", method="GET")  # no header at all
        assert status == 401
        assert_error_shape(body, 401, "invalid_api_key")
        status, _, _ = raw(url, "/models", method="GET", headers={"Authorization": "Basic s3cret-key"})
        assert status == 401
        good = client(url, api_key="s3cret-key")
        assert good.chat.completions.create(model="fake", messages=USER).choices[0].message.content == "ok"
        assert [m.id for m in good.models.list()] == ["fake"]
        assert raw(url.removesuffix("/v1"), "/health", method="GET")[0] == 200  # open, as in vLLM
        assert raw(url.removesuffix("/v1"), "/metrics", method="GET")[0] == 200


BAD_BODIES = [  # (body, status, code, param)
    (b'{"model": "fake", "messages": [', 400, "invalid_json", None),
    (b"\xff\xfe not utf-8", 400, "invalid_json", None),
    (b'[{"role": "user", "content": "hi"}]', 400, "invalid_json", None),
    (b'{"model": "fake"}', 400, "invalid_value", "messages"),
    (b'{"messages": []}', 400, "invalid_value", "messages"),
    (b'{"messages": [{"role": 1, "content": "hi"}]}', 400, "invalid_value", "messages.0.role"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"}', 400, "invalid_value", "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, "invalid_value", "max_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', 400, "invalid_value",
     "temperature"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', 400, "invalid_value", "stream"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "spec_mode": "warp"}', 400, "invalid_value", "spec_mode"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', 400, None, "n"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}', 400, None, "tools"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400, "unsupported_content",
     "messages.0.content"),
    ((b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": false}, '
      b'"thinking_token_budget": 5}'), 400, None, "reasoning_effort"),
    (b'{"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}', 404, "model_not_found", "model"),
    (b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "invalid_input", "messages"),
]


def test_bad_requests_get_the_openai_error_shape_and_the_server_keeps_serving():
    eng = fake_engine(script_policy("still here"), args=EngineArgs(max_context=64))
    with serve(eng, max_body_bytes=4096) as (url, _):
        for body, status, code, param in BAD_BODIES:
            got, data, _ = raw(url, "/chat/completions", body)
            assert got == status, (body, data)
            assert_error_shape(data, status, code)
            assert param is None or data["error"]["param"] == param, (body, data)
        # context overflow: the prompt does not fit in max_context
        long = json.dumps({"messages": [{"role": "user", "content": "word " * 200}]}).encode()
        got, data, _ = raw(url, "/chat/completions", long)
        assert got == 400 and data["error"]["code"] == "context_length_exceeded", data
        got, data, _ = raw(url, "/completions", b'{"prompt": [1, 2, 999999]}')
        assert got == 400 and data["error"]["type"] == "invalid_request_error"
        got, data, _ = raw(url, "/completions", b'{"prompt": ""}')
        assert got == 400 and data["error"]["param"] == "prompt"
        # size limits: a declared length, and a chunked body with none
        got, data, _ = raw(url, "/chat/completions", b'{"messages": "' + b"x" * 5000 + b'"}')
        assert got == 413
        assert_error_shape(data, 413, "request_too_large")
        host, port = url.split("//")[1].split("/")[0].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v1/chat/completions", body=iter([b"{" + b" " * 1000] * 6), encode_chunked=True,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 413
        assert_error_shape(json.loads(resp.read()), 413, "request_too_large")
        conn.close()
        # routes and methods
        got, data, _ = raw(url, "/embeddings", b"{}")
        assert got == 404
        assert_error_shape(data, 404)
        got, data, _ = raw(url, "/chat/completions", method="GET")
        assert got == 405
        assert_error_shape(data, 405)
        r = client(url).chat.completions.create(model="fake", messages=USER)
        assert r.choices[0].message.content == "still here"


def test_engine_failure_is_a_500_in_shape_and_the_server_keeps_serving():
    eng = ScriptedEngine(EngineArgs(), Script(answer="fine", reasoning="", fail_with=RuntimeError("GPU fell off")))
    with serve(eng) as (url, _):
        got, data, _ = raw(url, "/chat/completions", json.dumps({"messages": USER}).encode())
        assert got == 500
        assert_error_shape(data, 500, "engine_error")
        assert "GPU fell off" in data["error"]["message"]
        with pytest.raises(openai.APIError):
            list(client(url).chat.completions.create(model="fake", messages=USER, stream=True))
        eng.script.fail_with = None
        assert client(url).chat.completions.create(model="fake", messages=USER).choices[0].message.content == "fine"


def test_sigterm_mid_reply_stops_the_process():
    """`ninfer-serve --fake` in a subprocess on a free port: a reply streams, SIGTERM ends the process within its
    shutdown timeout after the engine thread was joined, and the port is closed. (uvicorn re-raises the signal
    once it has shut down, so the status is -SIGTERM.)"""
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.serve.main", "--fake", "--fake-delay", "0.05", "--port", "0",
         "--shutdown-timeout", "1", "--log-level", "info"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True, env={**os.environ, "NINFER_API_KEY": ""})
    try:
        line, deadline = "", time.monotonic() + 60
        while "serving" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, f"no start: {line!r}"
            line = proc.stderr.readline()
        url = line.split(" on ")[1].split()[0]
        stream = client(url).chat.completions.create(model="fake", messages=USER, stream=True)
        it = iter(stream)
        next(it), next(it)
        proc.send_signal(signal.SIGTERM)
        rest = []
        try:
            rest = [ch for ch in it]  # ends when the server stops (at the latest after the shutdown timeout)
        except openai.APIError:
            pass
        assert proc.wait(timeout=20) in (0, -signal.SIGTERM)
        assert "the engine thread joined" in proc.stderr.read()
        assert len(rest) < 60  # it did not just run the reply to its end at leisure
        with pytest.raises(openai.APIConnectionError):
            client(url, timeout=2).models.list()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stderr.close()


def test_a_queued_client_that_leaves_frees_its_place():
    eng = held_engine(hold_after=1)
    with serve(eng, max_queue=1, disconnect_poll_s=0.05) as (url, _):
        stream = client(url).chat.completions.create(model="fake", messages=USER, stream=True)
        it = iter(stream)
        next(it), next(it)  # generating, and holding
        with pytest.raises(openai.APITimeoutError):  # waits in the queue, then gives up
            client(url, timeout=0.5).chat.completions.create(model="fake", messages=USER)
        wait_for(lambda: health(url)["waiting"] == 0, what="the queue to forget the client that left")
        later: dict = {}
        t = threading.Thread(target=lambda: later.setdefault(
            "r", client(url).chat.completions.create(model="fake", messages=USER)))
        t.start()  # admitted (not 429): the place is free again
        wait_for(lambda: health(url)["waiting"] == 1, what="the new request to wait")
        eng.script.release.set()
        assert "".join(ch.choices[0].delta.content or "" for ch in it if ch.choices) == "two three four five"
        t.join(10)
        assert later["r"].choices[0].message.content == "one two three four five"
