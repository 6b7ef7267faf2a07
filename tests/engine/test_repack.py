"""engine.backends.cpu.repack: the jitted repack gives exactly the arrays the numpy version gave."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine.backends.cpu import fast as cpu_fast
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


def _random_tensor(rng, qtype, rows, cols, special_halves=False, name="w"):
    raw = rng.integers(0, 256, (rows, cols // 32 * BYTES[qtype]), dtype=np.uint8)
    if not special_halves:  # realistic scales: finite halves in the block headers
        blocks = raw.reshape(rows, cols // 32, BYTES[qtype])
        halves = 2 if qtype == QT.Q4_1 else 1
        blocks[..., :2 * halves] = rng.normal(0, 0.05, (rows, cols // 32, halves)).astype(np.float16).view(np.uint8)
    return QTensor(name=name, qtype=qtype, shape=(rows, cols), data=raw)


def _layers(rng, role, qtypes, shapes):
    """A role's tensors, one per layer (names blk.i.role)."""
    return [_random_tensor(rng, qt, r, c, name=f"blk.{i}.{role}") for i, (qt, (r, c)) in enumerate(zip(qtypes, shapes))]


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
@pytest.mark.parametrize("threads", [1, 2])
def test_layer_repack_equals_one_by_one(qtype, threads):
    """cpu_fast.prepare_layers: each layer's parts hold what prepare_weight gives for that tensor alone, the
    fused step's role stacks are those very views (no copy of the weights at load), and with two parts
    each thread's parts lie one after another in memory, layer by layer and role by role."""
    from engine.backends.cpu.step import _role_stacks
    rng = np.random.default_rng(int(qtype) + threads)
    roles = {"a": _layers(rng, "a", [qtype] * 3, [(64, 64)] * 3), "b": _layers(rng, "b", [qtype] * 3, [(128, 96)] * 3)}
    ws = cpu_fast.prepare_layers(roles, threads=threads)
    for ts in roles.values():
        for qt in ts:
            w, one = ws[qt.name], cpu_fast.prepare_weight(qt)
            assert w.kind == one.kind and w.shape == one.shape and w.blocks.shape[0] == threads
            assert np.array_equal(w.blocks.reshape(one.blocks.shape), one.blocks)
    a0, b0 = ws[roles["a"][0].name], ws[roles["b"][0].name]
    # layer 0: part 0 of a, then part 0 of b; layer 1's part 0 next; part 1 after all parts 0
    assert b0.blocks[0].ctypes.data == a0.blocks[0].ctypes.data + a0.blocks[0].nbytes
    assert ws[roles["a"][1].name].blocks[0].ctypes.data == b0.blocks[0].ctypes.data + b0.blocks[0].nbytes
    if threads == 2:
        last = ws[roles["b"][2].name].blocks[0]
        assert a0.blocks[1].ctypes.data == last.ctypes.data + last.nbytes

    class L:  # a layer of the fused step's roles, all of them role "a" or "b"
        def __init__(self, i):
            for r in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
                setattr(self, r, ws[roles["a" if r != "w_down" else "b"][i].name])
    stacks = _role_stacks([L(i) for i in range(3)])
    assert stacks["wq"] is a0.stack and stacks["w_down"] is b0.stack and a0.stack.shape[:2] == (3, threads)


def test_role_stacks_of_weights_prepared_one_by_one():
    """Layer weights without prepare_layers' buffer (prepared one by one): the fused step stacks copies of
    one part each, and the weights then view them."""
    from engine.backends.cpu.step import _ROLES, _role_stacks
    rng = np.random.default_rng(11)
    ts = _layers(rng, "a", [QT.Q4_1] * 2, [(64, 64)] * 2)
    ws = [cpu_fast.prepare_weight(t) for t in ts]
    want = [w.blocks.copy() for w in ws]

    class L:
        def __init__(self, i):
            for r in _ROLES:
                setattr(self, r, ws[i])
    stacks = _role_stacks([L(0), L(1)])
    assert stacks["wq"].shape == (2, 1) + want[0].shape
    for i, w in enumerate(ws):
        assert np.array_equal(stacks["wq"][i, 0], want[i]) and w.blocks.shape == (1,) + want[i].shape


def test_layer_repack_parts_fall_back_to_one():
    """Groups that do not divide among the threads: one part (the role's matrices still in one buffer)."""
    rng = np.random.default_rng(9)
    ws = cpu_fast.prepare_layers({"a": _layers(rng, "a", [QT.Q4_1] * 2, [(96, 64)] * 2)}, threads=2)
    assert all(w.blocks.shape[:2] == (1, 3) for w in ws.values())


def test_layer_repack_declines_mixed_roles():
    """A role whose layers differ in type or shape, or is not 4-bit, is left out (prepared one by one)."""
    rng = np.random.default_rng(5)
    ok = _layers(rng, "ok", [QT.Q4_1] * 2, [(32, 64)] * 2)
    ws = cpu_fast.prepare_layers({
        "ok": ok,
        "types": _layers(rng, "types", [QT.Q4_1, QT.Q4_0], [(32, 64)] * 2),
        "shapes": _layers(rng, "shapes", [QT.Q4_1] * 2, [(32, 64), (64, 64)]),
        "q8": _layers(rng, "q8", [QT.Q8_0] * 2, [(32, 64)] * 2)}, threads=2)
    assert set(ws) == {t.name for t in ok}
