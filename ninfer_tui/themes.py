"""Themes as data: every *.toml in the shipped themes and in <user config dir>/themes/ becomes a Textual Theme.

The shipped themes are the repository's top-level themes/, which ninfer_tui/builtin_themes links to in the
source tree and which a wheel holds as package data in its place."""
from __future__ import annotations

import tomllib
from pathlib import Path

from textual.theme import Theme

from engine import paths
from engine.errors import ConfigError

BUILTIN_THEMES = Path(__file__).with_name("builtin_themes")
_FIELDS = ("primary", "secondary", "warning", "error", "success", "accent", "foreground", "background",
           "surface", "panel", "boost")


def theme_from_file(path: Path) -> Theme:
    """One theme file -> Theme. Raises ConfigError naming the file and the problem."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as e:
        raise ConfigError(f"theme file {path} cannot be read ({e}); fix or remove it") from None
    if "name" not in data or "primary" not in data:
        raise ConfigError(f"theme file {path} needs at least `name` and `primary`")
    kw = {k: str(data[k]) for k in _FIELDS if k in data}
    try:
        theme = Theme(name=str(data["name"]), dark=bool(data.get("dark", True)),
                      luminosity_spread=float(data.get("luminosity_spread", 0.15)),
                      text_alpha=float(data.get("text_alpha", 0.95)),
                      variables={str(k): str(v) for k, v in data.get("variables", {}).items()}, **kw)
        theme.to_color_system()  # validates the colors now, not at first paint
    except Exception as e:
        raise ConfigError(f"theme file {path} has an invalid value ({e})") from None
    return theme


def load_themes(extra_dirs: list[Path] | None = None) -> tuple[list[Theme], list[str]]:
    """All themes found (shipped first, user dir overrides by name) and one warning line per bad file."""
    dirs = [BUILTIN_THEMES, paths.user_config_dir() / "themes"] + list(extra_dirs or [])
    found: dict[str, Theme] = {}
    warnings = []
    for d in dirs:
        if not d.is_dir():
            continue
        for f in sorted(d.glob("*.toml")):
            try:
                t = theme_from_file(f)
            except ConfigError as e:
                warnings.append(str(e))
                continue
            found[t.name] = t
    return list(found.values()), warnings
