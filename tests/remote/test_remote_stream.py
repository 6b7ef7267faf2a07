"""engine.remote's mapping of other servers' streams, on the openai client's own chunk type: <think> in the
content (llama.cpp's server without a reasoning parser), vLLM's `reasoning` field, llama.cpp's `timings`, a
stream without usage; vLLM's /metrics counters, parsed and scraped (from ninfer-serve's page, whose counters
carry vLLM's names under the ninfer_ prefix); the [remote] options."""
from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletionChunk

from engine import options
from engine.errors import ConfigError
from engine.events import FinalStats, ReasoningDelta, TextDelta
from engine.fake import fake_engine, script_policy
from engine.remote import RemoteEngine, RemoteOptions, remote_options
from engine.remote.metrics import SpecCounters, parse_spec_counters
from engine.remote.servers import detect, metrics_url, normalize_endpoint
from engine.remote.stream import ReplyMeter


def chunk(content=None, finish=None, usage=None, **extra) -> ChatCompletionChunk:
    delta = {"role": "assistant"} | ({"content": content} if content is not None else {})
    delta |= {k: v for k, v in extra.items() if k in ("reasoning_content", "reasoning")}
    body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    body |= {k: v for k, v in extra.items() if k == "timings"}
    return ChatCompletionChunk.model_validate(body)


def feed(chunks) -> tuple[str, str, FinalStats]:
    meter = ReplyMeter()
    events = [ev for c in chunks for ev in meter.feed(c)] + meter.end()
    final = meter.final()
    return ("".join(e.text for e in events if isinstance(e, ReasoningDelta)),
            "".join(e.text for e in events if isinstance(e, TextDelta)), final)


def test_think_tags_in_the_content_split_even_across_chunks():
    parts = ["<th", "ink>\nLet me", " see.</thi", "nk>\n\nParis", " is the capital."]
    reasoning, answer, final = feed([chunk(p) for p in parts] + [chunk(finish="stop")])
    assert reasoning == "Let me see." and answer == "Paris is the capital."
    assert final.output_tokens == 5 and final.reasoning_tokens == 3  # no usage: one token per delta
    # content that only looks like a marker's start is released at the end, not lost
    assert feed([chunk("a <"), chunk("b"), chunk("<")])[1] == "a <b<"
    # leading blank lines of a plain answer are not reasoning
    reasoning, answer, final = feed([chunk("\n\n"), chunk("Hi"), chunk(" there")])
    assert (reasoning, answer, final.reasoning_tokens, final.answer_tokens) == ("", "Hi there", 0, 3)


def test_vllm_reasoning_field_and_usage():
    chunks = [chunk(reasoning="hmm "), chunk(reasoning="ok"), chunk("Paris."),
              chunk(finish="length", usage={"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16,
                                            "completion_tokens_details": {"reasoning_tokens": 5},
                                            "prompt_tokens_details": {"cached_tokens": 4}})]
    reasoning, answer, final = feed(chunks)
    assert (reasoning, answer) == ("hmm ok", "Paris.")
    assert (final.prompt_tokens, final.output_tokens, final.reasoning_tokens, final.answer_tokens,
            final.cached_prompt_tokens, final.finish_reason) == (9, 7, 5, 2, 4, "length")
    assert final.spec_mode == "off" and final.backend == "remote"
    # a server that counts no reasoning says so with 0, which stands
    zero = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
            "completion_tokens_details": {"reasoning_tokens": 0}}
    assert feed([chunk(reasoning="r"), chunk("a", finish="stop", usage=zero)])[2].reasoning_tokens == 0


def test_llama_cpp_timings_give_prefill_rate_and_draft_acceptance():
    timings = {"prompt_n": 20, "cache_n": 3, "prompt_per_second": 812.5, "predicted_n": 4,
               "predicted_per_second": 55.0, "draft_n": 10, "draft_n_accepted": 6}
    _, answer, final = feed([chunk("a"), chunk("b"), chunk("c"), chunk("d", finish="stop", timings=timings)])
    assert answer == "abcd" and (final.prompt_tokens, final.cached_prompt_tokens) == (20, 3)
    assert final.prefill_tok_s == 812.5 and final.decode_tok_s > 0  # decode from the stream, not the server
    assert (final.spec_mode, final.drafted, final.accepted, final.rounds) == ("server", 10, 6, 0)
    assert final.acceptance == 0.6


def test_an_unusual_finish_reason_is_named():
    final = feed([chunk("x", finish="content_filter")])[2]
    assert final.finish_reason == "stop" and "content_filter" in final.stop_reason_detail


VLLM_PAGE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="other"} 99.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 17.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 6.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_vllm_spec_counters_parse_and_subtract():
    c = parse_spec_counters(VLLM_PAGE, "vllm:", "m")
    assert c == SpecCounters(10.0, 30.0, 17.0, (8.0, 6.0, 3.0))
    assert parse_spec_counters(VLLM_PAGE, "vllm:", "nobody") is None  # another model's counters are not ours
    assert parse_spec_counters("vllm:x{ broken", "vllm:") is None
    d = SpecCounters(14.0, 42.0, 23.0, (10.0, 8.0, 5.0)).minus(c)
    assert (d.drafts, d.draft_tokens, d.accepted) == (4.0, 12.0, 6.0) and d.per_position_accept() == (0.5, 0.5, 0.5)
    meter = ReplyMeter()
    meter.feed(chunk("x", finish="stop"))
    final = meter.final(spec=d)
    assert (final.spec_mode, final.rounds, final.drafted, final.accepted) == ("server", 4, 12, 6)
    assert final.per_position_accept == (0.5, 0.5, 0.5)


def test_metrics_scrape_around_a_reply(serve):
    """The scrape path (openai client GET of /metrics, parsed) on ninfer-serve's page: its counters are vLLM's
    under another prefix, and the difference over a speculative reply is that reply's drafts."""
    text = " the capital of France is Paris." * 3
    with serve(fake_engine(script_policy(text)), model_id="m") as (url, _):
        eng = RemoteEngine.connect(RemoteOptions(url))
        try:
            eng.spec_metrics = "ninfer_"
            before = eng.loop.run(eng._spec_counters())
            events = list(eng.session().generate([{"role": "user", "content": "hi"}],
                                                 options.generate_request(None, temperature=0.0, spec="ngram")))
            after = eng.loop.run(eng._spec_counters())
        finally:
            eng.close()
    final = events[-1]
    assert final.spec_mode == "ngram" and final.drafted > 0  # ninfer-serve's own figures (timings) come first
    d = after.minus(before)
    assert (d.draft_tokens, d.accepted) == (final.drafted, final.accepted)  # (its rounds counter is named apart)


def test_endpoints_servers_and_options(monkeypatch):
    assert normalize_endpoint("http://h:8080") == "http://h:8080/v1"
    assert normalize_endpoint("https://h/api/v1/ ") == "https://h/api/v1"
    assert metrics_url("http://h:8000/v1") == "http://h:8000/metrics"
    assert detect([{"id": "x", "owned_by": "vllm"}]).kind == "vllm"
    assert detect([{"id": "x", "owned_by": "llamacpp"}]).kind == "llama.cpp"
    assert detect([{"id": "x", "owned_by": "me"}]).kind == "llama-cpp-python"
    assert detect([{"id": "x", "owned_by": "acme"}]).kind == "openai-compatible"
    assert remote_options(None) is None  # config.toml: no endpoint, the local engine
    cfg = {"remote": {"endpoint": "http://h:1", "model": "m", "api_key": "k", "timeout": 5.0}}
    o = remote_options(cfg)
    assert (o.endpoint, o.model, o.api_key, o.timeout) == ("http://h:1/v1", "m", "k", 5.0)
    o = remote_options(cfg, endpoint="http://other:2/v1", api_key="flag", model="n")
    assert (o.endpoint, o.model, o.api_key) == ("http://other:2/v1", "n", "flag")
    monkeypatch.setenv("NINFER_API_KEY", "env")
    assert remote_options({"remote": {"endpoint": "http://h:1"}}).api_key == "env"
    with pytest.raises(ConfigError, match="timeout must be > 0"):
        remote_options({"remote": {"endpoint": "http://h:1", "timeout": 0.0}})
    with pytest.raises(ConfigError, match=r"unknown key \[remote\] endpont"):
        remote_options({"remote": {"endpont": "http://h:1"}})
