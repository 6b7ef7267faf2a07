"""The fakes the model-free speculative tests share (test_spec_unit, test_spec_adaptive): a chooser with
penalties and forcing, a cache that only counts, a model whose logits are a pure function of the prefix (so
speculation must be exactly lossless), a drafter of given lists, a fake clock of verify costs, and plain / speculative
decode loops over them."""
from __future__ import annotations

import random

import numpy as np

from engine.spec import spec_round

PROMPT = [3, 4, 5, 6, 7, 8, 9, 10, 11, 0, 1, 2, 3]  # the fake model's prompt in the round tests


class FakeChooser:
    """A minimal TokenChooser: presence penalty over accepted tokens, optional forced token at a given reply
    length (like thinking-budget forcing), greedy at T=0 else a seeded softmax draw."""

    def __init__(self, temperature=0.0, presence=0.0, seed=0, force_at=None, force_token=None):
        self.t, self.presence = temperature, presence
        self.rng = np.random.default_rng(seed)
        self.force_at, self.force_token = force_at, force_token
        self.history: list[int] = []
        self.seen_at_choose: list[tuple[int, ...]] = []  # history visible to each choose() call

    def choose(self, row):
        self.seen_at_choose.append(tuple(self.history))
        if self.force_at is not None and len(self.history) == self.force_at:
            return self.force_token
        x = np.asarray(row, dtype=np.float64).copy()
        for tok in set(self.history):
            x[tok] -= self.presence
        if self.t == 0:
            return int(np.argmax(x))
        p = np.exp((x - x.max()) / self.t)
        return int(self.rng.choice(len(p), p=p / p.sum()))

    def accept(self, tok):
        self.history.append(int(tok))


class FakeCache:
    def __init__(self, capacity=10_000):
        self.tokens: list[int] = []
        self.capacity = capacity

    def truncate(self, n):
        assert 0 <= n <= len(self.tokens)
        del self.tokens[n:]


class FakeModel:
    """Logits after a prefix depend on its last two tokens: a strong bias to (last + 1) % V plus seeded
    noise, so greedy output is mostly a counting pattern (n-gram drafts get accepted) but not always."""

    def __init__(self, vocab=12, bias=3.0, noise=1.0):
        self.vocab, self.bias, self.noise = vocab, bias, noise
        self.calls: list[int] = []  # T of each forward

    def next_logits(self, prefix):
        a, b = (prefix[-2] if len(prefix) > 1 else 0), prefix[-1]
        row = np.random.default_rng(1000 + a * 97 + b).normal(size=self.vocab) * self.noise
        row[(b + 1) % self.vocab] += self.bias
        return row.astype(np.float32)  # (vocab,)

    def forward(self, tokens, pos0, cache, *, all_logits=False):
        assert len(cache.tokens) == pos0, "cache must hold exactly pos0 tokens"
        assert pos0 + len(tokens) <= cache.capacity
        assert all(0 <= int(t) < self.vocab for t in tokens), "token outside the vocabulary"
        self.calls.append(len(tokens))
        cache.tokens.extend(int(t) for t in tokens)
        rows = np.stack([self.next_logits(cache.tokens[:pos0 + i + 1]) for i in range(len(tokens))])
        return rows if all_logits else rows[-1:]  # (T or 1, vocab)


class ListDrafter:
    """Proposes a fixed script: the next k tokens of `script` after the context's length, optionally
    corrupted at random (so some drafts are rejected)."""

    name = "script"
    features_needed = ()

    def __init__(self, script, corrupt=0.0, vocab=12, seed=0):
        self.script, self.corrupt, self.vocab = list(script), corrupt, vocab
        self.rng = random.Random(seed)
        self.observed: list[int] = []

    def reset(self):
        self.observed = []

    def observe(self, tokens, features):
        self.observed.extend(tokens)

    def propose(self, context, k, features):
        out = self.script[len(context):len(context) + k]
        return [self.rng.randrange(self.vocab) if self.rng.random() < self.corrupt else t for t in out]


def plain_decode(model, prompt, chooser, n, stop_ids=()):
    cache = FakeCache()
    y = chooser.choose(model.forward(np.array(prompt), 0, cache)[-1])
    chooser.accept(y)
    out = [y]
    while len(out) < n and out[-1] not in stop_ids:
        y = chooser.choose(model.forward(np.array([out[-1]]), len(cache.tokens), cache)[-1])
        chooser.accept(y)
        out.append(y)
    return out


def spec_decode(model, prompt, chooser, n, drafter, k, stop_ids=(), capacity=10_000):
    """-> (the reply's tokens, its rounds after the first token)."""
    cache = FakeCache(capacity)
    rounds = []
    y = chooser.choose(model.forward(np.array(prompt), 0, cache)[-1])
    chooser.accept(y)
    out = [y]
    while len(out) < n and out[-1] not in stop_ids and len(prompt) + len(out) <= capacity:
        r, _ = spec_round(model, cache, chooser, drafter, prompt + out, k, stop_ids=stop_ids,
                          max_tokens=n - len(out), capacity=capacity)
        assert len(cache.tokens) == len(prompt) + len(out) + len(r.tokens) - 1  # all but the last token
        out.extend(r.tokens)
        rounds.append(r)
    return out, rounds


def accepted(rounds):
    return sum(r.accepted for r in rounds)


class SimClock:
    """A model that advances a fake clock by a verify cost c(T) = base + slope (T - 1) per forward."""

    def __init__(self, model, base, slope):
        self.now, self.model, self.base, self.slope = 0.0, model, base, slope

    def __call__(self):
        return self.now

    def forward(self, tokens, pos0, cache, *, all_logits=False):
        self.now += (self.base + self.slope * (len(tokens) - 1)) / 1e3
        return self.model.forward(tokens, pos0, cache, all_logits=all_logits)

    @property
    def calls(self):
        return self.model.calls
