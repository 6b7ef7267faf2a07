"""The engine without weights, for tests and `ninfer-chat --fake`: a fake tokenizer and model under the real
`engine.api.Engine`, and a scripted engine with the same attributes and events whose timings can be fixed.

`fake_engine(...)` returns a real `engine.api.Engine` whose model is a `FakeModel`: every forward pass asks a
*policy* for the next token and returns logits that make that token the argmax. A policy sees the text of the
current reply so far (everything after the last `<|im_start|>assistant\\n`, including what the prompt already
put there, e.g. an opened `<think>`) and returns the text the reply should continue with; "" means end of turn.
Because the policy is a function of the context, forced tokens, cancelled turns, prefix reuse and speculative
verify passes all behave like they would with a real model.

    from engine.fake import fake_engine, echo_policy
    engine = fake_engine(echo_policy, delay_s=0.02)       # ~50 tok/s, like a slow CPU
    for ev in engine.session().generate([{"role": "user", "content": "hi"}]):
        ...

The fake KV cache asserts the cache contract (it must hold exactly pos0 tokens before a forward call), so the
tests of the generation loop also check its bookkeeping.

`ScriptedEngine` (an Engine: same name, capacity, thinking_kind, spec_modes and events) plays a `Script` instead
of running the generation loop: reasoning and answer text, token timing (or virtual timings for snapshots),
a hold until released, a failure, the speculative modes it reports. The TUI's tests and `--fake` use it:

    engine = ScriptedEngine.load(EngineArgs(), script=Script(answer="**hi**", delay=0.02))
"""
from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from .api import Engine
from .config import EngineArgs, GenerateRequest, ModelArgs
from .events import (
    FinalStats,
    Progress,
    ReasoningDelta,
    StepStats,
    TextDelta,
    ThinkingForced,
)

# Policy: reply text so far -> continuation text ("" = end of turn).
Policy = Callable[[str], str]

SPECIALS = ("<unk>", "<|im_start|>", "<|im_end|>")
THINK_TOKENS = ("<think>", "</think>")
# Multi-character pieces so that words span one token and markers/stop strings span several.
WORDS = (" the", " capital", " of", " France", " is", " Paris", "Paris", ".", "hmm", " hmm", "think", "</",
         "<", ">", "\n\n", "\n", "assistant", "user", "system", "STOP", " Let", " me", " ok", "Hello", "!")


class FakeTokenizer:
    """Bytes + a few words + ChatML specials. `native_thinking` adds single-token `<think>`/`</think>`
    and a template with an `enable_thinking` switch (like Qwen3); otherwise `<think>` is several tokens
    (like SmolLM2) and the template has no switch."""

    def __init__(self, native_thinking: bool = False):
        self.native_thinking = native_thinking
        pieces: list[bytes] = [s.encode() for s in SPECIALS]
        pieces += [bytes([b]) for b in range(256)]
        self.n_special = len(SPECIALS)
        if native_thinking:
            pieces += [t.encode() for t in THINK_TOKENS]
        pieces += [w.encode() for w in WORDS]
        self.pieces = pieces  # id -> bytes
        self.vocab_size = len(pieces)
        self._special_ids = {s: i for i, s in enumerate(SPECIALS)}
        if native_thinking:
            self._special_ids.update({t: self.n_special + 256 + j for j, t in enumerate(THINK_TOKENS)})
        self._words = sorted(((w, i) for i, w in enumerate(pieces) if i >= self.n_special + 256
                              and w.decode() not in THINK_TOKENS), key=lambda x: -len(x[0]))
        self.bos_id = None
        self.eos_id = 2
        self.stop_ids = (2,)
        self.chat_template = _TEMPLATE_NATIVE if native_thinking else _TEMPLATE_PLAIN
        self.think_ids = (self._special_ids["<think>"], self._special_ids["</think>"]) if native_thinking else None
        self.template_has_thinking_switch = native_thinking

    # -- text <-> ids ------------------------------------------------------------------------------------
    def encode(self, text: str, *, add_bos: bool = False, parse_special: bool = True) -> list[int]:
        """Specials first (as in a chat template render), then longest word, else single bytes."""
        ids: list[int] = []
        i = 0
        specials = sorted(self._special_ids.items(), key=lambda x: -len(x[0]))
        data = text
        while i < len(data):
            for s, sid in specials:
                if data.startswith(s, i):
                    ids.append(sid)
                    i += len(s)
                    break
            else:
                j = i + 1
                while j < len(data) and not any(data.startswith(s, j) for s, _ in specials):
                    j += 1
                ids += self._encode_plain(data[i:j].encode())
                i = j
        return ids

    def _encode_plain(self, b: bytes) -> list[int]:
        out, i = [], 0
        while i < len(b):
            for w, wid in self._words:
                if b.startswith(w, i):
                    out.append(wid)
                    i += len(w)
                    break
            else:
                out.append(self.n_special + b[i])
                i += 1
        return out

    def decode(self, ids, *, skip_special: bool = False) -> str:
        return b"".join(self.pieces[int(t)] for t in ids).decode("utf-8", errors="replace")

    def token_bytes(self, tid: int) -> bytes:
        return self.pieces[tid]

    def token_text(self, tid: int) -> str:
        return self.pieces[tid].decode("utf-8", errors="replace")

    def incremental_decoder(self, skip_special: bool = False):
        from .tokenizer import IncrementalDecoder
        return IncrementalDecoder(self, skip_special)

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(range(self.n_special))

    # -- chat template -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        from .tokenizer import validate_messages
        validate_messages(messages)
        out = []
        for m in messages:
            out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
            if self.native_thinking and extra.get("enable_thinking") is False:
                out.append("<think>\n\n</think>\n\n")
        return "".join(out)

    def encode_chat(self, messages, add_generation_prompt: bool = True, **extra) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra))


# Only used to tell "has a switch" apart; the fake renders in Python above.
_TEMPLATE_PLAIN = "{% for m in messages %}<|im_start|>{{m.role}}...{% endfor %}"
_TEMPLATE_NATIVE = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"


class FakeCache:
    """Token list standing in for the KV cache; checks the position contract."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        assert 0 <= n <= len(self.tokens), (n, len(self.tokens))
        del self.tokens[n:]


class FakeModel:
    """forward() returns logits (T or 1, vocab) with +10 on the policy's next token (0 elsewhere)."""

    def __init__(self, tokenizer: FakeTokenizer, policy: Policy, delay_s: float = 0.0,
                 context_length: int = 2048):
        self.tok = tokenizer
        self.policy = policy
        self.delay_s = delay_s
        self.forward_calls: list[tuple[int, int]] = []  # (pos0, T) per call, for tests
        self.args = ModelArgs(arch="llama", n_layer=1, d_model=8, n_head=1, n_kv_head=1, head_dim=8, d_ff=8,
                              vocab_size=tokenizer.vocab_size, context_length=context_length)
        self._header = tokenizer.encode("<|im_start|>assistant\n")

    def new_cache(self, capacity: int, kv_dtype: str = "f16") -> FakeCache:
        return FakeCache(capacity)

    def next_token(self, context: list[int]) -> int:
        """The policy's next token after `context` (the whole sequence)."""
        h = self._header
        start = 0
        for i in range(len(context) - len(h), -1, -1):
            if context[i:i + len(h)] == h:
                start = i + len(h)
                break
        raw = b"".join(self.tok.pieces[t] for t in context[start:])
        for cut in range(min(4, len(raw)) + 1):  # drop the bytes of a character still being spelled out
            try:
                so_far = raw[:len(raw) - cut].decode("utf-8")
                break
            except UnicodeDecodeError:
                continue
        else:
            return self.tok.eos_id
        partial = raw[len(raw) - cut:] if cut else b""
        cont = self.policy(so_far)
        if not cont:
            return self.tok.eos_id
        if not partial:
            return self.tok.encode(cont)[0]
        b = cont.encode()
        return self.tok._encode_plain(b[len(partial):])[0] if b.startswith(partial) and len(b) > len(partial) \
            else self.tok.eos_id

    def forward(self, tokens, pos0: int, cache: FakeCache, *, all_logits: bool = False) -> np.ndarray:
        tokens = [int(t) for t in np.asarray(tokens).reshape(-1)]  # (T,)
        assert len(cache.tokens) == pos0, f"cache holds {len(cache.tokens)} tokens, forward at pos0={pos0}"
        assert pos0 + len(tokens) <= cache.capacity, "fake cache overflow"
        self.forward_calls.append((pos0, len(tokens)))
        if self.delay_s:
            time.sleep(self.delay_s)
        rows = range(len(tokens)) if all_logits else [len(tokens) - 1]
        out = np.zeros((len(rows), self.tok.vocab_size), np.float32)  # (T or 1, vocab)
        for r, i in enumerate(rows):
            out[r, self.next_token(cache.tokens + tokens[:i + 1])] = 10.0
        cache.tokens.extend(tokens)
        return out


# -- policies ----------------------------------------------------------------------------------------------
def script_policy(text: str) -> Policy:
    """Say `text`, then end the turn; anything else in the reply (e.g. a forced insert) ends it too."""
    def policy(so_far: str) -> str:
        return text[len(so_far):] if text.startswith(so_far) else ""
    return policy


def echo_policy(so_far: str) -> str:
    """A chatty default for the TUI: a fixed markdown answer."""
    return script_policy("Hello! This is the **fake** model.\n\n- it streams\n- it stops\n")(so_far)


def thinking_policy(answer: str = " Paris.", word: str = " hmm", close_after: int | None = None,
                    open_marker: str = "<think>", close_marker: str = "</think>") -> Policy:
    """Reason by repeating `word` (never closing when close_after is None, else after that many words),
    then answer `answer` once the close marker is in the reply. Opens the marker itself if the prompt did not."""
    def policy(so_far: str) -> str:
        s = so_far.lstrip()
        if not s.startswith(open_marker):
            if open_marker.startswith(s):
                return open_marker[len(s):]
            return answer[len(s):] if answer.startswith(s) else ""
        if close_marker in s:
            ans = s.split(close_marker, 1)[1].lstrip()
            return answer.lstrip()[len(ans):] if answer.lstrip().startswith(ans) else ""
        body = s[len(open_marker):]
        # Continue a close marker the model has started.
        for k in range(len(close_marker) - 1, 0, -1):
            if body.endswith(close_marker[:k]):
                return close_marker[k:]
        if close_after is not None and body.count(word.strip()) >= close_after:
            return close_marker + "\n\n"
        return word
    return policy


def fake_engine(policy: Policy = echo_policy, *, native_thinking: bool = False, delay_s: float = 0.0,
                args: EngineArgs | None = None):
    """An `engine.api.Engine` over the fake model: the whole API (sessions, events, stats) without weights."""
    tok = FakeTokenizer(native_thinking=native_thinking)
    model = FakeModel(tok, policy, delay_s=delay_s)
    return Engine.from_parts(model, tok, args or EngineArgs(max_context=1024), name="fake")


# -- the scripted engine --------------------------------------------------------------------------------------
DEFAULT_ANSWER = ("Here is a short answer to **{prompt}**.\n\n"
                  "```python\nprint('hello from the fake engine')\n```\n\n"
                  "- first point\n- second point\n\nThat is all.")
DEFAULT_REASONING = "Let me think about {prompt}. The user wants a clear answer with an example. " * 3


@dataclass
class Script:
    """What the fake model says. `answer`/`reasoning` may use {prompt}; callables get the messages."""

    answer: str | Callable[[list[dict]], str] = DEFAULT_ANSWER
    reasoning: str | Callable[[list[dict]], str] = DEFAULT_REASONING
    native_thinking: bool = False  # False: like SmolLM2, reasoning only when asked (prompted thinking)
    delay: float = 0.0  # seconds per token
    hold_after: int | None = None  # block after this many tokens until `release` is set (tests)
    release: threading.Event = field(default_factory=threading.Event)
    spec_modes: dict = field(default_factory=lambda: {
        "off": None, "ngram": None, "mtp": "no MTP head in this model", "dflash": "no DFlash drafter for this model"})
    fail_with: Exception | None = None
    virtual_tok_s: float | None = None  # report timings as if decoding ran at this speed (snapshots)
    warming: str | None = None  # Engine.warming's note: each reply starts with Progress("compile", 0, 1, it)


def _tokens(text: str) -> list[str]:
    """Split into word-ish pieces that concatenate back to the text (one piece = one 'token')."""
    out, cur = [], ""
    for ch in text:
        cur += ch
        if ch in " \n":
            out.append(cur)
            cur = ""
    if cur:
        out.append(cur)
    return out


class ScriptedEngine(Engine):
    """The real Engine (its attributes: name, capacity, thinking_kind, spec_modes(), session()) over the fake
    tokenizer, whose sessions play a Script instead of running the generation loop."""

    def __init__(self, args: EngineArgs | None = None, script: Script | None = None):
        self.script = script or Script()
        tok = FakeTokenizer(native_thinking=self.script.native_thinking)
        args = args or EngineArgs()
        model = FakeModel(tok, script_policy(""))
        max_ctx, cap = args.resolve_context(model.args.context_length)
        super().__init__(model, tok, args, max_ctx, cap, name="fake-model (scripted)")
        self.requests: list[GenerateRequest] = []  # every request seen, for tests

    @classmethod
    def load(cls, args: EngineArgs, progress: Callable | None = None,
             script: Script | None = None) -> "ScriptedEngine":
        for i in range(1, 4):
            if progress:
                progress(Progress("load", i, 3, f"fake tensors {i}/3"))
        return cls(args, script)

    def spec_modes(self) -> dict[str, str | None]:
        return dict(self.script.spec_modes)

    def warming(self) -> str | None:
        return self.script.warming

    def session(self) -> "ScriptedSession":
        return ScriptedSession(self)


class ScriptedSession:
    """Plays the engine's Script: the events of Session.generate, in its order, with no model."""

    def __init__(self, engine: ScriptedEngine):
        self.engine = engine

    def generate(self, messages: list[dict], request: GenerateRequest | None = None,
                 cancel: threading.Event | None = None) -> Iterator:
        eng, sc = self.engine, self.engine.script
        req = request or GenerateRequest()
        eng.requests.append(req)
        cancel = cancel or threading.Event()
        if sc.fail_with is not None:
            raise sc.fail_with
        prompt = messages[-1]["content"] if messages else ""
        fill = (lambda v: v(messages) if callable(v) else v.format(prompt=prompt[:40]))
        prompt_tokens = sum(len(_tokens(m["content"])) + 4 for m in messages)
        if sc.warming:
            yield Progress("compile", 0, 1, sc.warming)
        yield Progress("prefill", prompt_tokens, prompt_tokens)
        t0 = time.perf_counter()
        think = req.thinking.enabled if req.thinking.enabled is not None else sc.native_thinking
        budget = req.thinking.budget
        max_new = req.sampling.max_new
        spec = req.spec or eng.args.spec
        n_out = n_reason = 0
        forced, finish, text_all = False, "stop", []
        ttft = None
        steps = ([("r", t) for t in _tokens(fill(sc.reasoning))] if think else []) + \
            [("a", t) for t in _tokens(fill(sc.answer))]
        in_reasoning = think
        for kind, piece in steps:
            if cancel.is_set():
                finish = "cancelled"
                break
            if n_out >= max_new:
                finish = "length"
                break
            if sc.hold_after is not None and n_out == sc.hold_after:
                while not sc.release.wait(0.01):
                    if cancel.is_set():
                        break
                if cancel.is_set():
                    finish = "cancelled"
                    break
            if sc.delay:
                time.sleep(sc.delay)
            if kind == "r" and not in_reasoning:
                continue  # the budget closed the reasoning early: skip the rest of it
            if kind == "a" and in_reasoning:
                in_reasoning = False
            if kind == "r" and budget is not None and n_reason >= budget:
                forced, in_reasoning = True, False
                yield ThinkingForced(n_reason, req.thinking.message)
                continue
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            n_out += 1
            text_all.append(piece)
            if kind == "r":
                n_reason += 1
                yield ReasoningDelta(piece)
            else:
                yield TextDelta(piece)
            el = time.perf_counter() - t0 if sc.virtual_tok_s is None else n_out / sc.virtual_tok_s
            yield StepStats(output_tokens=n_out, reasoning_tokens=n_reason, elapsed_s=el,
                            decode_tok_s=n_out / max(el, 1e-6), context_used=prompt_tokens + n_out,
                            round_tokens=2 if spec != "off" else 1,
                            draft_ms=0.1 if spec != "off" else 0.0, verify_ms=1.0 if spec != "off" else 0.0,
                            prompt_tokens=prompt_tokens, ttft_s=ttft,
                            prefill_tok_s=prompt_tokens / ttft if ttft else 0.0)
        wall = time.perf_counter() - t0
        if sc.virtual_tok_s is not None:  # deterministic figures: prefill 10x faster than decode
            wall = max(n_out, 1) / sc.virtual_tok_s
            ttft = prompt_tokens / (10 * sc.virtual_tok_s)
        rounds = n_out if spec == "off" else max(1, n_out // 2)
        yield FinalStats(
            finish_reason=finish, prompt_tokens=prompt_tokens, output_tokens=n_out, reasoning_tokens=n_reason,
            answer_tokens=n_out - n_reason, cached_prompt_tokens=0, ttft_s=ttft or wall,
            prefill_tok_s=prompt_tokens / max(ttft or wall, 1e-6), decode_tok_s=n_out / max(wall, 1e-6),
            wall_s=wall, output_sha256=hashlib.sha256("".join(text_all).encode()).hexdigest(),
            thinking_forced=forced, spec_mode=spec or "off", rounds=rounds,
            drafted=0 if spec == "off" else rounds * 3, accepted=0 if spec == "off" else rounds,
            draft_ms=0.0 if spec == "off" else rounds * 0.1, verify_ms=rounds * 1.0,
            backend=eng.args.backend, kv_dtype=eng.args.kv_dtype, context_capacity=eng.capacity)
