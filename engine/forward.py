"""The transformer forward pass, written once: a list of per-layer phases and the walk over them.

Every runner is this walk over its own operations (`LayerOps`): the plain kernel path (`engine.model.Model`,
any backend's kernels one by one), the CPU start-up tier (kernels called from Python), the fused CUDA
sequence, and tensor-parallel ranks (the walk over every rank, an all-reduce in two tails). The fused CPU
step, which numba needs as ONE jitted function, is generated from the same list: its phase loop runs over
`N_LAYER_PHASES` with the kinds below, and its weight stacks are taken in `LAYER_PHASES` role order.

Per layer (pre-norm; qwen2 adds the q/k/v biases, qwen3 the per-head RMSNorm of q and k before RoPE):

    QKV        q, k, v = Wq xb, Wk xb, Wv xb        tail: biases, q/k norms, RoPE, store k, v in the cache
    ATTENTION  att = softmax(q K^T * scale) V        tail: merge of split attention (where split)
    O          proj = Wo att                        tail: x += proj; xb = ffn_norm(x)
    GATE_UP    gate, up = Wgate xb, Wup xb          tail: hb = silu(gate) * up
    DOWN       proj = Wdown hb                      tail: x += proj; xb = attn_norm[l + 1](x) (not after the last)

before the layers `embed`: x = token_embd[tokens], xb = attn_norm[0](x); after them `head`: the output
norm of the last rows_out rows and the output head (the token embedding when the file ties them).
A "phase" is the work that can be shared out (matmul row groups, attention items); a "tail" is the serial
work after it. Each phase reads only what earlier tails wrote, so runners may fuse a tail into its phase
(the CUDA epilogues) without changing the arithmetic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

# phase kinds: module constants, so the numba step compiles them in as literals
QKV, ATTENTION, O, GATE_UP, DOWN = range(5)


@dataclass(frozen=True)
class Phase:
    """One phase of a layer: the matmuls of `roles` (LayerWeights fields) from `src` into `dst`
    (RunState buffer names), or attention (no roles); `tail` says what follows it."""

    kind: int
    name: str
    roles: tuple[str, ...]
    src: str
    dst: tuple[str, ...]
    tail: str


LAYER_PHASES = (
    Phase(QKV, "qkv", ("wq", "wk", "wv"), "xb", ("q", "k", "v"), "biases, q/k norms, RoPE, KV store"),
    Phase(ATTENTION, "attention", (), "q", ("att",), "merge of split attention"),
    Phase(O, "o", ("wo",), "att", ("proj",), "x += proj; xb = ffn_norm(x)"),
    Phase(GATE_UP, "gate_up", ("w_gate", "w_up"), "xb", ("gate", "up"), "hb = silu(gate) * up"),
    Phase(DOWN, "down", ("w_down",), "hb", ("proj",), "x += proj; xb = next layer's attn_norm(x)"),
)
N_LAYER_PHASES = len(LAYER_PHASES)
MATRIX_ROLES = tuple(r for ph in LAYER_PHASES for r in ph.roles)  # wq wk wv wo w_gate w_up w_down


class LayerOps(Protocol):
    """What a runner provides for `walk`. Buffers and weights are its own; the walk only orders the work."""

    n_layer: int

    def begin(self, tokens: np.ndarray, pos0: int, cache) -> None:
        """Bind one pass: tokens (T,) int32 at positions pos0.. over cache (holding pos0 tokens)."""

    def embed(self) -> None:
        """x = token_embd[tokens]; xb = attn_norm[0](x)."""

    def phase(self, ph: Phase, layer: int) -> None:
        """The shared-out work of ph in this layer."""

    def tail(self, ph: Phase, layer: int) -> None:
        """The serial work after ph (see LAYER_PHASES)."""

    def capture(self, layer: int) -> None:
        """Keep a host copy of the residual stream after this layer (drafters' features)."""

    def head(self, rows_out: int) -> np.ndarray:
        """Output norm + head of the last rows_out rows: logits (rows_out, vocab) f32 on the host."""


def walk(ops: LayerOps, tokens: np.ndarray, pos0: int, cache, rows_out: int,
         capture: tuple[int, ...] = ()) -> np.ndarray:
    """The forward pass of tokens (T,) at pos0..pos0+T-1 over `ops`; logits of the last rows_out rows.
    The cache holds pos0 + T positions afterwards."""
    ops.begin(tokens, pos0, cache)
    ops.embed()
    for layer in range(ops.n_layer):
        for ph in LAYER_PHASES:
            ops.phase(ph, layer)
            ops.tail(ph, layer)
        if layer in capture:
            ops.capture(layer)
    cache.length = pos0 + tokens.shape[0]
    return ops.head(rows_out)


class Runner(Protocol):
    """What the engine, the reply loop and the drafters call: a model ready to run on one backend.

    forward: `tokens (T,) int32, pos0, cache -> logits (T or 1, vocab) f32` (engine.model.Model.forward's
    contract); decode_block: up to n tokens chosen and forwarded in one call, or None where the runner
    cannot (the reply loop then runs single forwards; with capture, it also sets captured to the passes'
    hidden rows of those layers, or returns None where it cannot; triggers: engine.triggers.context_keys of the
    context, where the block may also end early, or None); captured: layer -> (T, d) host copies
    of the last forward's (or decode block's) captured hidden states."""

    args: object
    captured: dict

    def forward(self, tokens, pos0: int, cache, *, all_logits: bool = False,
                capture: tuple[int, ...] = ()) -> np.ndarray: ...

    def decode_block(self, token: int, pos0: int, cache, n: int, stop_ids: frozenset,
                     choice=None, capture: tuple[int, ...] = (), triggers=None) -> list[int] | None: ...

    def new_cache(self, capacity: int, kv_dtype: str = "f16"): ...


def scratch_steps(runner: Runner, kv_dtype: str = "f16") -> None:
    """A 2-token pass and a decode step on a scratch cache: every kernel of a runner compiled (or its
    launches captured) before the first real token."""
    cache = runner.new_cache(4, kv_dtype)
    runner.forward(np.array([0, 0], np.int32), 0, cache)
    runner.forward(np.array([0], np.int32), 2, cache)


class OverModel:
    """Base of the runners that run a `engine.model.Model`'s weights another way (the CPU fused step, CUDA
    fusion and graphs): the model's args, caches and captured states; no decode blocks unless overridden."""

    def __init__(self, model):
        self.model = model
        self.args = model.args

    @property
    def captured(self) -> dict:
        return self.model.captured

    def new_cache(self, capacity: int, kv_dtype: str = "f16"):
        return self.model.new_cache(capacity, kv_dtype)

    def decode_block(self, token: int, pos0: int, cache, n: int, stop_ids: frozenset,
                     choice=None, capture: tuple[int, ...] = (), triggers=None) -> list[int] | None:
        return None
