"""The engine API: `Engine.load(EngineArgs)` -> `engine.session()` -> `Session.generate(messages)` -> events.

    from engine.api import Engine
    from engine.config import EngineArgs, GenerateRequest, SamplingParams
    engine = Engine.load(EngineArgs(), progress=print)          # the default model on the CPU
    session = engine.session()                                  # one conversation = one KV cache
    for ev in session.generate([{"role": "user", "content": "Hi"}], GenerateRequest(SamplingParams(greedy=True))):
        ...                                                     # TextDelta, ReasoningDelta, ..., FinalStats last

A session keeps the tokens its KV cache holds; the next `generate` reuses the longest common token prefix, so
regenerate/edit/continue only prefill the new suffix (`FinalStats.cached_prompt_tokens`). `generate` checks
its arguments eagerly (ConfigError/InputError before the first event) and returns an iterator; `cancel` (a
threading.Event) is checked between prefill chunks and decode rounds. One session serves one thread at a time.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Callable, Iterator

from .config import EngineArgs, GenerateRequest, check_messages
from .errors import ConfigError, InputError
from .events import Progress
from .generate import Reply, run_reply
from .reply_stats import ReplyOptions
from .rounds import PlainRound, RoundFn
from .prefill import Target
from .reply_text import TextStream
from .sampling import TokenChooser
from .thinking import ANSWER, ChannelSplitter, ThinkingPlan, ThinkingState, detect_start, plan_thinking

ProgressFn = Callable[[Progress], None]


class Engine:
    """A loaded model + tokenizer + backend. Cheap to share; each `session()` owns its own KV cache."""

    def __init__(self, model, tokenizer, args: EngineArgs, max_context: int, capacity: int, name: str = "",
                 model_path: str | None = None, description: str = ""):
        self.model = model
        self.tokenizer = tokenizer
        self.args = args
        self.max_context = max_context
        self.capacity = capacity
        self.name = name
        self.model_path = model_path
        self.description = description
        self.vocab_size = model.args.vocab_size

    @classmethod
    def load(cls, args: EngineArgs | None = None, progress: ProgressFn | None = None,
             config_model: str | None = None) -> "Engine":
        """Resolve (explicit -> config `model` -> embedded default), load and prepare a model."""
        from . import backends, paths
        from .gguf import load_gguf
        from .tokenizer import Tokenizer

        args = args or EngineArgs()
        report = progress or (lambda p: None)
        path = paths.resolve_model(args.model, config_model)
        report(Progress("load", 0, 3, f"opening {path.name}"))
        backend = backends.select(args)(args, path)  # may start reading cached weights in the background
        mf = load_gguf(path)
        tok = Tokenizer.from_gguf(mf)
        max_ctx, cap = args.resolve_context(mf.args.context_length)
        if args.prefill_chunk > cap:  # no chunk is longer than the cache: buffers for more rows would idle
            args = dataclasses.replace(args, prefill_chunk=cap)
        if args.threads:
            set_threads(args.threads)
        report(Progress("load", 1, 3, f"preparing weights for the {backend.name} backend"))
        model = backend.build(mf, max_batch=max(args.prefill_chunk, args.draft_tokens + 1))
        report(Progress("compile", 2, 3, "compiling kernels"))
        t0 = time.perf_counter()
        backend.warm_up(model, lambda msg: report(Progress("compile", 2, 3, msg)))
        model.warmup_s = time.perf_counter() - t0  # start-up figures (ninfer-bench)
        report(Progress("load", 2, 3, backend.describe(model)))
        report(Progress("load", 3, 3, mf.describe()))
        return cls(model, tok, args, max_ctx, cap, name=path.name, model_path=str(path),
                   description=mf.describe())

    @classmethod
    def from_parts(cls, model, tokenizer, args: EngineArgs | None = None, name: str = "") -> "Engine":
        """An engine over an already built model and tokenizer (tests, `engine.fake`)."""
        args = args or EngineArgs()
        max_ctx, cap = args.resolve_context(model.args.context_length)
        return cls(model, tokenizer, args, max_ctx, cap, name=name)

    def session(self) -> "Session":
        return Session(self)

    def with_context(self, max_context: int, session: "Session") -> "Session":
        """Set the context limit of the replies to come without reloading the model (the chat's settings).
        Returns the session to go on with: `session` itself where the KV capacity holds `max_context`
        positions already, else a new session whose cache does (the capacity grows to it; the next reply
        prefills its whole prompt again). A cache that cannot be allocated raises ConfigError and changes
        nothing."""
        from .config import MAX_POSITIONS
        if not 1 <= max_context <= MAX_POSITIONS:
            raise ConfigError(f"--max-context must be in 1..{MAX_POSITIONS}, got {max_context}")
        if max_context <= self.capacity:
            self.max_context = max_context
            return session
        old = self.capacity
        self.capacity = max_context
        try:
            grown = self.session()
        except BaseException:
            self.capacity = old
            raise
        self.max_context = max_context
        return grown

    @property
    def thinking_kind(self) -> str:
        """"native" (the model has its own reasoning markers) or "prompted" (reasoning is asked for by an
        instruction; be honest about it in the UI)."""
        from .thinking import native_markers
        return "native" if native_markers(self.tokenizer) else "prompted"

    def warming(self) -> str | None:
        """Why replies run slower now than they will once the backend has warmed up (the CPU backend's first
        start serves kernel by kernel while its fused step compiles in the background), or None. A reply that
        starts meanwhile says so first: Progress("compile", 0, 1, this note)."""
        note = getattr(self.model, "warming", None)
        return note() if callable(note) else None

    def spec_modes(self) -> dict[str, str | None]:
        """Every speculative mode -> None (usable with this model) or the reason it is not."""
        from .spec import available_modes
        return available_modes(self.model_path)


class Session:
    """One conversation: its KV cache and the tokens in it. `generate` may be called again and again."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.cache = engine.model.new_cache(engine.capacity, engine.args.kv_dtype)
        self.cached: list[int] = []  # the tokens the cache holds, in order
        self.stats_interval_s = 0.1
        self._busy = threading.Lock()

    def reset(self) -> None:
        """Forget the cache (a new conversation)."""
        self.cache.truncate(0)
        self.cached.clear()

    def prompt_tokens(self, messages, request: GenerateRequest | None = None) -> list[int]:
        """The token ids `generate` would prefill for these messages (after the thinking plan)."""
        req = request or GenerateRequest()
        plan = plan_thinking(req.thinking, self.engine.tokenizer, req.sampling.max_new)
        return self._render(messages, plan)[1]

    def generate(self, messages, request: GenerateRequest | None = None,
                 cancel: threading.Event | None = None, round_fn: RoundFn | None = None) -> Iterator:
        """Stream one assistant reply to `messages` as engine.events (FinalStats last).

        Raises ConfigError/InputError here (before iterating) for an invalid request or a prompt that does
        not fit in the context."""
        req = request or GenerateRequest()
        plan = plan_thinking(req.thinking, self.engine.tokenizer, req.sampling.max_new)
        text, prompt = self._render(messages, plan)
        stop_ids = frozenset(self.engine.tokenizer.stop_ids) | frozenset(req.sampling.stop_token_ids)
        return self._reply(prompt, plan, detect_start(plan, text), stop_ids, req, cancel, round_fn)

    def generate_ids(self, prompt: list[int], request: GenerateRequest | None = None,
                     cancel: threading.Event | None = None, round_fn: RoundFn | None = None) -> Iterator:
        """`generate` for a prompt of token ids as they are (no chat template, no thinking plan): the
        reply stops only at request.sampling.stop_token_ids, a stop string or max_new, never at the
        model's end-of-text. The benchmark's fixed-length workloads (engine.bench) decode through it."""
        req = request or GenerateRequest()
        prompt = [int(t) for t in prompt]
        if not prompt or not all(0 <= t < self.engine.vocab_size for t in prompt):
            raise InputError(f"a token prompt needs at least one id, each in 0..{self.engine.vocab_size - 1}")
        stop_ids = frozenset(req.sampling.stop_token_ids)
        return self._reply(prompt, ThinkingPlan("off"), ANSWER, stop_ids, req, cancel, round_fn)

    def _reply(self, prompt, plan, start, stop_ids, req, cancel, round_fn) -> Iterator:
        eng = self.engine
        sp = req.sampling
        if len(prompt) >= eng.max_context:
            raise InputError(f"the prompt is {len(prompt)} tokens but the context is {eng.max_context}; "
                             "shorten the conversation or raise --max-context")
        thinking = ThinkingState(plan, stop_ids, decode=eng.tokenizer.decode, start=start)
        text = TextStream(eng.tokenizer.incremental_decoder(), stop_ids, sp.stop, ChannelSplitter(plan, start),
                          thinking)
        spec = req.spec if req.spec is not None else eng.args.spec
        if round_fn is None:
            round_fn = _pick_round(eng, spec, req.draft_tokens or eng.args.draft_tokens)
        reply = Reply(prompt, TokenChooser(sp, eng.vocab_size, thinking=thinking), thinking, text, stop_ids,
                      sp.max_new, round_fn)
        opts = ReplyOptions(max_context=eng.max_context, prefill_chunk=eng.args.prefill_chunk,
                            prefix_reuse=eng.args.prefix_reuse, stats_interval_s=self.stats_interval_s,
                            spec_mode=spec, backend=eng.args.backend, kv_dtype=eng.args.kv_dtype,
                            capacity=eng.capacity)
        events = run_reply(Target(eng.model, self.cache, self.cached), reply, opts, cancel)
        note = eng.warming()
        if note:  # the first reply(s) of a cold start: the UI can say why this one is slower
            events = itertools.chain([Progress("compile", 0, 1, note)], events)
        return self._locked(events)

    def _locked(self, it: Iterator) -> Iterator:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this session is already generating; one generate at a time")
        try:
            yield from it
        finally:
            self._busy.release()

    def _render(self, messages, plan) -> tuple[str, list[int]]:
        tok = self.engine.tokenizer
        msgs = check_messages(messages)
        if plan.system_note:
            if msgs[0]["role"] == "system":
                msgs[0] = dict(msgs[0], content=(msgs[0]["content"] + "\n\n" + plan.system_note).strip())
            else:
                msgs.insert(0, {"role": "system", "content": plan.system_note})
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, **plan.template_extra) + plan.prompt_suffix
        add_bos = bool(getattr(tok, "add_bos", False)) and not getattr(tok, "bos_token_in_template", False)
        return text, tok.encode(text, add_bos=add_bos)


def _pick_round(engine: Engine, mode: str, k: int) -> RoundFn:
    """A plain round, or the speculative round of `mode` (engine.spec) drafting up to k tokens; ConfigError
    with the reason when the mode cannot run for this model."""
    if mode == "off":
        return PlainRound()
    from .spec import SpecRound, make_drafter
    drafter = make_drafter(mode, engine.model, engine.model_path, capacity=engine.capacity,
                           lm_head_draft=engine.args.lm_head_draft, lookup=engine.args.spec_lookup)
    return SpecRound(drafter, k, engine.capacity)


def set_threads(n: int) -> None:
    """numba's thread count for this process (kernels and the sampling chain), at most what it started with."""
    try:
        import numba
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
    except ImportError:
        pass
    except ValueError as e:
        raise ConfigError(f"--threads {n}: {e}") from None
