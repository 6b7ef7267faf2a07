"""Tensor parallelism over 2 devices: `--tp 2 --devices 0,1 --transport auto|p2p|mapped`.

`TPModel` is a runner (engine.forward.Runner: args, forward, new_cache, captured) so generation, spec
decoding and the API use it unchanged. Each rank is a plain `Model` built from its shard of the file tensors
(plan.py): its weights, RoPE table and run state; `TPModel` is engine.forward's layer walk over the ranks in
lockstep (each rank's own phases and tails), with an all-reduce before two tails per layer (after Wo, after
Wdown):

    rank r: proj_r = partial (T, d);  transport: recv_r <- proj_{1-r};  proj_r += recv_r;  x_r += proj_r

p0 + p1 == p1 + p0 exactly in IEEE arithmetic, so both copies of the residual stream stay bit-identical.
The ranks run from one host thread: kernel launches are asynchronous, so the two devices still overlap.

Transports (chosen once by `probe_transport`, logged with the reason, kept in `TPModel.transport_reason`):
  host    staged through host memory with the backends' to_host/upload (CPU "devices"; any backend)
  p2p     device-to-device: a local copy when both ranks share a device, else cuMemcpyPeer between the two
          contexts after enabling peer access both ways (serialized with the work of both contexts)
  mapped  each rank copies its partial into its own portable, host-mapped pinned buffer (one allocation per
          buffer: a slice of a mapped array has no device pointer); the other rank's residual_add kernel
          reads it zero-copy over PCIe. Works without peer access (e.g. V100s on different PCIe roots).
"""
from __future__ import annotations

import contextlib
import logging
import os

import numpy as np

from ...config import EngineArgs, ModelArgs
from ...errors import ConfigError
from ...kv_cache import KVCache
from ...forward import DOWN, O, walk
from ...model import Model, RunState, check_forward_args
from .plan import ff_unit, plan_shards, shard_args, shard_tensors

log = logging.getLogger("ninfer.tp")


class _Rank:
    """One device's share: its Model (shard weights + run state), backend and device scope."""

    def __init__(self, shard, device, be, scope, model: Model):
        self.shard, self.device, self.be, self.scope, self.model = shard, device, be, scope, model

    def ctx(self):
        return self.scope() if self.scope else contextlib.nullcontext()


# ------------------------------------------------------------------------------------------ transports
class HostTransport:
    """All-reduce staged through host memory (to_host, upload): CPU devices, or any backend as a baseline."""

    name = "host"

    def setup(self, ranks, max_t, d):
        self.recv = []
        for rk in ranks:
            with rk.ctx():
                self.recv.append(rk.be.zeros((max_t, d), "float32"))  # (max_t, d) f32 on rank's device

    def all_reduce(self, ranks, bufs, t_n):
        host = []
        for rk, b in zip(ranks, bufs):
            with rk.ctx():
                host.append(rk.be.to_host(b))  # (T, d) f32
        for r, rk in enumerate(ranks):
            with rk.ctx():
                rk.be.upload(self.recv[r][:t_n], host[1 - r])
                rk.be.residual_add(bufs[r], self.recv[r][:t_n])


class P2PTransport:
    """Device-to-device copies (same device: local copy; two devices: cuMemcpyPeer between contexts)."""

    name = "p2p"

    def setup(self, ranks, max_t, d):
        self.recv = []
        for rk in ranks:
            with rk.ctx():
                self.recv.append(rk.be.zeros((max_t, d), "float32"))  # (max_t, d) f32
        self.contexts = [_context_of(rk) for rk in ranks]

    def all_reduce(self, ranks, bufs, t_n):
        for r, rk in enumerate(ranks):
            dst, src = self.recv[r][:t_n], bufs[1 - r]
            with rk.ctx():
                if ranks[0].device == ranks[1].device or self.contexts[r] is None:
                    dst.copy_to_device(src)  # same context (or the simulator): a local D2D copy
                else:
                    _memcpy_peer(dst, self.contexts[r], src, self.contexts[1 - r])
        for r, rk in enumerate(ranks):
            with rk.ctx():
                rk.be.residual_add(bufs[r], self.recv[r][:t_n])


class MappedTransport:
    """Each rank's partial goes to its own host-mapped pinned buffer; the peer reads it zero-copy."""

    name = "mapped"

    def setup(self, ranks, max_t, d):
        self.host, self.dev = [], []
        for rk in ranks:
            with rk.ctx():
                h, dv = _mapped_buffer((max_t, d))
            self.host.append(h)  # (max_t, d) f32 host view of the pinned memory
            self.dev.append(dv)  # the same memory as a device array (whole buffer: slices lose the pointer)

    def all_reduce(self, ranks, bufs, t_n):
        for r, rk in enumerate(ranks):
            with rk.ctx():
                bufs[r].copy_to_host(self.host[r][:t_n])  # synchronous: the partial is complete
        for r, rk in enumerate(ranks):
            with rk.ctx():  # residual_add reads the first T rows of the peer's (max_t, d) buffer
                rk.be.residual_add(bufs[r], self.dev[1 - r])


def _context_of(rk):
    if rk.be.name != "cuda" or rk.be.module.SIMULATOR:
        return None
    from numba import cuda
    with rk.ctx():
        return cuda.current_context()


def _memcpy_peer(dst, dst_ctx, src, src_ctx):
    from cuda.bindings import driver as cu
    nbytes = int(src.size) * src.dtype.itemsize
    err, = cu.cuMemcpyPeer(dst.__cuda_array_interface__["data"][0], dst_ctx.handle,
                           src.__cuda_array_interface__["data"][0], src_ctx.handle, nbytes)
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyPeer failed: {err}")


def _mapped_buffer(shape):
    """(host ndarray, device array) over one portable host-mapped pinned allocation of f32 `shape`."""
    from numba import cuda
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        h = np.zeros(shape, np.float32)  # the simulator's kernels read host arrays directly
        return h, h
    from numba.cuda.cudadrv import devicearray
    nbytes = int(np.prod(shape)) * 4
    mem = cuda.current_context().memhostalloc(nbytes, mapped=True, portable=True)  # mapped_array drops portable
    arr = np.ndarray(shape=shape, dtype=np.float32, buffer=mem)
    mapped = np.ndarray.view(arr, type=devicearray.MappedNDArray)
    mapped.device_setup(mem, stream=0)
    arr[:] = 0
    return np.asarray(mapped), mapped


def probe_transport(backend_name: str, devices: tuple[int, ...], requested: str = "auto"):
    """(transport, reason). CPU backends always use host staging; cuda: p2p when the two devices share one
    context or can access each other's memory, else (or when forced) host-mapped pinned memory."""
    if requested not in ("auto", "p2p", "mapped"):
        raise ConfigError(f"--transport {requested!r} is not one of auto, p2p, mapped")
    if backend_name != "cuda":
        return HostTransport(), f"{backend_name} devices: partials staged through host memory"
    if requested == "mapped":
        return MappedTransport(), "host-mapped pinned memory (forced by --transport mapped)"
    d0, d1 = devices
    if d0 == d1:
        return P2PTransport(), f"both ranks on device {d0}: device-local copies"
    from numba import cuda
    ok = False
    try:
        with cuda.gpus[d0]:
            c0 = cuda.current_context()
            ok = c0.can_access_peer(d1)
        with cuda.gpus[d1]:
            c1 = cuda.current_context()
            ok = ok and c1.can_access_peer(d0)
    except Exception as e:  # the simulator and odd drivers: no peer access
        why = f"peer access probe failed ({e})"
    else:
        why = f"devices {d0} and {d1} cannot access each other's memory (cuDeviceCanAccessPeer = 0)"
    if ok:
        for ca, cb, dev in ((c0, c1, d0), (c1, c0, d1)):
            with cuda.gpus[dev]:
                try:
                    ca.enable_peer_access(cb.handle)
                except Exception as e:  # already enabled is fine
                    if "ALREADY" not in str(e).upper():
                        raise
        return P2PTransport(), f"peer access between devices {d0} and {d1}"
    if requested == "p2p":
        raise ConfigError(f"--transport p2p: {why}; use --transport mapped (or auto)")
    return MappedTransport(), f"{why}: host-mapped pinned fallback"


# ------------------------------------------------------------------------------------------ the model
class TPCache:
    """One KVCache per rank (each holds its KV heads); `length` is shared."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches
        self.kv_dtype = caches[0].kv_dtype
        self.capacity = caches[0].capacity

    @property
    def length(self) -> int:
        return self.caches[0].length

    @length.setter
    def length(self, n: int):
        for c in self.caches:
            c.length = n

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def check_room(self, n_total: int) -> None:
        self.caches[0].check_room(n_total)

    def truncate(self, n: int) -> None:
        for c in self.caches:
            c.truncate(n)

    def reset(self) -> None:
        for c in self.caches:
            c.reset()


class TPModel:
    """A model split over two ranks: a runner (engine.forward.Runner) and the LayerOps of its walk."""

    def __init__(self, args: ModelArgs, tensors: dict, backends: list, devices: tuple[int, ...],
                 transport: str = "auto", max_batch: int = 64):
        self.args, self.n_layer = args, args.n_layer
        shards = plan_shards(args, len(backends), ff_unit(args, tensors))
        self.transport, self.transport_reason = probe_transport(backends[0].name, tuple(devices), transport)
        log.info("tp: %s transport: %s", self.transport.name, self.transport_reason)
        self.ranks = []
        for s, be, dev in zip(shards, backends, devices):
            scope = _device_scope(be, dev)
            with scope() if scope else contextlib.nullcontext():
                m = Model(shard_args(args, s), shard_tensors(args, tensors, s), be, max_batch=max_batch)
            self.ranks.append(_Rank(s, dev, be, scope, m))
        self.transport.setup(self.ranks, max_batch, args.d_model)
        self.captured: dict[int, np.ndarray] = {}

    def describe(self) -> str:
        """One line: the split and the transport."""
        parts = [f"rank {rk.shard.rank} dev {rk.device}: kv {rk.shard.kv} q {rk.shard.q} ff {rk.shard.ff} "
                 f"vocab {rk.shard.vocab}" for rk in self.ranks]
        return f"tp=2 [{'; '.join(parts)}] transport {self.transport.name} ({self.transport_reason})"

    def new_cache(self, capacity: int, kv_dtype: str = "f16") -> TPCache:
        caches = []
        for rk in self.ranks:
            with rk.ctx():
                caches.append(rk.model.new_cache(capacity, kv_dtype))
        return TPCache(caches)

    def forward(self, tokens, pos0: int, cache: TPCache, *, all_logits: bool = False,
                capture: tuple[int, ...] = ()) -> np.ndarray:
        """As `Model.forward`: logits (T or 1, vocab) f32 on the host, gathered from the vocab shards."""
        tokens = check_forward_args(tokens, pos0, cache, self.args.vocab_size)
        self.captured = {}
        return walk(self, tokens, pos0, cache, tokens.shape[0] if all_logits else 1, capture)

    def decode_block(self, token: int, pos0: int, cache, n: int, stop_ids: frozenset, choice=None,
                     capture: tuple[int, ...] = (), triggers=None):
        """None: the ranks choose no tokens themselves (the reply loop runs single forwards)."""
        return None

    # ---- engine.forward.LayerOps: every rank walks the same phases in lockstep; the partial sums of the
    # output projection and of the down projection are all-reduced before their tails add them to x
    def begin(self, tokens, pos0: int, cache: TPCache) -> None:
        t_n = tokens.shape[0]
        if t_n > self.ranks[0].model.state.max_t:
            for rk in self.ranks:
                with rk.ctx():
                    rk.model.state = RunState(rk.be, rk.model.args, t_n)
            self.transport.setup(self.ranks, t_n, self.args.d_model)
        self.t_n = t_n
        for rk, c in zip(self.ranks, cache.caches):
            with rk.ctx():
                rk.model.begin(tokens, pos0, c)

    def embed(self) -> None:
        for rk in self.ranks:
            with rk.ctx():
                rk.model.embed()

    def phase(self, ph, layer: int) -> None:
        for rk in self.ranks:
            with rk.ctx():
                rk.model.phase(ph, layer)  # its heads' / its FFN columns' share

    def tail(self, ph, layer: int) -> None:
        if ph.kind in (O, DOWN):  # each rank's proj holds a partial sum: the sum of both, then x += proj
            self.transport.all_reduce(self.ranks, [rk.model.state.proj[:self.t_n] for rk in self.ranks], self.t_n)
        for rk in self.ranks:
            with rk.ctx():
                rk.model.tail(ph, layer)

    def capture(self, layer: int) -> None:
        with self.ranks[0].ctx():
            self.captured[layer] = self.ranks[0].be.to_host(self.ranks[0].model.state.x[:self.t_n])

    def head(self, rows_out: int) -> np.ndarray:
        logits = []
        for rk in self.ranks:
            with rk.ctx():
                logits.append(rk.model.head_device(rows_out))
        parts = []
        for rk, lg in zip(self.ranks, logits):
            with rk.ctx():
                parts.append(rk.be.to_host(lg))
        return np.concatenate(parts, axis=1)  # (rows, vocab) in vocab order: rank 0 holds the first rows


def _device_scope(be, device):
    """A zero-argument callable returning a context manager that makes `device` current (cuda), or None."""
    if be.name != "cuda":
        return None
    from numba import cuda
    return lambda: cuda.gpus[device]


def build_tp_model(args: ModelArgs, tensors: dict, eargs: EngineArgs, max_batch: int = 64) -> TPModel:
    """The TPModel for EngineArgs (tp, devices, transport, backend). CPU backends: devices are logical."""
    from ..kernels import get_kernels
    if eargs.tp != 2:
        raise ConfigError(f"--tp {eargs.tp}: only --tp 1 and --tp 2 are supported")
    devices = tuple(eargs.devices) if len(eargs.devices) == 2 else (0, 1)
    if len(eargs.devices) not in (1, 2) or (len(eargs.devices) == 1 and eargs.backend == "cuda"):
        raise ConfigError(f"--tp 2 needs --devices with two ids (e.g. 0,1 or 0,0), got {eargs.devices}")
    be = get_kernels(eargs.backend)
    return TPModel(args, tensors, [be, be], devices, eargs.transport, max_batch)
