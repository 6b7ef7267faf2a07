"""Configuration as dataclasses: model shape (from the GGUF), engine options, sampling, thinking.

Every option the CLI, the TUI and the benchmark accept travels as one of these; never a loose dict.
"""
from __future__ import annotations

import math
import unicodedata
from dataclasses import dataclass, field

from .errors import ConfigError, InputError

ARCHITECTURES = ("llama", "qwen2", "qwen3")
KV_DTYPES = ("f16", "int8")
SPEC_MODES = ("off", "ngram", "mtp", "dflash")
BACKENDS = ("cpu", "ref", "cuda")
MAX_POSITIONS = 1 << 24  # context, KV capacity and prefill chunk (16.7M positions: past any model's context)
MIN_TEMPERATURE = 1e-6  # the smallest temperature that is not 0 (greedy); below it logits / T can overflow


@dataclass
class ModelArgs:
    """Shape of a decoder-only transformer, read from GGUF metadata (`engine.gguf`)."""

    arch: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    d_ff: int
    vocab_size: int
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    context_length: int = 2048
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k before RoPE
    tied_embeddings: bool = True  # output head = token_embd when the file has no output.weight
    rope_neox: bool = False  # qwen2/qwen3 rotate halves (NEOX); llama rotates adjacent pairs

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"unsupported architecture {self.arch!r}; supported: {', '.join(ARCHITECTURES)}")
        if self.n_head % self.n_kv_head:
            raise ConfigError(f"n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head}")
        if self.head_dim < 8 or self.head_dim % 2:  # rope rotates pairs; the CPU attention reads blocks of 8
            raise ConfigError(f"head_dim {self.head_dim} is not supported: it must be even and at least 8")
        self.q_dim = self.n_head * self.head_dim
        self.kv_dim = self.n_kv_head * self.head_dim
        self.group = self.n_head // self.n_kv_head  # query heads per KV head (GQA)


@dataclass
class EngineArgs:
    """How to run a model: backend, cache, prefill, speculation, parallelism."""

    model: str | None = None  # path; None -> config -> embedded default (engine.paths)
    backend: str = "cpu"
    threads: int | None = None  # None: all cores numba sees
    max_context: int | None = None  # None: min(model context, 4096)
    kv_capacity: int | None = None  # None: = max_context; must be >= max_context
    kv_dtype: str = "f16"
    prefill_chunk: int = 256
    prefix_reuse: bool = True
    spec: str = "off"
    draft_tokens: int = 3
    lm_head_draft: bool = False  # a trained drafter (mtp) drafts over its hot vocabulary's head rows only
    # a trained drafter (mtp, dflash) drafts second to prompt lookup where the context's last spec_lookup+ tokens
    # occurred before (engine.spec.lookup); 0: the trained drafter alone
    spec_lookup: int = 3
    tp: int = 1
    devices: tuple[int, ...] = (0,)
    transport: str = "auto"  # auto | p2p | mapped (TP only)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ConfigError(f"--backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype {self.kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        if not isinstance(self.spec_lookup, int) or self.spec_lookup < 0:
            raise ConfigError(f"--spec-lookup must be a whole number >= 0 (0 = off), got {self.spec_lookup!r}")
        if self.spec not in SPEC_MODES:
            raise ConfigError(f"--spec {self.spec!r} is not one of {', '.join(SPEC_MODES)}")
        if not 1 <= self.prefill_chunk <= MAX_POSITIONS:
            raise ConfigError(f"--prefill-chunk must be in 1..{MAX_POSITIONS}, got {self.prefill_chunk}")
        _check_draft_tokens(self.draft_tokens)
        if self.transport not in ("auto", "p2p", "mapped"):
            raise ConfigError(f"--transport {self.transport!r} is not one of auto, p2p, mapped")
        if self.max_context is not None and not 1 <= self.max_context <= MAX_POSITIONS:
            raise ConfigError(f"--max-context must be in 1..{MAX_POSITIONS}, got {self.max_context}")
        if self.kv_capacity is not None and not 1 <= self.kv_capacity <= MAX_POSITIONS:
            raise ConfigError(f"--kv-capacity must be in 1..{MAX_POSITIONS}, got {self.kv_capacity}")
        if self.kv_capacity is not None and self.max_context is not None and self.kv_capacity < self.max_context:
            raise ConfigError(
                f"--kv-capacity {self.kv_capacity} is smaller than --max-context {self.max_context}; "
                "raise --kv-capacity or lower --max-context")

    def resolve_context(self, model_context: int) -> tuple[int, int]:
        """(max_context, kv_capacity) after defaults, validated against the model's trained context."""
        max_ctx = self.max_context or min(model_context, 4096)
        cap = self.kv_capacity or max_ctx
        if cap < max_ctx:
            raise ConfigError(f"--kv-capacity {cap} is smaller than --max-context {max_ctx}; "
                              "raise --kv-capacity or lower --max-context")
        return max_ctx, cap


@dataclass
class SamplingParams:
    """The per-position sampling chain. temperature 0 (or greedy=True) means argmax.

    Penalties follow OpenAI semantics over the tokens generated so far in this reply:
    logit -= presence_penalty * (count > 0) + frequency_penalty * count.

    The product's defaults are config.toml's (top-k 40, top-p 0.95, min-p 0.05 ...), applied by
    engine.options for ninfer, ninfer-chat and the settings screen. The filters here default to off, so a
    caller of the API gets exactly the chain it names (the benchmark presets, the tests, llama.cpp
    comparisons); tests/engine/test_options.py holds every other default equal to config.toml's.
    """

    temperature: float = 0.7
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_new: int = 512
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    greedy: bool = False

    def __post_init__(self):
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0 or 0 < self.temperature < MIN_TEMPERATURE:
            raise ConfigError(f"--temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {self.temperature} "
                              "(below that the scaled logits overflow)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"--min-p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ConfigError(f"--top-k must be >= 0, got {self.top_k}")
        if self.max_new < 1:
            raise ConfigError(f"--max-new must be >= 1, got {self.max_new}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            raise ConfigError(f"--seed must be in [0, 2^63), got {self.seed}; leave it out for a random seed")
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0


@dataclass
class ThinkingParams:
    """Reasoning control. enabled None = the model's default (native thinking on, none otherwise)."""

    enabled: bool | None = None
    budget: int | None = None  # reasoning tokens before the close is forced; None: unlimited
    message: str = ("\n\nConsidering the limited time by the user, I have to give the solution "
                    "based on the thinking directly now.\n")
    open_marker: str | None = None  # None: from the model (template/tokenizer) or the prompted default
    close_marker: str | None = None
    budget_fits: bool = False  # --reasoning-effort: a budget too large for max_new shrinks to leave the answer room

    def __post_init__(self):
        if self.budget is not None and self.budget < 0:
            raise ConfigError(f"--thinking-budget must be >= 0, got {self.budget}")


@dataclass
class GenerateRequest:
    """One reply: the sampling chain, thinking control and speculation for it."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    thinking: ThinkingParams = field(default_factory=ThinkingParams)
    spec: str | None = None  # None: EngineArgs.spec; else overrides for this reply
    draft_tokens: int | None = None

    def __post_init__(self):
        if self.draft_tokens is not None:
            _check_draft_tokens(self.draft_tokens)


def _check_draft_tokens(n: int) -> None:
    """1..15 drafts: a verify pass of at most 16 rows, which the CPU step computes row for row as decode
    steps (lossless speculation; a prompt's 32+ rows take kernels that sum in another order)."""
    if not 1 <= n <= 15:
        raise ConfigError(f"--draft-tokens must be 1..15, got {n}")


def check_messages(messages, text_only: bool = False) -> list[dict]:
    """A chat's messages as a fresh list of dicts, each content NFC-normalized (CJK input comes typed in many
    forms); InputError (one line) for anything but a non-empty list of {"role": str, "content": str}.
    text_only: role and content only (what a remote server is sent), else every key the message has (a chat
    template may read more)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError('messages must be a non-empty list of {"role": ..., "content": ...} objects')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or not isinstance(m.get("role"), str):
            raise InputError(f"message {i} must be an object with string 'role' and 'content'")
        content = unicodedata.normalize("NFC", m["content"])
        out.append({"role": m["role"], "content": content} if text_only else dict(m, content=content))
    return out
