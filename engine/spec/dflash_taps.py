"""The DFlash drafter's context features: what it reads of the target at every fed position.

DFlash (Chen et al. 2026, "Block Diffusion for Flash Speculative Decoding") conditions its draft block on
target hidden states tapped from a few layers (early, middle, late), concatenated, projected and normed. On
the CPU backend a pass that copies out the residual stream of any layer but the last leaves the fused
one-call step for the per-kernel walk (~20x slower under load, measured: a verify of 8 rows 36 ms -> 239 ms),
which would cost more than speculation saves. So the early and middle taps are read where the target already
wrote them: its KV cache. Layer j's keys and values at position p are linear maps of attn_norm(x_j(p)), the
residual stream entering block j (= the output of block j - 1); keys carry RoPE of position p, which
`unrope` takes off, so a tap means the same thing at every position. The late tap is the last block's output
h(p) itself, which the fused step hands out for free (`capture=(n_layer - 1,)`).

Per position p, the feature row (width `Taps.width`):

    f(p) = [h(p) (d); K_j(p) unroped, V_j(p) (2 kv_dim) for j in kv_layers]          float32

Training (train/dflash_features.py) and the runtime (engine/spec/dflash.py) both read K and V through
`kv_rows`, from a cache the engine filled, so the drafter is trained on the values it sees.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Taps:
    """Which target layers the drafter reads: the KV cache layers `kv_layers` and the last block's output."""

    kv_layers: tuple[int, ...]  # cache layers j whose K (unroped) and V rows are read
    hidden_layer: int  # the layer whose output h the forward captures (the last: free on every runner)
    d_model: int
    kv_dim: int  # n_kv_head * head_dim

    @property
    def width(self) -> int:
        return self.d_model + 2 * self.kv_dim * len(self.kv_layers)


def taps_from_dict(d: dict) -> Taps:
    """Taps from their JSON form (a drafter file's meta, a feature shard, a checkpoint)."""
    return Taps(tuple(int(j) for j in d["kv_layers"]), int(d["hidden_layer"]), int(d["d_model"]), int(d["kv_dim"]))


def default_taps(args) -> Taps:
    """Early / middle / late: cache layers at ~1/15, 3/8 and 2/3 of the depth (2, 11, 20 of SmolLM2's 30)
    and the last block's output."""
    n = args.n_layer
    kv = sorted({min(max(1, round(n * f)), n - 1) for f in (1 / 15, 11 / 30, 2 / 3)})
    return Taps(tuple(kv), n - 1, args.d_model, args.n_kv_head * args.head_dim)


def check_taps(taps: Taps, args) -> str | None:
    """None if a target with these ModelArgs has the tapped layers and widths, else why not (one line)."""
    if taps.hidden_layer != args.n_layer - 1:
        return f"its hidden tap is layer {taps.hidden_layer}, this model's last layer is {args.n_layer - 1}"
    bad = [j for j in taps.kv_layers if not 0 <= j < args.n_layer]
    if bad:
        return f"it taps KV layer {bad[0]}, this model has {args.n_layer} layers"
    if taps.d_model != args.d_model or taps.kv_dim != args.n_kv_head * args.head_dim:
        return (f"it reads d_model {taps.d_model} / kv_dim {taps.kv_dim}, this model has {args.d_model} / "
                f"{args.n_kv_head * args.head_dim}")
    return None


def unrope(x: np.ndarray, pos0: int, inv_freq: np.ndarray, neox: bool) -> np.ndarray:
    """x (T, H, hd) rotated back by -(pos0 + t) * inv_freq (the inverse of the ref kernel's rope); a new
    float32 array."""
    t_n, _, hd = x.shape
    half = hd // 2
    ang = np.arange(pos0, pos0 + t_n, dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]  # (T, 1, hd/2)
    x = np.asarray(x, np.float64)
    out = np.empty(x.shape, np.float32)
    if neox:
        a, b = x[..., :half], x[..., half:]
        out[..., :half] = a * cos + b * sin
        out[..., half:] = b * cos - a * sin
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * cos + b * sin
        out[..., 1::2] = b * cos - a * sin
    return out


def _host(a) -> np.ndarray:
    """A cache array (or slice) on the host: numpy as is, a device array copied."""
    copy = getattr(a, "copy_to_host", None)
    return copy() if copy is not None else np.asarray(a)


def _layer_kv(cache, j: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """K, V rows lo..hi-1 of cache layer j as float32 (T, n_kv, hd): f16 as stored, int8 dequantized."""
    if cache.kv_dtype == "f16":
        k, v = cache.layer(j)
        return _host(k[lo:hi]).astype(np.float32), _host(v[lo:hi]).astype(np.float32)
    k_q, k_s, v_q, v_s = (_host(a[lo:hi]) for a in cache.layer(j))
    g = k_q.shape[-1] // k_s.shape[-1]  # values per scale
    return (k_q.astype(np.float32) * np.repeat(k_s, g, axis=-1),
            v_q.astype(np.float32) * np.repeat(v_s, g, axis=-1))


_TABLES: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}  # inv_freq's bytes -> (cos, sin) of positions 0..


def _rope_table(inv_freq: np.ndarray, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
    """backends/cpu/kv_taps.rope_table for at least n_pos positions, kept (grown by doubling)."""
    from ..backends.cpu.kv_taps import rope_table
    key = np.asarray(inv_freq, np.float64).tobytes()
    cs = _TABLES.get(key)
    if cs is None or cs[0].shape[0] < n_pos:
        if len(_TABLES) > 4:
            _TABLES.clear()
        cs = _TABLES[key] = rope_table(max(n_pos, 2 * (0 if cs is None else cs[0].shape[0]), 256), inv_freq)
    return cs


def kv_rows(cache, taps: Taps, lo: int, hi: int, inv_freq: np.ndarray, neox: bool) -> np.ndarray:
    """The KV part of the feature rows of positions lo..hi-1 (the cache must hold them):
    (hi - lo, 2 kv_dim len(kv_layers)) float32, per layer [K unroped | V]. An f16 cache in host memory is
    read by one jitted call per layer (backends/cpu/kv_taps: the same bits as the numpy form below)."""
    out = np.empty((hi - lo, 2 * taps.kv_dim * len(taps.kv_layers)), np.float32)
    if cache.kv_dtype == "f16" and isinstance(cache.layer(taps.kv_layers[0])[0], np.ndarray):
        from ..backends.cpu.kv_taps import kv_taps_f16
        cos, sin = _rope_table(inv_freq, hi)
        for i, j in enumerate(taps.kv_layers):
            k, v = cache.layer(j)
            kv_taps_f16(out, 2 * taps.kv_dim * i, k.view(np.uint16), v.view(np.uint16), lo, cos, sin, bool(neox))
        return out
    return kv_rows_numpy(cache, taps, lo, hi, inv_freq, neox, out)


def kv_rows_numpy(cache, taps: Taps, lo: int, hi: int, inv_freq: np.ndarray, neox: bool,
                  out: np.ndarray | None = None) -> np.ndarray:
    """kv_rows for any cache (f16 or int8, host or device) in numpy: the reference of the jitted form."""
    if out is None:
        out = np.empty((hi - lo, 2 * taps.kv_dim * len(taps.kv_layers)), np.float32)
    for i, j in enumerate(taps.kv_layers):
        k, v = _layer_kv(cache, j, lo, hi)
        c = 2 * taps.kv_dim * i
        out[:, c:c + taps.kv_dim] = unrope(k, lo, inv_freq, neox).reshape(hi - lo, -1)
        out[:, c + taps.kv_dim:c + 2 * taps.kv_dim] = v.reshape(hi - lo, -1)
    return out
