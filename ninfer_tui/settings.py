"""The chat's live settings: built from the merged config, turned into a `GenerateRequest` per reply.

The TUI keys and the plain-mode slash commands both mutate one `ChatSettings`; a change applies from the next
reply. `save_user_settings` writes the changed values back to the user's config file with tomli-w (the repo
config.toml is never written).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine import paths
from engine.config import SPEC_MODES, GenerateRequest, SamplingParams, ThinkingParams
from engine.errors import ConfigError

THINKING_MODES = ("auto", "on", "off")


def _num(cfg: dict, key: str, default, kind=float):
    value = cfg.get(key, default)
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config value {key} = {value!r} is not a {kind.__name__}; fix your config.toml") from None


@dataclass
class ChatSettings:
    """Everything the user can change between replies (F-keys, settings screen, slash commands)."""

    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    max_new: int = 512
    seed: int | None = None
    penalties_on: bool = False
    presence: float = 0.5
    frequency: float = 0.3
    thinking: str = "auto"  # auto | on | off
    budget: int = 0  # 0: unlimited
    budget_step: int = 64
    thinking_message: str = ThinkingParams.message
    spec: str = "off"
    draft_tokens: int = 3
    theme: str = "ninfer-dark"
    show_stats: bool = True
    export_format: str = "md"
    telemetry_interval: float = 1.0
    stream_fps: float = 12.0  # at most this many renders a second while streaming
    ui_cpu_budget: float = 0.05  # share of one core the UI thread may use while streaming (frames widen)
    gil_switch_ms: float = 0.5  # Python's GIL switch interval while streaming (default 5 ms)
    reserve_ui_core: bool = True  # CPU backend, > 2 cores, no --threads: decode on all cores but one
    keymap: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: dict) -> "ChatSettings":
        """Read the merged config dict (engine.paths.load_config); unknown keys are ignored."""
        s, p = cfg.get("sampling", {}), cfg.get("penalties", {})
        t, sp, ui = cfg.get("thinking", {}), cfg.get("spec", {}), cfg.get("ui", {})
        out = cls(
            temperature=_num(s, "temperature", 0.7), top_k=_num(s, "top_k", 40, int),
            top_p=_num(s, "top_p", 0.95), min_p=_num(s, "min_p", 0.05), max_new=_num(s, "max_new", 512, int),
            seed=None if s.get("seed") is None else _num(s, "seed", 0, int),
            penalties_on=bool(p.get("enabled", False)), presence=_num(p, "presence", 0.5),
            frequency=_num(p, "frequency", 0.3),
            thinking=str(t.get("mode", "auto")), budget=_num(t, "budget", 0, int),
            budget_step=max(1, _num(t, "budget_step", 64, int)),
            thinking_message=str(t.get("message", ThinkingParams.message)),
            spec=str(sp.get("mode", "off")), draft_tokens=_num(sp, "draft_tokens", 3, int),
            theme=str(ui.get("theme", "ninfer-dark")), show_stats=bool(ui.get("show_stats", True)),
            export_format=str(ui.get("export_format", "md")),
            telemetry_interval=_num(ui, "telemetry_interval", 1.0),
            stream_fps=_num(ui, "stream_fps", 12.0), ui_cpu_budget=_num(ui, "ui_cpu_budget", 0.05),
            gil_switch_ms=_num(ui, "gil_switch_ms", 0.5), reserve_ui_core=bool(ui.get("reserve_ui_core", True)),
            keymap={str(k): str(v) for k, v in cfg.get("keymap", {}).items()},
        )
        out.validate()
        return out

    def validate(self) -> None:
        """Raise ConfigError naming the bad value (also builds the request once to reuse its checks)."""
        if self.thinking not in THINKING_MODES:
            raise ConfigError(f"thinking mode {self.thinking!r} is not one of {', '.join(THINKING_MODES)}")
        if self.spec not in SPEC_MODES:
            raise ConfigError(f"spec mode {self.spec!r} is not one of {', '.join(SPEC_MODES)}")
        if self.budget < 0:
            raise ConfigError(f"thinking budget must be >= 0 (0 = unlimited), got {self.budget}")
        if self.export_format not in ("md", "json"):
            raise ConfigError(f"export_format {self.export_format!r} is not md or json")
        self.request()

    # -- the request for the next reply ------------------------------------------------------------
    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            presence_penalty=self.presence if self.penalties_on else 0.0,
            frequency_penalty=self.frequency if self.penalties_on else 0.0,
            seed=self.seed, max_new=self.max_new)

    def thinking_params(self) -> ThinkingParams:
        enabled = {"auto": None, "on": True, "off": False}[self.thinking]
        # A budget only makes sense with thinking; asking for one turns prompted thinking on (issue 5).
        if self.budget and enabled is None:
            enabled = True
        return ThinkingParams(enabled=enabled, budget=self.budget or None, message=self.thinking_message)

    def request(self) -> GenerateRequest:
        """The GenerateRequest for the next reply."""
        return GenerateRequest(sampling=self.sampling(), thinking=self.thinking_params(),
                               spec=self.spec, draft_tokens=self.draft_tokens)

    def as_record(self) -> dict:
        """What a transcript stores with each reply."""
        r = self.request()
        return {"temperature": r.sampling.temperature, "top_k": r.sampling.top_k, "top_p": r.sampling.top_p,
                "min_p": r.sampling.min_p, "presence_penalty": r.sampling.presence_penalty,
                "frequency_penalty": r.sampling.frequency_penalty, "seed": r.sampling.seed,
                "max_new": r.sampling.max_new, "thinking": self.thinking, "thinking_budget": self.budget,
                "spec": self.spec, "draft_tokens": self.draft_tokens}

    # -- the toggles -------------------------------------------------------------------------------
    def next_spec(self, available: dict[str, str | None]) -> tuple[str, list[str]]:
        """Advance off -> ngram -> mtp -> dflash, skipping modes the engine reports unavailable.

        Returns (new mode, ["mode: reason", ...] for the skipped ones) so the UI can say why.
        """
        order = list(SPEC_MODES)
        i = order.index(self.spec)
        skipped = []
        for step in range(1, len(order) + 1):
            mode = order[(i + step) % len(order)]
            reason = available.get(mode)
            if reason is None:
                self.spec = mode
                return mode, skipped
            skipped.append(f"{mode}: {reason}")
        return self.spec, skipped

    def toggle_penalties(self) -> bool:
        self.penalties_on = not self.penalties_on
        return self.penalties_on

    def toggle_thinking(self) -> str:
        """auto/on -> off -> on."""
        self.thinking = "on" if self.thinking == "off" else "off"
        return self.thinking

    def change_budget(self, direction: int) -> int:
        self.budget = max(0, self.budget + direction * self.budget_step)
        if self.budget and self.thinking == "off":
            self.thinking = "on"
        return self.budget

    def penalties_label(self) -> str:
        state = "on" if self.penalties_on else "off"
        return f"{state} (presence {self.presence:g}, frequency {self.frequency:g})"

    def budget_label(self) -> str:
        return str(self.budget) if self.budget else "unlimited"

    def to_config(self) -> dict:
        """The user-changeable part of the config, in config.toml's layout (for tomli-w)."""
        sampling = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                    "min_p": self.min_p, "max_new": self.max_new}
        if self.seed is not None:
            sampling["seed"] = self.seed
        return {
            "sampling": sampling,
            "penalties": {"enabled": self.penalties_on, "presence": self.presence, "frequency": self.frequency},
            "thinking": {"mode": self.thinking, "budget": self.budget, "budget_step": self.budget_step},
            "spec": {"mode": self.spec, "draft_tokens": self.draft_tokens},
            "ui": {"theme": self.theme, "show_stats": self.show_stats, "export_format": self.export_format},
        }


def save_user_settings(settings: ChatSettings) -> str:
    """Merge the settings into the user's config file (keeps their other keys); returns its path."""
    import tomllib

    import tomli_w

    path = paths.user_config_path()
    try:
        current = tomllib.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"user config {path} is not valid TOML ({e}); fix or remove it before saving") from None
    for section, values in settings.to_config().items():
        current.setdefault(section, {}).update(values)
    if "seed" in current.get("sampling", {}) and settings.seed is None:
        del current["sampling"]["seed"]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(tomli_w.dumps(current), encoding="utf-8")
    tmp.replace(path)  # atomic: a crash never leaves half a config
    return str(path)
