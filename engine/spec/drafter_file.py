"""Drafter files: trained drafter weights, keyed by the base model they were trained for.

A drafter file is an `.npz` (no pickle) with a `meta` JSON string and float16 / int32 arrays. `meta` holds
`format` (e.g. "ninfer-mtp"), `version`, `base_sha256` (of the GGUF file the drafter was trained on) and
`base_name`, the shapes, and a training summary. A drafter runs only on its own base model: hidden states of
another model (even another quantisation of it) mean nothing to it. Loading checks format, version and base
model and fails with one line that says what to do (the reference product's v2/v3 pitfall: a drafter of the
wrong version silently drafting garbage).

Where drafters are found: every directory in `$NINFER_DRAFTER_DIRS` (path-separated), then the package's
`engine/spec/drafters/`: a drafter the user trained or exported for a model serves before the packaged one (and
an A-B of two files needs no copy over the packaged file); a file of another version is passed over while a
later one fits. The base model's sha256 is computed once per file version and kept
in the user cache directory (a 100 MB model costs ~0.2 s to hash).
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError

PACKAGED = Path(__file__).resolve().parent / "drafters"


class DrafterFileError(ConfigError):
    """A drafter file that cannot serve this model (damaged, another version, another base model)."""


@dataclass
class DrafterFile:
    path: Path
    meta: dict
    arrays: dict[str, np.ndarray]


def search_dirs() -> list[Path]:
    """Where drafter files are looked for, first to last: $NINFER_DRAFTER_DIRS, then the packaged ones."""
    extra = [Path(p) for p in os.environ.get("NINFER_DRAFTER_DIRS", "").split(os.pathsep) if p]
    return [*extra, PACKAGED]


def _exporter(fmt: str) -> str:
    """The script that writes drafter files of this format."""
    return {"ninfer-dflash": "train/dflash_train.py"}.get(fmt, "train/mtp_train.py")


def read_meta(path: Path) -> dict:
    """The `meta` of a drafter file; DrafterFileError when it is not one."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"][()]))
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise DrafterFileError(f"drafter file {path} is damaged or not a drafter file ({type(e).__name__}); "
                               "delete it, or re-export it with train/mtp_train.py --export") from None
    if not isinstance(meta, dict):
        raise DrafterFileError(f"drafter file {path} has no meta table; re-export it")
    return meta


def base_sha256(model_path: str | os.PathLike) -> str:
    """sha256 of a model file, cached per (path, size, mtime) in the user cache directory."""
    p = Path(model_path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
    cache = _cache_dir() / f"{key}.sha256"
    try:
        got = cache.read_text().strip()
        if len(got) == 64:
            return got
    except OSError:
        pass
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(digest + "\n")
    except OSError:
        pass  # a read-only cache only costs the hash again next time
    return digest


def _cache_dir() -> Path:
    from ..numba_env import cache_root
    return cache_root() / "model-sha256"


def find(fmt: str, version: int, model_path: str | None) -> tuple[Path | None, str | None]:
    """(the drafter file of format `fmt` for this model, None) or (None, why there is none)."""
    if model_path is None:
        return None, "no drafter for this model"
    candidates = [p for d in search_dirs() if d.is_dir() for p in sorted(d.glob("*.npz"))]
    if not candidates:
        return None, "no drafter for this model"
    sha = base_sha256(model_path)
    others, stale = [], None
    for p in candidates:  # the first that fits, in search_dirs order
        try:
            meta = read_meta(p)
        except DrafterFileError:
            continue
        if meta.get("format") != fmt:
            continue
        if meta.get("base_sha256") != sha:
            others.append(str(meta.get("base_name", p.name)))
            continue
        if meta.get("version") != version:
            stale = stale or (f"drafter {p.name} is version {meta.get('version')}, this engine reads version "
                              f"{version}; re-export it with {_exporter(fmt)} --export")
            continue
        return p, None
    if stale is not None:
        return None, stale
    trained = f" (drafters here are for: {', '.join(sorted(set(others)))})" if others else ""
    return None, f"no {fmt} drafter for this model file{trained}"


def load(path: Path, fmt: str, version: int, model_path: str | None, required: tuple[str, ...]) -> DrafterFile:
    """Read and check a drafter file for the model at model_path; DrafterFileError with one line if it does
    not fit."""
    meta = read_meta(path)
    if meta.get("format") != fmt or meta.get("version") != version:
        raise DrafterFileError(f"drafter file {path} is {meta.get('format')} version {meta.get('version')}; "
                               f"this engine reads {fmt} version {version}: re-export it")
    if model_path is not None and meta.get("base_sha256") != base_sha256(model_path):
        raise DrafterFileError(f"drafter file {path} was trained for {meta.get('base_name', 'another model')}, "
                               f"not {Path(model_path).name} (base sha256 differs); use the drafter of this model")
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "meta"}
    missing = [k for k in required if k not in arrays]
    if missing:
        raise DrafterFileError(f"drafter file {path} lacks {', '.join(missing)}; re-export it")
    return DrafterFile(Path(path), meta, arrays)


def kept_network(kept: dict, mode: str, fmt: str, version: int, model_path: str | None, required: tuple[str, ...],
                 options: tuple, build):
    """The drafter network of this model's `fmt` file, made once by build(drafter file, target GGUF) and kept in
    `kept` (one model's network at a time: a reply makes its drafter around it) under the file, its version on
    disk, the model and `options`; ConfigError with one line where the model has no such file."""
    path, why = find(fmt, version, model_path)
    if path is None:
        raise ConfigError(f"--spec {mode}: {why}")
    key = (str(path), path.stat().st_mtime_ns, str(model_path), *options)
    if key not in kept:
        from ..gguf import load_gguf
        target = load_gguf(model_path)
        df = load(path, fmt, version, model_path, required)
        kept.clear()
        kept[key] = build(df, target)
    return kept[key]
