"""Which model file a name means: `ninfer-chat --model NAME_OR_PATH` and the config's `model`.

    choose_model("llama3.2", cfg) -> (Path, "llama3.2:latest")   (a path, a listed name, ORG/REPO/FILE.gguf)

Order: an existing path; a name the finder lists (finder.resolve_name: a cached Hugging Face file resolves
by its ORG/REPO/FILE name offline); an ORG/REPO/FILE.gguf name not on this machine is downloaded
(download.py, optional). Nothing given: the config's `model` (the same rules), else the embedded default.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import ModelFileError
from .download import download, parse_hub_name
from .finder import find_models, resolve_name


def model_dirs(cfg: dict) -> list[str]:
    """The config's extra model folders (top-level `model_dirs`)."""
    dirs = cfg.get("model_dirs") or []
    return [str(d) for d in dirs]


def _one(spec: str, where: str, cfg: dict, fetch: bool, env: dict | None, home: Path | None) -> tuple[Path, str]:
    p = Path(spec).expanduser()
    if p.exists():
        return p, p.name
    try:
        found = resolve_name(spec, find_models(model_dirs(cfg), env=env, home=home, read=False))
        return found.path, found.name
    except ModelFileError as e:
        if "matches" in str(e):  # several models answer to it: say which
            raise
        not_listed = e
    if parse_hub_name(spec) is not None:
        if not fetch:
            raise ModelFileError(f"{spec} (from {where}) is not on this machine; downloads are off here")
        return download(spec), spec
    if "/" in spec or spec.lower().endswith(".gguf"):
        raise ModelFileError(f"model file {p} (from {where}) does not exist; check the path, or name a model "
                             "from `ninfer-chat --list-models`")
    raise not_listed


def choose_model(spec: str | None, cfg: dict, fetch: bool = True, env: dict | None = None,
                 home: Path | None = None) -> tuple[Path, str]:
    """(model file, the name to show) for `spec`, else the config's `model`, else the embedded default (module
    docstring). `fetch` False: never download. One ModelFileError line when nothing fits."""
    from ..options import config_model
    from ..paths import resolve_model
    for where, value in (("the argument", spec), ("config `model`", config_model(cfg))):
        if value:
            return _one(value, where, cfg, fetch, env, home)
    p = resolve_model(None, None)
    return p, p.name
