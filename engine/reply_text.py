"""A reply's text as it streams: tokens -> text (never half a UTF-8 character) -> stop strings held back ->
the reasoning and answer channels, as events; and where a stop token or a stop string ends the reply.

Never half a character also where the model's text is cut: max_new, a full context, a cancel or a stop token
after a token that began a multi-byte character, or a thinking budget's forced insert after one. The bytes of
that character are dropped there (made once here, the CLI, the TUI and the store all get text without a
U+FFFD from a cut), where the decoder's flush would make them U+FFFD."""
from __future__ import annotations

from typing import NamedTuple

from .events import ReasoningDelta, TextDelta, ThinkingForced
from .thinking import ChannelSplitter, ThinkingState, partial_suffix


class Finish(NamedTuple):
    """Why a reply ended: FinalStats.finish_reason (stop | length | cancelled) and stop_reason_detail."""

    reason: str
    detail: str


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
        k = partial_suffix(buf, self.stops)
        self.held = buf[len(buf) - k:] if k else ""
        return buf[:len(buf) - k], None

    def flush(self) -> str:
        h, self.held = self.held, ""
        return h


class TextStream:
    """One reply's tokens in, its text events out. `decoder` is the tokenizer's incremental decoder
    (`feed(token) -> str`, `flush() -> str`); the thinking state says which tokens are its forced insert
    (the engine's text, not the model's: no stop string matches inside it, the splitter drops it from the
    reasoning, and a ThinkingForced event carries it)."""

    def __init__(self, decoder, stop_ids: frozenset[int], stops: tuple[str, ...], splitter: ChannelSplitter,
                 thinking: ThinkingState):
        self.decoder = decoder
        self.stop_ids = stop_ids
        self.stopper = StopMatcher(stops)
        self.splitter = splitter
        self.thinking = thinking
        self.text = ""  # everything emitted (FinalStats.output_sha256: reasoning + answer as generated)
        self._forced_sent = False
        self._stop_string = False  # a stop string ended the reply: the held-back text is not flushed

    @property
    def answer_empty(self) -> bool:
        return self.splitter.answer_chars == 0

    def take(self, tokens: list[int], first: int) -> tuple[int, Finish | None, list]:
        """A round's tokens, the first being reply token number `first` -> (how many the reply keeps, the
        Finish when a stop token or stop string ends it there or None, their events)."""
        events: list = []
        for n, tok in enumerate(tokens, 1):
            tok = int(tok)
            if tok in self.stop_ids:
                return n, Finish("stop", f"stop token {tok}"), events
            hit = self._feed(first + n - 1, tok, events)
            if hit is not None:
                self._stop_string = True
                return n, Finish("stop", f"stop string {hit!r}"), events
        return len(tokens), None, events

    def flush(self) -> list:
        """The reply ended: the text held back (a partial stop string's, the splitter's); a character the cut left
        incomplete is dropped."""
        tail = ""
        self._drop_cut_character()
        if not self._stop_string:
            tail = self.stopper.flush()
            self.text += tail
        return _route(self.splitter.feed(tail, final=True))

    def _drop_cut_character(self) -> None:
        """The model's text ends here: drop the bytes of a character its last token left incomplete. The
        decoder returns each character as soon as its bytes are complete and makes bytes that can never be
        one U+FFFD as they come, so all its flush holds is that cut character, as U+FFFD: never text the
        model wrote (a U+FFFD the model wrote whole came out with its token)."""
        held = self.decoder.flush()
        assert not held.replace("\ufffd", ""), f"the decoder held back complete text until the end: {held!r}"

    def _feed(self, i: int, tok: int, events: list) -> str | None:
        """Reply token i -> its events appended; the stop string it completed, or None."""
        th = self.thinking
        if th.insert_starts(i):
            self._drop_cut_character()  # the model's reasoning ends here: the insert's bytes are not its
            self.splitter.force_at(len(self.text) + len(self.stopper.held))
        if th.in_insert(i):  # a stop string must not match inside the insert
            emit, hit = self.stopper.flush() + self.decoder.feed(tok), None
        else:
            emit, hit = self.stopper.push(self.decoder.feed(tok))
        self.text += emit
        events += _route(self.splitter.feed(emit))
        if not self._forced_sent and th.insert_done(i):
            # at its last token, also where a round took all of it at once
            events.append(ThinkingForced(th.reasoning_tokens, th.inserted_text))
            self._forced_sent = True
        return hit


def _route(pieces) -> list:
    return [ReasoningDelta(t) if ch == "reasoning" else TextDelta(t) for ch, t in pieces]
