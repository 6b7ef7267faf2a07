"""The GGUF files on this machine, named the way their tool names them, and the resolution of a name.

    find_models(model_dirs, config_model) -> [FoundModel(name, path, source, info), ...]
    resolve_name("llama3.2", models) -> the FoundModel, or ModelFileError listing the candidates

Sources, in the listing's order: the embedded default model, the config's `model`, files given explicitly
(the model running now), the config's `model_dirs` (searched recursively), the Hugging Face hub cache
(`models--ORG--REPO/snapshots/REV/FILE` links into `blobs/`; named ORG/REPO/FILE), LM Studio's folders
(PUBLISHER/REPO/FILE) and Ollama's store (`manifests/HOST/NAMESPACE/MODEL/TAG` JSON naming a sha256 blob;
named MODEL:TAG as `ollama list` shows it). A file reached twice (a link, a folder inside another) is listed
once, under its first source (an Ollama blob once per name). Each entry carries its header facts (header.read_info): a bad file is listed
with the reason instead of being left out.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFileError
from .header import ModelInfo, read_info
from .places import SOURCE_LABELS, places

MAX_DEPTH = 6  # folder levels searched below a model_dirs entry / LM Studio root
# Parts 2..N of a split model (llama-gguf-split): listed through part 1, which says it is split.
_LATER_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY, OLLAMA_LIBRARY = "registry.ollama.ai", "library"


@dataclass(frozen=True)
class FoundModel:
    name: str  # what the user calls it: ORG/REPO/FILE.gguf, llama3.2:latest, sub/file.gguf
    path: Path  # the GGUF file (an HF snapshot link, an Ollama blob)
    source: str  # places.SOURCES, or "path" (given explicitly)
    info: ModelInfo

    @property
    def supported(self) -> bool:
        return self.info.supported

    def row(self) -> tuple[str, ...]:
        """The listing's cells (COLUMNS): what the model screen and `--list-models` show."""
        i = self.info
        return (self.name, i.arch or "?", i.params_label() or "?", i.size_label() if i.size else "?",
                i.quant_label(2) or "?", SOURCE_LABELS[self.source], "yes" if i.supported else f"no: {i.problem}")


COLUMNS = ("name", "arch", "params", "size", "quant", "from", "runs here")


def _is_gguf(name: str) -> bool:
    if not name.lower().endswith(".gguf"):
        return False
    m = _LATER_PART.search(name)
    return m is None or int(m.group(1)) == 1


def _walk(root: Path, depth: int = MAX_DEPTH):
    """(relative name, path) of the .gguf files below root: hidden folders skipped, folder links followed
    once (a loop is not walked twice)."""
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        rel = os.path.relpath(dirpath, root)
        level = 0 if rel == "." else rel.count(os.sep) + 1
        if real in seen or level > depth:
            dirnames[:] = []
            continue
        seen.add(real)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if _is_gguf(f):
                yield (f if rel == "." else f"{rel}/{f}").replace(os.sep, "/"), Path(dirpath) / f


def _hf(root: Path):
    """(ORG/REPO/FILE, path) per GGUF file in a hub cache; refs/main's snapshot keeps the plain name, a file
    of another snapshot with the same name but other contents gets @REV."""
    for repo_dir in sorted(root.glob("models--*")):
        repo = repo_dir.name[len("models--"):].replace("--", "/")
        try:
            main = (repo_dir / "refs" / "main").read_text().strip()
        except OSError:
            main = ""
        snaps = sorted((repo_dir / "snapshots").glob("*")) if (repo_dir / "snapshots").is_dir() else []
        snaps.sort(key=lambda s: s.name != main)  # main first: it keeps the plain names
        named: dict[str, str] = {}
        for snap in snaps:
            for rel, path in _walk(snap):
                name = f"{repo}/{rel}"
                real = os.path.realpath(path)
                if named.setdefault(name, real) != real:
                    name = f"{name}@{snap.name[:8]}"
                yield name, path


def ollama_name(host: str, namespace: str, model: str, tag: str) -> str:
    """How `ollama list` shows a model: llama3.2:latest for the library, NS/MODEL:TAG, HOST/NS/MODEL:TAG."""
    if host == OLLAMA_REGISTRY:
        return f"{model}:{tag}" if namespace == OLLAMA_LIBRARY else f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def _ollama(root: Path):
    """(MODEL:TAG, blob path) per manifest whose model layer is a blob here; a manifest that cannot be read
    names a path that does not exist, so the list shows it with the reason."""
    manifests = root / "manifests"
    if not manifests.is_dir():
        return
    for dirpath, _dirs, files in sorted(os.walk(manifests)):
        for tag in sorted(files):
            parts = Path(dirpath, tag).relative_to(manifests).parts
            if len(parts) != 4:
                continue
            name = ollama_name(*parts)
            try:
                doc = json.loads(Path(dirpath, tag).read_text(encoding="utf-8"))
                digest = next(layer["digest"] for layer in doc.get("layers", [])
                              if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
            except (OSError, ValueError, StopIteration, KeyError, TypeError, AttributeError):
                yield name, Path(dirpath, tag), "its manifest names no model layer (not a model, or damaged)"
                continue
            algo, _, hexdigest = str(digest).partition(":")
            blob = root / "blobs" / f"{algo}-{hexdigest}"
            if not blob.exists() and (root / "blobs" / str(digest)).exists():  # older Ollama: sha256:HEX
                blob = root / "blobs" / str(digest)
            yield name, blob, None


def find_models(model_dirs=(), config_model: str | None = None, extra=(), env: dict | None = None,
                home: Path | None = None, default: bool = True, read: bool = True) -> list[FoundModel]:
    """Every GGUF file the chat can offer (see the module docstring), each with its header facts (`read`
    False: only names and paths, for resolving a name). `extra`: paths listed whatever folder they are in
    (the model running now). `env`/`home` default to this process's; tests pass a fake tree."""
    return list(iter_models(model_dirs, config_model, extra, env, home, default, read))


def iter_models(model_dirs=(), config_model: str | None = None, extra=(), env: dict | None = None,
                home: Path | None = None, default: bool = True, read: bool = True) -> Iterator[FoundModel]:
    """find_models one model at a time (a header with a large vocabulary takes ~0.2 s to read: the model
    screen shows each as it comes)."""
    seen: set[str] = set()

    def entries() -> Iterator[tuple[str, Path, str, str | None]]:
        if default:
            from ..paths import default_model_path
            if (p := default_model_path()) is not None:
                yield p.name, p, "default", None
        if config_model and Path(config_model).expanduser().exists():  # a name in the config is found below
            p = Path(config_model).expanduser()
            yield p.name, p, "config", None
        for p in extra:
            yield Path(p).name, Path(p), "path", None
        for place in places(list(model_dirs), env, home):
            if place.source == "hf":
                yield from ((name, path, "hf", None) for name, path in _hf(place.root))
            elif place.source == "ollama":
                yield from ((name, path, "ollama", problem) for name, path, problem in _ollama(place.root))
            else:
                yield from ((name, path, place.source, None) for name, path in _walk(place.root))

    for name, path, source, problem in entries():
        # a file once; an Ollama blob once per name (two tags often share one blob, and `ollama list` shows both)
        key = f"ollama:{name}" if source == "ollama" else os.path.realpath(path)
        if key in seen:
            continue
        seen.add(key)
        info = read_info(path) if problem is None and read else ModelInfo(path, problem=problem)
        yield FoundModel(name, path, source, info)


def _keys(m: FoundModel) -> set[str]:
    """The names a model answers to (lower case): its full name, without .gguf, its file name and stem, and
    an Ollama model's name without :latest."""
    name = m.name.lower()
    base = name.rsplit("/", 1)[-1]
    keys = {name, base}
    for k in (name, base):
        if k.endswith(".gguf"):
            keys.add(k[:-5])
    if m.source == "ollama" and name.endswith(":latest"):
        keys.add(name[:-len(":latest")])
    return keys


def resolve_name(spec: str, models: list[FoundModel]) -> FoundModel:
    """The listed model `spec` names (case-insensitive; see _keys). ModelFileError (one line) when none or
    several do."""
    want = spec.strip().lower()
    hits = [m for m in models if want in _keys(m)]
    exact = [m for m in hits if m.name.lower() == want]
    if len(exact) == 1 or len(hits) == 1:
        return (exact or hits)[0]
    if hits:
        names = ", ".join(m.name for m in hits[:5]) + (", ..." if len(hits) > 5 else "")
        raise ModelFileError(f"model name {spec!r} matches {len(hits)} models ({names}); give the full name or "
                             "a path")
    raise ModelFileError(f"no model named {spec!r} among the {len(models)} found; `ninfer-chat --list-models` "
                         "shows them (config model_dirs adds folders), or give a path")
