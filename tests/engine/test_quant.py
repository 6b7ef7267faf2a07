"""engine.quant: the numpy reference dequantization of every supported type == gguf.quants (llama.cpp's
Python), block tables, and the byte-size validation."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants

from engine.errors import ModelFileError
from engine.quant import SUPPORTED, QTensor, dequantize, dequantize_rows, row_bytes, validate
from reference_forward import random_qtensor


@pytest.mark.parametrize("qtype", list(SUPPORTED), ids=lambda q: q.name)
def test_dequantize_matches_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    qt = random_qtensor(qtype, 6, 512, rng)
    raw = np.ascontiguousarray(qt.data)
    want = quants.dequantize(raw, qtype)
    got = dequantize(qt)
    assert got.dtype == np.float32 and got.shape == (6, 512)
    np.testing.assert_array_equal(got, want.reshape(6, 512).astype(np.float32))
    # the same tensor handed over as raw bytes (rows, bytes_per_row), as the loader maps it
    as_bytes = QTensor("w", qtype, (6, 512), raw.view(np.uint8).reshape(6, -1))
    np.testing.assert_array_equal(dequantize(as_bytes), got)
    # a row range without the rest
    np.testing.assert_array_equal(dequantize_rows(as_bytes, 2, 5), got[2:5])


def test_quantized_values_are_close_to_the_input():
    # independent of gguf's dequant: quantize known values and check the error bound of each type
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    for qtype, tol in [(QT.Q8_0, 0.02), (QT.Q4_0, 0.25), (QT.Q4_1, 0.25), (QT.BF16, 0.01)]:
        qt = QTensor("w", qtype, (4, 256), quants.quantize(x, qtype))
        err = np.abs(dequantize(qt) - x).max()
        assert err < tol * np.abs(x).max(), (qtype.name, err)


def test_k_quant_layout_by_hand():
    # Q4_K: one super-block with d=1, dmin=0; sub-block j has scale j+1 and nibble value 1 everywhere:
    # value i = (i // 32) + 1. Q6_K: d=1, scales[j] = j, all 6-bit quants 33 -> value i = (i // 16) * 1.
    blk = np.zeros(144, np.uint8)
    blk[0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    sc = np.arange(1, 9)
    blk[4:8] = sc[:4]
    blk[12:16] = (sc[4:] & 0x0F)  # high 2 bits of sc[4:] are 0 (values < 16)
    blk[16:] = 0x11
    got = dequantize(QTensor("k4", QT.Q4_K, (1, 256), blk.reshape(1, -1)))
    np.testing.assert_array_equal(got[0], np.repeat(np.arange(1, 9), 32).astype(np.float32))
    blk6 = np.zeros(210, np.uint8)
    blk6[0:128] = 0x11  # low nibbles 1
    blk6[128:192] = 0xAA  # high bits 2 for all four 2-bit fields -> q = 1 | 2 << 4 = 33
    blk6[192:208] = np.arange(16, dtype=np.int8).view(np.uint8)
    blk6[208:210] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    got6 = dequantize(QTensor("k6", QT.Q6_K, (1, 256), blk6.reshape(1, -1)))
    np.testing.assert_array_equal(got6[0], np.repeat(np.arange(16), 16).astype(np.float32))


def test_vectors():
    v = np.linspace(-1, 1, 64, dtype=np.float32)
    assert dequantize(QTensor("n", QT.F32, (64,), v)).shape == (64,)
    np.testing.assert_array_equal(dequantize(QTensor("n", QT.F16, (64,), v.astype(np.float16))),
                                  v.astype(np.float16).astype(np.float32))


def test_block_tables():
    assert row_bytes(QT.Q4_1, 576) == 18 * 20
    assert row_bytes(QT.Q8_0, 64) == 68
    assert row_bytes(QT.Q6_K, 512) == 420
    assert row_bytes(QT.F16, 10) == 20


def test_validation_names_the_tensor():
    qt = random_qtensor(QT.Q4_1, 4, 64)
    validate(qt)
    short = QTensor("blk.3.ffn_up.weight", QT.Q4_1, (4, 64), qt.data[:3])
    with pytest.raises(ModelFileError, match=r"blk\.3\.ffn_up\.weight.*truncated"):
        dequantize(short)
    with pytest.raises(ModelFileError, match=r"'odd'.*multiple of the Q8_0 block size 32"):
        validate(QTensor("odd", QT.Q8_0, (2, 40), np.zeros((2, 40), np.uint8)))
    with pytest.raises(ModelFileError, match=r"'q2'.*Q2_K, not supported"):
        validate(QTensor("q2", QT.Q2_K, (2, 256), np.zeros((2, 84), np.uint8)))
