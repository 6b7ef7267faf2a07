"""CUDA-graph decode: replay the whole T=1 forward pass (~15 launches per layer) as ONE graph launch.

`GraphDecoder(model)` wraps an `engine.model.Model` on the cuda backend and has the same interface. A T=1
`forward` on a cache it has not seen runs plainly (that also warms the run state: every buffer, including the
logits, exists afterwards and every kernel is compiled), then captures the same call into a graph through a
cuda.core `GraphBuilder` (numba-cuda >= 0.30.4 launches into it). Later T=1 calls write the token and the
position into device buffers, replay the graph and copy the logits back: 3 host<->device operations and one
launch per token instead of ~450 launches. The position-dependent kernels read the position from the device
(`cuda.CAPTURE.pos_dev`), so one graph serves every position; buffers are baked in, so there is one graph per
cache and run state (a session keeps its cache; a larger batch that regrows the state forces a recapture).
T > 1 (prefill, verify) and feature capture always run plainly.

Under the simulator (no graphs) the capture records the launches in a list and replays them: the same
bookkeeping is tested without a GPU. Any failure while capturing or replaying switches the wrapper back to
plain launches for good, with the reason in `fallback_reason` (logged once).
"""
from __future__ import annotations

import logging

import numpy as np

from ...errors import InputError
from ...forward import OverModel
from . import kernels as ck

log = logging.getLogger("ninfer.cuda")


def _core_device():
    try:
        from cuda.core import Device
    except ImportError:  # cuda-core < 0.6
        from cuda.core.experimental import Device
    dev = Device()
    dev.set_current()
    return dev


class _Step:
    """One captured decode step for one (model, cache)."""

    def __init__(self, model, cache, fwd):
        self.model, self.cache = model, cache
        self.state = model.state  # the graph bakes in its buffers: holding it keeps them alive
        self.pos_dev = ck.to_device(np.zeros(1, np.int32))  # (1,) int32: the position the graph reads
        self.recording = None
        self.graph = self.stream = None
        saved = cache.length
        tok = np.zeros(1, np.int32)
        builder = None
        n0 = ck.LAUNCHES[0]
        try:
            if ck.SIMULATOR:
                ck.CAPTURE.recording = self.recording = []
            else:
                dev = _core_device()
                self.stream = dev.create_stream()
                builder = dev.create_graph_builder()
                builder.begin_building()
                ck.CAPTURE.stream = builder
            ck.CAPTURE.pos_dev = self.pos_dev
            fwd(tok, saved, cache)  # recorded, not executed; host-side checks only
            if builder is not None:
                ck.CAPTURE.stream = 0
                self.graph = builder.end_building().complete()
        finally:
            ck.CAPTURE.stream, ck.CAPTURE.recording, ck.CAPTURE.pos_dev = 0, None, None
            cache.length = saved
        self.kernels = ck.LAUNCHES[0] - n0  # kernels inside the graph

    def replay(self, token: int, pos0: int) -> np.ndarray:
        """Run the step for `token` at `pos0`; logits (1, vocab) f32 on the host."""
        s = self.model.state
        tok = np.array([token], np.int32)
        pos = np.array([pos0], np.int32)
        if self.graph is None:  # simulator: replay the recorded launches
            s.tokens[:1].copy_to_device(tok)
            self.pos_dev.copy_to_device(pos)
            for k, grid, block, args in self.recording:
                k[grid, block](*args)
            return s.logits[:1].copy_to_host()
        s.tokens[:1].copy_to_device(tok, stream=self.stream)
        self.pos_dev.copy_to_device(pos, stream=self.stream)
        self.graph.launch(self.stream)
        out = s.logits[:1].copy_to_host(stream=self.stream)
        self.stream.sync()
        return out


class GraphDecoder(OverModel):
    """The cuda backend's runner: a cuda-backend Model whose T=1 forward passes replay a captured CUDA graph
    (see module docstring). fused=True runs every pass (captured or not) through `fused.FusedModel` when the
    model allows it (`fused_reason` says why not otherwise); enabled=False keeps plain launches (fusion
    still applies)."""

    def __init__(self, model, enabled: bool = True, fused: bool = True):
        super().__init__(model)
        self.enabled = enabled and getattr(model.be, "name", "") == "cuda"
        self.fallback_reason = None if self.enabled else "graphs off (not requested or not the cuda backend)"
        self.steps: dict[int, _Step] = {}
        self.replays = 0
        self.runner = model  # what runs the forward pass: the fused sequence when the model allows it
        self.fused_reason = "fusion off"
        if fused and getattr(model.be, "name", "") == "cuda":
            from .fused import FusedModel
            fm = FusedModel(model)
            self.fused_reason = fm.why_not
            if fm.supported:
                self.runner = fm
        self.fused = self.runner is not model

    def describe(self) -> str:
        fused = "fused kernels" if self.fused else f"plain kernels ({self.fused_reason})"
        graphs = "one CUDA graph per decode step" if self.enabled else f"plain launches ({self.fallback_reason})"
        return f"cuda: {fused}, {graphs}"

    def _disable(self, why: str):
        self.enabled = False
        self.fallback_reason = why
        self.steps.clear()
        log.warning("cuda graphs disabled, using plain launches: %s", why)

    def forward(self, tokens, pos0: int, cache, *, all_logits: bool = False, capture: tuple[int, ...] = ()):
        """As `Model.forward`."""
        toks = np.asarray(tokens, dtype=np.int32).reshape(-1)
        if not self.enabled or toks.shape[0] != 1 or capture:  # prefill, verify, features: no graph
            return self.runner.forward(toks, pos0, cache, all_logits=all_logits, capture=capture)
        step = self.steps.get(id(cache))
        if step is None or step.cache is not cache or step.state is not self.model.state:  # new cache/state
            out = self.runner.forward(toks, pos0, cache, all_logits=all_logits)  # plain: warms everything
            try:
                self.steps[id(cache)] = _Step(self.model, cache, self.runner.forward)
            except Exception as e:  # noqa: BLE001 - any capture problem means plain launches
                self._disable(f"capture failed: {type(e).__name__}: {e}")
            return out
        if cache.length != pos0:
            raise ValueError(f"cache holds {cache.length} tokens but pos0 is {pos0}; truncate it first")
        cache.check_room(pos0 + 1)
        if not 0 <= int(toks[0]) < self.model.args.vocab_size:
            raise InputError(f"token id {int(toks[0])} is outside the vocabulary (0..{self.model.args.vocab_size - 1})")
        try:
            logits = step.replay(int(toks[0]), pos0)
        except Exception as e:  # noqa: BLE001
            self._disable(f"replay failed: {type(e).__name__}: {e}")
            return self.runner.forward(toks, pos0, cache, all_logits=all_logits)
        cache.length = pos0 + 1
        self.model.captured = {}
        self.replays += 1
        return logits
