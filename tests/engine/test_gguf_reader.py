"""engine.gguf_reader: the lean parser reads exactly what llama.cpp's gguf.GGUFReader reads."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from engine.gguf_reader import GGUFFile, GGUFFormatError


def _reader_value(f):
    """A field's value the way engine.gguf decoded GGUFReader fields before the lean parser."""
    if not f.types:
        return None
    main = f.types[0]
    if main == GGUFValueType.ARRAY:
        sub = f.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        if sub == GGUFValueType.ARRAY:
            return None
        return [v.item() for i in f.data for v in f.parts[i]]
    if main == GGUFValueType.STRING:
        return bytes(f.parts[-1]).decode("utf-8", errors="replace")
    return f.parts[-1][0].item()


def _assert_same(path):
    old, new = GGUFReader(path, "r"), GGUFFile(path)
    assert list(new.fields) == list(old.fields)
    for key, f in old.fields.items():
        got = new.value(key)
        if f.types[:2] == [GGUFValueType.ARRAY, GGUFValueType.ARRAY]:
            assert got is None, key  # nested arrays (GGUFReader flattens them): nothing uses them, not decoded
            continue
        want = _reader_value(f)
        assert type(got) is type(want) and got == want, key
        if isinstance(want, list) and want:
            assert all(type(a) is type(b) for a, b in zip(got, want)), key
    assert new.data_offset == old.data_offset and new.alignment == old.alignment
    assert [t.name for t in new.tensors] == [t.name for t in old.tensors]
    for a, b in zip(new.tensors, old.tensors):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(b.shape.tolist()), a.name
        assert (a.n_elements, a.n_bytes, a.data_offset) == (b.n_elements, b.n_bytes, b.data_offset), a.name
        data = new.tensor_data(a)
        assert data.dtype == b.data.dtype and data.shape == b.data.shape, a.name
        assert data.tobytes() == b.data.tobytes(), a.name
        assert np.shares_memory(data, new.data) and not data.flags.writeable


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_same_as_gguf_reader_on_tiny_models(tiny_models, arch):
    _assert_same(tiny_models[arch])


def test_same_as_gguf_reader_on_default_model(smollm2_path):
    _assert_same(smollm2_path)


def test_every_value_type(tmp_path):
    """Scalars of every type, strings with invalid UTF-8, empty and nested arrays, a custom alignment."""
    p = tmp_path / "kinds.gguf"
    w = GGUFWriter(str(p), "llama")
    w.add_uint8("k.u8", 200)
    w.add_int8("k.i8", -5)
    w.add_uint16("k.u16", 60000)
    w.add_int16("k.i16", -30000)
    w.add_uint32("k.u32", 4_000_000_000)
    w.add_int32("k.i32", -2_000_000_000)
    w.add_float32("k.f32", 0.1)
    w.add_float64("k.f64", 0.1)
    w.add_bool("k.bool", True)
    w.add_uint64("k.u64", 2**63 + 5)
    w.add_int64("k.i64", -(2**62))
    w.add_string("k.str", "héllo")
    w.add_array("k.strs", ["a", "", "日本", "x" * 300])
    w.add_array("k.ints", [1, -2, 3])
    w.add_array("k.floats", [0.5, 0.1])
    w.add_array("k.bools", [True, False])
    w.add_array("k.empty", [])
    w.add_array("k.nested", [[1, 2], [3]])
    w.add_array("k.nested_strs", [["a", "bc"], ["d"]])
    w.add_uint32("general.alignment", 64)
    w.add_tensor("t.f32", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("t.f16", np.ones(5, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _assert_same(p)
    f = GGUFFile(p)
    assert f.value("k.u64") == 2**63 + 5 and f.value("k.strs") == ["a", "", "日本", "x" * 300]
    assert f.value("k.empty", "absent") == "absent" and f.value("k.nested", "absent") == "absent"
    assert f.value("nope", 7) == 7 and f.alignment == 64
    assert bytes(f.raw("k.ints")) == np.array([1, -2, 3], "<i4").tobytes() and f.raw("k.u8") is None


def test_invalid_utf8_is_replaced(tmp_path, tiny_models):
    """A broken token string decodes with U+FFFD, like before, instead of failing the load."""
    raw = bytearray(tiny_models["llama"].read_bytes())
    f = GGUFFile(tiny_models["llama"])
    tok = f.fields["tokenizer.ggml.tokens"]
    raw[tok.start + 8] = 0xFF  # first byte of the first token
    p = tmp_path / "bad-utf8.gguf"
    p.write_bytes(bytes(raw))
    assert GGUFFile(p).value("tokenizer.ggml.tokens")[0].startswith("\ufffd")
    _assert_same(p)


@pytest.mark.parametrize("where", ["string_length", "array_count", "value_type"])
def test_damage_raises_format_error(tmp_path, tiny_models, where):
    raw = bytearray(tiny_models["llama"].read_bytes())
    tok = GGUFFile(tiny_models["llama"]).fields["tokenizer.ggml.tokens"]
    if where == "string_length":
        raw[tok.start:tok.start + 8] = (2**40).to_bytes(8, "little")
    elif where == "array_count":
        raw[tok.start - 8:tok.start] = (2**40).to_bytes(8, "little")
    else:
        raw[tok.start - 16:tok.start - 12] = (99).to_bytes(4, "little")  # the field's own type
    p = tmp_path / "damaged.gguf"
    p.write_bytes(bytes(raw))
    with pytest.raises(GGUFFormatError):
        GGUFFile(p)


def test_lazy_strings_read_like_the_decoded_list(tiny_models, request):
    paths = list(tiny_models.values())
    try:
        paths.append(request.getfixturevalue("smollm2_path"))
    except pytest.skip.Exception:
        pass
    for path in paths:
        f = GGUFFile(path)
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            lazy, full = f.lazy_strings(key), f.value(key)
            assert len(lazy) == len(full) and list(lazy) == full
            assert [lazy[i] for i in range(len(full))] == full
            assert [lazy[-i] for i in range(1, len(full) + 1)] == full[::-1]
            with pytest.raises(IndexError):
                lazy[len(full)]
        assert f.lazy_strings("tokenizer.ggml.token_type") is None and f.lazy_strings("nope") is None


def test_unknown_tensor_type_is_one_clear_error(tmp_path, tiny_models):
    from engine.errors import ModelFileError
    from engine.gguf import load_gguf
    raw = bytearray(tiny_models["llama"].read_bytes())
    f = GGUFFile(tiny_models["llama"])
    name = f.tensors[0].name.encode()
    at = raw.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)  # -> n_dims, dims, type, offset
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    raw[at + 4 + 8 * n_dims:at + 8 + 8 * n_dims] = (999).to_bytes(4, "little")
    p = tmp_path / "unknown-type.gguf"
    p.write_bytes(bytes(raw))
    with pytest.raises(ModelFileError, match="unknown tensor type") as ei:
        load_gguf(p)
    assert "\n" not in str(ei.value) and str(p) in str(ei.value)
