"""The chat's live settings: built from the merged config, turned into a `GenerateRequest` per reply.

The TUI keys and the plain-mode slash commands both mutate one `ChatSettings`; a change applies from the next
reply. `save_user_settings` writes the changed values back to the user's config file with tomli-w (the repo
config.toml is never written).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine import options, paths
from engine.config import MAX_POSITIONS, SPEC_MODES, GenerateRequest
from engine.errors import ConfigError
from engine.options import THINKING_MODES  # noqa: F401 (the settings screen's choices)


@dataclass
class ChatSettings:
    """Everything the user can change between replies (F-keys, settings screen, slash commands).

    No defaults of its own: `from_config` reads them from config.toml under the user's config."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    max_new: int
    seed: int | None
    penalties_on: bool
    presence: float
    frequency: float
    thinking: str  # auto | on | off
    budget: int  # 0: unlimited
    budget_step: int
    thinking_message: str
    spec: str
    draft_tokens: int
    theme: str
    show_stats: bool
    export_format: str
    telemetry_interval: float
    stream_fps: float  # at most this many renders a second while streaming
    ui_cpu_budget: float  # share of one core the UI thread may use while streaming (frames widen)
    gil_switch_ms: float  # Python's GIL switch interval while streaming (default 5 ms)
    reserve_ui_core: bool  # CPU backend, > 2 cores, no --threads: decode on all cores but one
    save_piped: bool  # a prompt piped to --plain is kept in the transcripts (one-shot runs: off)
    system_prompt: str  # the system prompt (persona) a new chat starts with; each chat keeps its own
    keymap: dict[str, str] = field(default_factory=dict)
    # the context size asked for on the settings screen (None: as the engine was loaded); the app applies it
    # to the running engine and it is saved as [engine] max_context
    max_context: int | None = None

    @classmethod
    def from_config(cls, cfg: dict) -> "ChatSettings":
        """The config dict (engine.paths.load_config, or any part of one) over config.toml's defaults;
        a key config.toml does not know, or a value of another type, is a ConfigError."""
        cfg = options.with_defaults(cfg)
        s, p, t, sp, ui = (cfg[k] for k in ("sampling", "penalties", "thinking", "spec", "ui"))
        out = cls(
            temperature=float(s["temperature"]), top_k=s["top_k"], top_p=float(s["top_p"]),
            min_p=float(s["min_p"]), max_new=s["max_new"], seed=s.get("seed"),
            penalties_on=p["enabled"], presence=float(p["presence"]), frequency=float(p["frequency"]),
            thinking=t["mode"], budget=t["budget"], budget_step=max(1, t["budget_step"]),
            thinking_message=t["message"], spec=sp["mode"], draft_tokens=sp["draft_tokens"],
            theme=ui["theme"], show_stats=ui["show_stats"], export_format=ui["export_format"],
            telemetry_interval=float(ui["telemetry_interval"]), stream_fps=float(ui["stream_fps"]),
            ui_cpu_budget=float(ui["ui_cpu_budget"]), gil_switch_ms=float(ui["gil_switch_ms"]),
            reserve_ui_core=ui["reserve_ui_core"], save_piped=ui["save_piped"],
            system_prompt=ui["system_prompt"], keymap={str(k): str(v) for k, v in cfg["keymap"].items()},
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
        if self.max_context is not None and not 1 <= self.max_context <= MAX_POSITIONS:
            raise ConfigError(f"context size must be in 1..{MAX_POSITIONS}, got {self.max_context}")
        if self.export_format not in ("md", "json"):
            raise ConfigError(f"export_format {self.export_format!r} is not md or json")
        self.request()

    # -- the request for the next reply ------------------------------------------------------------
    def request(self) -> GenerateRequest:
        """The GenerateRequest for the next reply, built by engine.options from these values."""
        cfg = self.to_config()
        cfg["thinking"]["message"] = self.thinking_message
        if self.budget and self.thinking == "auto":  # asking for a budget turns prompted thinking on (issue 5)
            cfg["thinking"]["mode"] = "on"
        return options.generate_request(cfg, spec=self.spec, draft_tokens=self.draft_tokens)

    def thinking_params(self):
        """The next reply's ThinkingParams (a budget turns "auto" thinking on)."""
        return self.request().thinking

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

    def thinks(self, native: bool | None) -> bool | None:
        """Whether the next reply reasons, on a model with (native True) or without (False) its own thinking
        markers; None where that is not known yet and the setting is "auto" (the model's default). "auto"
        thinks on a native model, and on another only when a budget asks for it (prompted thinking)."""
        enabled = self.thinking_params().enabled
        return enabled if enabled is not None else native

    def toggle_thinking(self, native: bool | None = None) -> str:
        """Turn thinking to the opposite of what the next reply would do, so every press changes the reply:
        "auto" goes to "off" on a model that thinks by default and to "on" on one that does not (native False
        or not known)."""
        self.thinking = "off" if self.thinks(native) else "on"
        return self.thinking

    def thinking_label(self, native: bool | None) -> str:
        """What the next reply does: "on", "on (prompted)" (no native thinking: reasoning is asked for by an
        instruction), "off", or "auto" while the model (its default) is not known."""
        thinks = self.thinks(native)
        if thinks is None:
            return "auto"
        return ("on" + (" (prompted)" if native is False else "")) if thinks else "off"

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
        out = {
            "sampling": sampling,
            "penalties": {"enabled": self.penalties_on, "presence": self.presence, "frequency": self.frequency},
            "thinking": {"mode": self.thinking, "budget": self.budget, "budget_step": self.budget_step},
            "spec": {"mode": self.spec, "draft_tokens": self.draft_tokens},
            "ui": {"theme": self.theme, "show_stats": self.show_stats, "export_format": self.export_format,
                   "system_prompt": self.system_prompt},
        }
        if self.max_context is not None:
            out["engine"] = {"max_context": self.max_context}
        return out


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
    engine = current.get("engine", {})
    if settings.max_context is not None and engine.get("kv_capacity", settings.max_context) < settings.max_context:
        engine["kv_capacity"] = settings.max_context  # a smaller capacity would stop the next start
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(tomli_w.dumps(current), encoding="utf-8")
    tmp.replace(path)  # atomic: a crash never leaves half a config
    return str(path)
