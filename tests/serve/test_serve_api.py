"""ninfer-serve's endpoints with the real openai client on loopback, over the fake engines (seconds, no model):
models, chat completions streamed and not, reasoning_content, completions, request fields -> GenerateRequest,
usage and our stats, /metrics."""
from __future__ import annotations

from serve_helpers import USER, client, raw, serve

from engine.config import EngineArgs
from engine.fake import (
    Script,
    ScriptedEngine,
    fake_engine,
    script_policy,
    thinking_policy,
)

ANSWER = "Paris is the capital of France."


def test_models_lists_the_served_model():
    with serve(fake_engine(script_policy(ANSWER)), model_id="tiny-chat") as (url, _):
        c = client(url)
        ids = [m.id for m in c.models.list()]
        assert ids == ["tiny-chat"]
        assert c.models.retrieve("tiny-chat").model_extra["max_model_len"] == 1024


def test_chat_non_streaming_answer_usage_and_stats():
    with serve(fake_engine(script_policy(ANSWER))) as (url, _):
        r = client(url).chat.completions.create(model="fake", messages=USER, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.content == ANSWER
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.completion_tokens > 0 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    t = r.model_extra["timings"]
    for key in ("ttft_ms", "decode_tok_s", "acceptance", "tokens_per_round", "ms_per_round", "prompt_n",
                "predicted_n", "predicted_per_second", "draft_n", "draft_n_accepted", "spec_mode"):
        assert key in t, key
    assert t["predicted_n"] == u.completion_tokens and t["spec_mode"] == "off"


def test_chat_streaming_chunks_add_up_and_the_last_carries_usage():
    with serve(fake_engine(script_policy(ANSWER))) as (url, _):
        chunks = list(client(url).chat.completions.create(
            model="fake", messages=USER, temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == ANSWER
    assert len(chunks) >= 4  # the role, the text (merged where the reader fell behind), finish, usage
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "stop"
    assert finish[0].usage.completion_tokens > 0 and "timings" in finish[0].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == finish[0].usage.total_tokens


def test_reasoning_content_streams_apart_from_the_answer():
    eng = fake_engine(thinking_policy(answer="Paris.", close_after=3), native_thinking=True)
    with serve(eng) as (url, _):
        c = client(url)
        chunks = list(c.chat.completions.create(model="fake", messages=USER, temperature=0, stream=True))
        r = c.chat.completions.create(model="fake", messages=USER, temperature=0)
        off = c.chat.completions.create(model="fake", messages=USER, temperature=0,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    answer = "".join(d.content or "" for d in deltas)
    assert reasoning == " hmm hmm hmm" and answer == "Paris."
    assert r.choices[0].message.model_extra["reasoning_content"] == " hmm hmm hmm"
    assert r.choices[0].message.content == "Paris."
    assert r.usage.completion_tokens_details.reasoning_tokens >= 3  # the engine counts the close marker too
    assert off.choices[0].message.content == "Paris." and "reasoning_content" not in off.choices[0].message.model_extra


def test_thinking_budget_forces_the_close():
    eng = fake_engine(thinking_policy(answer="Paris.", close_after=None), native_thinking=True)
    with serve(eng) as (url, _):
        c = client(url)
        for field in ("thinking_token_budget", "thinking_budget_tokens"):
            r = c.chat.completions.create(model="fake", messages=USER, temperature=0, max_tokens=200,
                                          extra_body={field: 2})
            t = r.model_extra["timings"]
            assert t["thinking_forced"] is True and t["reasoning_tokens"] == 2, field
            assert r.choices[0].message.content == "Paris."


def test_request_fields_reach_the_engine_request():
    eng = ScriptedEngine(EngineArgs(), Script(answer="ok", reasoning="r", native_thinking=True))
    with serve(eng) as (url, _):
        client(url).chat.completions.create(
            model="fake", messages=USER, temperature=0.3, top_p=0.9, max_tokens=77, seed=5, stop=["END", "STOP"],
            presence_penalty=0.4, frequency_penalty=0.2,
            extra_body={"top_k": -1, "min_p": 0.1, "thinking_token_budget": 12, "spec_mode": "ngram",
                        "speculative.n_max": 5})
        client(url).chat.completions.create(model="fake", messages=USER, reasoning_effort="low", max_tokens=100)
        client(url).chat.completions.create(model="fake", messages=USER)
    full, effort, plain = eng.requests
    s = full.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.max_new, s.seed) == (0.3, 0.9, 0, 0.1, 77, 5)
    assert (s.presence_penalty, s.frequency_penalty, s.stop) == (0.4, 0.2, ("END", "STOP"))
    assert full.thinking.enabled is True and full.thinking.budget == 12
    assert (full.spec, full.draft_tokens) == ("ngram", 5)
    assert effort.thinking.budget == 25 and effort.sampling.max_new == 100  # low = 1/4 of max_tokens
    # nothing given: config.toml's defaults (engine.options), the engine's spec mode
    assert (plain.sampling.top_k, plain.sampling.top_p, plain.sampling.max_new) == (40, 0.95, 512)
    assert plain.spec is None and plain.thinking.enabled is None


def test_spec_mode_per_request_reports_acceptance():
    text = " the capital of France is Paris." * 3
    with serve(fake_engine(script_policy(text))) as (url, _):
        c = client(url)
        r = c.chat.completions.create(model="fake", messages=USER, temperature=0, extra_body={"spec_mode": "ngram"})
        assert r.choices[0].message.content == text
        t = r.model_extra["timings"]
        assert t["spec_mode"] == "ngram" and t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
        assert t["acceptance"] == round(t["draft_n_accepted"] / t["draft_n"], 4)
        assert t["tokens_per_round"] > 1
        status, body, _ = raw(url, "/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
                              b'"spec_mode": "mtp"}')
        assert status == 400 and "drafter" in body["error"]["message"]
        metrics = raw(url.removesuffix("/v1"), "/metrics", method="GET")[1]
    assert f"ninfer_spec_decode_num_draft_tokens_total {float(t['draft_n'])}" in metrics
    assert f"ninfer_spec_decode_num_accepted_tokens_total {float(t['draft_n_accepted'])}" in metrics


def test_completions_text_ids_and_stream():
    with serve(fake_engine(script_policy(ANSWER))) as (url, _):
        c = client(url)
        prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        r = c.completions.create(model="fake", prompt=prompt, max_tokens=200, temperature=0)
        assert r.object == "text_completion" and r.choices[0].text == ANSWER
        assert r.choices[0].finish_reason == "stop"  # the model's end-of-text stops a completion
        short = c.completions.create(model="fake", prompt=prompt, max_tokens=3, temperature=0)
        assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3
        ids = c.completions.create(model="fake", prompt=[1, 2], max_tokens=4, temperature=0)
        assert ids.usage.prompt_tokens == 2
        streamed = list(c.completions.create(model="fake", prompt=prompt, max_tokens=200, temperature=0,
                                             stream=True))
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == ANSWER
        assert streamed[-1].choices[0].finish_reason == "stop" and streamed[-1].usage.completion_tokens > 0


def test_metrics_counts_requests_tokens_and_ttft():
    with serve(fake_engine(script_policy(ANSWER))) as (url, _):
        c = client(url)
        r = c.chat.completions.create(model="fake", messages=USER)
        # read to its end: a stream closed early cancels the reply, which may then finish with no tokens
        assert "".join(ch.choices[0].delta.content or "" for ch in
                       c.chat.completions.create(model="fake", messages=USER, stream=True) if ch.choices) == ANSWER
        status, text, headers = raw(url.removesuffix("/v1"), "/metrics", method="GET")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    assert 'ninfer_requests_total{endpoint="chat",status="200"} 2.0' in text
    assert "ninfer_generation_tokens_total" in text and "ninfer_time_to_first_token_seconds_count 2.0" in text
    assert "ninfer_queue_wait_seconds_count 2.0" in text
    assert "ninfer_num_requests_running 0.0" in text and "ninfer_num_requests_waiting 0.0" in text
    assert "ninfer_decode_tokens_per_second" in text and r.usage.completion_tokens > 0


def test_stream_sends_each_token_as_it_comes():
    """With a reader that keeps up (a slow engine), every token is its own chunk, before the reply ends."""
    with serve(fake_engine(script_policy(ANSWER), delay_s=0.02)) as (url, _):
        stream = client(url).chat.completions.create(model="fake", messages=USER, temperature=0, stream=True)
        pieces = [ch.choices[0].delta.content for ch in stream if ch.choices and ch.choices[0].delta.content]
    assert "".join(pieces) == ANSWER and len(pieces) >= len(ANSWER.split()) - 1


def test_coalesce_joins_runs_of_the_same_delta():
    from engine.events import ReasoningDelta, TextDelta, ThinkingForced
    from engine.serve.app import coalesce
    forced = ThinkingForced(3, "")
    got = coalesce([ReasoningDelta("a"), ReasoningDelta("b"), forced, TextDelta("c"), TextDelta("d"),
                    ReasoningDelta("e")])
    assert got == [ReasoningDelta("ab"), forced, TextDelta("cd"), ReasoningDelta("e")]
