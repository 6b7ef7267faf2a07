"""engine.gguf: loading the tiny models of every architecture, and one clear error per kind of bad file."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from engine.errors import ModelFileError
from engine.gguf import expected_shapes, load_gguf


def _one_line_error(path) -> str:
    with pytest.raises(ModelFileError) as ei:
        load_gguf(path)
    msg = str(ei.value)
    assert "\n" not in msg and msg
    return msg


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_model_loads(tiny_models, arch):
    m = load_gguf(tiny_models[arch])
    a = m.args
    assert (a.arch, a.n_layer, a.d_model, a.n_head, a.n_kv_head, a.head_dim, a.d_ff) == (arch, 2, 64, 4, 2, 16, 256)
    assert a.qkv_bias == (arch == "qwen2") and a.qk_norm == (arch == "qwen3")
    assert a.rope_neox == (arch != "llama") and a.tied_embeddings == (arch != "qwen2")
    assert a.vocab_size == len(m.field("tokenizer.ggml.tokens"))
    assert set(m.tensors) == set(expected_shapes(a))
    assert sum(m.quant_summary.values()) == len(m.tensors)
    assert m.metadata["general.architecture"] == arch and m.file_size == tiny_models[arch].stat().st_size
    for name, t in m.tensors.items():
        assert t.shape == expected_shapes(a)[name]
        if len(t.shape) == 2:
            block, nbytes = GGML_QUANT_SIZES[t.qtype]
            assert t.data.dtype == np.uint8 and t.data.shape == (t.shape[0], t.shape[1] // block * nbytes)
            # a view of the memory map, not a copy
            assert np.shares_memory(t.data, m.reader.data) and not t.data.flags.writeable
        else:
            assert t.data.dtype in (np.float32, np.float16) and t.data.shape == t.shape


def test_tiny_models_cover_all_quant_types(tiny_models):
    seen = set()
    for p in tiny_models.values():
        seen |= set(load_gguf(p).quant_summary)
    assert seen >= {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}


def test_writer_is_deterministic(tiny_models, make_tiny, tmp_path):
    again = make_tiny(tmp_path / "again.gguf", "qwen3", seed=0)
    assert again.read_bytes() == tiny_models["qwen3"].read_bytes()
    other = make_tiny(tmp_path / "other.gguf", "qwen3", seed=1)
    assert other.read_bytes() != again.read_bytes()


def test_missing_file_and_directory(tmp_path):
    assert "does not exist" in _one_line_error(tmp_path / "nope.gguf")
    assert "directory" in _one_line_error(tmp_path)


def test_wrong_magic_and_version(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"GGML" + b"\0" * 64)
    msg = _one_line_error(p)
    assert "not a GGUF file" in msg and str(p) in msg
    p.write_bytes(b"GGUF" + struct.pack("<I", 1) + b"\0" * 64)
    assert "version 1" in _one_line_error(p)
    p.write_bytes(b"")
    assert "not a GGUF file" in _one_line_error(p)


@pytest.mark.parametrize("keep", [6, 40, 0.5, -16])
def test_truncated_file(tiny_models, tmp_path, keep):
    raw = tiny_models["llama"].read_bytes()
    n = int(len(raw) * keep) if isinstance(keep, float) else (keep if keep > 0 else len(raw) + keep)
    p = tmp_path / "cut.gguf"
    p.write_bytes(raw[:n])
    msg = _one_line_error(p)
    assert "truncated" in msg and str(p) in msg


def test_corrupt_header(tiny_models, tmp_path):
    raw = bytearray(tiny_models["llama"].read_bytes())
    raw[16:24] = struct.pack("<Q", 2**40)  # kv_count absurdly large
    p = tmp_path / "corrupt.gguf"
    p.write_bytes(bytes(raw))
    assert "corrupt" in _one_line_error(p)


def test_unsupported_architecture(make_tiny, tmp_path):
    p = make_tiny(tmp_path / "phi.gguf", "llama", arch_name="phi3")
    msg = _one_line_error(p)
    assert "'phi3'" in msg and "llama, qwen2, qwen3" in msg


def test_unsupported_quant_type(make_tiny, tmp_path):
    p = make_tiny(tmp_path / "mxfp4.gguf", "llama", qtypes={"attn_q": QT.MXFP4})
    msg = _one_line_error(p)
    assert "MXFP4" in msg and "supported" in msg


def test_all_missing_and_unknown_tensors_in_one_error(make_tiny, tmp_path):
    p = make_tiny(tmp_path / "holes.gguf", "qwen2",
                  drop=("blk.1.ffn_up.weight", "blk.0.attn_k.bias", "output_norm.weight"),
                  extra={"blk.0.mystery.weight": np.zeros(64), "rope_freqs.weight": np.ones(8)})
    msg = _one_line_error(p)
    for name in ("blk.1.ffn_up.weight", "blk.0.attn_k.bias", "output_norm.weight",
                 "blk.0.mystery.weight", "rope_freqs.weight"):
        assert name in msg
    assert "3 missing" in msg and "2 unknown" in msg and str(p) in msg


def test_qwen3_without_qk_norm_is_reported(make_tiny, tmp_path):
    p = make_tiny(tmp_path / "q3.gguf", "qwen3", drop=("blk.0.attn_q_norm.weight", "blk.1.attn_k_norm.weight"))
    msg = _one_line_error(p)
    assert "blk.0.attn_q_norm.weight" in msg and "blk.1.attn_k_norm.weight" in msg


def test_smollm2_loads(smollm2_path):
    m = load_gguf(smollm2_path)
    a = m.args
    assert (a.arch, a.n_layer, a.d_model, a.n_head, a.n_kv_head, a.head_dim, a.d_ff, a.vocab_size) == \
        ("llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert a.rope_base == 100000.0 and a.context_length == 8192 and a.tied_embeddings
    assert m.quant_summary == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    assert m.tensors["token_embd.weight"].data.shape == (49152, 576 // 32 * 34)


def _tensor_info_at(raw: bytes, name: str) -> tuple[int, int]:
    """(offset of the type field, n_dims) of a tensor's info record in a GGUF file's bytes."""
    key = name.encode()
    i = raw.find(struct.pack("<Q", len(key)) + key)
    assert i > 0
    at = i + 8 + len(key)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    return at + 4 + 8 * n_dims, n_dims


def _patched(src, dst, patch) -> object:
    raw = bytearray(src.read_bytes())
    patch(raw)
    dst.write_bytes(bytes(raw))
    return dst


@pytest.mark.parametrize("key,value", [("llama.attention.layer_norm_rms_epsilon", float("nan")),
                                       ("llama.attention.layer_norm_rms_epsilon", -1.0),
                                       ("llama.rope.freq_base", float("inf"))])
def test_metadata_the_forward_divides_by_must_be_finite_and_positive(tiny_models, tmp_path, key, value):
    """NaN there made every activation NaN, and the threaded decode step then waited forever."""
    def patch(raw):
        i = raw.find(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key)
        assert struct.unpack_from("<I", raw, i)[0] == 6  # FLOAT32
        struct.pack_into("<f", raw, i + 4, value)
    msg = _one_line_error(_patched(tiny_models["llama"], tmp_path / "m.gguf", patch))
    assert repr(key) in msg and "finite number > 0" in msg


def test_a_norm_holding_nan_is_reported(tiny_models, tmp_path):
    mf = load_gguf(tiny_models["llama"])
    t = next(t for t in mf.reader.tensors if t.name == "blk.0.attn_norm.weight")

    def patch(raw):
        struct.pack_into("<f", raw, t.data_offset + 4, float("nan"))
    msg = _one_line_error(_patched(tiny_models["llama"], tmp_path / "m.gguf", patch))
    assert "blk.0.attn_norm.weight" in msg and "NaN" in msg


def test_a_misaligned_or_overlapping_tensor_is_reported(tiny_models, tmp_path):
    """A damaged offset (off the alignment) or type field (its data now runs into the next tensor's) read
    other bytes as weights: a ZeroDivisionError traceback, or a hang, before."""
    raw0 = tiny_models["llama"].read_bytes()
    at, _ = _tensor_info_at(raw0, "blk.0.ffn_norm.weight")

    def shift(raw):
        struct.pack_into("<Q", raw, at + 4, struct.unpack_from("<Q", raw, at + 4)[0] + 3)
    assert "alignment" in _one_line_error(_patched(tiny_models["llama"], tmp_path / "a.gguf", shift))

    mf = load_gguf(tiny_models["llama"])
    big = next(t for t in mf.reader.tensors if t.tensor_type == QT.Q4_1 and t.name.startswith("blk.0."))
    at2, _ = _tensor_info_at(raw0, big.name)

    def retype(raw):  # Q4_1 -> Q8_0: same block, 34 bytes instead of 20: runs into the next tensor
        struct.pack_into("<I", raw, at2, int(QT.Q8_0))
    msg = _one_line_error(_patched(tiny_models["llama"], tmp_path / "t.gguf", retype))
    assert "overlaps" in msg or "past the end" in msg


def test_a_special_token_id_outside_the_vocabulary_is_reported(tiny_models, tmp_path):
    """An eos id past the vocabulary never matched: replies ran to max_new with no word of why."""
    from engine.tokenizer import Tokenizer
    key = "tokenizer.ggml.eos_token_id"

    def patch(raw):
        i = raw.find(struct.pack("<Q", len(key)) + key.encode()) + 8 + len(key)
        assert struct.unpack_from("<I", raw, i)[0] == 4  # UINT32
        struct.pack_into("<I", raw, i + 4, 99999999)
    p = _patched(tiny_models["llama"], tmp_path / "m.gguf", patch)
    with pytest.raises(ModelFileError, match="eos_token_id = 99999999 is not a token id"):
        Tokenizer.from_gguf(load_gguf(p))
