"""engine.remote with the real openai client against ninfer-serve on loopback (fake engines: seconds, no model):
connecting and what the server can do, the event stream and its figures, the request fields the engine
receives, a stop that closes the stream, one-line errors, the /metrics scrape; servers that take fewer fields."""
from __future__ import annotations

import threading
import time

import pytest

from engine import options
from engine.config import EngineArgs, GenerateRequest
from engine.errors import ConfigError, InputError
from engine.events import (
    FinalStats,
    ReasoningDelta,
    StepStats,
    TextDelta,
    ThinkingForced,
)
from engine.fake import (
    Script,
    ScriptedEngine,
    fake_engine,
    script_policy,
    thinking_policy,
)
from engine.remote import RemoteEngine, RemoteError, RemoteOptions, remote_options
from engine.remote.servers import GENERIC, SERVERS

USER = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "Paris is the capital of France."


def connect(url: str, **kw) -> RemoteEngine:
    return RemoteEngine.connect(RemoteOptions(url, timeout=30.0, **kw))


def run(engine: RemoteEngine, request: GenerateRequest | None = None, messages=USER, cancel=None) -> list:
    return list(engine.session().generate(messages, request or options.generate_request(None, temperature=0.0),
                                          cancel))


def texts(events, kind) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


def test_connect_finds_the_model_and_what_ninfer_serve_can_do(serve):
    with serve(fake_engine(script_policy(ANSWER)), model_id="tiny-chat") as (url, _):
        progress = []
        eng = RemoteEngine.connect(RemoteOptions(url), progress=progress.append)
        try:
            assert eng.model_id == "tiny-chat" and eng.server is SERVERS["ninfer"]
            assert eng.max_context == 1024 and eng.capacity == 1024 and eng.kv_dtype == "f16"
            assert eng.chat_name == f"tiny-chat @ {url}"
            assert [p.done for p in progress] == [0, 1, 3] and "ninfer-serve" in progress[1].message
            # the per-request fields it takes are not listed as unavailable; what no client can change is
            assert set(eng.unavailable()) == {"context", "gpu"}
            assert eng.spec_modes()["ngram"] is None and "drafter" in eng.spec_modes()["mtp"]  # the server's own
            facts = eng.facts()
            assert facts["backend"] == "remote" and facts["context_capacity"] == 1024
            assert facts["model"] == f"tiny-chat @ {url.split('//')[1].split('/')[0]}"
            with pytest.raises(ConfigError, match="sets the context size when it starts"):
                eng.with_context(2048, eng.session())
        finally:
            eng.close()


def test_stream_events_and_figures(serve):
    with serve(fake_engine(script_policy(ANSWER), delay_s=0.01)) as (url, _):
        eng = connect(url)
        events = run(eng)
        second = run(eng, messages=USER + [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "ok"}])
        eng.close()
    assert texts(events, TextDelta) == ANSWER and not texts(events, ReasoningDelta)
    final = events[-1]
    assert isinstance(final, FinalStats) and sum(isinstance(e, FinalStats) for e in events) == 1
    assert any(isinstance(e, StepStats) for e in events)
    assert final.finish_reason == "stop" and final.backend == "remote" and final.context_capacity == 1024
    assert final.prompt_tokens > 0 and final.output_tokens >= len(ANSWER.split())  # the server's usage
    assert final.answer_tokens == final.output_tokens and final.reasoning_tokens == 0
    # measured from the stream: the server sleeps 10 ms a token, so the whole reply reads at most ~100 tok/s; the
    # decode rate alone can read more where the server merged deltas it fell behind on (200.3 tok/s in a clean-
    # clone run beside a training job), so it is only checked to be a rate
    assert 0 < final.ttft_s < final.wall_s and 0 < final.decode_tok_s < float("inf")
    assert final.output_tokens / final.wall_s <= 110
    assert second[-1].cached_prompt_tokens > 0  # the server's prefix reuse, as its usage reports it


def test_reasoning_content_is_reasoning_and_a_forced_close_is_reported(serve):
    eng_ = fake_engine(thinking_policy(answer="Paris.", close_after=None), native_thinking=True)
    with serve(eng_) as (url, _):
        eng = connect(url)
        free = run(eng, options.generate_request(None, temperature=0.0, max_new=12))
        forced = run(eng, options.generate_request(None, temperature=0.0, max_new=200, thinking={"budget": 3}))
        eng.close()
    words = texts(free, ReasoningDelta).split()  # 12 tokens: the opening marker and 11 words
    assert words == ["hmm"] * 11 and texts(free, TextDelta) == ""
    assert free[-1].finish_reason == "length" and (free[-1].output_tokens, free[-1].reasoning_tokens) == (12, 11)
    assert texts(forced, TextDelta) == "Paris." and texts(forced, ReasoningDelta).split()[:3] == ["hmm"] * 3
    assert any(isinstance(e, ThinkingForced) for e in forced) and forced[-1].thinking_forced


def test_request_fields_reach_the_served_engine(serve):
    eng_ = ScriptedEngine(EngineArgs(), Script(answer="ok", reasoning="r", native_thinking=True))
    with serve(eng_) as (url, _):
        eng = connect(url)
        req = options.generate_request(None, temperature=0.3, top_p=0.9, top_k=7, min_p=0.1, max_new=77, seed=5,
                                       presence_penalty=0.4, frequency_penalty=0.2, stop=("END",),
                                       thinking={"mode": "on", "budget": 12}, spec="ngram", draft_tokens=4)
        run(eng, req)
        run(eng, options.generate_request(None, greedy=True, top_k=0, thinking={"mode": "off"}, spec="off"))
        eng.close()
    full, off = eng_.requests
    s = full.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.max_new, s.seed) == (0.3, 0.9, 7, 0.1, 77, 5)
    assert (s.presence_penalty, s.frequency_penalty, s.stop) == (0.4, 0.2, ("END",))
    assert full.thinking.enabled is True and full.thinking.budget == 12
    assert (full.spec, full.draft_tokens) == ("ngram", 4)
    assert off.sampling.temperature == 0.0 and off.thinking.enabled is False and off.spec == "off"
    assert off.sampling.top_k == 0  # off: sent as -1 (vLLM's "off"), which ninfer-serve reads as off too


def test_stop_closes_the_stream_and_the_server_cancels_the_reply(serve):
    held = ScriptedEngine(EngineArgs(), Script(answer="one two three four five", reasoning="", hold_after=2))
    with serve(held) as (url, app):
        finals, worker = [], app.state.worker
        observe = worker.on_final
        worker.on_final = lambda st: (finals.append(st), observe(st))
        eng = connect(url)
        cancel = threading.Event()
        out, t_cancel = [], None
        for ev in eng.session().generate(USER, GenerateRequest(), cancel):
            out.append(ev)
            if isinstance(ev, TextDelta) and texts(out, TextDelta) == "one two " and t_cancel is None:
                t_cancel = time.perf_counter()
                cancel.set()  # the engine holds after two tokens: only the stop can end this reply
        ended = time.perf_counter() - t_cancel
        assert isinstance(out[-1], FinalStats) and out[-1].finish_reason == "cancelled" and ended < 1.0
        deadline = time.monotonic() + 5
        while not finals and time.monotonic() < deadline:  # the server saw the client leave
            time.sleep(0.01)
        assert finals and finals[-1].finish_reason == "cancelled"
        assert not held.script.release.is_set()
        held.script.hold_after = None
        assert texts(run(eng), TextDelta) == "one two three four five"  # the server and session are free again
        eng.close()


def test_errors_are_one_line_saying_what_to_do(serve):
    with serve(fake_engine(script_policy(ANSWER)), api_key="sekrit") as (url, _):
        with pytest.raises(RemoteError, match=r"refused the API key \(HTTP 401.*--api-key"):
            connect(url, api_key="wrong")
        with pytest.raises(RemoteError, match=r"has no model 'nope'; it serves tiny \(pick one with --model\)"):
            connect(url, api_key="sekrit", model="nope")
        with pytest.raises(RemoteError, match=r"no OpenAI API there \(HTTP 404.*ends in /v1"):
            connect(url.replace("/v1", "/api"), api_key="sekrit")
        eng = connect(url, api_key="sekrit")
        with pytest.raises(RemoteError, match=r"refused the request \(HTTP 400: the prompt is \d+ tokens but the "
                                              r"context is 1024"):
            run(eng, messages=[{"role": "user", "content": "word " * 3000}])
        assert texts(run(eng), TextDelta) == ANSWER  # the server and the engine go on
        eng.close()
    with pytest.raises(RemoteError, match=r"cannot reach http://127.0.0.1:9/v1 .*check the URL"):
        connect("http://127.0.0.1:9/v1")
    for bad in ("localhost:8080", "ftp://host/v1", "http://host:8080/v1?x=1"):
        with pytest.raises(ConfigError, match="--endpoint"):
            remote_options(None, endpoint=bad)


def test_what_a_server_cannot_take_is_refused_with_the_reason(serve):
    """The same ninfer-serve, treated as servers that take fewer fields (what detect() picks for them)."""
    with serve(ScriptedEngine(EngineArgs(), Script(answer="ok", reasoning="", native_thinking=True))) as (url, _):
        eng = connect(url)
        for server in (GENERIC, SERVERS["me"], SERVERS["llamacpp"], SERVERS["vllm"]):
            eng.server = server
            why = eng.unavailable()
            assert why["spec"].startswith(server.label) and "context" in why and "gpu" in why
            assert set(eng.spec_modes().values()) == {None, f"set when {server.label} starts"}
            with pytest.raises(ConfigError, match="speculative mode ngram: .*cannot switch it"):
                eng.session().generate(USER, GenerateRequest(spec="ngram"))
            budget = options.generate_request(None, thinking={"budget": 8})
            thinking = options.generate_request(None, thinking={"mode": "off"})
            if server.budget:
                assert eng.request_kwargs(USER, budget)["extra_body"]["thinking_token_budget"] == 8
            else:
                with pytest.raises(ConfigError, match="no per-request thinking budget; leave the budget at 0"):
                    eng.session().generate(USER, budget)
            if server.template_kwargs:
                assert eng.request_kwargs(USER, thinking)["extra_body"]["chat_template_kwargs"] == {
                    "enable_thinking": False}
            else:
                with pytest.raises(ConfigError, match="takes no chat_template_kwargs"):
                    eng.session().generate(USER, thinking)
            kw = eng.request_kwargs(USER, options.generate_request(None, top_k=0))
            extra = kw.get("extra_body", {})
            assert ("top_k" in extra) == server.top_k_min_p and ("top_k_min_p" in why) != server.top_k_min_p
            if server is SERVERS["me"]:  # llama-cpp-python: top_k >= 0, and its 1.1 repeat penalty neutralised
                assert extra["top_k"] == 0 and extra["repeat_penalty"] == 1.0
            # what the server does take still answers
            assert texts(run(eng, options.generate_request(None, temperature=0.0)), TextDelta) == "ok"
        eng.close()
    with pytest.raises(InputError):
        eng.session().generate([], GenerateRequest())
