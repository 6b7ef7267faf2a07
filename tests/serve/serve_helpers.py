"""Helpers of tests/serve. `serve(engine, **settings)` starts ninfer-serve's app in a thread on a free port of
127.0.0.1 and yields (base_url, app); `client(url)` is the real openai client for it; `raw(...)` sends bytes
as they are (malformed bodies the openai client would never send)."""
from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")

from engine.serve.app import ServeSettings, create_app
from engine.serve.main import background


@contextlib.contextmanager
def serve(engine, model_id: str = "fake", **settings):
    app = create_app(engine, ServeSettings(model_id=model_id, **settings))
    with background(app) as url:
        yield url, app


def client(url: str, api_key: str = "none", timeout: float = 10.0):
    return openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=timeout)


def raw(url: str, path: str, body: bytes | None = None, method: str = "POST", headers: dict | None = None):
    """(status, parsed JSON or text, headers) of one request to url + path."""
    req = urllib.request.Request(url + path, data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, data, hdrs = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e:
        status, data, hdrs = e.code, e.read(), e.headers
    try:
        return status, json.loads(data), hdrs
    except ValueError:
        return status, data.decode(errors="replace"), hdrs


def wait_for(pred, timeout: float = 5.0, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def health(url: str) -> dict:
    return raw(url.removesuffix("/v1"), "/health", method="GET")[1]


USER = [{"role": "user", "content": "What is the capital of France?"}]
