"""The engine API over an OpenAI-compatible endpoint: `RemoteEngine.connect(RemoteOptions)` -> `session()` ->
`generate(messages, request, cancel)` yields the events `engine.api.Session.generate` yields, so the chat and
`ninfer` drive a remote server the way they drive the in-process engine.

    engine = RemoteEngine.connect(RemoteOptions("http://127.0.0.1:8080/v1"))
    for ev in engine.session().generate([{"role": "user", "content": "Hi"}], GenerateRequest()):
        ...                                                     # TextDelta, ReasoningDelta, ..., FinalStats last

Requests go through the official `openai` client (its async flavour on a loop thread, loop.py: a cancel closes
the stream at once and the server sees the client leave). What the server cannot do per request (servers.py)
is refused up front with the reason (ConfigError), never sent to be ignored; `unavailable()` lists it for the UI.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..config import MAX_POSITIONS, GenerateRequest, check_messages
from ..errors import ConfigError
from ..events import Progress
from .errors import RemoteError, explain
from .loop import LoopThread
from .metrics import SpecCounters, parse_spec_counters
from .servers import FEATURES, Server, detect, host_of, metrics_url, normalize_endpoint
from .stream import ReplyMeter

CONNECT_TIMEOUT_S = 15.0  # listing the models: a server that does not answer this fast is not there
METRICS_TIMEOUT_S = 3.0


@dataclass
class RemoteOptions:
    """Where the model is served. Built by `remote_options` from [remote] in the config and the flags."""

    endpoint: str
    api_key: str | None = None
    model: str | None = None  # None: the first model the server lists
    timeout: float = 600.0  # seconds the server may stay silent while a reply is on
    metrics: bool = True  # read vLLM's speculative counters from /metrics around each reply


def remote_options(cfg: dict | None, *, endpoint: str | None = None, api_key: str | None = None,
                   model: str | None = None) -> RemoteOptions | None:
    """RemoteOptions from the flags over [remote] (config.toml); None where neither names an endpoint. The
    key: the flag, else [remote] api_key, else $NINFER_API_KEY (the variable ninfer-serve reads)."""
    from ..options import with_defaults
    r = with_defaults(cfg)["remote"]
    url = endpoint if endpoint is not None else r["endpoint"]
    if not url:
        return None
    try:
        url = normalize_endpoint(url)
    except ValueError as e:
        raise ConfigError(f"--endpoint {e}") from None
    if r["timeout"] <= 0:
        raise ConfigError(f"[remote] timeout must be > 0 seconds, got {r['timeout']}")
    key = api_key if api_key is not None else (r["api_key"] or os.environ.get("NINFER_API_KEY") or None)
    return RemoteOptions(url, key or None, (model if model is not None else r["model"]) or None,
                         float(r["timeout"]), bool(r["metrics"]))


class RemoteEngine:
    """A model served at an OpenAI-compatible endpoint, with the attributes the chat reads of an Engine
    (name, max_context, capacity, thinking_kind, spec_modes(), session(), with_context())."""

    def __init__(self, opts: RemoteOptions, server: Server, model_id: str, card: dict, served: list[str],
                 loop: LoopThread, client, notes: list[str]):
        self.opts, self.server, self.model_id, self.card, self.served = opts, server, model_id, card, served
        self.endpoint, self.host = opts.endpoint, host_of(opts.endpoint)
        self.loop, self.client = loop, client
        self.notes = notes  # what the chat says once it is connected
        meta = card.get("meta") if isinstance(card.get("meta"), dict) else {}
        self.meta = meta
        self.name = model_id
        known = meta.get("context") or card.get("max_model_len")
        self.context_known = isinstance(known, int) and known > 0
        self.max_context = int(known) if self.context_known else MAX_POSITIONS
        self.capacity = int(meta.get("kv_capacity") or known or 0) if self.context_known else 0
        self.kv_dtype = str(meta.get("kv_dtype") or "n/a")
        self.thinking_kind = "prompted" if meta.get("thinking") == "prompted" else "native"
        self.spec_metrics = server.spec_metrics if opts.metrics else None
        self.description = f"{model_id} on {server.label} at {self.endpoint}"
        self.chat_name = f"{model_id} @ {self.endpoint}"  # what a transcript records as its model

    # -- connecting ------------------------------------------------------------------------------------------
    @classmethod
    def connect(cls, opts: RemoteOptions, progress: Callable[[Progress], None] | None = None) -> RemoteEngine:
        """List the endpoint's models, pick ours and find out what the server can do; RemoteError in one line
        (unreachable, a refused key, no such model)."""
        try:
            import openai
        except ImportError as e:
            raise ConfigError(f"a remote endpoint needs the openai client ({e}); pip install 'ninfer-chat'") from None
        report = progress or (lambda p: None)
        report(Progress("load", 0, 3, f"connecting to {opts.endpoint}"))
        loop = LoopThread()
        client = None
        try:
            async def make():
                return openai.AsyncOpenAI(base_url=opts.endpoint, api_key=opts.api_key or "none", max_retries=0,
                                          timeout=opts.timeout)
            client = loop.run(make())
            async def listing():
                return await client.with_options(timeout=min(CONNECT_TIMEOUT_S, opts.timeout)).models.list()
            try:
                page = loop.run(listing())
            except Exception as e:  # noqa: BLE001 - any failure to list the models is one line for the user
                raise explain(e, opts.endpoint) from None
            models = [m.model_dump() for m in page.data]
            served = [str(m.get("id")) for m in models]
            if not served:
                raise RemoteError(f"{opts.endpoint} lists no models; load one on the server first")
            if opts.model is not None and opts.model not in served:
                raise RemoteError(f"{opts.endpoint} has no model {opts.model!r}; it serves {', '.join(served)} "
                                  "(pick one with --model)")
            model_id = opts.model or served[0]
            server = detect(models)
            notes = []
            if opts.model is None and len(served) > 1:
                notes.append(f"{opts.endpoint} serves {len(served)} models; chatting with {model_id} "
                             "(--model picks another)")
            report(Progress("load", 1, 3, f"{server.label}: {model_id}"))
            engine = cls(opts, server, model_id, next(m for m in models if str(m.get("id")) == model_id), served,
                         loop, client, notes)
            if engine.spec_metrics:
                report(Progress("load", 2, 3, "reading the server's /metrics"))
                try:
                    counters = loop.run(engine._spec_counters())
                except openai.OpenAIError as e:
                    counters = None
                    notes.append(f"no speculative figures: {explain(e, metrics_url(opts.endpoint))}")
                if counters is None:
                    engine.spec_metrics = None
            report(Progress("load", 3, 3, engine.description))
            return engine
        except BaseException:
            if client is not None:  # its connections belong to the loop: closed there, before the loop goes
                with contextlib.suppress(openai.OpenAIError, RuntimeError, TimeoutError):
                    loop.run(client.close(), timeout=5)
            loop.close()
            raise

    async def _spec_counters(self) -> SpecCounters | None:
        text = await self.client.with_options(timeout=METRICS_TIMEOUT_S).get(metrics_url(self.endpoint), cast_to=str)
        return parse_spec_counters(text, self.spec_metrics or "", self.model_id)

    def close(self) -> None:
        import openai
        with contextlib.suppress(openai.OpenAIError, RuntimeError, TimeoutError):  # closing: nothing to tell
            self.loop.run(self.client.close(), timeout=5)
        self.loop.close()

    # -- what the chat asks of an engine -----------------------------------------------------------------------
    def session(self) -> RemoteSession:
        return RemoteSession(self)

    def spec_modes(self) -> dict[str, str | None]:
        return self.server.spec_modes(self.meta.get("spec_modes"))

    def unavailable(self) -> dict[str, str]:
        """feature (servers.FEATURES) -> why it cannot be used with this server."""
        return self.server.unavailable(self.host)

    def with_context(self, max_context: int, session):
        raise ConfigError(self.unavailable()["context"])

    def facts(self) -> dict:
        """What the stats panel shows about the engine (ninfer_tui.bridge.engine_facts)."""
        return {"model": f"{self.model_id} @ {self.host}", "backend": "remote", "threads": "-",
                "kv_dtype": self.kv_dtype, "context_capacity": self.capacity, "spec_modes": self.spec_modes(),
                "native_thinking": self.thinking_kind == "native"}

    def describe_unavailable(self) -> str:
        """One line: what the chat cannot change on this server, and why."""
        return "; ".join(f"{FEATURES[k]}: {why}" for k, why in self.unavailable().items())

    # -- the request -----------------------------------------------------------------------------------------
    def request_kwargs(self, messages: list[dict], req: GenerateRequest) -> dict:
        """The keyword arguments of chat.completions.create for this reply; ConfigError for what the server
        cannot be asked (with the reason)."""
        s, sp, th = self.server, req.sampling, req.thinking
        why = self.unavailable()
        kw: dict = {"model": self.model_id, "messages": messages, "stream": True, "max_tokens": sp.max_new,
                    "temperature": 0.0 if sp.is_greedy else sp.temperature, "top_p": sp.top_p,
                    "presence_penalty": sp.presence_penalty, "frequency_penalty": sp.frequency_penalty}
        if s.stream_usage:
            kw["stream_options"] = {"include_usage": True}
        if sp.seed is not None:
            kw["seed"] = sp.seed
        if sp.stop:
            kw["stop"] = list(sp.stop)
        extra: dict = dict(s.neutral)
        if s.top_k_min_p:
            extra["top_k"] = sp.top_k if sp.top_k > 0 else (0 if s.kind in ("llama.cpp", "llama-cpp-python") else -1)
            extra["min_p"] = sp.min_p
        if th.enabled is not None:
            if not s.template_kwargs:
                raise ConfigError(f"thinking {'on' if th.enabled else 'off'}: {why['thinking']}; leave thinking "
                                  "on auto")
            extra["chat_template_kwargs"] = {"enable_thinking": bool(th.enabled)}
        if th.budget is not None and th.enabled is not False:
            if not s.budget:
                raise ConfigError(f"thinking budget {th.budget}: {why['budget']}; leave the budget at 0 (unlimited)")
            extra["thinking_token_budget"] = th.budget
        if req.spec is not None:
            if s.spec_per_request:
                if (reason := self.spec_modes().get(req.spec)) is not None:
                    raise ConfigError(f"speculative mode {req.spec}: {reason}")
                extra["spec_mode"] = req.spec
                if req.draft_tokens is not None and req.spec != "off":
                    extra["speculative.n_max"] = req.draft_tokens
            elif req.spec != "off":
                raise ConfigError(f"speculative mode {req.spec}: {why['spec']}")
        if extra:
            kw["extra_body"] = extra
        return kw

    async def _pump(self, kwargs: dict, put: Callable) -> None:
        """Stream one reply into `put`: ("chunk", chunk)..., then ("end", SpecCounters | None) or ("error", e).
        Cancelling the task closes the stream (the server sees the client leave)."""
        import openai
        before = None
        if self.spec_metrics:
            try:
                before = await self._spec_counters()
            except openai.OpenAIError:
                before = None
        try:
            stream = await self.client.chat.completions.create(**kwargs)
            async with stream:
                async for chunk in stream:
                    put(("chunk", chunk))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reading thread, which raises it as a RemoteError
            put(("error", e))
            return
        spec = None
        if before is not None:
            try:
                after = await self._spec_counters()
                spec = after.minus(before) if after is not None else None
            except openai.OpenAIError:
                spec = None
        put(("end", spec))


class RemoteSession:
    """One conversation with the remote model. The server keeps no state we rely on: each reply sends the whole
    conversation (servers with a prefix cache reuse it on their side; usage reports the cached tokens)."""

    def __init__(self, engine: RemoteEngine):
        self.engine = engine
        self.stats_interval_s = 0.1
        self._busy = threading.Lock()

    def reset(self) -> None:
        """Nothing to forget here: the server holds no conversation of ours."""

    def generate(self, messages, request: GenerateRequest | None = None,
                 cancel: threading.Event | None = None) -> Iterator:
        """Stream one assistant reply as engine.events (FinalStats last). ConfigError/InputError here, before the
        first event, for a request this server cannot take; RemoteError while iterating for the server's."""
        req = request or GenerateRequest()
        msgs = check_messages(messages, text_only=True)
        kwargs = self.engine.request_kwargs(msgs, req)
        return self._events(kwargs, req, cancel or threading.Event())

    def _events(self, kwargs: dict, req: GenerateRequest, cancel: threading.Event) -> Iterator:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this session is already generating; one generate at a time")
        eng = self.engine
        items: queue.Queue = queue.Queue()
        try:
            meter = ReplyMeter(stats_interval_s=self.stats_interval_s, capacity=eng.capacity, kv_dtype=eng.kv_dtype)
            fut = eng.loop.submit(eng._pump(kwargs, items.put_nowait))
            cancelled, spec = False, None
            try:
                while True:
                    try:
                        kind, value = items.get(timeout=0.05)
                    except queue.Empty:
                        if cancel.is_set():
                            cancelled = True
                            break
                        continue
                    if kind == "chunk":
                        yield from meter.feed(value)
                    elif kind == "error":
                        raise explain(value, eng.endpoint, eng.model_id, eng.served)
                    else:
                        spec = value
                        break
                    if cancel.is_set():
                        cancelled = True
                        break
            finally:
                if not fut.done():
                    fut.cancel()
            yield from meter.end()
            yield from meter.forced()
            yield meter.final(cancelled=cancelled, spec=spec)
        finally:
            self._busy.release()
