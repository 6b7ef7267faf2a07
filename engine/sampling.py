"""The per-position sampling chain: logits row -> one token.

Order (one `TokenChooser` per reply):
  1. a forced token from the thinking state machine (budget insert / close continuation) wins outright;
  2. penalties, OpenAI semantics over this reply's tokens so far:
     logit[t] -= presence_penalty * (count[t] > 0) + frequency_penalty * count[t];
  3. banned tokens (thinking: no end of turn before the first answer token after a close) -> -inf;
  4. greedy (argmax) or: temperature -> top-k -> top-p -> min-p over the renormalised probabilities, then one
     draw with the injected seeded `numpy.random.Generator` (same seed -> same tokens);
  5. the thinking state machine may replace the drawn token: at the budget boundary by the first forced one,
     inside the reasoning an end of turn by the close marker.
`accept(token)` must follow every `choose` with the token actually taken (plain decode: the chosen one;
speculative verify: the chosen one at each verified position, in order). Nothing is ever rolled back.

Cost: no full sort of the vocabulary per token. top-k uses argpartition; top-p without top-k widens a
partition (64, 512, ... candidates) until it covers top_p of the mass, which is exact.
"""
from __future__ import annotations

import numpy as np

from .config import SamplingParams

_NEG_INF = np.float32(-np.inf)


class TokenChooser:
    """Chooses one token per position for one reply. See the module docstring for the order of the chain."""

    def __init__(self, params: SamplingParams, vocab_size: int, rng: np.random.Generator | int | None = None,
                 thinking=None):
        self.params = params
        self.vocab_size = vocab_size
        if rng is None or isinstance(rng, (int, np.integer)):
            rng = np.random.default_rng(params.seed if rng is None else int(rng))
        self.rng = rng
        self.thinking = thinking  # engine.thinking.ThinkingState | None
        self.counts = np.zeros(vocab_size, np.int32)  # (vocab,) occurrences in this reply
        self._seen: list[int] = []  # distinct tokens seen, so penalties touch only those
        self.n_accepted = 0

    # -- the chain -------------------------------------------------------------------------------------------
    def choose(self, logits_row: np.ndarray) -> int:
        """logits_row (vocab,) float32 -> token id. Does not change state except the generator's."""
        th = self.thinking
        if th is not None:
            forced = th.force()
            if forced is not None:
                return forced
        x = self._processed(logits_row)
        tok = self._pick(x)
        if th is not None:
            tok = th.redirect(tok)
        return tok

    def accept(self, token: int) -> None:
        """Advance: count the token for penalties and feed the thinking state machine."""
        if self.counts[token] == 0:
            self._seen.append(token)
        self.counts[token] += 1
        self.n_accepted += 1
        if self.thinking is not None:
            self.thinking.accept(token)

    # -- steps -----------------------------------------------------------------------------------------------
    def _processed(self, logits_row: np.ndarray) -> np.ndarray:
        p = self.params
        x = np.array(logits_row, dtype=np.float32, copy=True).reshape(-1)  # (vocab,)
        if self._seen and (p.presence_penalty or p.frequency_penalty):
            ids = np.fromiter(self._seen, np.int64, len(self._seen))  # (n_seen,)
            x[ids] -= np.float32(p.presence_penalty) + np.float32(p.frequency_penalty) * self.counts[ids]
        if self.thinking is not None:
            ban = self.thinking.ban()
            if ban:
                x[list(ban)] = _NEG_INF
        return x

    def _pick(self, x: np.ndarray) -> int:
        p = self.params
        if p.is_greedy:
            return int(np.argmax(x))
        cand, probs = candidates(x, p.temperature, p.top_k, p.top_p, p.min_p)
        u = self.rng.random()
        cdf = np.cumsum(probs)
        i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        return int(cand[min(i, len(cand) - 1)])


def candidates(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
               ) -> tuple[np.ndarray, np.ndarray]:
    """Processed logits x (vocab,) -> (token ids (n,), probabilities (n,)) after temperature, top-k, top-p and
    min-p, renormalised (sorted by probability only when top-p needed it). Model-free, exact, and testable by hand."""
    z = x / np.float32(temperature)  # (vocab,)
    vocab = z.shape[0]
    k = top_k if 0 < top_k < vocab else vocab
    m = float(np.max(z))
    if not np.isfinite(m):
        raise ValueError("every token is banned or the logits are not finite")
    if k < vocab:
        ids = np.argpartition(-z, k - 1)[:k]  # (k,) the top-k, unordered
        norm = float(np.sum(np.exp(z[ids] - m)))
    elif top_p < 1.0:
        # Exact top-p without a full sort: widen the partition until it holds top_p of the whole mass.
        norm = float(np.sum(np.exp(z - m)))
        n = 64
        while True:
            ids = np.argpartition(-z, n - 1)[:n] if n < vocab else np.arange(vocab)
            if n >= vocab or float(np.sum(np.exp(z[ids] - m))) >= top_p * norm:
                break
            n = min(vocab, n * 8)
    else:
        ids = np.flatnonzero(z > _NEG_INF)  # everything that is allowed
        norm = float(np.sum(np.exp(z[ids] - m)))
    probs = np.exp(z[ids] - m) / norm  # (n,) true probabilities over the top-k set (or the vocabulary)
    if top_p < 1.0:
        # Sort only the candidates; keep the smallest prefix whose mass reaches top_p (the token that
        # crosses the line is kept).
        order = np.argsort(-probs, kind="stable")
        ids, probs = ids[order], probs[order]
        keep = int(np.searchsorted(np.cumsum(probs), top_p, side="left")) + 1
        ids, probs = ids[:max(1, min(keep, len(ids)))], probs[:max(1, min(keep, len(ids)))]
    if min_p > 0.0:
        mask = probs >= np.float32(min_p) * probs.max()  # the top token always survives
        ids, probs = ids[mask], probs[mask]
    return ids, probs / probs.sum()
