"""Where GGUF files live on a machine: the config's `model_dirs`, the Hugging Face hub cache, LM Studio's models
folder and Ollama's blob store, each found the way its own tool finds it (environment variables first).

    places(model_dirs, env, home) -> [Place("hf", Path("~/.cache/huggingface/hub")), ...]

Only folders that exist are returned; the finder (finder.py) knows each layout.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

SOURCES = ("default", "config", "dir", "hf", "lmstudio", "ollama")
SOURCE_LABELS = {"default": "default", "config": "config", "dir": "model_dirs", "hf": "Hugging Face",
                 "lmstudio": "LM Studio", "ollama": "Ollama", "path": "path"}


@dataclass(frozen=True)
class Place:
    source: str  # "dir" | "hf" | "lmstudio" | "ollama"
    root: Path


def hf_cache(env: dict, home: Path) -> Path:
    """huggingface_hub's cache: HF_HUB_CACHE, the older HUGGINGFACE_HUB_CACHE, HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub (~/.cache/huggingface/hub)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else home / ".cache"
    return cache / "huggingface" / "hub"


def lmstudio_dirs(home: Path) -> list[Path]:
    """LM Studio's models folder: ~/.lmstudio/models (0.3 on), ~/.cache/lm-studio/models (earlier)."""
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def ollama_dirs(env: dict, home: Path, system: bool = True) -> list[Path]:
    """Ollama's store: OLLAMA_MODELS, else ~/.ollama/models (a user install) and, with `system`, the Linux
    service's /usr/share/ollama/.ollama/models."""
    if env.get("OLLAMA_MODELS"):
        return [Path(env["OLLAMA_MODELS"]).expanduser()]
    return [home / ".ollama" / "models"] + ([Path("/usr/share/ollama/.ollama/models")] if system else [])


def places(model_dirs: list[str] | tuple[str, ...] = (), env: dict | None = None,
           home: Path | None = None) -> list[Place]:
    """The folders to search, in the listing's order (the config's first), those that exist. A `home` given
    (tests) leaves out the system-wide folders."""
    env = dict(os.environ) if env is None else env
    system = home is None
    home = Path(env.get("HOME") or Path.home()) if home is None else home
    out = [Place("dir", Path(d).expanduser()) for d in model_dirs]
    out.append(Place("hf", hf_cache(env, home)))
    out += [Place("lmstudio", d) for d in lmstudio_dirs(home)]
    out += [Place("ollama", d) for d in ollama_dirs(env, home, system)]
    seen, kept = set(), []
    for p in out:
        try:
            real = p.root.resolve()
            ok = p.root.is_dir()
        except OSError:
            continue
        if ok and real not in seen:
            seen.add(real)
            kept.append(p)
    return kept
