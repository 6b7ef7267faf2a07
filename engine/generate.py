"""One reply: prefix reuse, chunked prefill, the decode loop of *rounds*, stop/cancel/length, text streams, stats.

The round seam (speculative decoding plugs in here)
---------------------------------------------------
The loop never calls the model directly after prefill; it calls a *round function* `round_fn(ctx) -> Round`.
Invariant before and after every round: `ctx.seq` is the whole sequence (prompt + reply so far) and the KV
cache holds exactly `seq[:-1]` (the newest token is pending; it is the first input of the next round).

- `plain_round` (the default): forward [seq[-1]] at position len(seq)-1, `chooser.choose` the next token,
  `chooser.accept` it, return Round(tokens=[t]).
- a speculative round (engine/spec/verify.py) may: propose drafts d1..dk (k <= ctx.max_tokens - 1), forward
  [seq[-1], d1..dk] with `all_logits=True`, then per position i in order: y = choose(row i), accept(y),
  emit y; continue while y == d_i and y not in ctx.stop_ids; finally `cache.truncate(len(seq_before) +
  n_returned - 1)` so the invariant holds, and return Round(tokens=[y...], drafted=k, accepted=n-1, ms...).
  It must not return more than `ctx.max_tokens` tokens. The loop handles stop tokens, stop strings, max_new
  and cancel on the returned tokens; if it stops in the middle of a round it truncates the cache itself.
Optional hooks a round function object may have: `begin()` (called once at the start of the reply),
`capture` (layer ids: prefill passes capture their hidden states) and `observe_prefill(tokens, features)`
(called after each prefill chunk). `engine.api.SpecRound` wires the modes of `engine.spec` this way.
Select a round function per reply with `Session.generate(..., round_fn=...)`; the session builds a
`SpecRound` when the request (or EngineArgs) names a speculative mode.
"""
from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .errors import ConfigError
from .events import FinalStats, Progress, ReasoningDelta, StepStats, TextDelta, ThinkingForced
from .thinking import ANSWER, FORCING, IDLE, ChannelSplitter, ThinkingState, _partial_suffix


@dataclass
class RoundContext:
    """What a round function may use. The round must not modify `seq`; the loop appends what it returns."""

    model: object
    cache: object
    seq: list[int]  # prompt + reply so far; the cache holds seq[:-1]
    chooser: object  # engine.sampling.TokenChooser
    max_tokens: int  # the most tokens this round may return (>= 1)
    stop_ids: frozenset[int]
    draft_tokens: int = 3
    state: dict = field(default_factory=dict)  # per-reply scratch for drafters
    reply_start: int = 0  # len(seq) when the reply began (the prompt's length); 0: not known


@dataclass
class Round:
    tokens: list[int]  # accepted drafts + the bonus token, already accepted by the chooser
    drafted: int = 0
    accepted: int = 0
    draft_ms: float = 0.0
    verify_ms: float = 0.0


RoundFn = Callable[[RoundContext], Round]


@functools.cache
def block_size() -> int:
    """Tokens per decode block (plain_round): 8, the UI getting them in bursts of ~8 x 5 ms; the environment
    variable NINFER_DECODE_BLOCK=1 turns blocks off, and the batched forced insert with them (benchmarks
    compare one token per round in the same run)."""
    v = os.environ.get("NINFER_DECODE_BLOCK", "8")
    if not v.isdigit() or int(v) < 1:
        raise ConfigError(f"NINFER_DECODE_BLOCK must be a whole number >= 1, got {v!r}")
    return int(v)


def plain_round(ctx: RoundContext) -> Round:
    """One token: forward the pending token, choose the next one. When the chooser can hand its choice to
    the model (TokenChooser.block: greedy with or without penalties, or sampling; in the answer, or in
    the reasoning up to its budget) and the model can choose by itself, a decode block instead: up to
    block_size() tokens in one call (Model.decode_block), the tokens single rounds would give. A stop token
    the chooser gives back (see TokenChooser.accepted) leaves the cache one position shorter. Not for the
    reply's first token (ctx.reply_start), which the user waits for. Tokens the thinking state forces (the
    budget's insert) need no choice: the rest of them go through one batched forward."""
    t0 = time.perf_counter()
    pos = len(ctx.seq) - 1
    forced = ctx.chooser.forced_run()[:ctx.max_tokens] if block_size() > 1 else ()
    if len(forced) > 1:  # known tokens (a forced insert): one batched forward, as a prefill; no choice to make
        ctx.model.forward(np.array([ctx.seq[-1], *forced[:-1]], np.int32), pos, ctx.cache)
        for tok in forced:
            ctx.chooser.accept(tok)
        return Round(list(forced), verify_ms=(time.perf_counter() - t0) * 1e3)
    # the reply's first token goes out alone: its text shows one forward after the prefill, not a block's
    n = 1 if len(ctx.seq) == ctx.reply_start else ctx.chooser.block_room(min(ctx.max_tokens, block_size()))
    block = getattr(ctx.model, "decode_block", None) if n > 1 else None
    choice = ctx.chooser.block(n) if block is not None else None
    if choice is not None:
        toks = block(ctx.seq[-1], pos, ctx.cache, n, ctx.stop_ids, choice) or []  # None: not yet
        taken = ctx.chooser.accepted(toks)  # [] for none: rewinds the generator, nothing taken
        if len(taken) < len(toks):  # a stop token given back: its position is chosen again
            ctx.cache.truncate(ctx.cache.length - (len(toks) - len(taken)))
        if taken:
            return Round(taken, verify_ms=(time.perf_counter() - t0) * 1e3)
    logits = ctx.model.forward(np.array([ctx.seq[-1]], np.int32), pos, ctx.cache)  # (1, vocab)
    tok = ctx.chooser.choose(logits[0])
    ctx.chooser.accept(tok)
    return Round([tok], verify_ms=(time.perf_counter() - t0) * 1e3)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n]) != np.asarray(b[:n])  # (n,)
    return int(np.argmax(x)) if x.any() else n


class Detokenizer:
    """Incremental detokenization that never emits half a UTF-8 character (prefix/read offsets).

    Works with any tokenizer that has `decode(ids) -> str` and marks broken bytes as U+FFFD."""

    def __init__(self, tokenizer, context: list[int] = ()):
        self.decode = tokenizer.decode
        self.ids: list[int] = list(context[-4:])  # a little left context so leading spaces decode right
        self.prefix = 0
        self.read = len(self.ids)

    def flush(self) -> str:
        return ""

    def feed(self, token: int) -> str:
        self.ids.append(token)
        prefix_text = self.decode(self.ids[self.prefix:self.read])
        new_text = self.decode(self.ids[self.prefix:])
        if new_text.endswith("\ufffd") or len(new_text) < len(prefix_text):
            return ""  # wait for the rest of the character
        delta = new_text[len(prefix_text):]
        self.prefix, self.read = self.read, len(self.ids)
        return delta


class StopMatcher:
    """Stop strings over the streamed text: holds back what could be the start of a stop string and never
    emits the stop string itself."""

    def __init__(self, stops):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def push(self, delta: str) -> tuple[str, str | None]:
        """-> (text safe to emit, the stop string that matched or None)."""
        if not self.stops:
            return delta, None
        buf = self.held + delta
        hit = min(((buf.find(s), s) for s in self.stops if s in buf), default=None)
        if hit is not None:
            self.held = ""
            return buf[:hit[0]], hit[1]
        k = _partial_suffix(buf, self.stops)
        self.held = buf[len(buf) - k:] if k else ""
        return buf[:len(buf) - k], None

    def flush(self) -> str:
        h, self.held = self.held, ""
        return h


@dataclass
class ReplyOptions:
    """Per-reply knobs resolved by the session (engine args + request)."""

    max_context: int
    prefill_chunk: int = 256
    prefix_reuse: bool = True
    stats_interval_s: float = 0.1
    draft_tokens: int = 3
    spec_mode: str = "off"
    backend: str = "cpu"
    kv_dtype: str = "f16"
    capacity: int = 0


def run_reply(model, cache, cached: list[int], prompt: list[int], chooser, thinking: ThinkingState,
              splitter: ChannelSplitter, tokenizer, stop_ids: frozenset[int], stops: tuple[str, ...],
              max_new: int, opts: ReplyOptions, cancel: threading.Event | None = None,
              round_fn: RoundFn = plain_round) -> Iterator:
    """Generate one reply, yielding engine.events; FinalStats last.

    `cached` is the list of tokens the cache holds on entry; it is updated in place so that it always
    says what the cache holds (also after an error or an abandoned iteration)."""
    t_start = time.perf_counter()
    cancelled = (lambda: cancel.is_set()) if cancel is not None else (lambda: False)
    P = len(prompt)
    reuse = min(common_prefix(cached, prompt), P - 1) if opts.prefix_reuse else 0
    cache.truncate(reuse)
    del cached[reuse:]

    def final(reason, detail, seq, out_text, t_first, t_prefill, prefilled, rounds):
        now = time.perf_counter()
        n_out = len(seq) - P
        decode_s = now - t_first if t_first else 0.0
        answer_empty = splitter.answer_chars == 0
        if answer_empty and reason != "cancelled" and n_out:
            detail = _empty_why(thinking, reason, detail)
        drafted = sum(r.drafted for r in rounds)
        acc = sum(r.accepted for r in rounds)
        k = max((r.drafted for r in rounds), default=0)
        ppa = tuple(sum(1 for r in rounds if r.drafted > i and r.accepted > i) /
                    max(1, sum(1 for r in rounds if r.drafted > i)) for i in range(k))
        return FinalStats(
            finish_reason=reason, prompt_tokens=P, output_tokens=n_out,
            reasoning_tokens=thinking.reasoning_tokens, answer_tokens=thinking.answer_tokens,
            cached_prompt_tokens=reuse, ttft_s=(t_first - t_start) if t_first else 0.0,
            prefill_tok_s=prefilled / t_prefill if t_prefill > 0 else 0.0,
            decode_tok_s=decode_rate(n_out, decode_s, rounds[0] if rounds else None),
            wall_s=now - t_start, output_sha256=hashlib.sha256(out_text.encode()).hexdigest(),
            token_ids=tuple(seq[P:]), thinking_forced=thinking.forced, stop_reason_detail=detail,
            spec_mode=opts.spec_mode, rounds=len(rounds), drafted=drafted, accepted=acc,
            draft_ms=sum(r.draft_ms for r in rounds), verify_ms=sum(r.verify_ms for r in rounds),
            per_position_accept=ppa, backend=opts.backend, kv_dtype=opts.kv_dtype,
            context_capacity=opts.capacity)

    # -- prefill prompt[reuse : P-1]; the last prompt token is the first round's input ---------------------
    if hasattr(round_fn, "begin"):
        round_fn.begin()
    layers = tuple(getattr(round_fn, "capture", ()) or ())
    observe = getattr(round_fn, "observe_prefill", None)
    todo = prompt[reuse:P - 1]
    chunk = opts.prefill_chunk
    n_chunks = (len(todo) + chunk - 1) // chunk
    t_prefill = 0.0  # forward time only (not the consumer's time between events)
    for c in range(n_chunks):
        if cancelled():
            yield final("cancelled", "cancelled during prefill", list(prompt), "", 0.0, 0.0, 0, [])
            return
        part = todo[c * chunk:(c + 1) * chunk]
        pos = len(cached)
        del cached[:]  # unknown state while the forward runs (restored right after)
        t0 = time.perf_counter()
        if layers:
            model.forward(np.asarray(part, np.int32), pos, cache, capture=layers)
        else:
            model.forward(np.asarray(part, np.int32), pos, cache)
        t_prefill += time.perf_counter() - t0
        cached.extend(prompt[:pos + len(part)])
        if observe is not None:
            observe(part, {i: model.captured[i] for i in layers} if layers else None)
        if n_chunks > 1:
            yield Progress("prefill", pos + len(part) - reuse, len(todo), "prefill")
    prefilled = len(todo)

    # -- decode rounds ------------------------------------------------------------------------------------
    seq = list(prompt)
    limit = min(max_new, opts.max_context - P)
    detok = tokenizer.incremental_decoder() if hasattr(tokenizer, "incremental_decoder") \
        else Detokenizer(tokenizer, prompt)
    stopper = StopMatcher(stops)
    out_text = ""
    rounds: list[Round] = []
    t_first = 0.0
    t_stats = 0.0
    reason, detail = None, ""
    ctx = RoundContext(model, cache, seq, chooser, 1, stop_ids, opts.draft_tokens, reply_start=P)
    forced_sent = False
    while reason is None:
        if cancelled():
            reason, detail = "cancelled", "cancelled by the user"
            break
        n_before = len(seq)
        ctx.max_tokens = limit - (n_before - P)
        try:
            rnd = round_fn(ctx)
        except BaseException:
            del cached[:]  # the cache's state is unknown after a failed round
            raise
        rounds.append(rnd)
        seq.extend(rnd.tokens)
        if not t_first:
            t_first = time.perf_counter()
        events = []
        kept = n_before
        for tok in rnd.tokens:
            kept += 1
            tok = int(tok)
            if tok in stop_ids:
                reason, detail = "stop", f"stop token {tok}"
                break
            if thinking.forced and thinking.forced_at == kept - P - 1:
                splitter.force_at(len(out_text) + len(stopper.held))
            i = kept - P - 1  # index of tok in the reply
            if thinking.forced and 0 <= i - thinking.forced_at < len(thinking.plan.forced_ids):
                # The forced insert is ours, not the model's: a stop string must not match inside it.
                emit, hit = stopper.flush() + detok.feed(tok), None
            else:
                emit, hit = stopper.push(detok.feed(tok))
            out_text += emit
            events += _route(splitter.feed(emit))
            if thinking.forced and not forced_sent and i - thinking.forced_at >= len(thinking.plan.forced_ids) - 1:
                # the insert is complete (at this token, also where the round took all of it at once)
                events.append(ThinkingForced(thinking.reasoning_tokens, thinking.plan.forced_text))
                forced_sent = True
            if hit is not None:
                reason, detail = "stop", f"stop string {hit!r}"
                break
            if kept - P >= limit:
                reason = "length"
                detail = (f"max_new {max_new} reached" if max_new <= opts.max_context - P
                          else f"context full ({opts.max_context} tokens)")
                break
        del seq[kept:]
        cache.truncate(len(seq) - 1)
        # cached == seq[:-1] held before the round, which only appended to seq: extend it by the kept tokens
        # (not a copy of the whole sequence per round: ~0.1-0.2 ms per token at 16-32k tokens of context)
        cached.extend(seq[len(cached):len(seq) - 1])
        now = time.perf_counter()
        if reason is None and now - t_stats >= opts.stats_interval_s:
            t_stats = now
            n_out = len(seq) - P
            el = now - t_first
            rate = decode_rate(n_out, el, rounds[0])
            events.append(StepStats(n_out, thinking.reasoning_tokens, el, rate, len(seq), len(rnd.tokens),
                                    rnd.draft_ms, rnd.verify_ms, P, reuse, t_first - t_start,
                                    prefilled / t_prefill if t_prefill > 0 else 0.0))
        yield from events
    # -- flush held-back text ----------------------------------------------------------------------------
    if reason != "stop" or not detail.startswith("stop string"):
        tail = stopper.push(detok.flush())[0] + stopper.flush()
        out_text += tail
        yield from _route(splitter.feed(tail, final=True))
    else:
        yield from _route(splitter.feed("", final=True))
    yield final(reason, detail, seq, out_text, t_first, t_prefill, prefilled, rounds)


def decode_rate(n_out: int, decode_s: float, first: Round | None) -> float:
    """Decode tok/s of a reply: the tokens after the first round over the time since it ended (the first
    round's end is the first token's time: it holds the prompt's last forward). A first round of several
    tokens (a decode block, accepted drafts) counts with the first token, not in the rate, so its tokens are
    not divided by the time of the others. A reply that came whole in its first round: that round's own
    rate, when it had more than one token."""
    n_first = min(len(first.tokens), n_out) if first is not None else 0
    if n_out > n_first and decode_s > 0:
        return (n_out - n_first) / decode_s
    ms = (first.draft_ms + first.verify_ms) if first is not None else 0.0
    return n_first / (ms / 1e3) if n_first > 1 and ms > 0 else 0.0


def _route(pieces) -> list:
    return [ReasoningDelta(t) if ch == "reasoning" else TextDelta(t) for ch, t in pieces]


def _empty_why(th: ThinkingState, reason: str, detail: str) -> str:
    """Never silently empty content: say why there is no answer."""
    if th.plan.active and th.state == IDLE:
        return f"empty answer: the model never opened its reasoning nor wrote answer text ({detail})"
    if th.plan.active and th.state != ANSWER:
        where = "inside the reasoning" if th.state != FORCING else "while inserting the thinking close"
        return f"empty answer: the reply ended {where} ({detail}); raise --max-new or set --thinking-budget"
    return f"empty answer: the model produced no answer text ({detail})"
