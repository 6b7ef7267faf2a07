"""engine/weight_store.py: a model's repacked weights stored on disk and read back by the next start."""
from __future__ import annotations

import os

import numpy as np
import pytest

from engine.backends.cpu import weight_store
from engine.backends.cpu.weight_store import WeightStore


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache" / weight_store.SUBDIR
    monkeypatch.setattr(weight_store, "cache_dir", lambda: d)
    monkeypatch.setattr(weight_store, "MIN_BYTES", 0)
    return d


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 255, (3, 5, 16, 32), dtype=np.uint8), rng.integers(0, 65535, (3, 5, 32), dtype=np.uint16),
            rng.integers(-128, 127, (7, 33), dtype=np.int8))


def _model_file(tmp_path, name="m.gguf", data=b"model bytes"):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_arrays_come_back_as_stored(store_dir, tmp_path):
    model = _model_file(tmp_path)
    s = WeightStore(model)
    assert s.get("a") is None and not s.hits
    s.put("a", _arrays()[:2])
    s.put("b", _arrays(1)[2:])
    s.save()
    (f,) = store_dir.glob("*.bin")
    again = WeightStore(model).preload()
    assert again.hits
    got = again.get("a") + again.get("b")
    for a, b in zip(got, _arrays()[:2] + _arrays(1)[2:]):
        assert a.dtype == b.dtype and a.shape == b.shape and a.flags.writeable
        np.testing.assert_array_equal(a, b)
    assert again.get("a") is None  # handed out once
    again.save()  # nothing new: the file stays as it is
    assert list(store_dir.glob("*.bin")) == [f]


def test_a_rewrite_keeps_what_was_read(store_dir, tmp_path):
    """An array put beside ones read from the file (one that was missing) rewrites the file with all of
    them: the next start reads everything, not only the newcomer."""
    model = _model_file(tmp_path)
    s = WeightStore(model)
    s.put("a", _arrays()[:1])
    s.save()
    s2 = WeightStore(model)
    assert s2.get("a") is not None and s2.get("b") is None
    s2.put("b", _arrays(1)[1:2])
    s2.save()
    s3 = WeightStore(model)
    np.testing.assert_array_equal(s3.get("a")[0], _arrays()[0])
    np.testing.assert_array_equal(s3.get("b")[0], _arrays(1)[1])


def test_a_changed_model_file_is_not_served_old_arrays(store_dir, tmp_path):
    model = _model_file(tmp_path)
    s = WeightStore(model)
    s.put("a", _arrays()[:1])
    s.save()
    old = set(store_dir.glob("*.bin"))
    model.write_bytes(b"another model, same path")
    s2 = WeightStore(model)
    assert s2.get("a") is None
    s2.put("a", _arrays(1)[:1])
    s2.save()
    new = set(store_dir.glob("*.bin"))
    assert len(new) == 1 and new != old  # the path's older file is dropped
    np.testing.assert_array_equal(WeightStore(model).get("a")[0], _arrays(1)[0])


def test_two_builds_in_turn_keep_a_file_each(store_dir, tmp_path, monkeypatch):
    """Two layout codes started in turn on one model (an A-B of two checkouts) each find their own file;
    a new version of the model file still replaces this code's old one."""
    model = _model_file(tmp_path)
    for code in ("aaaa", "bbbb"):
        monkeypatch.setattr(weight_store, "_code_digest", lambda c=code: c)
        s = WeightStore(model)
        s.put("a", _arrays(len(code) + ord(code[0]))[:1])
        s.save()
    for code in ("aaaa", "bbbb", "aaaa"):
        monkeypatch.setattr(weight_store, "_code_digest", lambda c=code: c)
        np.testing.assert_array_equal(WeightStore(model).get("a")[0], _arrays(len(code) + ord(code[0]))[0])
    assert len(list(store_dir.glob("*.bin"))) == 2
    model.write_bytes(b"a new version of the model")
    s = WeightStore(model)  # code "aaaa"
    s.put("a", _arrays(9)[:1])
    s.save()
    names = sorted(p.name for p in store_dir.glob("*.bin"))
    assert len(names) == 2 and sum("-aaaa-" in n for n in names) == 1 and sum("-bbbb-" in n for n in names) == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "empty", "header"])
def test_a_damaged_file_means_prepare_again(store_dir, tmp_path, damage):
    model = _model_file(tmp_path)
    s = WeightStore(model)
    s.put("a", _arrays())
    s.save()
    (f,) = store_dir.glob("*.bin")
    raw = f.read_bytes()
    damaged = {"truncate": raw[:len(raw) - 100], "flip": raw[:-100] + bytes([raw[-100] ^ 1]) + raw[-99:],
               "garbage": b"\xff\xfe not a store at all", "empty": b"",
               "header": raw[:40] + b"{" + raw[41:]}[damage]
    f.write_bytes(damaged)
    again = WeightStore(model)
    assert again.get("a") is None and not again.hits
    again.put("a", _arrays())
    again.save()
    assert f.read_bytes() == raw  # rewritten whole


def test_unwritable_or_full_cache_leaves_no_trace(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_store, "MIN_BYTES", 0)
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(weight_store, "cache_dir", lambda: blocker / weight_store.SUBDIR)
    s = WeightStore(_model_file(tmp_path))
    s.put("a", _arrays())
    s.save()  # no error
    monkeypatch.setattr(weight_store, "cache_dir", lambda: tmp_path / "cache" / weight_store.SUBDIR)
    s = WeightStore(_model_file(tmp_path))
    s.put("a", _arrays())

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "replace", full)
    s.save()  # no error, and no temporary file left behind
    assert list((tmp_path / "cache" / weight_store.SUBDIR).iterdir()) == []


def test_small_models_are_not_stored_and_few_files_are_kept(store_dir, tmp_path, monkeypatch):
    s = WeightStore(_model_file(tmp_path, "small.gguf"))
    s.put("a", _arrays())
    monkeypatch.setattr(weight_store, "MIN_BYTES", 1 << 30)
    s.save()
    assert not store_dir.exists()
    monkeypatch.setattr(weight_store, "MIN_BYTES", 0)
    for i in range(weight_store.KEEP + 2):
        s = WeightStore(_model_file(tmp_path, f"m{i}.gguf"))
        s.put("a", _arrays(i))
        s.save()
        os.utime(s.path, (1000 + i, 1000 + i))  # in order of use
    kept = sorted(store_dir.glob("*.bin"), key=lambda p: p.stat().st_mtime)
    assert len(kept) == weight_store.KEEP
    assert WeightStore(tmp_path / f"m{weight_store.KEEP + 1}.gguf").hits
    assert not WeightStore(tmp_path / "m0.gguf").hits


def test_engine_reads_the_store_instead_of_repacking(tiny_models, store_dir, monkeypatch):
    """Engine.load stores a model's repacked weights once; the next load reads them (no repack at all) and
    the model computes the same logits; NINFER_WEIGHT_STORE=0 turns the store off."""
    from engine.api import Engine
    from engine.config import EngineArgs
    from engine.backends.cpu import repack as cpu_repack
    args = EngineArgs(model=str(tiny_models["qwen3"]), threads=1)
    toks = np.array([3, 17, 42, 5], np.int32)

    def logits(eng):
        return eng.model.forward(toks, 0, eng.model.new_cache(16))

    first = Engine.load(args)
    assert len(list(store_dir.glob("*.bin"))) == 1
    want = logits(first)

    def no_repack(*a, **k):
        raise AssertionError("repacked although stored")
    monkeypatch.setattr(cpu_repack, "repack_q4", no_repack)
    monkeypatch.setattr(cpu_repack, "repack_arrays", no_repack)
    np.testing.assert_array_equal(logits(Engine.load(args)), want)
    monkeypatch.setenv("NINFER_WEIGHT_STORE", "0")
    with pytest.raises(AssertionError, match="repacked although stored"):
        Engine.load(args)
