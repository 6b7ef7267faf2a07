"""The K-quant / Q5 fast kernels (engine/backends/cpu/kquant.py, kquant_avx2.py) against the numpy reference
(engine.quant.dequantize), and bit for bit against themselves: AVX2 against the generic kernels, a row of a
T-row call against a one-row call (decode vs prefill chunk / verify), NINFER_CPU_GENERIC=1 against AVX2."""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from reference_forward import random_qtensor, reference_logits, tiny_model

from engine.backends.cpu import fast, kquant
from engine.quant import SUPPORTED, QTensor, dequantize

ROOT = Path(__file__).resolve().parents[2]
BYTE_TYPES = [QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K]
ALL = [QT.Q4_K, *BYTE_TYPES]
# relative error (of the largest output) against the exact dot product with the int8 activations: f32 roundings
# only, plus for Q5_1 / Q5_K the f16 block sums of the activations (xs, as Q4_1) and for Q4_K / Q5_K the f16
# scales and mins (kquant's docstring)
EXACT_TOL = {QT.Q5_0: 2e-6, QT.Q6_K: 2e-6, QT.Q5_1: 1e-3, QT.Q5_K: 2e-3, QT.Q4_K: 2e-3}


def _weight(qtype, rows, cols, seed, extreme=False):
    rng = np.random.default_rng(seed)
    qt = random_qtensor(qtype, rows, cols, rng)
    if extreme:  # every value the largest the type has (Q6_K, Q5_x: 63 / 31; the int16 sums' bound)
        raw = np.asarray(qt.data).reshape(rows, -1, SUPPORTED[qtype][1])
        if qtype == QT.Q6_K:
            raw[..., 0:192] = 0xFF
            raw[..., 192:208] = np.uint8(127)
        elif qtype == QT.Q5_K:
            raw[..., 16:176] = 0xFF
        else:
            raw[..., 2 if qtype == QT.Q5_0 else 4:] = 0xFF
    return qt, fast.prepare_weight(qt)


def _quantized(t_n, cols, seed, extreme=False):
    x = np.random.default_rng(seed).standard_normal((t_n, cols)).astype(np.float32)
    if extreme:  # every activation +-127 after quantization
        x = np.sign(x).astype(np.float32)
    nb = cols // 32
    qa, sa, xs = np.zeros((t_n, cols), np.int8), np.zeros((t_n, nb), np.float32), np.zeros((t_n, fast.XS * nb), np.float32)
    fast.quantize_rows(qa, sa, xs, x)
    return x, qa, sa, xs


def test_types_take_the_fast_layouts():
    """Q4_K becomes fast's 'q4k' layout (q4k.py, the fused step's stacks), the others kquant's."""
    for qtype in ALL:
        _, w = _weight(qtype, 64, 256, 1)
        want = (fast.FastWeight, "q4k") if qtype == QT.Q4_K else (kquant.KWeight, 5 if qtype != QT.Q6_K else 6)
        assert isinstance(w, want[0]) and w.shape == (64, 256), qtype
        assert (w.kind if qtype == QT.Q4_K else w.bits) == want[1]


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [45, 96])  # 45: a padded last row group
@pytest.mark.parametrize("t_n", [1, 3, 8])
def test_matmul_matches_reference(qtype, rows, t_n):
    cols = 512
    qt, w = _weight(qtype, rows, cols, rows + t_n)
    x, qa, sa, _ = _quantized(t_n, cols, t_n)
    out = np.full((t_n, rows), np.nan, np.float32)
    fast.matmul(out, x, w, fast.new_scratch(8, cols))
    wd = dequantize(qt).astype(np.float64)
    ref = x.astype(np.float64) @ wd.T
    np.testing.assert_allclose(out, ref, atol=0.02 * np.abs(ref).max())  # int8 activations: ~|x| / 254 a value
    exact = (qa.reshape(t_n, -1, 32) * sa[..., None].astype(np.float64)).reshape(t_n, cols) @ wd.T
    assert np.abs(out - exact).max() <= EXACT_TOL[qtype] * np.abs(exact).max()


@pytest.mark.parametrize("qtype", BYTE_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [45, 64])
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("t_n", [5, 20])  # the multi-row decode form (<= ROWS_MERGED), the unpacked one
def test_kernels_bitwise(qtype, rows, extreme, t_n):
    """AVX2 decode rows, AVX2 multi-row and batched forms and the generic kernel give the same bits; every row
    of a T-row matmul equals the one-row matmul of its activations (speculative verify / prefill chunk ==
    decode)."""
    cols = 256
    _, w = _weight(qtype, rows, cols, rows, extreme)
    x, qa, sa, xs = _quantized(t_n, cols, rows, extreme)
    batched = np.full((t_n, rows), np.nan, np.float32)
    kquant.mm(batched, qa, sa, xs, w.blocks, w.bits)
    generic = np.full((t_n, rows), np.nan, np.float32)
    tmp = np.empty(kquant.G, np.float32)
    for g in range(w.blocks.shape[0]):
        n = min(kquant.G, rows - g * kquant.G)
        for t in range(t_n):
            kquant.rows_generic(tmp, qa, sa, xs, w.blocks, g, t, w.bits)
            generic[t, g * kquant.G:g * kquant.G + n] = tmp[:n]
    assert np.isfinite(generic).all() and np.abs(generic).max() > 0
    np.testing.assert_array_equal(batched, generic)
    one = np.full((1, rows), np.nan, np.float32)
    for t in range(t_n):  # through the public matmul: activations quantized per row as a decode step does
        fast.matmul(one, x[t:t + 1], w, fast.new_scratch(1, cols))
        np.testing.assert_array_equal(one[0], batched[t])


@pytest.mark.parametrize("extreme", [False, True])
def test_q5_0_blocks_without_m_give_the_bits_of_blocks_with_it(extreme):
    """Q5_0's blocks end before m (BLK5Z: its m is -16 d): every form (decode, multi-row, unpacked, generic,
    embedding) gives the bits of the same blocks with m = f16(-16 d) stored (kquant.with_m: the layout Q5_0 had
    before), and a stack that holds Q5_0 beside Q5_1 takes them with m."""
    from engine.backends.cpu import kquant_avx2 as kx
    from engine.backends.cpu import step_weights
    rows, cols = 45, 256
    _, w = _weight(QT.Q5_0, rows, cols, 7, extreme)
    assert w.blocks.shape[-1] == kquant.BLK5Z
    old = kquant.with_m(w.blocks)
    assert old.shape[-1] == kquant.BLK5 and np.array_equal(old[..., :kquant.BLK5Z], w.blocks)
    for t_n in (1, 3, 5, 20):
        x, qa, sa, xs = _quantized(t_n, cols, t_n, extreme)
        got = [np.full((t_n, rows), np.nan, np.float32) for _ in range(4)]
        kquant.mm(got[0], qa, sa, xs, w.blocks, 5)
        kquant.mm(got[1], qa, sa, xs, old, 5)
        tmp = np.empty(kquant.G, np.float32)
        for i, blk in ((2, w.blocks), (3, old)):
            for g in range(blk.shape[0]):
                n = min(kquant.G, rows - g * kquant.G)
                for t in range(t_n):
                    kquant.rows_generic(tmp, qa, sa, xs, blk, g, t, 5)
                    got[i][t, g * kquant.G:g * kquant.G + n] = tmp[:n]
        assert np.isfinite(got[0]).all()
        for o in got[1:]:
            np.testing.assert_array_equal(got[0], o)
    if kquant.HAVE_AVX2:  # the unpacked block (the batched form where T passes ROWS_MERGED): the same bytes
        from numba import njit
        unpack = njit(lambda buf, blk, off, b: kx.unpack5(buf, blk, off, b))
        bufs = [np.zeros(kx.UNBUF, np.uint8) for _ in range(2)]
        for g in range(w.blocks.shape[0]):
            for b in range(w.blocks.shape[1]):
                unpack(bufs[0], w.blocks, g * w.blocks.strides[0], b)
                unpack(bufs[1], old, g * old.strides[0], b)
                np.testing.assert_array_equal(bufs[0], bufs[1])
    tokens = np.arange(rows, dtype=np.int32)
    emb = [np.zeros((rows, cols), np.float32) for _ in range(2)]
    kquant.embed_rows(emb[0], w.blocks, tokens, 5)
    kquant.embed_rows(emb[1], old, tokens, 5)
    np.testing.assert_array_equal(emb[0], emb[1])
    _, w1 = _weight(QT.Q5_1, rows, cols, 8)
    st = step_weights._stack([w, w1], step_weights.Q5, old.shape[0], 1)
    assert st.shape[-1] == kquant.BLK5 and np.array_equal(w.blocks, old) and w.blocks.base is not None


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_embed_matches_reference(qtype):
    qt, w = _weight(qtype, 70, 512, 3)
    tokens = np.arange(70, dtype=np.int32)  # every row: each row position of the layout
    got = np.zeros((70, 512), np.float32)
    fast.embed(got, w, tokens)
    want = dequantize(qt)
    if qtype in (QT.Q4_K, QT.Q5_K):  # the f16 scales and mins: ~2^-11 of a sub-block's scale times 31
        np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max())
    else:
        np.testing.assert_array_equal(got, want)


def test_q4k_as_q41_is_the_same_values():
    """The Q4_1 blocks of a Q4_K tensor: each sub-block's nibbles as they are, its scale d sc_j and min
    -dmin mn_j rounded to f16 once; a scale beyond f16 is refused (kernels.py's layout then)."""
    from engine.quant import _q4k_scales
    rng = np.random.default_rng(4)
    qt = random_qtensor(QT.Q4_K, 8, 512, rng)
    raw = np.asarray(qt.data).reshape(8, -1)
    blk = raw.reshape(8, 2, 144)
    d, dmin = (blk[..., o:o + 2].copy().view(np.float16)[..., 0].astype(np.float32) for o in (0, 2))
    sc, mn = (a.reshape(8, 2, 8) for a in _q4k_scales(blk[..., 4:16].reshape(-1, 12)))
    qs = blk[..., 16:].reshape(8, 2, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3).reshape(8, 16, 32)  # sub-block 2c: low nibbles of chunk c
    b41 = kquant.q4k_as_q41(raw).reshape(8, 16, 20)
    np.testing.assert_array_equal(np.concatenate([b41[..., 4:] & 15, b41[..., 4:] >> 4], axis=-1), q)
    np.testing.assert_array_equal(b41[..., 0:2].copy().view(np.float16)[..., 0],
                                  (d[..., None] * sc).astype(np.float16).reshape(8, 16))
    np.testing.assert_array_equal(b41[..., 2:4].copy().view(np.float16)[..., 0],
                                  (-(dmin[..., None] * mn)).astype(np.float16).reshape(8, 16))
    raw[0, 0:2] = np.frombuffer(np.float16(60000.0).tobytes(), np.uint8)
    raw[0, 4] = 63  # scale 63 x d = 60000: beyond f16
    assert kquant.q4k_as_q41(raw) is None
    assert not isinstance(fast.prepare_weight(QTensor("w", QT.Q4_K, (8, 512), raw)), fast.FastWeight)


@pytest.mark.parametrize("threads", [1, 2])
def test_q4k_layers_repack_into_parts(threads):
    """fast.prepare_layers takes a role of Q4_K layers: each layer's parts hold what prepare_weight gives."""
    rng = np.random.default_rng(threads)
    roles = {"a": [random_qtensor(QT.Q4_K, 128, 256, rng, name=f"blk.{i}.a") for i in range(2)]}
    ws = fast.prepare_layers(roles, threads=threads)
    for qt in roles["a"]:
        w, one = ws[qt.name], fast.prepare_weight(qt)
        assert w.kind == one.kind == "q4k" and w.blocks.shape[0] == threads
        assert np.array_equal(w.blocks.reshape(one.blocks.shape), one.blocks)


def _kquant_model():
    """A tiny llama whose matrices are Q4_K, Q5_0, Q5_1, Q5_K, Q6_K (a Q4_K_M-like mix), the table Q6_K."""
    from reference_forward import _qtensor
    a, t = tiny_model("llama", qtype=QT.Q4_K, embd_qtype=QT.Q6_K, d=256, n_head=4, n_kv_head=2, head_dim=64,
                      d_ff=512, n_layer=2, vocab=96)
    rng = np.random.default_rng(8)
    mix = {"attn_q": QT.Q5_0, "attn_k": QT.Q5_1, "attn_v": QT.Q6_K, "attn_output": QT.Q4_K, "ffn_gate": QT.Q4_K,
           "ffn_up": QT.Q6_K, "ffn_down": QT.Q5_K}
    for i in range(a.n_layer):
        for role, qtype in mix.items():  # weights of ~0.05 (random K-quant bytes: d ~1e-4), as real models have
            name = f"blk.{i}.{role}.weight"
            t[name] = _qtensor(name, qtype, *t[name].shape, rng, 0.05 if qtype in (QT.Q5_0, QT.Q5_1) else 0.01)
    t["token_embd.weight"] = _qtensor("token_embd.weight", QT.Q6_K, a.vocab_size, a.d_model, rng, 0.02)
    return a, t


def test_kquant_model_matches_reference_and_decode_equals_chunks():
    """A model of these types on the cpu backend: every matrix on the fast kernels, logits close to the
    independent numpy forward, and a token's logits the same whether decoded alone or inside a chunk."""
    from engine.backends.kernels import get_kernels
    from engine.model import Model
    a, t = _kquant_model()
    model = Model(a, t, get_kernels("cpu"), max_batch=8)
    assert all(isinstance(getattr(lw, r), (fast.FastWeight, kquant.KWeight))
               for lw in model.layers for r in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    assert isinstance(model.tok_embd, kquant.KWeight)
    tokens = np.array([5, 17, 3, 90, 41, 41, 0, 77, 12], np.int32)
    want = reference_logits(a, t, tokens)
    chunk = model.forward(tokens, 0, model.new_cache(16), all_logits=True)
    assert np.abs(chunk - want).max() <= 5e-2 * np.abs(want).max()  # int8 activations (measured 1.3e-2)
    cache = model.new_cache(16)
    rows = np.array([model.forward(tokens[i:i + 1], i, cache)[0] for i in range(len(tokens))])
    assert np.abs(rows - chunk).max() <= 5e-4 * np.abs(chunk).max()  # as test_model's chunked-prefill check


GENERIC = """
import json, sys
import numpy as np
sys.path.insert(0, "tests/engine")
from engine.backends.cpu import fast, kquant
from test_kquant import ALL, _weight
res = {"avx2": kquant.HAVE_AVX2, "out": []}
for qtype in ALL:
    for t_n in (1, 3):
        qt, w = _weight(qtype, 45, 256, 7)
        x = np.random.default_rng(t_n).standard_normal((t_n, 256)).astype(np.float32)
        out = np.full((t_n, 45), np.nan, np.float32)
        fast.matmul(out, x, w, fast.new_scratch(4, 256))
        res["out"].append(out.tolist())
print(json.dumps(res))
"""


def _generic_job():
    """GENERIC with NINFER_CPU_GENERIC=1 and a cold numba cache, started with the session (tests/background.py;
    imported here: tests/ is not on the path of the GENERIC subprocess, which imports this module)."""
    import background
    return background.python_job("generic:kquant", GENERIC, {"NUMBA_NUM_THREADS": "2", "NINFER_CPU_GENERIC": "1"},
                                 timeout=900, cold_numba=True)


BACKGROUND = [_generic_job]


def test_generic_fallback_equals_avx2(tmp_path):
    """NINFER_CPU_GENERIC=1 (a host without AVX2) gives the AVX2 path's matmul results bit for bit."""
    if not kquant.HAVE_AVX2:
        pytest.skip("host without AVX2: the generic kernels are the only ones")
    import background
    generic = background.result_json(_generic_job(), "the generic kernels' run")
    assert generic["avx2"] is False
    i = 0
    for qtype in ALL:
        for t_n in (1, 3):
            _, w = _weight(qtype, 45, 256, 7)
            x = np.random.default_rng(t_n).standard_normal((t_n, 256)).astype(np.float32)
            out = np.full((t_n, 45), np.nan, np.float32)
            fast.matmul(out, x, w, fast.new_scratch(4, 256))
            np.testing.assert_array_equal(out, np.array(generic["out"][i], np.float32), err_msg=qtype.name)
            i += 1
