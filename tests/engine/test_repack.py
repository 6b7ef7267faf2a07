"""engine.kernels.cpu_repack: the jitted repack gives exactly the arrays the numpy version gave."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine.kernels import cpu_fast
from engine.quant import QTensor

G = cpu_fast.G
BYTES = {QT.Q4_0: 18, QT.Q4_1: 20, QT.Q8_0: 34}


def _f16_field(raw, off):
    return np.ascontiguousarray(raw[..., off:off + 2]).view(np.float16)[..., 0].astype(np.float32)


def numpy_repack(qt: QTensor):
    """The numpy implementation cpu_fast.repack had before the jitted one (the reference): (kind, qs, d, m8)."""
    rows, cols = qt.shape[0], qt.shape[-1]
    nb, ng = cols // 32, (rows + G - 1) // G
    raw = np.ascontiguousarray(qt.data).view(np.uint8).reshape(rows, -1)
    if rows % G:
        raw = np.concatenate([raw, np.zeros((ng * G - rows, raw.shape[1]), np.uint8)])
    raw = raw.reshape(ng, G, nb, -1)  # (ng, G, nb, B)
    d = np.ascontiguousarray(_f16_field(raw, 0).transpose(0, 2, 1))  # (ng, nb, G)
    if qt.qtype == QT.Q8_0:
        pairs = raw[..., 2:].reshape(ng, G, nb, 16, 2).transpose(0, 2, 3, 1, 4)  # (ng, nb, 16, G, 2)
        return "q8", np.ascontiguousarray(pairs).view(np.int8).reshape(ng, nb, 16, 2 * G), d, None
    if qt.qtype == QT.Q4_1:
        m8 = np.ascontiguousarray(_f16_field(raw, 2).transpose(0, 2, 1)) + 8.0 * d
        qs = np.ascontiguousarray(raw[..., 4:].transpose(0, 2, 3, 1))  # (ng, nb, 16, G)
    else:
        m8 = np.zeros_like(d)
        qs = np.ascontiguousarray(raw[..., 2:].transpose(0, 2, 3, 1))
    return "q4", qs, d, m8.astype(np.float32)


def _same(a, b, nan_payload=True):
    """Bitwise equality, dtype and shape included (-0.0 counts). nan_payload=False: NaN == NaN whatever the
    payload (m + 8 d with both operands NaN: which payload survives depends on the operand order)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if nan_payload:
        return a.tobytes() == b.tobytes()
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(b)) and a[~nan].tobytes() == b[~nan].tobytes()


def _random_tensor(rng, qtype, rows, cols, special_halves=False):
    raw = rng.integers(0, 256, (rows, cols // 32 * BYTES[qtype]), dtype=np.uint8)
    if not special_halves:  # realistic scales: finite halves in the block headers
        blocks = raw.reshape(rows, cols // 32, BYTES[qtype])
        halves = 2 if qtype == QT.Q4_1 else 1
        blocks[..., :2 * halves] = rng.normal(0, 0.05, (rows, cols // 32, halves)).astype(np.float16).view(np.uint8)
    return QTensor(name="w", qtype=qtype, shape=(rows, cols), data=raw)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
@pytest.mark.parametrize("rows", [1, 31, 32, 33, 70, 96])
def test_jitted_repack_equals_numpy(qtype, rows):
    rng = np.random.default_rng(rows * 10 + int(qtype))
    with np.errstate(invalid="ignore"):  # the reference adds NaN scales in the special case
        _check_random(rng, qtype, rows)


def _check_random(rng, qtype, rows):
    for cols, special in ((64, False), (96, True)):  # special: random bytes, i.e. NaN/inf/subnormal scales
        qt = _random_tensor(rng, qtype, rows, cols, special)
        w = cpu_fast.repack(qt)
        kind, qs, d, m8 = numpy_repack(qt)
        assert w.kind == kind and w.shape == (rows, cols)
        assert _same(w.qs, qs) and _same(w.d, d)
        assert (w.m8 is None) if m8 is None else _same(w.m8, m8, nan_payload=not special)


def test_repack_of_a_memory_mapped_weight(smollm2_path):
    """The real weights (views into the file map, read-only) of each type the default model has."""
    from engine.gguf import load_gguf
    mf = load_gguf(smollm2_path)
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
        qt = mf.tensors[name]
        w = cpu_fast.repack(qt)
        kind, qs, d, m8 = numpy_repack(qt)
        assert w.kind == kind and _same(w.qs, qs) and _same(w.d, d) and (m8 is None or _same(w.m8, m8)), name
