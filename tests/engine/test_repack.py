"""engine.kernels.cpu_repack: the jitted repack gives exactly the arrays the numpy version gave."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine.kernels import cpu_fast
from engine.quant import QTensor

G = cpu_fast.G
BYTES = {QT.Q4_0: 18, QT.Q4_1: 20, QT.Q8_0: 34}


def _f16_bits(raw, off):
    return np.ascontiguousarray(raw[..., off:off + 2]).view(np.uint16)[..., 0]


def numpy_repack(qt: QTensor):
    """The layout in plain numpy (the reference): (kind, qs, d, m), d and m the f16 bit patterns (ng, nb, G)."""
    rows, cols = qt.shape[0], qt.shape[-1]
    nb, ng = cols // 32, (rows + G - 1) // G
    raw = np.ascontiguousarray(qt.data).view(np.uint8).reshape(rows, -1)
    if rows % G:
        raw = np.concatenate([raw, np.zeros((ng * G - rows, raw.shape[1]), np.uint8)])
    raw = raw.reshape(ng, G, nb, -1)  # (ng, G, nb, B)
    d = np.ascontiguousarray(_f16_bits(raw, 0).transpose(0, 2, 1))  # (ng, nb, G)
    if qt.qtype == QT.Q8_0:
        pairs = raw[..., 2:].reshape(ng, G, nb, 16, 2).transpose(0, 2, 3, 1, 4)  # (ng, nb, 16, G, 2)
        return "q8", np.ascontiguousarray(pairs).view(np.int8).reshape(ng, nb, 16, 2 * G), d, None
    off = 4 if qt.qtype == QT.Q4_1 else 2
    if qt.qtype == QT.Q4_1:
        m = np.ascontiguousarray(_f16_bits(raw, 2).transpose(0, 2, 1))
    else:  # Q4_0: value = d (q - 8), i.e. a min of -8 d
        with np.errstate(over="ignore", invalid="ignore"):
            m = (d.view(np.float16) * np.float16(-8)).view(np.uint16)
    b = raw[..., off:off + 16]  # (ng, G, nb, 16) file bytes: value v in byte v % 16, high nibble for v >= 16
    vals = np.concatenate([b & 15, b >> 4], axis=-1)  # (ng, G, nb, 32) values 0..31 of every row
    # cpu_avx2's layout: vector 2k + h, byte 4r + e = value 4k + e of rows 16h + r (low) and 16h + 8 + r (high)
    v = vals.reshape(ng, 2, 2, 8, nb, 8, 4)  # (ng, h, low/high, r, nb, k, e)
    packed = v[:, :, 0] | (v[:, :, 1] << 4)  # (ng, h, r, nb, k, e)
    qs = np.ascontiguousarray(packed.transpose(0, 3, 4, 1, 2, 5)).reshape(ng, nb, 16, G)  # (ng, nb, k, h, r, e)
    return "q4", qs, d, m


def _same(a, b):
    """Bitwise equality, dtype and shape included."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


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
    for cols, special in ((64, False), (96, True)):  # special: random bytes, i.e. NaN/inf/subnormal scales
        qt = _random_tensor(rng, qtype, rows, cols, special and qtype != QT.Q4_0)
        w = cpu_fast.repack(qt)
        kind, qs, d, m = numpy_repack(qt)
        assert w.kind == kind and w.shape == (rows, cols)
        assert _same(w.qs, qs) and _same(w.d, d)
        assert (w.m is None) if m is None else _same(w.m, m)


def test_q4_0_scale_that_overflows_keeps_the_plain_layout():
    """Q4_0's min -8 d must fit f16; a block with |d| > 8188 keeps cpu.py's layout instead (never wrong)."""
    qt = _random_tensor(np.random.default_rng(3), QT.Q4_0, 32, 64)
    raw = np.asarray(qt.data).reshape(32, 2, 18)
    raw[5, 1, :2] = np.array([9000.0], np.float16).view(np.uint8)
    assert cpu_fast.repack(qt) is None
    assert not isinstance(cpu_fast.prepare_weight(qt), cpu_fast.FastWeight)


def test_repack_of_a_memory_mapped_weight(smollm2_path):
    """The real weights (views into the file map, read-only) of each type the default model has."""
    from engine.gguf import load_gguf
    mf = load_gguf(smollm2_path)
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight"):
        qt = mf.tensors[name]
        w = cpu_fast.repack(qt)
        kind, qs, d, m = numpy_repack(qt)
        assert w.kind == kind and _same(w.qs, qs) and _same(w.d, d) and (m is None or _same(w.m, m)), name


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1])
def test_stacked_repack_equals_one_by_one(qtype):
    """cpu_fast.prepare_stacked: each layer's slot holds what prepare_weight gives for that tensor alone, and
    the fused step's role stack is that very array (no copy of the weights at load)."""
    from engine.kernels.cpu_fast_step import _stacked
    rng = np.random.default_rng(int(qtype))
    ts = [_random_tensor(rng, qtype, 45, 64) for _ in range(3)]
    ws = cpu_fast.prepare_stacked(ts)
    for qt, w in zip(ts, ws):
        one = cpu_fast.prepare_weight(qt)
        assert w.kind == one.kind and w.shape == one.shape
        assert _same(w.qs, one.qs) and _same(w.d, one.d) and _same(w.m, one.m)
    stack = _stacked([w.blocks for w in ws])
    assert stack.shape == (3,) + ws[0].blocks.shape and stack is ws[0].blocks.base
    assert _stacked([w.blocks.copy() for w in ws]).base is None  # unrelated arrays: a stacked copy


def test_stacked_repack_declines_mixed_roles():
    rng = np.random.default_rng(5)
    assert cpu_fast.prepare_stacked([_random_tensor(rng, QT.Q4_1, 32, 64), _random_tensor(rng, QT.Q4_0, 32, 64)]) is None
    assert cpu_fast.prepare_stacked([_random_tensor(rng, QT.Q4_1, 32, 64), _random_tensor(rng, QT.Q4_1, 64, 64)]) is None
    assert cpu_fast.prepare_stacked([_random_tensor(rng, QT.Q8_0, 32, 64)]) is None
