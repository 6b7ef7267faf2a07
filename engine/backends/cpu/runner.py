"""The CPU backend's runner: the fused one-call step where it applies, the plain walk where it does not.

`step` is a `step.FusedForward` (the whole pass in one numba call, decode blocks), during a cold start a
`tier.TieredForward` (the same kernels called one by one until the fused step is compiled), or None (weight
types the fused step does not take: the model's plain walk, one kernel call at a time). All three compute the
same bits. A pass that captures the last layer's hidden states (the MTP drafter's features) reads them from
the step's residual-stream buffer, which holds them after the pass; other layers' states run the plain walk
(the fused step keeps no per-layer copies).
"""
from __future__ import annotations

import numpy as np

from ...forward import OverModel
from ...model import Model, check_forward_args


class CpuRunner(OverModel):
    """engine.forward.Runner over a Model on the cpu kernels and its fused step (or None)."""

    def __init__(self, model: Model, step=None):
        super().__init__(model)
        self.step = step

    def warming(self) -> str | None:
        """Engine.warming's note: the cold start's tier still serving (tier.TieredForward.warming), else None."""
        note = getattr(self.step, "warming", None)
        return note() if callable(note) else None

    def forward(self, tokens, pos0: int, cache, *, all_logits: bool = False,
                capture: tuple[int, ...] = ()) -> np.ndarray:
        """engine.model.Model.forward's contract."""
        last = self.args.n_layer - 1
        if self.step is None or any(layer != last for layer in capture):
            return self.model.forward(tokens, pos0, cache, all_logits=all_logits, capture=capture)
        tokens = check_forward_args(tokens, pos0, cache, self.args.vocab_size)
        t_n = tokens.shape[0]
        logits = self.model.logit_rows.copy(self.step.run(tokens, pos0, cache, t_n if all_logits else 1))
        fused = getattr(self.step, "ff", self.step)  # a TieredForward runs over its FusedForward's buffers
        self.model.captured = {last: fused.hidden(t_n).copy()} if capture else {}  # x (T, d) after the pass
        return logits

    def decode_block(self, token: int, pos0: int, cache, n: int, stop_ids: frozenset,
                     choice=None, capture: tuple[int, ...] = (), triggers=None) -> list[int] | None:
        """Up to n tokens after `token` (forwarded at pos0) in one call (step.FusedForward.block): each
        chosen from the previous one's logits by `choice` (TokenChooser.block; None: the argmax) and
        forwarded next, as n forward + choose rounds would; stops after a token in stop_ids (returned last), or
        where the last three tokens are one of `triggers` (engine.triggers.context_keys; the same tokens either way).
        The cache then holds pos0 + len(result). capture: (n_layer - 1,) also sets captured to the passes'
        last hidden rows (len(result), d), as forward over [token, result[:-1]] would. None when the step
        cannot, or not yet (the tiered start's first steps), or for any other layer: the caller runs single
        forwards."""
        last = self.args.n_layer - 1
        if self.step is None or any(layer != last for layer in capture):
            return None
        check_forward_args([token], pos0, cache, self.args.vocab_size)
        cache.check_room(pos0 + n)
        out = self.step.block(int(token), pos0, cache, n, stop_ids, choice, triggers)
        if out is not None and capture:
            fused = getattr(self.step, "ff", self.step)  # a TieredForward runs over its FusedForward's buffers
            self.model.captured = {last: fused.block_hidden(len(out)).copy()}
        return out
