"""Thinking budget: a scripted model that never closes, natural close, boundary cases, stop/cancel, too-large
budgets, native markers with the template switch, prompted thinking, and forcing through speculative verify."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from engine.config import GenerateRequest, SamplingParams, ThinkingParams
from engine.errors import ConfigError
from engine.events import FinalStats, ReasoningDelta, StepStats, TextDelta, ThinkingForced
from engine.fake import FakeTokenizer, fake_engine, script_policy, thinking_policy
from engine.sampling import TokenChooser
from engine.thinking import ThinkingState, plan_thinking

MSG = [{"role": "user", "content": "What is the capital of France?"}]
NOTE = "Considering the limited time"


def run(engine, budget=None, max_new=400, enabled=None, stop=(), cancel=None, on_event=None, session=None):
    req = GenerateRequest(SamplingParams(greedy=True, max_new=max_new, stop=stop),
                          ThinkingParams(enabled=enabled, budget=budget))
    s = session or engine.session()
    s.stats_interval_s = 0.0
    evs = []
    for ev in s.generate(MSG, req, cancel=cancel):
        evs.append(ev)
        if on_event:
            on_event(ev)
    final = evs[-1]
    assert isinstance(final, FinalStats)
    text = "".join(e.text for e in evs if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in evs if isinstance(e, ReasoningDelta))
    raw = engine.tokenizer.decode(final.token_ids)
    return final, text, reasoning, raw, evs


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("budget", [0, 1, 7, 20])
def test_never_closing_model_budget_enforced_exactly(native, budget):
    eng = fake_engine(thinking_policy(close_after=None), native_thinking=native)
    final, text, reasoning, raw, evs = run(eng, budget=budget)
    assert final.reasoning_tokens == budget
    assert final.thinking_forced
    assert raw.count(NOTE) == 1 and raw.count("</think>") == 1
    assert sum(isinstance(e, ThinkingForced) for e in evs) == 1
    assert text == "Paris."
    assert reasoning == " hmm" * budget
    assert NOTE not in reasoning and "</think>" not in text + reasoning
    assert final.finish_reason == "stop"
    # the forced event comes after the last reasoning delta and before the answer
    kinds = [type(e).__name__ for e in evs if not isinstance(e, StepStats)]
    assert kinds.index("ThinkingForced") < kinds.index("TextDelta")


@pytest.mark.parametrize("native", [False, True])
def test_natural_close_before_budget_inserts_nothing(native):
    eng = fake_engine(thinking_policy(close_after=3), native_thinking=native)
    final, text, reasoning, raw, evs = run(eng, budget=50)
    assert not final.thinking_forced and NOTE not in raw
    assert not any(isinstance(e, ThinkingForced) for e in evs)
    assert reasoning.strip() == "hmm hmm hmm" and text == "Paris."


@pytest.mark.parametrize("native", [False, True])
def test_natural_close_at_the_boundary_wins(native):
    """The model closes exactly when the budget is spent: its own close is kept, no message inserted."""
    eng = fake_engine(thinking_policy(close_after=5), native_thinking=native)
    final, text, _, raw, _ = run(eng, budget=5)
    assert final.reasoning_tokens == 5
    assert not final.thinking_forced and NOTE not in raw
    assert raw.count("</think>") == 1 and text == "Paris."


def test_max_new_at_the_boundary_still_answers():
    eng = fake_engine(thinking_policy(close_after=None))
    tok = eng.tokenizer
    plan = plan_thinking(ThinkingParams(budget=4), tok, 10_000)
    need = plan.min_tokens()
    final, text, _, _, _ = run(eng, budget=4, max_new=need)
    assert final.finish_reason == "length" and final.output_tokens == need
    assert final.thinking_forced and final.answer_tokens == 1 and text == "Paris"  # one answer token fits
    with pytest.raises(ConfigError, match="leaves no room"):
        run(eng, budget=4, max_new=need - 1)


def test_budget_too_large_is_rejected_up_front():
    eng = fake_engine(thinking_policy(close_after=None))
    with pytest.raises(ConfigError, match="--max-new"):
        eng.session().generate(MSG, GenerateRequest(SamplingParams(max_new=50), ThinkingParams(budget=48)))


def test_budget_with_stop_string_in_reasoning_says_why_answer_is_empty():
    eng = fake_engine(thinking_policy(close_after=None))
    final, text, reasoning, _, _ = run(eng, budget=10, stop=("hmm hmm hmm",))
    assert final.finish_reason == "stop" and text == ""
    assert "empty answer" in final.stop_reason_detail and "reasoning" in final.stop_reason_detail
    assert "hmm hmm hmm" not in reasoning


def test_budget_with_stop_string_in_answer():
    eng = fake_engine(thinking_policy(close_after=None))
    final, text, _, _, _ = run(eng, budget=3, stop=("ris",))
    assert final.thinking_forced and text == "Pa" and final.stop_reason_detail == "stop string 'ris'"


def test_budget_with_cancel_at_the_boundary():
    """Cancel when the budget is spent: cancelling wins, no forced insert."""
    eng = fake_engine(thinking_policy(close_after=None))
    cancel = threading.Event()

    def on_event(ev):
        if isinstance(ev, StepStats) and ev.reasoning_tokens >= 6:
            cancel.set()
    final, text, reasoning, raw, _ = run(eng, budget=6, cancel=cancel, on_event=on_event)
    assert final.finish_reason == "cancelled" and not final.thinking_forced
    assert final.output_tokens == 6 and NOTE not in raw and reasoning == " hmm" * 6


def test_ended_inside_reasoning_is_reported():
    eng = fake_engine(thinking_policy(close_after=None))
    final, text, _, _, _ = run(eng, enabled=True, max_new=12)
    assert final.finish_reason == "length" and text == ""
    assert final.stop_reason_detail.startswith("empty answer") and "--thinking-budget" in final.stop_reason_detail


def test_no_end_of_turn_right_after_a_close():
    """A model that ends its turn right after the close marker still gives a visible answer."""
    def policy(so_far):
        return "" if "</think>" in so_far else thinking_policy(close_after=None)(so_far)
    eng = fake_engine(policy)
    final, text, _, _, _ = run(eng, budget=2, max_new=200)
    assert text.strip() and final.answer_tokens >= 1


def test_prompted_thinking_prompt_and_off_by_default():
    eng = fake_engine(script_policy("Paris."))
    s = eng.session()
    plain = eng.tokenizer.decode(s.prompt_tokens(MSG))
    assert "<think>" not in plain
    prompted = eng.tokenizer.decode(s.prompt_tokens(MSG, GenerateRequest(thinking=ThinkingParams(budget=8))))
    assert prompted.endswith("<|im_start|>assistant\n<think>\n") and "</think>" in prompted.split("assistant")[0]


def test_native_template_switch_on_and_off():
    eng = fake_engine(thinking_policy(close_after=2), native_thinking=True)
    final, text, reasoning, raw, _ = run(eng)  # default: native thinking on
    assert reasoning.strip() == "hmm hmm" and text == "Paris." and raw.startswith("<think>")
    s = eng.session()
    off = GenerateRequest(SamplingParams(greedy=True), ThinkingParams(enabled=False))
    prompt = eng.tokenizer.decode(s.prompt_tokens(MSG, off))
    assert prompt.endswith("<think>\n\n</think>\n\n")  # the template's own enable_thinking=False
    final, text, reasoning, raw, _ = run(eng, enabled=False)
    assert reasoning == "" and final.reasoning_tokens == 0 and text == "Paris."


def test_forcing_works_through_speculative_verify():
    """verify() calls choose/accept per position: a forced token is just the target's token there."""
    from engine.spec.verify import verify
    tok = FakeTokenizer()
    plan = plan_thinking(ThinkingParams(budget=2), tok, 1000)
    state = ThinkingState(plan, tok.stop_ids, decode=tok.decode)
    ch = TokenChooser(SamplingParams(greedy=True), tok.vocab_size, thinking=state)
    hmm = tok.encode(" hmm")[0]
    rows = np.zeros((4, tok.vocab_size), np.float32)
    rows[:, hmm] = 10.0  # the target keeps reasoning
    res = verify(ch, rows, [hmm, hmm, hmm])
    # positions 1-2 accept the drafts; position 3 is forced to the insert's first token (a mismatch)
    assert res.tokens == [hmm, hmm, plan.forced_ids[0]] and res.n_accepted == 2
    res = verify(ch, rows, list(plan.forced_ids[1:4]))
    assert res.tokens == list(plan.forced_ids[1:5]) and res.n_accepted == 3
    assert state.reasoning_tokens == 2 and state.forced


@pytest.mark.parametrize("budget", [None, 3])
def test_end_of_turn_inside_reasoning_becomes_the_close(budget):
    """A model that ends its turn while reasoning (SmolLM2 with prompted thinking does) gets the close marker
    instead (no budget message), then answers; at the boundary too."""
    base = thinking_policy(close_after=None)

    def policy(so_far):
        if "</think>" not in so_far and so_far.count("hmm") >= 3:
            return ""  # end of turn, still inside the reasoning
        return base(so_far)
    eng = fake_engine(policy)
    final, text, reasoning, raw, evs = run(eng, budget=budget, enabled=True)
    assert reasoning == " hmm" * 3 and text == "Paris."
    assert not final.thinking_forced and NOTE not in raw and raw.count("</think>") == 1
    assert not any(isinstance(e, ThinkingForced) for e in evs)


def test_tiny_qwen3_native_markers_switch_and_forcing(tiny_models):
    """Real <think>/</think> added tokens and the template's enable_thinking switch on a real forward pass."""
    from engine.api import Engine
    from engine.config import EngineArgs
    eng = Engine.load(EngineArgs(model=str(tiny_models["qwen3"]), max_context=256))
    tok = eng.tokenizer
    open_id, close_id = tok.think_ids
    s = eng.session()
    plan = plan_thinking(ThinkingParams(budget=5), tok, 200)
    assert plan.mode == "native" and plan.open_ids == (open_id,) and plan.close_ids == (close_id,)
    on = tok.decode(s.prompt_tokens(MSG, GenerateRequest(thinking=ThinkingParams(enabled=True))))
    off = tok.decode(s.prompt_tokens(MSG, GenerateRequest(thinking=ThinkingParams(enabled=False))))
    assert on.endswith("<|im_start|>assistant\n") and off.endswith("<think>\n\n</think>\n\n")
    final, text, reasoning, _, _ = run(eng, enabled=False, max_new=6, session=s)
    assert final.reasoning_tokens == 0 and final.answer_tokens == 6

    # A template that opens the block itself (as Qwen3 thinking-only variants do): the budget forces the close.
    render = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **k: render(*a, **k) + "<think>\n"
    try:
        final, text, reasoning, _, evs = run(eng, budget=5, max_new=120, session=s)
    finally:
        del tok.apply_chat_template
    ids = list(final.token_ids)
    assert final.reasoning_tokens == 5 and final.thinking_forced
    assert ids[5:5 + len(plan.forced_ids)] == list(plan.forced_ids)  # the insert right after 5 reasoning tokens
    assert ids.count(close_id) == 1 and close_id in plan.forced_ids
    assert sum(isinstance(e, ThinkingForced) for e in evs) == 1


def test_stop_string_never_matches_inside_the_forced_insert():
    eng = fake_engine(thinking_policy(close_after=None))
    final, text, _, raw, _ = run(eng, budget=3, stop=("limited time", "\n\n"))
    assert final.thinking_forced and text == "Paris." and NOTE in raw


def test_settled_only_once_the_answer_can_take_any_token():
    """settled(): not while reasoning, not in the forced close, not while stop tokens are banned after the
    close; yes once the answer has a visible token, and always when the reply has no reasoning at all.
    block_room(n) (how many tokens a decode block may choose): those and the reasoning short of the budget."""
    from engine.thinking import ThinkingPlan, ThinkingState
    assert ThinkingState(ThinkingPlan("off"), stop_ids=(0,)).settled()
    plan = ThinkingPlan("prompted", open_ids=(5,), close_ids=(6,), forced_ids=(7, 6), budget=2, start="reasoning")
    st = ThinkingState(plan, stop_ids=(0,))
    seen, room, taken = [], [], []
    for raw in (11, 12, 13, 99, 21, 22):  # the model's picks; the state forces / redirects as choose does
        seen.append(st.settled())
        room.append(st.block_room(8))
        forced = st.force()
        tok = forced if forced is not None else st.redirect(raw)
        taken.append(tok)
        st.accept(tok)
    seen.append(st.settled())
    room.append(st.block_room(8))
    assert taken == [11, 12, 7, 6, 21, 22]  # the budget of 2 forces the close (7, 6)
    assert seen == [False, False, False, False, False, True, True]  # 21: answer, stop tokens still banned
    # a decode block's room: the reasoning up to the budget, none while forcing or banning, all once settled
    assert room == [2, 1, 0, 0, 0, 8, 8]
    assert ThinkingState(plan, stop_ids=(0,), start="idle").block_room(8) == 0  # may still open
    unlimited = ThinkingState(ThinkingPlan("prompted", close_ids=(6,), start="reasoning"), stop_ids=(0,))
    assert unlimited.block_room(8) == 8
