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
speculative verify: the chosen one at each verified position, in order). Nothing is ever rolled back,
except a decode block's last token (below).
A decode block (`block(n)` -> Model.decode_block -> `accepted(tokens)`) makes the same choices inside the
model's call (sampling_fast.block_choice) where the thinking state cannot force or ban within n tokens (in
the answer, or inside the reasoning short of the budget): the same tokens, counts, penalty row and random
stream as n choose + accept calls. A block stops after a stop token; if single rounds would not have taken
it (the reasoning redirects it to the close marker; a close inside the block bans it until the answer
shows), `accepted` redirects it or gives it back.

Candidate order (what `candidates` returns and the draw walks): processed logit descending, ties by the lower
token id; with no truncation at all (top_k off, top_p 1, min_p 0) every allowed token in id order. Banned
tokens are never candidates. Top-k keeps the lowest ids among tokens tied at the k-th value.

Cost: no full sort, copy or vocabulary-sized temporary per token. The chain runs in `engine.sampling_fast`
(jitted): penalties and bans live in a per-chooser penalty row (updated in `accept`, bans set for one call)
subtracted while scanning, so the caller's logits are read once and never written; top-k keeps a small sorted
buffer in that one scan; top-p without top-k computes the exact normaliser over the vocabulary into a
per-chooser work row and sorts only the tokens above a widening threshold that covers top_p of the mass.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .config import SamplingParams
from .thinking import REASONING

if TYPE_CHECKING:
    from .sampling_fast import BlockChoice

_NEG_INF = np.float32(-np.inf)
_NO_PEN = np.zeros(0, np.float32)  # "no penalty row": the scans skip the subtraction


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
        self.n_accepted = 0
        p = params
        self._penalised = bool(p.presence_penalty or p.frequency_penalty)
        # (vocab,) f32 presence + frequency * count for every token seen so far (0 elsewhere); +inf on banned
        # tokens for the duration of one choose.
        self._pen = np.zeros(vocab_size, np.float32)
        from . import sampling_fast as sf  # numba loads on first use, not when the UI imports the engine
        k = sf.top_k_of(p.top_k, vocab_size)
        self._args = (float(p.temperature), k, float(p.top_p), float(p.min_p))
        self._scan, self._select, self._draw = sf.top_scan, sf.select, sf.draw
        self._us = np.zeros(0, np.float64)  # a decode block's uniforms (block)
        self._rewind = None  # the generator's state before a block drew them
        self._argmax = None  # a greedy block's choice tuple (built once: it holds self.counts)
        if p.is_greedy:  # argmax = top-1: (1,) i64 / f32 buffers, and its probability in a block (see block)
            self._ids, self._vals, self._p = np.zeros(1, np.int64), np.empty(1, np.float32), np.empty(1, np.float64)
            self._work = _NO_PEN  # (empty) no full-vocabulary path
        else:
            self._ids, self._vals, self._p, self._work = _buffers(vocab_size, k)

    # -- the chain -------------------------------------------------------------------------------------------
    def choose(self, logits_row: np.ndarray) -> int:
        """logits_row (vocab,) float32 -> token id. Does not change state except the generator's."""
        th = self.thinking
        ban = ()
        if th is not None:
            forced = th.force()
            if forced is not None:
                return forced
            ban = th.ban()
        x = _row(logits_row)
        if ban:
            idx = np.fromiter(ban, np.int64, len(ban))  # (n_ban,)
            saved = self._pen[idx]
            self._pen[idx] = np.inf
            try:
                tok = self._pick(x, self._pen)
            finally:
                self._pen[idx] = saved
        else:
            tok = self._pick(x, self._pen if self._penalised else _NO_PEN)
        if th is not None:
            tok = th.redirect(tok)
        return tok

    def block(self, n: int) -> BlockChoice | None:
        """The choice of the next n tokens as a decode block takes it inside one call (Model.decode_block,
        step._choose), or None when a choice needs this class: the thinking state may force or ban
        within n tokens (`block_room`). Greedy with penalties goes as top-1 sampling over the penalised
        logits: one candidate (top_scan's, the one `choose` takes), drawn with probability 1 from a zero
        uniform, so the generator is not touched (greedy draws none). Sampling takes `select`'s path
        (small top-k, or the full vocabulary with this chooser's work row). The uniforms are drawn ahead;
        `accepted` rewinds the generator to where one draw per token taken leaves it, so the tokens and the
        draws that follow are those of single `choose` calls."""
        from .sampling_fast import BlockChoice, argmax_choice
        th, p = self.thinking, self.params
        if th is not None and th.block_room(n) < n:
            return None
        if p.is_greedy:
            if self._penalised:
                return BlockChoice(1, 1.0, 1, 1.0, 0.0, float(p.presence_penalty), float(p.frequency_penalty),
                                   self._pen, self.counts, self._uniforms(n), self._work, self._ids, self._vals,
                                   self._p)
            if self._argmax is None:
                self._argmax = argmax_choice(self.counts)
            return self._argmax
        t, k, top_p, min_p = self._args
        self._rewind = self.rng.bit_generator.state
        us = self._uniforms(n)
        self.rng.random(out=us)
        return BlockChoice(1, t, k, top_p, min_p, float(p.presence_penalty), float(p.frequency_penalty),
                           self._pen if self._penalised else _NO_PEN, self.counts, us, self._work, self._ids,
                           self._vals, self._p)

    def _uniforms(self, n: int) -> np.ndarray:
        """(n,) f64 view of the block's uniforms buffer (grown when needed; zeros until a sampled block
        draws into it, which greedy blocks, never drawing, rely on)."""
        if self._us.shape[0] < n:
            self._us = np.zeros(n, np.float64)
        return self._us[:n]

    def forced_run(self) -> tuple[int, ...]:
        """The tokens the thinking state forces from this position on (`choose` would return them one by
        one without a draw); () when none."""
        return () if self.thinking is None else self.thinking.forced_run()

    def block_room(self, n: int) -> int:
        """How many of the next n tokens a decode block may choose (fewer inside a thinking budget; 0: none)."""
        return n if self.thinking is None else self.thinking.block_room(n)

    def accepted(self, tokens: list[int]) -> list[int]:
        """After a decode block from `block`: its tokens were chosen and counted (penalty row included)
        inside the call. Returns the tokens the reply takes: the block's, except for a stop token that ends
        it where single rounds would not take it. Inside the reasoning it becomes the close marker's token
        (as `choose` redirects it); where the thinking state bans it (a close went by in the block, and no
        answer yet) it is given back, and the caller drops the cache's last position so that the next
        round chooses that position again. The generator is rewound to one draw per token taken (sampled),
        the thinking state advances. Raises like `choose` when the block found no token to take (-1, last)."""
        taken = list(tokens)
        th = self.thinking
        if th is not None and taken and taken[-1] >= 0:
            for tok in taken[:-1]:
                th.accept(tok)
            last = taken[-1]
            if last in th.stop_ids and th.state == REASONING:
                taken[-1] = th.redirect(last)
                self._recount(last, taken[-1])
            elif last in th.ban():
                self._recount(last, None)
                taken.pop()
            if len(taken) == len(tokens):
                th.accept(taken[-1])
        if self._rewind is not None:
            self.rng.bit_generator.state, self._rewind = self._rewind, None
            if taken:
                self.rng.random(len(taken))
        if taken and taken[-1] < 0:
            raise ValueError("every token is banned or the logits are not finite")
        self.n_accepted += len(taken)
        return taken

    def _recount(self, old: int, new: int | None) -> None:
        """A block counted `old` (block_choice, as `accept` does); count `new` instead (None: nothing)."""
        if new != old:
            self._count(old, -1)
            if new is not None:
                self._count(new, 1)

    def _count(self, token: int, d: int) -> None:
        """counts[token] += d, and its penalty row entry to match (0 for a token no longer counted)."""
        self.counts[token] += d
        if self._penalised:
            p, c = self.params, int(self.counts[token])
            self._pen[token] = p.presence_penalty + p.frequency_penalty * c if c else 0.0

    def accept(self, token: int) -> None:
        """Advance: count the token for penalties and feed the thinking state machine."""
        self._count(token, 1)
        self.n_accepted += 1
        if self.thinking is not None:
            self.thinking.accept(token)

    # -- steps -----------------------------------------------------------------------------------------------
    def _processed(self, logits_row: np.ndarray) -> np.ndarray:
        """The processed logits (penalties, bans) as a new array: what `choose` scans, for tests and inspection
        (`choose` itself never materialises it)."""
        x = _row(logits_row) - self._pen  # (vocab,)
        if self.thinking is not None:
            ban = self.thinking.ban()
            if ban:
                x[list(ban)] = _NEG_INF
        return x

    def _pick(self, x: np.ndarray, pen: np.ndarray) -> int:
        if self.params.is_greedy:  # the first index of the largest value (np.argmax's; 0 if all are -inf)
            if pen is _NO_PEN:
                return int(np.argmax(x))  # SIMD, ~2x the jitted scan; and nothing to compile
            return int(self._ids[0]) if self._scan(x, pen, 1, self._ids, self._vals) else 0
        n = self._select(x, pen, *self._args, self._work, self._ids, self._vals, self._p)
        if n <= 0:
            raise ValueError("every token is banned or the logits are not finite")
        return int(self._ids[self._draw(self._p, n, self.rng.random())])


def _row(logits_row: np.ndarray) -> np.ndarray:
    """(vocab,) contiguous float32 view of a logits row (a copy only if it is not one already)."""
    return np.ascontiguousarray(logits_row, dtype=np.float32).reshape(-1)


def _buffers(vocab: int, k: int):
    """Candidate buffers for `sampling_fast.select` with top-k k (sampling_fast.top_k_of's): ids (cap,) i64,
    vals (cap,) f32, probs (cap,) f64, and the exp work row (vocab,) f32 the threshold path needs (empty on
    the small top-k path, which does not)."""
    from .sampling_fast import KMAX
    cap = k if 0 < k <= KMAX else vocab
    work = np.empty(0 if 0 < k <= KMAX else vocab, np.float32)
    return np.empty(cap, np.int64), np.empty(cap, np.float32), np.empty(cap, np.float64), work


def candidates(x: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
               ) -> tuple[np.ndarray, np.ndarray]:
    """Processed logits x (vocab,) -> (token ids (n,) int64, probabilities (n,) float64 summing to 1) after
    temperature, top-k, top-p and min-p, renormalised, in the candidate order of the module docstring.
    Model-free, exact, and testable by hand (the same jitted code `TokenChooser.choose` runs)."""
    from .sampling_fast import select, top_k_of
    x = _row(x)
    ids, vals, probs, work = _buffers(x.shape[0], top_k_of(top_k, x.shape[0]))
    n = select(x, _NO_PEN, float(temperature), int(top_k), float(top_p), float(min_p), work, ids, vals, probs)
    if n <= 0:
        raise ValueError("every token is banned or the logits are not finite")
    return ids[:n].copy(), probs[:n].copy()
