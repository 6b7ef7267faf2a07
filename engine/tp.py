"""Tensor parallelism over 2 devices: `--tp 2 --devices 0,1 --transport auto|p2p|mapped`.

`TPModel` has the `engine.model.Model` interface (args, forward, new_cache, captured) so generation, spec
decoding and the API use it unchanged. Each rank is a plain `Model` built from its shard of the file tensors
(`engine.tp_plan`): its weights, RoPE table and run state; `TPModel.forward` drives the ranks in lockstep
through the same kernel sequence as `Model.forward`, with two all-reduces per layer (after Wo, after Wdown):

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

from .config import EngineArgs, ModelArgs
from .errors import ConfigError
from .kv_cache import KVCache
from .model import Model, RunState
from .tp_plan import ff_unit, plan_shards, shard_args, shard_tensors
from .model import check_forward_args

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
    """A model split over two ranks; same interface as `engine.model.Model`."""

    def __init__(self, args: ModelArgs, tensors: dict, backends: list, devices: tuple[int, ...],
                 transport: str = "auto", max_batch: int = 64):
        self.args = args
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
        a = self.args
        tokens = check_forward_args(tokens, pos0, cache, a.vocab_size)
        t_n = tokens.shape[0]
        if t_n > self.ranks[0].model.state.max_t:
            for rk in self.ranks:
                with rk.ctx():
                    rk.model.state = RunState(rk.be, rk.model.args, t_n)
            self.transport.setup(self.ranks, t_n, a.d_model)
        for rk in self.ranks:
            with rk.ctx():
                s = rk.model.state
                rk.be.upload(s.tokens[:t_n], tokens)
                rk.be.embed(s.x[:t_n], rk.model.tok_embd, s.tokens[:t_n])
        self.captured = {}
        for i in range(a.n_layer):
            for rk, c in zip(self.ranks, cache.caches):
                with rk.ctx():
                    # each rank's partial sums (its heads' share of the output projection) into state.proj
                    rk.model.attention_partial(rk.model.layers[i], c.layer(i), c.kv_dtype, t_n, pos0)
            self._reduce_into_residual(t_n)
            for rk in self.ranks:
                with rk.ctx():
                    rk.model.ffn_partial(rk.model.layers[i], t_n)  # its FFN columns' share
            self._reduce_into_residual(t_n)
            if i in capture:
                with self.ranks[0].ctx():
                    self.captured[i] = self.ranks[0].be.to_host(self.ranks[0].model.state.x[:t_n])
        cache.length = pos0 + t_n
        rows = t_n if all_logits else 1
        parts = []
        for rk in self.ranks:
            with rk.ctx():
                m, s, be = rk.model, rk.model.state, rk.be
                if s.logits is None or s.logits.shape[0] < rows:
                    s.logits = be.zeros((rows, m.args.vocab_size), "float32")
                src = s.x[:t_n] if all_logits else s.x[t_n - 1:t_n]
                be.rmsnorm(s.xb[:rows], src, m.output_norm, a.rms_eps)
                be.matmul(s.logits[:rows], s.xb[:rows], m.output, s.scratch)
        for rk in self.ranks:
            with rk.ctx():
                parts.append(rk.be.to_host(rk.model.state.logits[:rows]))
        return np.concatenate(parts, axis=1)  # (rows, vocab) in vocab order: rank 0 holds the first rows

    def _reduce_into_residual(self, t_n):
        bufs = [rk.model.state.proj[:t_n] for rk in self.ranks]
        self.transport.all_reduce(self.ranks, bufs, t_n)
        for rk, b in zip(self.ranks, bufs):
            with rk.ctx():
                rk.be.residual_add(rk.model.state.x[:t_n], b)


def _device_scope(be, device):
    """A zero-argument callable returning a context manager that makes `device` current (cuda), or None."""
    if be.name != "cuda":
        return None
    from numba import cuda
    return lambda: cuda.gpus[device]


def build_tp_model(args: ModelArgs, tensors: dict, eargs: EngineArgs, max_batch: int = 64) -> TPModel:
    """The TPModel for EngineArgs (tp, devices, transport, backend). CPU backends: devices are logical."""
    from .backend import get_backend
    if eargs.tp != 2:
        raise ConfigError(f"--tp {eargs.tp}: only --tp 1 and --tp 2 are supported")
    devices = tuple(eargs.devices) if len(eargs.devices) == 2 else (0, 1)
    if len(eargs.devices) not in (1, 2) or (len(eargs.devices) == 1 and eargs.backend == "cuda"):
        raise ConfigError(f"--tp 2 needs --devices with two ids (e.g. 0,1 or 0,0), got {eargs.devices}")
    be = get_backend(eargs.backend)
    return TPModel(args, tensors, [be, be], devices, eargs.transport, max_batch)
