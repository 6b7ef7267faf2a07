"""Reasoning control: the per-reply thinking plan, the budget state machine, and the text channel splitter.

Terms. *Markers*: the open/close reasoning markers (`<think>`/`</think>`), token sequences in general (one
special token in Qwen3, several plain tokens in SmolLM2). *Native* thinking: the tokenizer has the markers as
special tokens (the model was trained to reason). *Prompted* thinking: a model without it is asked to reason
by an instruction, and the assistant turn starts with an opened marker. *Forced insert*: the tokens of
(budget message + close marker) the engine appends without sampling when the budget runs out.

`ThinkingState` is one reply's state machine (idle -> reasoning -> forcing -> answer, after llama.cpp's
reasoning-budget sampler). It lives inside the per-position sampling chain (`engine.sampling.TokenChooser`):
`force()` says which token a position must take, `ban()` which tokens it must not, `redirect()` decides at
the budget boundary (and turns an end of turn inside the reasoning into the close marker), `accept()`
advances. Nothing happens outside `choose`/`accept`, so a speculative verify pass that calls the chooser once per position gets forced tokens as "the target's token at that position".

`ChannelSplitter` routes the generated text into the reasoning and answer streams (marker text is not shown).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import ThinkingParams
from .errors import ConfigError

IDLE, REASONING, FORCING, CLOSING, ANSWER = "idle", "reasoning", "forcing", "closing", "answer"

DEFAULT_OPEN, DEFAULT_CLOSE = "<think>", "</think>"
PROMPTED_INSTRUCTION = ("Before answering, think step by step inside <think> and </think>. "
                        "After </think>, write the final answer.")


@dataclass
class ThinkingPlan:
    """How one reply handles reasoning, resolved from the request and the model (see `plan_thinking`)."""

    mode: str  # "off" | "native" | "prompted"
    open_text: str = DEFAULT_OPEN
    close_text: str = DEFAULT_CLOSE
    open_ids: tuple[int, ...] = ()
    close_ids: tuple[int, ...] = ()
    forced_ids: tuple[int, ...] = ()  # tokenized (message + close marker)
    forced_text: str = ""
    budget: int | None = None
    start: str = IDLE  # state at the first generated token: IDLE (model opens), REASONING, ANSWER
    template_extra: dict = field(default_factory=dict)  # e.g. {"enable_thinking": False}
    prompt_suffix: str = ""  # appended after the generation prompt (prompted: the opened marker)
    system_note: str = ""  # instruction added to the system message (prompted)

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def min_tokens(self) -> int:
        """Tokens a reply needs when the budget is spent: (open) + budget + forced insert + 1 answer token."""
        if self.budget is None:
            return 1
        opening = len(self.open_ids) if self.start == IDLE else 0
        return opening + self.budget + len(self.forced_ids) + 1


def has_template_switch(tokenizer) -> bool:
    """True when the chat template reads `enable_thinking` (Qwen3 style on/off switch)."""
    flag = getattr(tokenizer, "template_has_thinking_switch", None)
    if flag is not None:
        return bool(flag)
    return "enable_thinking" in (getattr(tokenizer, "chat_template", None) or "")


def native_markers(tokenizer) -> tuple[str, str] | None:
    """The model's own reasoning markers, when its vocabulary has them as single tokens."""
    ids = getattr(tokenizer, "think_ids", None)  # (open id, close id) or None
    if ids:
        return tokenizer.decode([ids[0]]), tokenizer.decode([ids[1]])
    return None


def plan_thinking(params: ThinkingParams, tokenizer, max_new: int) -> ThinkingPlan:
    """Resolve on/off/budget for this model: native markers (+ template switch) or prompted thinking.

    Raises ConfigError when a budget cannot leave room for the close marker and one answer token in max_new.
    """
    native = native_markers(tokenizer)
    open_text = params.open_marker or (native[0] if native else DEFAULT_OPEN)
    close_text = params.close_marker or (native[1] if native else DEFAULT_CLOSE)
    if native:
        enabled = params.enabled if params.enabled is not None else True
        if not enabled:
            # The template's own switch when it has one, else pre-close the block ourselves (Qwen's recipe).
            if has_template_switch(tokenizer):
                return ThinkingPlan("off", open_text, close_text, template_extra={"enable_thinking": False})
            return ThinkingPlan("off", open_text, close_text, prompt_suffix=f"{open_text}\n\n{close_text}\n\n")
        mode, start, suffix, note = "native", IDLE, "", ""
        extra = {"enable_thinking": True} if has_template_switch(tokenizer) else {}
    else:
        enabled = params.enabled if params.enabled is not None else params.budget is not None
        if not enabled:
            return ThinkingPlan("off", open_text, close_text)
        mode, start, extra = "prompted", REASONING, {}
        suffix, note = open_text + "\n", PROMPTED_INSTRUCTION.replace("<think>", open_text).replace(
            "</think>", close_text)
    close_ids = tuple(tokenizer.encode(close_text))
    forced_text = params.message + close_text + "\n\n"
    plan = ThinkingPlan(mode, open_text, close_text, open_ids=tuple(tokenizer.encode(open_text)),
                        close_ids=close_ids, forced_ids=tuple(tokenizer.encode(forced_text)),
                        forced_text=forced_text, budget=params.budget, start=start, template_extra=extra,
                        prompt_suffix=suffix, system_note=note)
    if plan.budget is not None and plan.min_tokens() > max_new and params.budget_fits:
        plan.budget = max(0, plan.budget - (plan.min_tokens() - max_new))  # an effort: what room allows
    if plan.budget is not None and plan.min_tokens() > max_new:
        if params.budget_fits:
            raise ConfigError(f"--max-new {max_new} cannot hold the thinking close insert "
                              f"({len(plan.forced_ids)} tokens) and an answer; raise --max-new to at least "
                              f"{plan.min_tokens()} or drop --reasoning-effort")
        raise ConfigError(
            f"--thinking-budget {plan.budget} leaves no room for the answer: with the close insert "
            f"({len(plan.forced_ids)} tokens) and one answer token it needs --max-new >= {plan.min_tokens()}, "
            f"got {max_new}; lower the budget or raise --max-new")
    return plan


def detect_start(plan: ThinkingPlan, prompt_text: str) -> str:
    """Where the reply starts, from the rendered prompt: a template may open (or open and close) the block."""
    if not plan.active:
        return ANSWER
    tail = prompt_text.rstrip()
    if tail.endswith(plan.close_text):
        return ANSWER
    if tail.endswith(plan.open_text):
        return REASONING
    return plan.start


class ThinkingState:
    """One reply's budget state machine. Counts reasoning and answer tokens; `forced` after a forced close."""

    def __init__(self, plan: ThinkingPlan, stop_ids=(), decode=None, start: str | None = None):
        self.plan = plan
        self.stop_ids = frozenset(stop_ids)
        self.decode = decode  # ids -> text; enables matching markers as decoded text
        self.state = (start or plan.start) if plan.active else ANSWER
        self.reasoning_tokens = 0
        self.answer_tokens = 0
        self.forced = False
        self.forced_at = -1  # index (in this reply's tokens) of the first forced token
        self.tokens: list[int] = []  # this reply's tokens so far
        self._idx = 0  # next forced/closing token index
        self._region = 0  # index where the current state's tokens begin (for marker matching)
        self._answer_visible = False  # the answer has a non-whitespace token
        self._closed = False  # a close marker (natural or forced) went by in this reply
        self._pick: tuple[int, bool] | None = None  # decision of `redirect`: (token, forced)
        self.closed_at_stop = False  # an end of turn inside the reasoning was turned into the close

    # -- queries used by TokenChooser.choose ---------------------------------------------------------------
    def force(self) -> int | None:
        """The token this position must take, or None."""
        if self.state == FORCING:
            return self.plan.forced_ids[self._idx]
        if self.state == CLOSING:
            return self.plan.close_ids[self._idx]
        return None

    def at_boundary(self) -> bool:
        """The budget is spent: the next reasoning position closes (naturally or by force)."""
        b = self.plan.budget
        return self.state == REASONING and b is not None and self.reasoning_tokens >= b

    def redirect(self, sampled: int) -> int:
        """The token a reasoning position takes instead of the sampled one (records why for `accept`).

        An end of turn inside the reasoning becomes the close marker without the message (the model wanted to
        stop thinking; a reply must not end without an answer). At the budget boundary a natural close (or its
        continuation) wins too; anything else starts the forced insert. Stop strings and cancel are handled
        by the loop and end the reply as they are."""
        if self.state != REASONING:
            return sampled
        c = self.plan.close_ids
        j = self._close_progress()
        if sampled in self.stop_ids and c:
            self._pick = (c[j], False)
            self.closed_at_stop = True
            return c[j]
        if self.at_boundary():
            if c and sampled == c[j]:
                self._pick = (sampled, False)
                return sampled
            self._pick = (self.plan.forced_ids[0], True)
            return self.plan.forced_ids[0]
        return sampled

    def settled(self) -> bool:
        """Nothing more to do in this reply: in the answer (which no token leaves) with no ban now, and so
        none later (the ban lasts only until the answer has a visible token)."""
        return self.state == ANSWER and not self.ban()

    def block_room(self, n: int) -> int:
        """How many of the next n tokens a decode block may choose by itself with the outcome of single
        choose + accept rounds (`TokenChooser.accepted` redirects or gives back a stop token that ends the
        block): n once settled; inside the reasoning, up to the budget boundary, where a position may be
        forced; 0 while a position is forced (the insert, a close after an end of turn), banned, or the
        reply is still deciding whether it opens."""
        if self.settled():
            return n
        if self.state != REASONING or self._pick is not None:
            return 0
        b = self.plan.budget
        return n if b is None else max(0, min(n, b - self.reasoning_tokens))

    def forced_run(self) -> tuple[int, ...]:
        """The tokens forced from this position on: the rest of the insert, or of a close after an end of
        turn (() when the next token is the model's)."""
        if self.state == FORCING:
            return self.plan.forced_ids[self._idx:]
        if self.state == CLOSING:
            return self.plan.close_ids[self._idx:]
        return ()

    def ban(self) -> frozenset[int]:
        """Tokens this position must not take: stop tokens before the first visible answer token after a
        close, so a reply never ends with reasoning and no content."""
        if self.state == ANSWER and self._closed and not self._answer_visible:
            return self.stop_ids
        return frozenset()

    # -- the forced insert, by index i among this reply's tokens (the reply loop routes its text) ------------
    def insert_starts(self, i: int) -> bool:
        """Token i is the first of the forced insert."""
        return self.forced and i == self.forced_at

    def in_insert(self, i: int) -> bool:
        """Token i is part of the forced insert."""
        return self.forced and 0 <= i - self.forced_at < len(self.plan.forced_ids)

    def insert_done(self, i: int) -> bool:
        """The forced insert is complete at token i (its last token, or a later one)."""
        return self.forced and i - self.forced_at >= len(self.plan.forced_ids) - 1

    @property
    def inserted_text(self) -> str:
        return self.plan.forced_text

    def why_no_answer(self, detail: str) -> str:
        """A reply with no answer text says why (never silently empty content); `detail` is why it ended."""
        if self.plan.active and self.state == IDLE:
            return f"empty answer: the model never opened its reasoning nor wrote answer text ({detail})"
        if self.plan.active and self.state != ANSWER:
            where = "inside the reasoning" if self.state != FORCING else "while inserting the thinking close"
            return f"empty answer: the reply ended {where} ({detail}); raise --max-new or set --thinking-budget"
        return f"empty answer: the model produced no answer text ({detail})"

    # -- advancing -------------------------------------------------------------------------------------------
    def accept(self, token: int) -> None:
        """Advance with the token taken at this position (sampled or forced)."""
        self.tokens.append(token)
        n = len(self.tokens)
        st = self.state
        if st == IDLE:
            if self._ends_with(self.plan.open_ids, self.plan.open_text, 0):
                self.state, self._region = REASONING, n
            elif not self._could_open():
                self.state = ANSWER
                self._count_answer(token)
        elif st == REASONING:
            if self.at_boundary_before():
                pick, self._pick = self._pick, None
                if token in self.stop_ids:
                    return
                if pick is not None and pick[1] and token == pick[0]:
                    self.forced, self.forced_at = True, n - 1
                    self._step_into(FORCING, 1, n)
                else:  # a natural close at the boundary: its remaining tokens are taken as they are
                    self._step_into(CLOSING, self._close_progress(exclude_last=True) + 1, n)
                return
            pick, self._pick = self._pick, None
            if pick is not None and token == pick[0]:  # an end of turn turned into the close marker
                self._step_into(CLOSING, self._close_progress(exclude_last=True) + 1, n)
                return
            self.reasoning_tokens += 1
            if self._ends_with(self.plan.close_ids, self.plan.close_text, self._region):
                self.state, self._region, self._closed = ANSWER, n, True
        elif st in (FORCING, CLOSING):
            seq = self.plan.forced_ids if st == FORCING else self.plan.close_ids
            assert token == seq[self._idx], "a forced position took another token"
            self._step_into(st, self._idx + 1, n)
        else:
            self._count_answer(token)

    def at_boundary_before(self) -> bool:
        b = self.plan.budget
        return b is not None and self.reasoning_tokens >= b

    def _step_into(self, state: str, idx: int, n: int) -> None:
        seq = self.plan.forced_ids if state == FORCING else self.plan.close_ids
        if idx >= len(seq):
            self.state, self._region, self._closed = ANSWER, n, True
        else:
            self.state, self._idx = state, idx

    def _close_progress(self, exclude_last: bool = False) -> int:
        """How many leading tokens of the close marker end the reasoning so far (a close in progress)."""
        toks = self.tokens[self._region:len(self.tokens) - (1 if exclude_last else 0)]
        c = self.plan.close_ids
        for k in range(min(len(c) - 1, len(toks)), 0, -1):
            if tuple(toks[-k:]) == c[:k]:
                return k
        return 0

    def _count_answer(self, token: int) -> None:
        self.answer_tokens += 1
        if not self._answer_visible and token not in self.stop_ids:
            if self.decode is None or self.decode([token]).strip():
                self._answer_visible = True

    def _ends_with(self, ids: tuple[int, ...], text: str, region: int) -> bool:
        """Marker match as a token sequence, or (with a decoder) as text in the recent tokens."""
        toks = self.tokens
        if ids and len(toks) - region >= len(ids) and tuple(toks[-len(ids):]) == ids:
            return True
        if self.decode is not None and text:
            window = toks[max(region, len(toks) - len(ids) - 3):]
            last = self.decode(window)
            prev = self.decode(window[:-1])
            return text in last and text not in prev
        return False

    def _could_open(self) -> bool:
        """Still idle: the reply so far is whitespace or a prefix of the open marker."""
        if self.decode is None:
            k = len(self.tokens)
            return k < len(self.plan.open_ids) and tuple(self.tokens) == self.plan.open_ids[:k]
        s = self.decode(self.tokens).lstrip()
        return self.plan.open_text.startswith(s)


class ChannelSplitter:
    """Splits the generated text (fed in order) into ("reasoning", text) and ("answer", text) pieces.

    Marker text is dropped; a forced insert (message + close) is dropped from the reasoning stream (the
    ThinkingForced event carries it); text that could be the start of a marker is held back until it is not.
    """

    def __init__(self, plan: ThinkingPlan, start: str):
        self.plan = plan
        self.mode = start if plan.active else ANSWER  # IDLE | REASONING | ANSWER
        self.text = ""  # everything fed so far
        self.pos = 0  # text[:pos] is routed
        self.forced_at: int | None = None  # text offset where a forced insert begins
        self.answer_started = start == ANSWER and not (plan.active and plan.start != ANSWER)
        self.reasoning_started = False
        self.answer_chars = 0  # answer text emitted so far

    def force_at(self, offset: int) -> None:
        self.forced_at = offset

    def feed(self, delta: str, final: bool = False) -> list[tuple[str, str]]:
        self.text += delta
        out: list[tuple[str, str]] = []
        while True:
            before = (self.mode, self.pos)
            if self.mode == IDLE:
                self._idle(final)
            if self.mode == REASONING:
                self._reasoning(out, final)
            if self.mode == ANSWER:
                self._answer(out, final)
            if (self.mode, self.pos) == before:
                return out

    def _idle(self, final: bool) -> None:
        rest = self.text[self.pos:]
        s = rest.lstrip()
        o = self.plan.open_text
        if s.startswith(o):
            self.pos += len(rest) - len(s) + len(o)
            self.mode = REASONING
        elif (not s or o.startswith(s)) and not final:
            return
        else:
            self.mode = ANSWER

    def _reasoning(self, out, final: bool) -> None:
        c = self.plan.close_text
        i = self.text.find(c, self.pos)
        end = i if i >= 0 else len(self.text)
        if self.forced_at is not None:
            end = min(end, max(self.forced_at, self.pos))
        elif i < 0 and not final:
            end -= partial_suffix(self.text[self.pos:], (c,))
        piece = self.text[self.pos:end]
        if not self.reasoning_started:
            piece = piece.lstrip("\n")
        if piece:
            self.reasoning_started = True
            out.append(("reasoning", piece))
        self.pos = end
        if i >= 0:
            self.pos = i + len(c)
            self.mode = ANSWER
        elif self.forced_at is not None:
            self.pos = max(self.pos, min(self.forced_at, len(self.text)))

    def _answer(self, out, final: bool) -> None:
        piece = self.text[self.pos:]
        if not self.answer_started:
            stripped = piece.lstrip()
            if not stripped:
                return
            self.answer_started = True
            piece = stripped
        if piece:
            out.append(("answer", piece))
            self.answer_chars += len(piece)
        self.pos = len(self.text)


def partial_suffix(text: str, targets) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `targets` (to hold back)."""
    best = 0
    for t in targets:
        for k in range(min(len(t) - 1, len(text)), best, -1):
            if text.endswith(t[:k]):
                best = k
                break
    return best
