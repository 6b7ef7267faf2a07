"""The generation loop on the scripted fake model: stop strings, stop ids, cancel, length, context, prefix reuse,
chunked prefill, UTF-8 streaming, stats, abandoned iteration and the round seam (speculative rounds)."""
from __future__ import annotations

import hashlib
import threading
import time

import pytest

from engine.config import EngineArgs, GenerateRequest, SamplingParams
from engine.errors import InputError
from engine.events import FinalStats, Progress, StepStats, TextDelta
from engine.fake import fake_engine, script_policy

MSG = [{"role": "user", "content": "hi"}]


def greedy(**kw):
    return GenerateRequest(SamplingParams(greedy=True, **kw))


def collect(session, messages=MSG, request=None, cancel=None):
    evs = list(session.generate(messages, request or greedy(), cancel=cancel))
    assert isinstance(evs[-1], FinalStats) and sum(isinstance(e, FinalStats) for e in evs) == 1
    return evs, evs[-1], "".join(e.text for e in evs if isinstance(e, TextDelta))


def test_plain_reply_and_final_stats():
    eng = fake_engine(script_policy("Hello! the capital"))
    evs, st, text = collect(eng.session())
    assert text == "Hello! the capital"
    assert st.finish_reason == "stop" and st.stop_reason_detail == "stop token 2"
    assert st.token_ids[-1] == 2 and st.output_tokens == len(st.token_ids)
    assert eng.tokenizer.decode(st.token_ids[:-1]) == text
    assert st.output_sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert st.prompt_tokens == len(eng.session().prompt_tokens(MSG))
    assert st.answer_tokens == st.output_tokens and st.reasoning_tokens == 0
    assert st.ttft_s > 0 and st.wall_s >= st.ttft_s


def test_stop_string_split_across_tokens_is_never_emitted():
    eng = fake_engine(script_policy("abc<END>def"))  # '<', 'E', 'N', 'D', '>' are separate tokens
    evs, st, text = collect(eng.session(), request=greedy(stop=("<END>",)))
    assert text == "abc" and st.finish_reason == "stop" and st.stop_reason_detail == "stop string '<END>'"
    assert not any("<" in e.text for e in evs if isinstance(e, TextDelta))


def test_held_back_prefix_is_flushed_when_no_stop_matches():
    eng = fake_engine(script_policy("a<b<EN"))
    _, st, text = collect(eng.session(), request=greedy(stop=("<END>",)))
    assert text == "a<b<EN" and st.stop_reason_detail == "stop token 2"


def test_extra_stop_token_ids():
    eng = fake_engine(script_policy("Hello!"))
    bang = eng.tokenizer.encode("!")[0]
    _, st, text = collect(eng.session(), request=greedy(stop_token_ids=(bang,)))
    assert text == "Hello" and st.stop_reason_detail == f"stop token {bang}"


def test_length():
    eng = fake_engine(script_policy("x" * 100))
    _, st, text = collect(eng.session(), request=greedy(max_new=5))
    assert st.finish_reason == "length" and st.output_tokens == 5 and text == "xxxxx"


def test_context_full_is_length():
    eng = fake_engine(script_policy("x" * 100), args=EngineArgs(max_context=30))
    s = eng.session()
    p = len(s.prompt_tokens(MSG))
    _, st, _ = collect(s)
    assert st.finish_reason == "length" and st.output_tokens == 30 - p and "context full" in st.stop_reason_detail


def test_prompt_longer_than_context_is_one_line_input_error():
    eng = fake_engine(args=EngineArgs(max_context=16))
    with pytest.raises(InputError) as e:
        eng.session().generate([{"role": "user", "content": "a long question " * 5}])
    assert "context" in str(e.value) and "\n" not in str(e.value)


def test_cancel_from_another_thread_keeps_text():
    eng = fake_engine(lambda so_far: "x", delay_s=0.005)  # never ends
    cancel = threading.Event()
    threading.Timer(0.15, cancel.set).start()
    t0 = time.perf_counter()
    _, st, text = collect(eng.session(), request=greedy(max_new=100_000), cancel=cancel)
    assert time.perf_counter() - t0 < 5
    assert st.finish_reason == "cancelled" and 0 < st.output_tokens < 100_000
    assert text == "x" * st.output_tokens


def test_prefix_reuse_second_turn_prefills_only_the_suffix():
    eng = fake_engine(script_policy("Paris."))
    s = eng.session()
    _, st1, text1 = collect(s)
    assert st1.cached_prompt_tokens == 0
    turn2 = MSG + [{"role": "assistant", "content": text1}, {"role": "user", "content": "and Spain?"}]
    p2 = s.prompt_tokens(turn2)
    eng.model.forward_calls.clear()
    _, st2, _ = collect(s, turn2)
    first = s.prompt_tokens(MSG)
    # everything up to the end of the first reply is reused (the rendered history matches the cache)
    assert st2.cached_prompt_tokens >= len(first) + len(eng.tokenizer.encode(text1))
    assert st2.cached_prompt_tokens < len(p2)
    pos0, t = eng.model.forward_calls[0]
    assert pos0 == st2.cached_prompt_tokens and t == len(p2) - 1 - pos0
    # regenerate the same turn: all but the last prompt token is reused
    _, st3, _ = collect(s, turn2)
    assert st3.cached_prompt_tokens == len(p2) - 1


def test_no_prefix_reuse():
    eng = fake_engine(script_policy("Paris."), args=EngineArgs(max_context=1024, prefix_reuse=False))
    s = eng.session()
    collect(s)
    _, st, _ = collect(s)
    assert st.cached_prompt_tokens == 0


def test_chunked_prefill_same_result_and_chunks():
    text_a = "Hello! the capital"
    a = fake_engine(script_policy(text_a), args=EngineArgs(max_context=1024, prefill_chunk=3))
    b = fake_engine(script_policy(text_a), args=EngineArgs(max_context=1024, prefill_chunk=256))
    msgs = [{"role": "user", "content": "a longer question for chunking"}]
    evs_a, st_a, out_a = collect(a.session(), msgs)
    _, st_b, out_b = collect(b.session(), msgs)
    assert out_a == out_b and st_a.token_ids == st_b.token_ids
    sizes = [t for _, t in a.model.forward_calls[:-st_a.output_tokens]]
    assert sizes and max(sizes) == 3 and sum(sizes) == st_a.prompt_tokens - 1
    assert any(isinstance(e, Progress) and e.stage == "prefill" for e in evs_a)


def test_utf8_split_over_byte_tokens_never_half_a_character():
    eng = fake_engine(script_policy("日本語 ok 🙂"))
    evs, _, text = collect(eng.session())
    assert text == "日本語 ok 🙂"
    assert all("\ufffd" not in e.text for e in evs if isinstance(e, TextDelta))


def test_step_stats_are_throttled():
    eng = fake_engine(script_policy("x" * 40))
    s = eng.session()
    s.stats_interval_s = 0.0
    evs, st, _ = collect(s)
    assert sum(isinstance(e, StepStats) for e in evs) == st.output_tokens - 1  # every round but the last
    s.stats_interval_s = 60.0
    evs, _, _ = collect(s)
    assert sum(isinstance(e, StepStats) for e in evs) == 1


def test_step_stats_carry_the_prompt_figures():
    """Every StepStats has the prompt's size, TTFT and prefill rate (a live panel shows them before the end),
    the same as the final stats."""
    eng = fake_engine(script_policy("x" * 20))
    s = eng.session()
    s.stats_interval_s = 0.0
    evs, st, _ = collect(s)
    steps = [e for e in evs if isinstance(e, StepStats)]
    assert steps and all((e.prompt_tokens, e.cached_prompt_tokens, e.ttft_s, e.prefill_tok_s)
                         == (st.prompt_tokens, st.cached_prompt_tokens, st.ttft_s, st.prefill_tok_s) for e in steps)
    assert st.ttft_s > 0 and st.prompt_tokens > 0


def test_abandoned_iteration_leaves_a_usable_session():
    eng = fake_engine(script_policy("Hello! the capital of France"))
    s = eng.session()
    it = s.generate(MSG, greedy())
    next(it), next(it)
    it.close()
    assert s.cache.length == len(s.cached)
    _, st, text = collect(s)
    assert text == "Hello! the capital of France" and st.cached_prompt_tokens > 0


def test_a_failing_round_forgets_the_cache_and_the_next_reply_starts_clean():
    """run_reply extends the session's token list round by round; a round that raises must leave it empty
    (the cache's state is unknown), and the next reply must then prefill from scratch and still be right."""
    eng = fake_engine(script_policy("Hello! the capital of France"))
    s = eng.session()
    forward, calls = eng.model.forward, []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 6:  # prefill, then a few decode rounds
            raise RuntimeError("device lost")
        return forward(*a, **k)
    eng.model.forward = failing
    with pytest.raises(RuntimeError):
        collect(s)
    assert s.cached == []
    eng.model.forward = forward
    _, st, text = collect(s)
    assert text == "Hello! the capital of France" and st.cached_prompt_tokens == 0
    assert s.cache.length == len(s.cached) and s.cached == s.prompt_tokens(MSG) + list(st.token_ids[:-1])


def test_one_generate_at_a_time():
    eng = fake_engine(script_policy("Hello"))
    s = eng.session()
    it = s.generate(MSG)
    next(it)
    with pytest.raises(RuntimeError):
        next(s.generate(MSG))
    it.close()


def test_sampled_reply_is_seeded():
    eng = fake_engine(lambda so_far: "ab"[len(so_far) % 2] if len(so_far) < 30 else "")
    req = GenerateRequest(SamplingParams(temperature=5.0, seed=11, max_new=40))
    a = collect(eng.session(), request=req)[1].token_ids
    b = collect(eng.session(), request=req)[1].token_ids
    assert a == b


def test_speculative_round_seam_matches_plain_decode():
    """An n-gram speculative round (engine.spec) through the same loop gives the plain greedy tokens."""
    pytest.importorskip("engine.spec.ngram")
    text = "one two one two one two one two one two"
    plain = fake_engine(script_policy(text))
    spec = fake_engine(script_policy(text), args=EngineArgs(max_context=1024, spec="ngram", draft_tokens=3))
    msgs = [{"role": "user", "content": "one two one two"}]
    _, st_p, out_p = collect(plain.session(), msgs)
    _, st_s, out_s = collect(spec.session(), msgs)
    assert out_s == out_p == text and st_s.token_ids == st_p.token_ids
    assert st_s.spec_mode == "ngram" and st_s.drafted > 0 and st_s.accepted > 0
    assert st_s.rounds < st_p.rounds


def test_a_round_function_is_told_the_reply_and_its_prefill():
    """The round seam's hooks (rounds.RoundFn): begin once per reply, before the prefill; observe_prefill
    for every pass, in order, with the tokens the pass forwarded (the prompt but its reused prefix and its
    last token, which is the first round's input) and no features when it captures no layer."""
    from engine import rounds
    calls = []

    class Watching(rounds.PlainRound):
        def begin(self):
            calls.append("begin")

        def observe_prefill(self, tokens, features):
            calls.append((list(tokens), features))

        def __call__(self, ctx):
            calls.append("round")
            return super().__call__(ctx)

    eng = fake_engine(script_policy("Paris."), args=EngineArgs(max_context=1024, prefill_chunk=4))
    s = eng.session()
    prompt = s.prompt_tokens(MSG)
    st = list(s.generate(MSG, greedy(), round_fn=Watching()))[-1]
    passes = calls[1:calls.index("round")]
    assert calls[0] == "begin" and calls.count("begin") == 1 and calls.count("round") == st.rounds
    assert [t for toks, _ in passes for t in toks] == prompt[:-1] and all(len(toks) <= 4 for toks, _ in passes)
    assert all(f is None for _, f in passes)


def test_empty_reply_says_why():
    eng = fake_engine(script_policy(""))  # ends the turn at once
    _, st, text = collect(eng.session())
    assert text == "" and st.stop_reason_detail.startswith("empty answer") and "stop token" in st.stop_reason_detail


@pytest.fixture(scope="module")
def tiny_engines(tiny_models):
    from engine.api import Engine
    path = str(tiny_models["qwen2"])  # its distribution is flat enough for sampling to vary
    return (Engine.load(EngineArgs(model=path, max_context=256, prefill_chunk=256)),
            Engine.load(EngineArgs(model=path, max_context=256, prefill_chunk=3, prefix_reuse=False)))


def test_real_model_chunked_prefill_and_prefix_reuse_give_the_same_tokens(tiny_engines):
    """On a real forward pass: prefill in chunks of 3 == one chunk, and a second turn that reuses the cache
    == the same turn computed from scratch."""
    big, small = tiny_engines
    msgs = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    # Sampling (seeded) rather than greedy: the random tiny model's argmax barely moves, its distribution does.
    req = GenerateRequest(SamplingParams(temperature=1.0, seed=3, max_new=12))
    s1 = big.session()
    _, a, text = collect(s1, msgs, req)
    _, b, _ = collect(small.session(), msgs, req)
    assert a.token_ids == b.token_ids and len(set(a.token_ids)) > 3
    turn2 = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    _, reused, _ = collect(s1, turn2, req)
    _, fresh, _ = collect(small.session(), turn2, req)
    assert reused.cached_prompt_tokens > len(s1.prompt_tokens(msgs)) and fresh.cached_prompt_tokens == 0
    assert reused.token_ids == fresh.token_ids and len(set(reused.token_ids)) > 3


def test_bad_decode_block_setting_is_a_one_line_config_error(monkeypatch):
    from engine import rounds
    from engine.errors import ConfigError
    monkeypatch.setenv("NINFER_DECODE_BLOCK", "eight")
    rounds.block_size.cache_clear()
    try:
        with pytest.raises(ConfigError, match="NINFER_DECODE_BLOCK must be a whole number >= 1, got 'eight'"):
            rounds.block_size()
    finally:
        monkeypatch.delenv("NINFER_DECODE_BLOCK")
        rounds.block_size.cache_clear()
    assert rounds.block_size() == 8


def test_decode_rate_leaves_the_first_rounds_tokens_out(monkeypatch):
    """A first round of several tokens (a decode block, accepted drafts) counts with the first token: the
    rate is the later tokens over the time since that round. A fake clock moves 10 ms per token forwarded,
    so every figure must read 100 tok/s (counting the first round's tokens in it read 108)."""
    import dataclasses

    from engine import reply_stats, rounds

    clock = [0.0]
    fake_time = type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])})
    monkeypatch.setattr(rounds, "time", fake_time)
    monkeypatch.setattr(reply_stats, "time", fake_time)

    class Four(rounds.PlainRound):
        def __call__(self, ctx):
            toks = []
            for _ in range(min(4, ctx.max_tokens)):
                toks += rounds.plain_round(dataclasses.replace(ctx, seq=ctx.seq + toks)).tokens
                clock[0] += 0.01
            return rounds.Round(toks, verify_ms=10.0 * len(toks))

    s = fake_engine(script_policy("x" * 80)).session()
    s.stats_interval_s = 0.0
    evs = list(s.generate(MSG, greedy(max_new=40), round_fn=Four()))
    st = evs[-1]
    assert st.finish_reason == "length" and st.output_tokens == 40 and st.rounds == 10
    assert st.decode_tok_s == pytest.approx(100.0)
    rates = [e.decode_tok_s for e in evs if isinstance(e, StepStats)]
    assert len(rates) == 9 and rates == pytest.approx([100.0] * 9)


def test_decode_rate_of_a_reply_in_one_round():
    from engine.rounds import Round
    from engine.reply_stats import decode_rate
    assert decode_rate(8, 0.0, Round([1] * 8, verify_ms=40.0)) == pytest.approx(200.0)
    assert decode_rate(5, 0.0, Round([1] * 8, verify_ms=40.0)) == pytest.approx(125.0)  # a stop inside it
    assert decode_rate(1, 0.0, Round([1], verify_ms=4.0)) == 0.0  # one token: no decode rate
    assert decode_rate(64, 0.63, Round([1], verify_ms=4.0)) == pytest.approx(100.0)
    assert decode_rate(0, 0.0, None) == 0.0


def test_generate_ids_takes_the_ids_as_they_are_and_runs_past_end_of_text():
    """The benchmark's synthetic workload: no template, no end-of-text stop, exactly max_new tokens."""
    eng = fake_engine(script_policy("abcd"))
    tok = eng.tokenizer
    prompt = tok.encode("ab")
    st = list(eng.session().generate_ids(prompt, greedy(max_new=5)))[-1]
    assert st.prompt_tokens == len(prompt) and st.finish_reason == "length" and st.output_tokens == 5
    assert tok.decode(st.token_ids[:2]) == "cd" and st.token_ids[2] == tok.eos_id
    st = list(eng.session().generate_ids(prompt, greedy(max_new=5, stop_token_ids=(tok.eos_id,))))[-1]
    assert st.finish_reason == "stop" and st.output_tokens == 3
    for bad in ([], [eng.vocab_size], [-1]):
        with pytest.raises(InputError, match="token prompt"):
            eng.session().generate_ids(bad, greedy())


# -- a reply cut inside a character ------------------------------------------------------------------------
# The fake tokenizer spells characters it has no word for as byte tokens: "🙂" is 4 tokens (f0 9f 99 82).
SMILE = "ab🙂🙂🙂🙂"


@pytest.mark.parametrize("max_new", [3, 4, 5])
def test_max_new_inside_a_character_drops_it(max_new):
    """max_new ends the reply 1-3 bytes into a character: the text ends before it (it ended in U+FFFD)."""
    eng = fake_engine(script_policy(SMILE))
    evs, st, text = collect(eng.session(), request=greedy(max_new=max_new))
    assert st.finish_reason == "length" and st.output_tokens == max_new
    assert text == "ab" and st.output_sha256 == hashlib.sha256(b"ab").hexdigest()
    assert all("\ufffd" not in e.text for e in evs if isinstance(e, TextDelta))
    _, st, text = collect(eng.session(), request=greedy(max_new=2 + 4 + 2))
    assert text == "ab🙂"


def test_full_context_inside_a_character_drops_it():
    s = fake_engine(script_policy(SMILE), args=EngineArgs(max_context=64)).session()
    p = len(s.prompt_tokens(MSG))
    s = fake_engine(script_policy(SMILE), args=EngineArgs(max_context=p + 2 + 4 + 3)).session()
    _, st, text = collect(s)
    assert "context full" in st.stop_reason_detail and text == "ab🙂"


def test_cancel_inside_a_character_drops_it():
    """Cancelled just after the first byte of a character was chosen (the policy sets the event while it
    picks that byte: the loop sees it before the next round)."""
    cancel = threading.Event()
    script = script_policy(SMILE)

    def policy(so_far):
        if so_far == "ab":
            cancel.set()
        return script(so_far)
    _, st, text = collect(fake_engine(policy).session(), request=greedy(max_new=100), cancel=cancel)
    assert st.finish_reason == "cancelled" and st.output_tokens == 3 and text == "ab"


def test_a_replacement_character_the_model_wrote_is_kept():
    """Only an incomplete character at the cut is dropped: a whole U+FFFD (bytes ef bf bd) is text."""
    eng = fake_engine(script_policy("ab\ufffd"))
    _, st, text = collect(eng.session())
    assert text == "ab\ufffd" and st.finish_reason == "stop"
    _, st, text = collect(eng.session(), request=greedy(max_new=5))
    assert text == "ab\ufffd" and st.finish_reason == "length"


def test_a_thinking_budget_inside_a_character_drops_it():
    """The budget's forced insert follows 2 bytes of a 4-byte character: the reply's text (output_sha256:
    reasoning, insert and answer as generated) has no U+FFFD for it (the insert's first byte made one)."""
    from engine.config import ThinkingParams
    from engine.events import ReasoningDelta, ThinkingForced
    from engine.fake import thinking_policy
    eng = fake_engine(thinking_policy(word="🙂", close_after=None), native_thinking=True)
    req = GenerateRequest(SamplingParams(greedy=True, max_new=400), ThinkingParams(budget=2))
    evs, st, _ = collect(eng.session(), request=req)
    assert st.reasoning_tokens == 2 and any(isinstance(e, ThinkingForced) for e in evs)
    assert "".join(e.text for e in evs if isinstance(e, ReasoningDelta)) == ""
    generated = eng.tokenizer.decode(st.token_ids[:-1])  # the end-of-turn token is not text
    assert generated.count("\ufffd") == 1  # the cut character, as a decode of the tokens shows it
    assert st.output_sha256 == hashlib.sha256(generated.replace("\ufffd", "").encode()).hexdigest()
