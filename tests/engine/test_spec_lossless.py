"""Speculative decoding is lossless end to end (Engine/Session, real Model.forward, real TokenChooser):

- greedy: the same tokens with and without speculation for draft lengths 1, 3, 5 (tiny models of every
  architecture; the default SmolLM2, short here and over 20 prompts + the workloads when slow);
- seeded sampling with penalties: the same tokens (verification draws once per emitted token, in order);
- sampled: the law of the first two reply tokens under speculation equals the target's exact law (chi-square;
  the drafter is right about half the time, so accept, reject and bonus paths all occur);
- penalties + thinking budget together with speculation: the same output as without.
"""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from engine.api import Engine
from engine.config import EngineArgs, GenerateRequest, SamplingParams, ThinkingParams
from engine.sampling import candidates
from engine.spec import SpecRound, make_drafter

PROMPTS = ["Hello there, how are you today?", "def main(args):\n    for item in items:",
           "The capital of France is Paris. The capital of", "Once upon a time there was a little girl"]
WORKLOADS = Path("/work/shared/workloads")


def run(session, prompt, spec="off", k=3, round_fn=None, **sampling):
    """Final stats of one reply (prefix reuse is off in these engines unless asked); round_fn: a round function
    in place of the one the request picks."""
    sp = SamplingParams(**{"greedy": True, "max_new": 40, **sampling})
    msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return [ev for ev in session.generate(msgs, GenerateRequest(sp, spec=spec, draft_tokens=k), round_fn=round_fn)][-1]


@pytest.fixture(scope="module")
def tiny_engines(tiny_models):
    return {arch: Engine.load(EngineArgs(model=str(p), max_context=512, prefix_reuse=False))
            for arch, p in tiny_models.items()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_greedy_lossless(tiny_engines, arch):
    eng = tiny_engines[arch]
    accepted = 0
    for prompt in PROMPTS:
        want = run(eng.session(), prompt)
        assert want.output_tokens > 0
        for k in (1, 3, 5):
            got = run(eng.session(), prompt, "ngram", k)  # the adaptive length users get (may block instead)
            assert got.token_ids == want.token_ids, (prompt, k)
            assert got.output_sha256 == want.output_sha256
            assert got.rounds <= got.output_tokens and got.spec_mode == "ngram"
            fixed = SpecRound(make_drafter("ngram", eng.model, None, adaptive=False, capacity=eng.capacity), k,
                              eng.capacity)  # every round drafts what it can: the verify paths run
            got = run(eng.session(), prompt, "ngram", k, round_fn=fixed)
            assert got.token_ids == want.token_ids, (prompt, k, "fixed")
            accepted += got.accepted
    assert accepted > 0, "no draft was ever accepted: the test would not exercise verification"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_seeded_sampling_with_penalties_is_identical(tiny_engines, arch):
    eng = tiny_engines[arch]
    opts = dict(greedy=False, temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, presence_penalty=1.5,
                frequency_penalty=0.3, max_new=40)
    for seed, prompt in enumerate(PROMPTS[:3]):
        want = run(eng.session(), prompt, seed=seed, **opts)
        for k in (2, 5):
            got = run(eng.session(), prompt, "ngram", k, seed=seed, **opts)
            assert got.token_ids == want.token_ids, (prompt, seed, k)


def test_tiny_penalties_and_thinking_budget_with_spec(tiny_engines):
    """Prompted thinking (tiny llama: the reply starts inside the reasoning), a budget that forces the close
    insert, penalties: speculation changes nothing, also while the forced tokens are being verified."""
    eng = tiny_engines["llama"]
    forced = 0
    for budget in (3, 9):
        for sampled in (False, True):
            sp = SamplingParams(greedy=not sampled, temperature=0.8, top_k=20, seed=7, presence_penalty=1.0,
                                frequency_penalty=0.5, max_new=120)
            th = ThinkingParams(enabled=True, budget=budget)
            msgs = [{"role": "user", "content": PROMPTS[0]}]
            finals = []
            for spec, k in (("off", 3), ("ngram", 1), ("ngram", 4)):
                evs = list(eng.session().generate(msgs, GenerateRequest(sp, th, spec=spec, draft_tokens=k)))
                text = "".join(getattr(e, "text", "") for e in evs[:-1])
                finals.append((evs[-1].token_ids, text, evs[-1].thinking_forced, evs[-1].reasoning_tokens))
            assert finals[1] == finals[0] and finals[2] == finals[0], (budget, sampled)
            forced += finals[0][2]
    assert forced > 0, "the budget never forced a close: the test would not exercise forcing"


def verify_rows_vs_steps(model, n_ctx=40, sizes=(2, 4, 8)):
    """Max |difference| between a batched verify pass over T tokens and T single-token decode steps."""
    rng = np.random.default_rng(0)
    toks = rng.integers(3, min(1000, model.args.vocab_size), n_ctx + max(sizes)).astype(np.int32)
    cache = model.new_cache(n_ctx + max(sizes))
    model.forward(toks[:n_ctx], 0, cache)
    steps = np.stack([model.forward(toks[i:i + 1], i, cache)[0].copy()
                      for i in range(n_ctx, n_ctx + max(sizes))])  # (max T, vocab)
    worst = {}
    for t in sizes:
        cache.truncate(n_ctx)
        rows = model.forward(toks[n_ctx:n_ctx + t], n_ctx, cache, all_logits=True)  # (T, vocab)
        worst[t] = float(np.abs(rows - steps[:t]).max())
    return worst


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_verify_rows_equal_decode_steps(tiny_engines, arch):
    """Byte-identical output with and without speculation needs the verify pass to compute each row exactly
    as a decode step would (same summation order whatever T is); otherwise near-ties can flip."""
    worst = verify_rows_vs_steps(tiny_engines[arch].model)
    assert all(d == 0.0 for d in worst.values()), worst


# ------------------------------------------------------------------ the sampled law (chi-square, exact target)

class ScriptDrafter:
    """Drafts the next tokens of a fixed script (a greedy reply) after the context's reply part."""

    name, features_needed = "script", ()

    def __init__(self, script, prompt_len):
        self.script, self.p = list(script), prompt_len

    def reset(self):
        pass

    def observe(self, tokens, features):
        pass

    def propose(self, context, k, features):
        i = len(context) - self.p
        return self.script[i:i + k] if self.script[:i] == list(context[self.p:]) else self.script[:0]


def chi2_pvalue(stat, df):
    """Upper tail of chi-square (Wilson-Hilferty approximation; fine for df >= 3)."""
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi2_stat(obs, probs, n):
    """Pearson statistic of counts `obs` against probabilities `probs` (cells with expectation < 5 pooled)."""
    stat, df, pool_o, pool_e = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        e = n * p
        if e < 5:
            pool_o, pool_e = pool_o + obs[cell], pool_e + e
            continue
        stat, df = stat + (obs[cell] - e) ** 2 / e, df + 1
    if pool_e > 0:
        stat, df = stat + (pool_o - pool_e) ** 2 / pool_e, df + 1
    return stat, df


def test_tiny_sampled_distribution_matches_target(tiny_models):
    # tiny qwen2 at T=1: its top token has ~37% of the mass, so both paths are common.
    eng = Engine.load(EngineArgs(model=str(tiny_models["qwen2"]), max_context=256, prefix_reuse=True))
    temp, top_k, presence = 1.0, 6, 0.8
    msgs = [{"role": "user", "content": "Hello there, how are you"}]
    session = eng.session()
    prompt = session.prompt_tokens(msgs)
    stop_ids = set(eng.tokenizer.stop_ids)
    model = eng.model

    # Exact law of (t1, t2) from teacher-forced logits, presence penalty on t1 at position 2.
    cache = model.new_cache(len(prompt) + 2)
    row0 = model.forward(np.array(prompt, np.int32), 0, cache)[0].copy()  # (vocab,)
    ids1, p1 = candidates(row0, temp, top_k, 1.0, 0.0)
    exact = {}
    for t1, q1 in zip(ids1.tolist(), p1):
        if t1 in stop_ids:
            exact[(t1,)] = q1
            continue
        cache.truncate(len(prompt))
        row1 = model.forward(np.array([t1], np.int32), len(prompt), cache)[0].copy()
        row1[t1] -= presence
        for t2, q2 in zip(*[a.tolist() for a in candidates(row1, temp, top_k, 1.0, 0.0)]):
            exact[(t1, t2)] = q1 * q2
    greedy_reply = [int(ids1[0]), 0]  # drafts: the most likely first token, then a likely second one
    greedy_reply[1] = max((c for c in exact if len(c) == 2 and c[0] == ids1[0]), key=exact.get)[1]

    round_fn = SpecRound(ScriptDrafter(greedy_reply, len(prompt)), 2, eng.capacity)

    n = 1200
    counts, n_acc = Counter(), Counter()
    sp = dict(greedy=False, temperature=temp, top_k=top_k, presence_penalty=presence, max_new=2)
    for seed in range(n):
        req = GenerateRequest(SamplingParams(seed=seed, **sp))
        final = list(session.generate(msgs, req, round_fn=round_fn))[-1]
        counts[final.token_ids] += 1
        n_acc[final.accepted] += 1
    assert n_acc[0] > 50 and n_acc[1] > 50  # both reject and accept (-> bonus) paths were taken
    assert set(counts) <= set(exact), set(counts) - set(exact)
    # The joint law, and the two marginals (fewer cells: more power against a shift of one token's mass).
    for key in (lambda c: c, lambda c: c[0], lambda c: c[-1]):
        obs, want = Counter(), Counter()
        for cell, p in exact.items():
            want[key(cell)] += p
            obs[key(cell)] += counts[cell]
        stat, df = chi2_stat(obs, want, n)
        assert df >= 4 and chi2_pvalue(stat, df) > 1e-3, (stat, df)


# ------------------------------------------------------------------ the default model (SmolLM2-135M Q4_1)

@pytest.fixture(scope="module")
def smol_engine(smollm2_path):
    return Engine.load(EngineArgs(model=str(smollm2_path), max_context=1024, prefix_reuse=False))


def test_smollm2_verify_rows_equal_decode_steps(smol_engine):
    worst = verify_rows_vs_steps(smol_engine.model)
    assert all(d == 0.0 for d in worst.values()), worst


def test_smollm2_greedy_lossless_short(smol_engine):
    """Two prompts (chat + counting), 48 tokens, draft lengths 1, 3, 5: identical tokens."""
    for prompt in ("What is the capital of France?", "Count from 1 to 300."):
        want = run(smol_engine.session(), prompt, max_new=48)
        for k in (1, 3, 5):
            got = run(smol_engine.session(), prompt, "ngram", k, max_new=48)
            assert got.token_ids == want.token_ids, (prompt, k)


def test_smollm2_penalties_and_thinking_budget_with_spec(smol_engine):
    """Prompted thinking (SmolLM2 has no native markers) with a budget, presence/frequency penalties, seeded
    sampling: with and without speculation the same output."""
    sp = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, frequency_penalty=0.2,
                        seed=42, max_new=48)
    th = ThinkingParams(enabled=True, budget=12)
    msgs = [{"role": "user", "content": "List three colours, then count to five."}]
    outs = []
    for spec in ("off", "ngram"):
        final = list(smol_engine.session().generate(msgs, GenerateRequest(sp, th, spec=spec, draft_tokens=3)))[-1]
        outs.append((final.token_ids, final.output_sha256, final.reasoning_tokens, final.thinking_forced))
    assert outs[1] == outs[0]


LONG_PROMPTS = [
    "What is the capital of France?", "Write a haiku about autumn.", "Explain what a CPU cache is.",
    "Translate 'good morning' into Spanish and French.", "Give me three tips for better sleep.",
    "What is 17 times 23?", "Write a Python function that reverses a string.", "Who wrote Hamlet?",
    "Summarise the plot of Cinderella in two sentences.", "List the planets of the solar system.",
    "What is photosynthesis?", "Repeat after me: the cat sat on the mat, the cat sat on the mat.",
    "Write a short email asking for a meeting on Monday.", "Why is the sky blue?",
    "Name five fruits and their colours.", "How do I make a cup of tea?", "What is the boiling point of water?",
    "Write the alphabet in capital letters.", "Describe a rainbow to a child.", "Count from 1 to 20.",
]


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 3, 5, 8])
def test_smollm2_greedy_lossless_prompts_and_workloads(smol_engine, k):
    convs = [[{"role": "user", "content": p}] for p in LONG_PROMPTS]
    convs += [json.loads(f.read_text()) for f in sorted(WORKLOADS.glob("*.json"))]
    for msgs in convs:
        want = run(smol_engine.session(), msgs, max_new=128)
        got = run(smol_engine.session(), msgs, "ngram", k, max_new=128)
        assert got.token_ids == want.token_ids, (msgs, k)
