"""The drafter plug-in seam: what every drafter implements, and the registry of speculative modes.

A *drafter* only proposes tokens; `engine.spec.verify` decides with the reply's `TokenChooser`, so any
drafter is lossless. Terms (defined once here): a *round* is one draft + one target verify pass over
[last token, d1..dk]; *accepted* drafts are those the target's own draws matched; the *bonus* token is the
target's draw after the last accepted draft (the first mismatch, or the extra token when all matched).

Registry: every speculative mode names the module that implements it. A mode module exposes
    unavailable_reason(model_path: str | None) -> str | None   # None: this mode can run for this model
    make_drafter(model, model_path: str | None, **options) -> Drafter
and is imported only when asked for (heavy drafters load lazily). A mode whose module is not in the tree yet
reports "no drafter for this model", so the CLI and TUI can show it disabled with that reason.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from ..config import SPEC_MODES
from ..errors import ConfigError

NO_DRAFTER = "no drafter for this model"

# Features a drafter may ask for: target layer id -> hidden states (T, d_model) float32 of the T positions
# fed in one target pass (layer id i = the residual stream after transformer block i; `Model.forward(capture=)`).
Features = Mapping[int, np.ndarray]


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens; never decides. One instance serves one session (reset per reply).

    Optional, read by the round where a drafter has them (engine.spec.round): `confidence` (its probability
    of each draft of the last propose), `bind_target(model, cache)` (called before propose: a drafter that
    reads the target's KV cache, DFlash), `from_lookup` (whether the round in flight verifies prompt-lookup
    drafts: Round.lookup), and the decode-block hooks of an adaptive length (`block_instead`, `may_block`,
    `blocked`, `block_timed`: engine.spec.adaptive.AdaptiveLength, engine.spec.lookup.LookupFirst)."""

    name: str
    # Target layer ids whose hidden states the drafter reads (captured during prefill and verify); () = none.
    features_needed: tuple[int, ...]

    def reset(self) -> None:
        """Forget all state: a new reply, or a context that does not continue the observed one."""

    def observe(self, tokens: Sequence[int], features: Features | None) -> None:
        """`tokens` were just fed to the target and are now in its KV cache (their features, if asked for:
        layer -> (len(tokens), d)). Called after prefill and after every round with the kept positions."""

    def propose(self, context_tokens: Sequence[int], k: int, features: Features | None) -> list[int]:
        """Up to `k` draft tokens that continue `context_tokens` (prompt + reply so far, the last one not yet
        fed to the target). May return fewer, or none (the round then is a plain decode step). A drafter
        with a model of its own may also set `confidence`: its probability of each draft returned."""


def top_probability(logits: np.ndarray) -> float:
    """The softmax probability of the top logit of one row: a trained drafter's confidence in its draft
    (published as `drafter.confidence`, one per draft of the last propose; engine.spec.adaptive uses it)."""
    from ..sampling_fast import softmax_top
    return float(softmax_top(np.ascontiguousarray(logits, np.float32).reshape(-1)))


# mode -> module implementing it (relative to this package). "off" has no drafter.
_MODE_MODULES = {"ngram": "ngram", "mtp": "mtp", "dflash": "dflash"}


def _mode_module(mode: str):
    """The module for `mode`, or None if it is not in the tree (not landed yet)."""
    name = f"{__package__}.{_MODE_MODULES[mode]}"
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)


def _check_mode(mode: str) -> None:
    if mode not in SPEC_MODES:
        raise ConfigError(f"--spec {mode!r} is not one of {', '.join(SPEC_MODES)}")


def unavailable_reason(mode: str, model_path: str | None = None) -> str | None:
    """None if `mode` can run for the model at `model_path`, else a one-line reason to show the user."""
    _check_mode(mode)
    if mode == "off":
        return None
    module = _mode_module(mode)
    if module is None or not hasattr(module, "make_drafter"):
        return NO_DRAFTER
    check = getattr(module, "unavailable_reason", None)
    return check(model_path) if check is not None else None


def available_modes(model_path: str | None = None) -> dict[str, str | None]:
    """Every speculative mode -> None (usable) or the reason it is not, in `SPEC_MODES` order.

    The CLI rejects an unusable `--spec` with the reason; the TUI shows such modes disabled."""
    return {mode: unavailable_reason(mode, model_path) for mode in SPEC_MODES}


def make_drafter(mode: str, model: Any = None, model_path: str | None = None, *, lookup: int = 0,
                 lookup_drafts: int | None = None, **options) -> Drafter | None:
    """The drafter for `mode` (None for "off"); ConfigError with the reason if the mode cannot run here.
    lookup n > 0: a trained drafter (mtp, dflash) drafts second to prompt lookup where the context's last n+
    tokens occurred before (engine.spec.lookup), whose rounds draft up to lookup_drafts (default
    lookup.LOOKUP_DRAFTS) or the round's k where that is more."""
    reason = unavailable_reason(mode, model_path)
    if reason is not None:
        raise ConfigError(f"--spec {mode}: {reason}; use --spec off or --spec ngram")
    if mode == "off":
        return None
    drafter = _mode_module(mode).make_drafter(model, model_path, **options)
    if lookup > 0 and mode in ("mtp", "dflash"):
        from .adaptive import AdaptiveLength
        if not isinstance(drafter, AdaptiveLength):
            raise ConfigError(f"--spec {mode}: lookup-first drafting needs the adaptive draft length")
        from .lookup import LOOKUP_DRAFTS, lookup_first
        drafter = lookup_first(drafter, model, lookup, LOOKUP_DRAFTS if lookup_drafts is None else lookup_drafts)
    return drafter
