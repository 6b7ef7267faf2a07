"""The ASGI app: routes, the API key, request limits, errors in OpenAI's shape, SSE streams.

    app = create_app(engine, ServeSettings(model_id="SmolLM2-135M-Instruct"))   # any ASGI server runs it

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/completions (both stream
with `"stream": true`), GET /health, GET /metrics. With an API key set, /v1/* needs `Authorization: Bearer
KEY` (compared in constant time); /health and /metrics stay open, as in vLLM. Every error a client can cause
is a JSON body {"error": {"message", "type", "param", "code"}} with the status OpenAI uses (400 bad request,
401 key, 404 model or route, 405, 413 body too large, 429 queue full, 503 shutting down); anything else is a
500 in the same shape, its traceback in the server's log only.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import options
from ..errors import ConfigError, InputError
from ..events import FinalStats, ReasoningDelta, TextDelta
from . import protocol as P
from .metrics import Metrics
from .worker import EngineWorker, Job, QueueFull, ShuttingDown

log = logging.getLogger("ninfer.serve")


@dataclass
class ServeSettings:
    """What the server adds to the engine: its model id, key, limits and the config the requests start from."""

    model_id: str
    api_key: str | None = None
    max_queue: int = 8  # requests waiting behind the one being generated; more get 429
    max_body_bytes: int = 4 << 20  # a request body past this gets 413
    config: dict | None = None  # config.toml's tables (engine.options): defaults for every request field
    disconnect_poll_s: float = 0.1  # how often a waiting non-streaming request checks its client is still there


class ClientGone(Exception):
    """The client disconnected before its reply was done."""


def create_app(engine, settings: ServeSettings) -> Starlette:
    worker = EngineWorker(engine, settings.max_queue)
    metrics = Metrics(worker.counts)
    worker.on_final, worker.on_wait = metrics.observe, metrics.queue_wait.observe
    cfg = options.with_defaults(settings.config)
    names = {settings.model_id, engine.name, Path(engine.name).stem}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.close)
            log.info("stopped: replies cancelled, the engine thread joined")

    # -- helpers --------------------------------------------------------------------------------------------
    def check_auth(request: Request) -> None:
        if not settings.api_key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        ok = hmac.compare_digest(token.strip().encode(), settings.api_key.encode()) and scheme.lower() == "bearer"
        if not ok:
            raise P.ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer KEY'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read_json(request: Request) -> dict:
        limit = settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise P.ApiError(413, f"the request body is {declared} bytes; this server takes at most {limit}",
                             code="request_too_large")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise P.ApiError(413, f"the request body is over {limit} bytes, this server's limit",
                                     code="request_too_large")
        except ClientDisconnect:
            raise ClientGone() from None
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise P.ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
        except RecursionError:
            raise P.ApiError(400, "the request body's JSON is nested too deeply", code="invalid_json") from None
        if not isinstance(data, dict):
            raise P.ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return data

    def parse(model, data: dict):
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            raise P.from_validation(e) from None
        req.check_supported()
        if req.model is not None and req.model not in names:
            raise P.ApiError(404, f"the model {req.model!r} does not exist; this server serves "
                             f"{settings.model_id!r}", param="model", code="model_not_found")
        return req

    def generate_request(req: P.SamplingFields, thinking: dict | None, stop_ids=()):
        try:
            g = options.generate_request(cfg, spec=req.spec_mode, draft_tokens=req.speculative_n_max,
                                         thinking=thinking, **req.sampling_flags())
        except ConfigError as e:
            raise engine_error(e) from None
        if stop_ids:
            g = dataclasses.replace(g, sampling=dataclasses.replace(g.sampling, stop_token_ids=tuple(stop_ids)))
        return g

    def submit(job: Job) -> None:
        try:
            worker.submit(job)
        except QueueFull as e:
            raise P.ApiError(429, f"the server is busy: {e}", type="rate_limit_error", code="rate_limit_exceeded",
                             headers={"Retry-After": "1"}) from None
        except ShuttingDown as e:
            raise P.ApiError(503, str(e), type="server_error", code="shutting_down") from None

    async def next_item(job: Job, request: Request):
        """The job's next item; while waiting, a client that left cancels the job (ClientGone)."""
        while True:
            try:
                return await asyncio.wait_for(job.items.get(), settings.disconnect_poll_s)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()
                    raise ClientGone() from None

    async def started(job: Job, request: Request) -> None:
        """Wait until the engine took the job (queued requests wait here) or refused it."""
        kind, value = await next_item(job, request)
        if kind == "error":
            raise engine_error(value)
        if kind == "end":  # cancelled before it ran: the server is stopping
            raise P.ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")

    async def run(job: Job, request: Request) -> None:
        """Queue the job and wait until the engine runs it; a failure or a client gone cancels it."""
        submit(job)
        try:
            await started(job, request)
        except BaseException:
            job.cancel.set()
            raise

    # -- endpoints ------------------------------------------------------------------------------------------
    async def chat(request: Request) -> Response:
        check_auth(request)
        req = parse(P.ChatRequest, await read_json(request))
        job = Job(req.engine_messages(), generate_request(req, req.thinking_flags()), asyncio.get_running_loop())
        await run(job, request)
        rid, created = P.new_id("chatcmpl"), P.now()
        if req.stream:
            return EventSourceResponse(chat_stream(job, rid, created, req.include_usage), ping=15)
        answer, reasoning, final = await collect(job, request)
        return JSONResponse(P.chat_response(rid, created, settings.model_id, answer, reasoning, final))

    async def chat_stream(job: Job, rid: str, created: int, include_usage: bool):
        model = settings.model_id
        try:
            yield json.dumps(P.chat_chunk(rid, created, model, {"role": "assistant", "content": ""}))
            final = None
            async for ev in events(job):
                if isinstance(ev, TextDelta):
                    yield json.dumps(P.chat_chunk(rid, created, model, {"content": ev.text}))
                elif isinstance(ev, ReasoningDelta):
                    yield json.dumps(P.chat_chunk(rid, created, model, {"reasoning_content": ev.text}))
                elif isinstance(ev, FinalStats):
                    final = ev
            yield json.dumps(P.chat_chunk(rid, created, model, {}, P.finish_reason(final), final))
            if include_usage:  # OpenAI's usage chunk: no choices
                yield json.dumps(P.chat_chunk(rid, created, model, {}, final=final, choices=False))
            yield "[DONE]"
        except P.ApiError as e:
            yield json.dumps(e.body())
            yield "[DONE]"
        finally:
            job.cancel.set()  # a client that left (sse-starlette cancels this generator) stops the engine

    async def completions(request: Request) -> Response:
        check_auth(request)
        req = parse(P.CompletionRequest, await read_json(request))
        tok = engine.tokenizer
        if isinstance(req.prompt, list) and isinstance(req.prompt[0], int):
            kind, prompt = "ids", list(req.prompt)
        else:
            kind, prompt = "text", req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        greq = generate_request(req, {"mode": "off"}, stop_ids=getattr(tok, "stop_ids", ()))
        job = Job(prompt, greq, asyncio.get_running_loop(), kind=kind)
        await run(job, request)
        rid, created = P.new_id("cmpl"), P.now()
        if req.stream:
            return EventSourceResponse(completion_stream(job, rid, created, req.include_usage), ping=15)
        answer, _, final = await collect(job, request)
        out = P.completion_chunk(rid, created, settings.model_id, answer, P.finish_reason(final), final)
        return JSONResponse(out)

    async def completion_stream(job: Job, rid: str, created: int, include_usage: bool):
        model = settings.model_id
        try:
            final = None
            async for ev in events(job):
                if isinstance(ev, TextDelta):
                    yield json.dumps(P.completion_chunk(rid, created, model, ev.text))
                elif isinstance(ev, FinalStats):
                    final = ev
            yield json.dumps(P.completion_chunk(rid, created, model, "", P.finish_reason(final), final))
            if include_usage:
                yield json.dumps(P.completion_chunk(rid, created, model, "", final=final, choices=False))
            yield "[DONE]"
        except P.ApiError as e:
            yield json.dumps(e.body())
            yield "[DONE]"
        finally:
            job.cancel.set()

    async def events(job: Job):
        """The job's engine events until its end; an engine failure mid-reply raises ApiError. Deltas already
        waiting are merged (a reader that fell behind the engine catches up in one chunk, not one per token)."""
        while True:
            items = [await job.items.get()]
            while not job.items.empty():
                items.append(job.items.get_nowait())
            for ev in coalesce(v for k, v in items if k == "event"):
                yield ev
            for kind, value in items:
                if kind == "error":
                    raise engine_error(value)
                if kind == "end":
                    return

    async def collect(job: Job, request: Request):
        answer, reasoning, final = [], [], None
        while True:
            kind, value = await next_item(job, request)
            if kind == "error":
                raise engine_error(value)
            if kind == "end":
                return "".join(answer), "".join(reasoning), final
            if isinstance(value, TextDelta):
                answer.append(value.text)
            elif isinstance(value, ReasoningDelta):
                reasoning.append(value.text)
            elif isinstance(value, FinalStats):
                final = value

    async def models(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model_one(request: Request) -> Response:
        check_auth(request)
        mid = request.path_params["model"]
        if mid not in names:
            raise P.ApiError(404, f"the model {mid!r} does not exist; this server serves {settings.model_id!r}",
                             param="model", code="model_not_found")
        return JSONResponse(model_card())

    def model_card() -> dict:
        return {"id": settings.model_id, "object": "model", "created": created_at, "owned_by": "ninfer",
                "max_model_len": engine.max_context,
                "meta": {"file": engine.name, "context": engine.max_context, "kv_capacity": engine.capacity,
                         "backend": engine.args.backend, "kv_dtype": engine.args.kv_dtype,
                         "spec_mode": engine.args.spec, "spec_modes": spec_modes, "thinking": engine.thinking_kind,
                         "description": engine.description}}

    async def health(request: Request) -> Response:
        running, waiting = worker.counts()
        return JSONResponse({"status": "ok", "running": running, "waiting": waiting})

    async def metrics_route(request: Request) -> Response:
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    created_at = P.now()
    spec_modes = engine.spec_modes()  # mode -> None (a request may ask for it) or why not; clients show it

    def counted(name: str, fn):
        async def endpoint(request: Request) -> Response:
            try:
                resp = await fn(request)
            except P.ApiError as e:
                resp = error_response(e)
            except ClientGone:
                resp = Response(status_code=499)  # nginx's "client closed request"; nobody reads it
            metrics.requests.labels(name, str(resp.status_code)).inc()
            return resp
        return endpoint

    routes = [
        Route("/v1/chat/completions", counted("chat", chat), methods=["POST"]),
        Route("/v1/completions", counted("completions", completions), methods=["POST"]),
        Route("/v1/models", counted("models", models), methods=["GET"]),
        Route("/v1/models/{model:path}", counted("models", model_one), methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
    ]
    handlers = {HTTPException: http_error, Exception: server_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics
    return app


# The engine's messages name the command-line options; a client sent these request fields instead.
FIELD_OF_FLAG = {"--max-new": "max_tokens", "--thinking-budget": "thinking_token_budget",
                 "--draft-tokens": "speculative.n_max", "--spec": "spec_mode", "--reasoning-effort": "reasoning_effort"}


def api_names(msg: str) -> str:
    """'--top-k must be >= 0' -> 'top_k must be >= 0'; the CLI's advice to raise --max-context stays."""
    def field(m: re.Match) -> str:
        flag = m.group(0)
        return FIELD_OF_FLAG.get(flag, flag if flag == "--max-context" else flag[2:].replace("-", "_"))
    return re.sub(r"--[a-z][a-z-]*[a-z]", field, msg)


def coalesce(evs) -> list:
    """Consecutive TextDeltas (or ReasoningDeltas) joined into one; other events kept in place."""
    out: list = []
    for ev in evs:
        if out and isinstance(ev, (TextDelta, ReasoningDelta)) and type(out[-1]) is type(ev):
            out[-1] = type(ev)(out[-1].text + ev.text)
        else:
            out.append(ev)
    return out


def engine_error(e: Exception) -> P.ApiError:
    """An engine exception as the client's error: a refused request (400) or our failure (500)."""
    if isinstance(e, P.ApiError):
        return e
    msg = (str(e).splitlines() or [type(e).__name__])[0]
    if isinstance(e, (InputError, ConfigError)):
        msg = api_names(msg)
    if isinstance(e, InputError):
        code = "context_length_exceeded" if "context" in msg else "invalid_input"
        return P.ApiError(400, msg, param="messages", code=code)
    if isinstance(e, ConfigError):
        return P.ApiError(400, msg, code="invalid_value")
    return P.ApiError(500, f"the engine failed: {type(e).__name__}: {msg}", type="server_error", code="engine_error")


def error_response(e: P.ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own errors (unknown route 404, wrong method 405) in OpenAI's shape."""
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(P.ApiError(exc.status_code, msg, code=kind, headers=dict(exc.headers or {})))


async def server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(P.ApiError(500, f"internal error ({type(exc).__name__}); see the server's log",
                                     type="server_error", code="internal_error"))
