"""Decode rounds of a reply with a thinking plan (ThinkingState.block_room / forced_run, TokenChooser.accepted,
rounds.plain_round): blocks inside the reasoning, and the budget's forced insert after its first token in one
batched forward, give what single steps give (tokens, thinking state, penalty state, the generator, the
cache), through the insert, an end of turn turned into the close marker, and an end of turn given back after
a close inside a block."""
from __future__ import annotations

import numpy as np
import pytest

from engine.config import SamplingParams
from fast_cpu import fast_model
from test_speed_guard import q4_tiny  # noqa: F401  (the fixture: a tiny all-Q4 llama)

PROMPT = [3, 17, 42, 5, 99, 7]
N_NEW = 24
# a presence penalty that all but bans a token once taken: the reply's first tokens all differ (this tiny
# model's logits are peaked beyond a penalty of 12)
CHOOSERS = [SamplingParams(greedy=True, presence_penalty=100.0, frequency_penalty=0.5, seed=7),
            SamplingParams(temperature=1.5, top_k=20, presence_penalty=100.0, seed=42)]


def _reply(model, sp, plan, stops, rounds_of_the_loop):
    """A reply: the first token alone, then the decode loop's rounds (engine.rounds.plain_round: blocks, forced
    runs), or single forward + choose + accept steps -> (reply tokens, tokens per round, thinking state,
    chooser, cache)."""
    from engine.rounds import RoundContext, plain_round
    from engine.sampling import TokenChooser
    from engine.thinking import ThinkingState
    th = ThinkingState(plan, stop_ids=stops)
    ch = TokenChooser(sp, model.args.vocab_size, thinking=th)
    cache = model.new_cache(96)
    seq = PROMPT + [ch.choose(model.forward(np.array(PROMPT, np.int32), 0, cache)[0])]
    ch.accept(seq[-1])
    rounds = []
    while len(seq) - len(PROMPT) < N_NEW and seq[-1] not in stops:
        if rounds_of_the_loop:
            ctx = RoundContext(model, cache, seq, ch, N_NEW - (len(seq) - len(PROMPT)), stops)
            toks = plain_round(ctx).tokens
        else:
            toks = [ch.choose(model.forward(np.array(seq[-1:], np.int32), len(seq) - 1, cache)[0])]
            ch.accept(toks[0])
        rounds.append(len(toks))
        seq = seq + toks
        assert cache.length == len(seq) - 1
    return seq[len(PROMPT):], rounds, th, ch, cache


@pytest.mark.parametrize("sp", CHOOSERS, ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", ["budget", "stop_in_reasoning", "stop_after_close"])
def test_reasoning_blocks_take_what_single_rounds_take(q4_tiny, sp, case):
    from engine.thinking import REASONING, ThinkingPlan
    model, _ = fast_model(q4_tiny)
    free = _reply(model, sp, ThinkingPlan("off"), frozenset(), False)[0]  # no thinking, no stops
    assert len(set(free[:6])) == 6
    unused = [t for t in range(model.args.vocab_size) if t not in free][:3]
    if case == "budget":  # 5 reasoning tokens (the first, a block of 4), the insert's first token, its rest
        plan, stops, first_round = ThinkingPlan("prompted", close_ids=(unused[2],), forced_ids=tuple(unused),
                                                budget=5, start=REASONING), frozenset(), 4
    elif case == "stop_in_reasoning":  # free[4] ends the turn: it becomes the close marker
        plan, stops, first_round = ThinkingPlan("prompted", close_ids=(unused[0],), start=REASONING), \
            frozenset({free[4]}), 4
    else:  # free[2] closes the reasoning, free[3] would end the turn with no answer: given back
        plan, stops, first_round = ThinkingPlan("prompted", close_ids=(free[2],), start=REASONING), \
            frozenset({free[3]}), 2
    one = _reply(model, sp, plan, stops, False)
    toks, rounds, th, ch, cache = _reply(model, sp, plan, stops, True)
    assert toks == one[0] and rounds[0] == first_round and max(rounds) > 1
    if case == "budget":
        assert rounds[1:3] == [1, 2]  # the insert's first token replaces a choice; the other two are known
    for a in ("state", "reasoning_tokens", "answer_tokens", "forced", "forced_at", "closed_at_stop", "tokens"):
        assert getattr(th, a) == getattr(one[2], a), a
    assert (th.forced, th.closed_at_stop) == (case == "budget", case == "stop_in_reasoning")
    np.testing.assert_array_equal(ch.counts, one[3].counts)
    np.testing.assert_array_equal(ch._pen, one[3]._pen)
    assert ch.n_accepted == one[3].n_accepted and ch.rng.random() == one[3].rng.random()
    np.testing.assert_array_equal(cache.k[:, :cache.length], one[4].k[:, :one[4].length])
