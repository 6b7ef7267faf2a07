"""`ninfer-serve`: the engine behind an OpenAI-compatible HTTP API. The engine never imports this package.

  main.py      the command (options from engine.options, like `ninfer`), the uvicorn server, `background()`
  app.py       the ASGI app: routes, API key, body limit, errors in OpenAI's shape, SSE streams
  worker.py    the engine thread: one session, replies one at a time, a bounded queue (429 beyond it)
  protocol.py  request models (pydantic, strict types) and response/chunk bodies; which extra fields we read
  metrics.py   /metrics (prometheus_client)

The stack, and why:
- starlette: the small ASGI toolkit FastAPI is built on, maintained by the encode team; routing, requests,
  responses and exception handlers without FastAPI's own error format (422 {"detail": ...}), which we would
  have to undo for OpenAI's {"error": {...}} shape.
- uvicorn: the reference ASGI server (h11 / httptools); we hand it a bound socket, so a test can listen on a
  free port, and its SIGINT/SIGTERM handling drains connections with a deadline (graceful shutdown).
- sse-starlette: the maintained SSE response for starlette: event framing, keep-alive pings and client
  disconnect detection (it cancels our stream generator, whose `finally` sets the engine's cancel event).
- pydantic v2 (strict mode): request validation that names the offending field and rejects wrong types
  ("temperature": "hot", "max_tokens": "10") instead of coercing them; the openai client needs it anyway.
- prometheus_client: the official Prometheus library, for /metrics' text format.
All of them pure Python or with wheels; they are the `serve` extra (the `test` extra pulls it in).

Concurrency: one loaded model, one engine session, requests served one at a time in arrival order (the
engine decodes one sequence with every core; it has no batched runner). HTTP handling is async on one event
loop; the engine runs in its own thread. At most 1 + --max-queue requests are held; more get 429 at once.
"""
