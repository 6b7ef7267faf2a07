"""How a prompt gets into a session's KV cache: prefix reuse, then a chunked prefill.

*Prefix reuse*: the cache keeps the longest common token prefix of what it holds and the new prompt, so
regenerate/edit/continue prefill only the new suffix. The prefill forwards the prompt up to its last token,
which is the first round's input (engine/generate.py): the cache then holds prompt[:-1].
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generator

import numpy as np

from .events import Progress

if TYPE_CHECKING:
    from .rounds import RoundFn


@dataclass
class Target:
    """The model and a session's KV cache. `cached` lists the tokens the cache holds, in order; it is updated
    in place so that it says what the cache holds also after an error or an abandoned iteration (emptied
    while a forward runs, as the cache's state is unknown if it fails)."""

    model: object
    cache: object  # engine.kv_cache.KVCache (or the model's own)
    cached: list[int]

    def holds(self, seq: list[int]) -> None:
        """After a round: the cache holds `seq[:-1]` (the newest token is the next round's input). `cached`
        already held a prefix of it: extended by the new tokens only, not a copy of the whole sequence per
        round (~0.1-0.2 ms per token at 16-32k tokens of context)."""
        self.cache.truncate(len(seq) - 1)
        self.cached.extend(seq[len(self.cached):len(seq) - 1])

    def forget(self) -> None:
        """The cache's state is unknown (a forward failed): the next reply prefills from scratch."""
        del self.cached[:]


@dataclass(frozen=True)
class Prefilled:
    tokens: int  # tokens forwarded (the prompt but its reused prefix and its last token)
    seconds: float  # forward time only, not the consumer's time between Progress events


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n]) != np.asarray(b[:n])  # (n,)
    return int(np.argmax(x)) if x.any() else n


def reuse_prefix(target: Target, prompt: list[int], enabled: bool) -> int:
    """Truncate the cache to its common prefix with `prompt` (never the prompt's last token, the first
    round's input) -> the number of tokens reused; 0 and an empty cache when reuse is off."""
    reuse = min(common_prefix(target.cached, prompt), len(prompt) - 1) if enabled else 0
    target.cache.truncate(reuse)
    del target.cached[reuse:]
    return reuse


def prefill(target: Target, prompt: list[int], chunk: int, round_fn: "RoundFn",
            cancelled: Callable[[], bool]) -> Generator[Progress, None, Prefilled | None]:
    """Forward prompt[len(cached) : -1] in passes of up to `chunk` tokens, yielding Progress when there are
    several; returns what it did, or None when `cancelled()` turned true between two passes. The passes
    capture the hidden states of `round_fn.capture` and hand them to `round_fn.observe_prefill`."""
    model, cache, cached = target.model, target.cache, target.cached
    reuse = len(cached)
    todo = prompt[reuse:len(prompt) - 1]
    layers = round_fn.capture
    n_chunks = (len(todo) + chunk - 1) // chunk
    seconds = 0.0
    for c in range(n_chunks):
        if cancelled():
            return None
        part = todo[c * chunk:(c + 1) * chunk]
        pos = len(cached)
        target.forget()  # restored right after the forward
        t0 = time.perf_counter()
        if layers:
            model.forward(np.asarray(part, np.int32), pos, cache, capture=layers)
        else:
            model.forward(np.asarray(part, np.int32), pos, cache)
        seconds += time.perf_counter() - t0
        cached.extend(prompt[:pos + len(part)])
        round_fn.observe_prefill(part, {i: model.captured[i] for i in layers} if layers else None)
        if n_chunks > 1:
            yield Progress("prefill", pos + len(part) - reuse, len(todo), "prefill")
    return Prefilled(len(todo), seconds)
