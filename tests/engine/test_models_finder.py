"""engine.models: the finder over a fake machine (a Hugging Face cache with snapshot links into blobs/, LM Studio
folders, an Ollama manifest and blob, model_dirs with broken files), the header facts and problems, resolving
a name, and the download path (huggingface_hub mocked: no network in tests)."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from engine.errors import ModelFileError
from engine.models import choose_model, find_models, read_info, resolve_name
from engine.models.download import download, parse_hub_name
from engine.models.finder import ollama_name

REV, OLD_REV = "a" * 40, "b" * 40


def _gguf(path: Path, arch: str, **meta) -> Path:
    """A small GGUF with `arch` and one F32 tensor (a header the finder reads; not a loadable model)."""
    w = GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    for k, v in meta.items():
        w.add_uint32(k, v)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def machine(tmp_path, tiny_models):
    """A home with every source, and a model_dirs folder; returns (home, model_dir, {what: path})."""
    home, mdir = tmp_path / "home", tmp_path / "models"
    paths = {}
    # Hugging Face: refs/main -> REV; REV's file links to a blob; OLD_REV has the same name, other contents,
    # and a link to a blob that is gone
    repo = home / ".cache/huggingface/hub/models--TinyOrg--Tiny-GGUF"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs/main").write_text(REV)
    for rev, src, blob in ((REV, tiny_models["llama"], "1" * 64), (OLD_REV, tiny_models["qwen2"], "2" * 64)):
        shutil.copy(src, repo / "blobs" / blob)
        (repo / "snapshots" / rev).mkdir(parents=True)
        os.symlink(f"../../blobs/{blob}", repo / "snapshots" / rev / "tiny.gguf")
    os.symlink("../../blobs/" + "3" * 64, repo / "snapshots" / OLD_REV / "gone.gguf")
    (repo / "snapshots" / REV / "README.md").write_text("not a model")
    paths["hf"] = repo / "snapshots" / REV / "tiny.gguf"
    # LM Studio: publisher/repo/file, and an mmproj (a vision projector: arch clip)
    lms = home / ".lmstudio/models/pub/Tiny-Qwen"
    lms.mkdir(parents=True)
    shutil.copy(tiny_models["qwen2"], lms / "tiny-qwen2-Q8_0.gguf")
    _gguf(lms / "mmproj-tiny.gguf", "clip")
    (lms.parent / "Other").mkdir()
    shutil.copy(tiny_models["qwen3"], lms.parent / "Other" / "mine.gguf")  # a file name model_dirs has too
    # Ollama: a library model and a namespaced one, blobs named by their sha256
    oll = home / ".ollama/models"
    (oll / "blobs").mkdir(parents=True)
    digest = "c" * 64
    shutil.copy(tiny_models["qwen3"], oll / "blobs" / f"sha256-{digest}")
    manifest = {"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "d" * 64},
        {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}]}
    for ns, model, tag in (("library", "tinyq3", "latest"), ("someone", "tinyq3", "v1")):
        (oll / "manifests/registry.ollama.ai" / ns / model).mkdir(parents=True)
        (oll / "manifests/registry.ollama.ai" / ns / model / tag).write_text(json.dumps(manifest))
    (oll / "manifests/registry.ollama.ai/library/broken").mkdir(parents=True)
    (oll / "manifests/registry.ollama.ai/library/broken/latest").write_text("{not json")
    paths["ollama"] = oll / "blobs" / f"sha256-{digest}"
    # model_dirs: good files, bad files, a split model, a link to a file listed elsewhere
    (mdir / "sub").mkdir(parents=True)
    shutil.copy(tiny_models["llama"], mdir / "sub" / "mine.gguf")
    (mdir / "notgguf.gguf").write_text("hello, not a model")
    (mdir / "truncated.gguf").write_bytes(tiny_models["llama"].read_bytes()[:2000])
    data = tiny_models["llama"].read_bytes()
    (mdir / "cut-data.gguf").write_bytes(data[:len(data) - 1000])
    (mdir / "empty.gguf").write_bytes(b"")
    _gguf(mdir / "gemma-tiny.gguf", "gemma3")
    _gguf(mdir / "big-00001-of-00002.gguf", "llama", **{"split.count": 2})
    _gguf(mdir / "big-00002-of-00002.gguf", "llama", **{"split.count": 2})
    (mdir / ".hidden").mkdir()
    shutil.copy(tiny_models["llama"], mdir / ".hidden" / "skipped.gguf")
    os.symlink(lms / "tiny-qwen2-Q8_0.gguf", mdir / "link-to-lmstudio.gguf")
    return home, mdir, paths


def _find(machine, **kw):
    home, mdir, _ = machine
    return find_models([str(mdir)], env={}, home=home, default=False, **kw)


def test_finder_lists_every_source_by_its_tools_names(machine):
    found = {m.name: m for m in _find(machine)}
    by_source = {}
    for m in found.values():
        by_source.setdefault(m.source, set()).add(m.name)
    assert by_source["dir"] == {"sub/mine.gguf", "notgguf.gguf", "truncated.gguf", "cut-data.gguf", "empty.gguf",
                                "gemma-tiny.gguf", "big-00001-of-00002.gguf", "link-to-lmstudio.gguf"}
    assert by_source["hf"] == {"TinyOrg/Tiny-GGUF/tiny.gguf", "TinyOrg/Tiny-GGUF/tiny.gguf@bbbbbbbb",
                               "TinyOrg/Tiny-GGUF/gone.gguf"}
    # the LM Studio file came first through model_dirs' link: listed once, there
    assert by_source["lmstudio"] == {"pub/Tiny-Qwen/mmproj-tiny.gguf", "pub/Other/mine.gguf"}
    # Ollama: the model's name, not its blob's hash; two tags of one blob are both listed (as `ollama list` does)
    assert by_source["ollama"] == {"tinyq3:latest", "someone/tinyq3:v1", "broken:latest"}
    assert found["someone/tinyq3:v1"].path == found["tinyq3:latest"].path
    assert found["tinyq3:latest"].path == machine[2]["ollama"]
    assert found["TinyOrg/Tiny-GGUF/tiny.gguf"].path == machine[2]["hf"]  # the snapshot link, main's


def test_header_facts_and_why_a_file_cannot_run(machine, tiny_models):
    found = {m.name: m for m in _find(machine)}
    ok = found["TinyOrg/Tiny-GGUF/tiny.gguf"].info
    assert ok.supported and ok.arch == "llama" and ok.size == tiny_models["llama"].stat().st_size
    assert ok.n_params > 100_000 and ok.params_label().endswith("K") and ok.context_length == 512
    assert ok.quant_mix[0][0] == "Q8_0" and abs(sum(s for _, s in ok.quant_mix) - 1) < 1e-9
    assert found["tinyq3:latest"].info.arch == "qwen3" and found["tinyq3:latest"].supported
    problems = {name: m.info.problem for name, m in found.items() if not m.supported}
    assert found["someone/tinyq3:v1"].supported
    assert problems.keys() == {"notgguf.gguf", "truncated.gguf", "cut-data.gguf", "empty.gguf", "gemma-tiny.gguf",
                               "big-00001-of-00002.gguf", "pub/Tiny-Qwen/mmproj-tiny.gguf",
                               "TinyOrg/Tiny-GGUF/gone.gguf", "broken:latest"}
    assert problems["notgguf.gguf"] == "not a GGUF file (it starts with b'hell')"
    assert problems["empty.gguf"] == "not a GGUF file (it is empty)"
    assert problems["truncated.gguf"].startswith("truncated or damaged header (metadata runs past the end")
    assert problems["cut-data.gguf"].startswith("truncated: the tensor data needs")
    assert problems["gemma-tiny.gguf"] == "architecture 'gemma3' is not supported (supported: llama, qwen2, qwen3)"
    assert problems["big-00001-of-00002.gguf"].startswith("split into 2 files")
    assert "architecture 'clip'" in problems["pub/Tiny-Qwen/mmproj-tiny.gguf"]
    assert problems["TinyOrg/Tiny-GGUF/gone.gguf"].startswith("a link to a missing file")
    assert "manifest names no model layer" in problems["broken:latest"]
    for m in found.values():  # every row renders, one line per cell
        assert all("\n" not in c for c in m.row())


def test_read_info_never_raises(tmp_path):
    (tmp_path / "d.gguf").mkdir()
    (tmp_path / "four.gguf").write_bytes(b"GGUF")
    (tmp_path / "v9.gguf").write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(32))
    assert read_info(tmp_path / "d.gguf").problem == "not a regular file"
    assert read_info(tmp_path / "four.gguf").problem.startswith("truncated: the header ends")
    assert read_info(tmp_path / "v9.gguf").problem == "GGUF version 9 (supported: 2, 3)"
    assert read_info(tmp_path / "missing.gguf").problem.startswith("cannot be read")


def test_hub_cache_location_follows_the_environment(tmp_path, tiny_models):
    for env_key, root in (("HF_HUB_CACHE", tmp_path / "a"), ("HF_HOME", tmp_path / "b")):
        hub = root if env_key == "HF_HUB_CACHE" else root / "hub"
        snap = hub / "models--o--r/snapshots/x"
        snap.mkdir(parents=True)
        shutil.copy(tiny_models["llama"], snap / f"{env_key}.gguf")
        names = [m.name for m in find_models(env={env_key: str(root)}, home=tmp_path / "nohome", default=False)]
        assert names == [f"o/r/{env_key}.gguf"]


def test_resolve_name(machine):
    found = _find(machine, read=False)
    assert resolve_name("tinyq3", found).name == "tinyq3:latest"  # :latest may be left out
    assert resolve_name("someone/tinyq3:v1", found).name == "someone/tinyq3:v1"
    assert resolve_name("TinyOrg/Tiny-GGUF/tiny.gguf", found).path == machine[2]["hf"]
    assert resolve_name("tiny", found).name == "TinyOrg/Tiny-GGUF/tiny.gguf"  # file stem
    assert resolve_name("SUB/MINE.gguf", found).name == "sub/mine.gguf"  # any case
    with pytest.raises(ModelFileError, match=r"^model name 'mine' matches 2 models \(sub/mine.gguf, pub/Other/mine"
                                             r"\.gguf\); give the full name or a path$"):
        resolve_name("mine", found)
    with pytest.raises(ModelFileError, match=r"^no model named 'nope' among the \d+ found; `ninfer-chat --list-mod"):
        resolve_name("nope", found)


def test_choose_model_path_name_config_and_errors(machine, tiny_models):
    home, mdir, paths = machine
    cfg = {"model_dirs": [str(mdir)]}
    kw = {"env": {}, "home": home}
    assert choose_model(str(tiny_models["qwen2"]), cfg, **kw) == (tiny_models["qwen2"], "tiny-qwen2.gguf")
    assert choose_model("tinyq3", cfg, **kw) == (paths["ollama"], "tinyq3:latest")
    assert choose_model(None, {**cfg, "model": "sub/mine"}, **kw)[1] == "sub/mine.gguf"  # the config names a model
    with pytest.raises(ModelFileError, match=r"^model file /no/such\.gguf \(from the argument\) does not exist"):
        choose_model("/no/such.gguf", cfg, **kw)
    with pytest.raises(ModelFileError, match="is not on this machine; downloads are off"):
        choose_model("Org/Repo/x.gguf", cfg, fetch=False, **kw)


class _FakeHub:
    """huggingface_hub with hf_hub_download replaced: records calls, returns a file or raises."""

    def __init__(self, result=None, error=None):
        import huggingface_hub
        self.real, self.calls, self.result, self.error = huggingface_hub, [], result, error

    def hf_hub_download(self, repo, filename, **kw):
        self.calls.append((repo, filename))
        if self.error is not None:
            raise self.error
        return str(self.result)


def test_download_mocked(monkeypatch, machine, tiny_models):
    home, mdir, _ = machine
    hub = _FakeHub(result=tiny_models["qwen3"])
    monkeypatch.setattr(hub.real, "hf_hub_download", hub.hf_hub_download)
    assert parse_hub_name("Org/Repo/dir/file.GGUF") == ("Org/Repo", "dir/file.GGUF")
    assert parse_hub_name("Org/file.gguf") is None and parse_hub_name("Org/Repo/../x.gguf") is None
    path, name = choose_model("Qwen/Qwen3-0.6B-GGUF/Qwen3-0.6B-Q8_0.gguf", {"model_dirs": [str(mdir)]},
                              env={}, home=home)
    assert path == tiny_models["qwen3"] and name == "Qwen/Qwen3-0.6B-GGUF/Qwen3-0.6B-Q8_0.gguf"
    assert hub.calls == [("Qwen/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q8_0.gguf")]
    hub.calls.clear()  # a file in the cache resolves by its name, without asking the hub
    assert choose_model("TinyOrg/Tiny-GGUF/tiny.gguf", {}, env={}, home=home)[0] == machine[2]["hf"]
    assert hub.calls == []


def test_download_reports_its_bytes_and_draws_nothing(monkeypatch, tiny_models, capsys):
    import huggingface_hub
    seen = []

    def fake(repo, filename, *, tqdm_class=None, **kw):  # as huggingface_hub drives its bar
        bar = tqdm_class(total=3_000_000, initial=0, unit="B", unit_scale=True, desc=filename,
                         name="huggingface_hub.http_get")
        bar.update(1_000_000)
        bar.update(2_000_000)
        bar.close()
        return str(tiny_models["qwen3"])
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
    assert download("Org/Repo/x.gguf", quiet=True, progress=lambda d, t: seen.append((d, t))) == tiny_models["qwen3"]
    assert seen[0] == (0, 3_000_000) and (1_000_000, 3_000_000) in seen and seen[-1] == (3_000_000, 3_000_000)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("error_name, expected", [
    ("LocalEntryNotFoundError", "offline (the Hugging Face Hub cannot be reached, or HF_HUB_OFFLINE is set)"),
    ("RepositoryNotFoundError", "no repository Org/Repo on the Hugging Face Hub"),
    ("EntryNotFoundError", "Org/Repo has no file x.gguf"),
    ("GatedRepoError", "Org/Repo is gated"),
])
def test_download_errors_are_one_line(monkeypatch, error_name, expected):
    from engine.models.download import _error
    cls = _error(error_name)
    err = cls.__new__(cls)  # the HTTP errors want a live response object: built without one
    Exception.__init__(err, "boom\nsecond line")
    hub = _FakeHub(error=err)
    monkeypatch.setattr(hub.real, "hf_hub_download", hub.hf_hub_download)
    with pytest.raises(ModelFileError) as e:
        download("Org/Repo/x.gguf")
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_download_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(ModelFileError, match=r"^Org/Repo/x\.gguf is not on this machine and downloading it needs "
                                             r"huggingface_hub; pip install 'ninfer-chat\[hub\]'"):
        download("Org/Repo/x.gguf")


def test_ollama_names():
    assert ollama_name("registry.ollama.ai", "library", "qwen3", "8b") == "qwen3:8b"
    assert ollama_name("registry.ollama.ai", "me", "m", "latest") == "me/m:latest"
    assert ollama_name("hf.co", "Org", "Repo-GGUF", "Q4_K_M") == "hf.co/Org/Repo-GGUF:Q4_K_M"
