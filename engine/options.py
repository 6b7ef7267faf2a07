"""Options from config and flags: the one builder of EngineArgs, SamplingParams, ThinkingParams and
GenerateRequest, shared by `ninfer` (engine.oneshot), `ninfer-chat` and its settings screen (ninfer_tui).

Every default is config.toml's (engine.paths.load_defaults): a config dict is laid over them, then each flag
that is not None over its key. The keys config.toml leaves out (paths.OPTIONAL_KEYS: threads, context limits,
a seed, thinking markers, tensor parallelism) keep the dataclass's own "choose for me" (None, tp 1).
"""
from __future__ import annotations

from . import paths
from .config import EngineArgs, GenerateRequest, SamplingParams, ThinkingParams
from .errors import ConfigError

THINKING_MODES = ("auto", "on", "off")  # [thinking] mode: the model's default, think, never think
EFFORT_SHARE = {"low": 0.25, "medium": 0.5, "high": 0.75}  # --reasoning-effort: a share of max_new


def with_defaults(cfg: dict | None, source: str = "(settings)") -> dict:
    """cfg laid over config.toml's defaults, its keys and types checked first (ConfigError naming `source`).
    A dict from paths.load_config comes back with the same values."""
    defaults = paths.load_defaults()
    if not cfg:
        return defaults
    paths.check_config(cfg, defaults, source)
    return paths.merge(defaults, cfg)


def _pick(flag, value):
    return value if flag is None else flag


def config_model(cfg: dict) -> str | None:
    """The model path the config names (top-level `model`, else [engine] model); None: the embedded default."""
    return cfg.get("model") or cfg.get("engine", {}).get("model") or None


def engine_args(cfg: dict | None, *, model: str | None = None, backend: str | None = None,
                threads: int | None = None, max_context: int | None = None, kv_capacity: int | None = None,
                kv_dtype: str | None = None, prefill_chunk: int | None = None, prefix_reuse: bool | None = None,
                spec: str | None = None, draft_tokens: int | None = None, lm_head_draft: bool | None = None,
                spec_lookup: int | None = None, tp: int | None = None, devices: tuple[int, ...] | None = None,
                transport: str | None = None) -> EngineArgs:
    """EngineArgs from [engine] (with [spec] mode / draft_tokens, which [engine] spec / draft_tokens override)
    and the flags. `model` is the explicit path only: config_model(cfg) is resolved after it (engine.paths)."""
    cfg = with_defaults(cfg)
    e, sx = cfg["engine"], cfg["spec"]
    if threads is None and e.get("threads") is not None and e["threads"] < 1:
        raise ConfigError(f"--threads must be >= 1, got {e['threads']} (from [engine] threads in your config)")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    given = {
        "model": model, "backend": _pick(backend, e["backend"]), "threads": _pick(threads, e.get("threads")),
        "max_context": _pick(max_context, e.get("max_context")),
        "kv_capacity": _pick(kv_capacity, e.get("kv_capacity")), "kv_dtype": _pick(kv_dtype, e["kv_dtype"]),
        "prefill_chunk": _pick(prefill_chunk, e["prefill_chunk"]),
        "prefix_reuse": _pick(prefix_reuse, e["prefix_reuse"]),
        "spec": _pick(spec, e.get("spec", sx["mode"])),
        "draft_tokens": _pick(draft_tokens, e.get("draft_tokens", sx["draft_tokens"])),
        "lm_head_draft": _pick(lm_head_draft, sx["lm_head_draft"]),
        "spec_lookup": _pick(spec_lookup, sx["lookup"]),
        "tp": _pick(tp, e.get("tp")), "transport": _pick(transport, e.get("transport")),
        "devices": tuple(_pick(devices, e.get("devices")) or ()) or None,
    }
    return EngineArgs(**{k: v for k, v in given.items() if v is not None})


def engine_args_from_flags(cfg: dict | None, a) -> EngineArgs:
    """EngineArgs from the engine flags `ninfer` and `ninfer-serve` share (same names: --model, --backend,
    --devices "0,1", ...) over the config."""
    devices = None
    if a.devices:
        try:
            devices = tuple(int(d) for d in a.devices.split(",") if d.strip())
        except ValueError:
            raise ConfigError(f"--devices {a.devices!r} must be comma-separated integers, e.g. 0,1") from None
    return engine_args(
        cfg, model=a.model, backend=a.backend, threads=a.threads, max_context=a.max_context,
        kv_capacity=a.kv_capacity, kv_dtype=a.kv_dtype, prefill_chunk=a.prefill_chunk,
        prefix_reuse=False if a.no_prefix_reuse else None, spec=a.spec, draft_tokens=a.draft_tokens,
        lm_head_draft=True if a.lm_head_draft else None, spec_lookup=a.spec_lookup, tp=a.tp,
        devices=devices, transport=a.transport)


def sampling_params(cfg: dict | None, *, greedy: bool = False, temperature: float | None = None,
                    top_k: int | None = None, top_p: float | None = None, min_p: float | None = None,
                    max_new: int | None = None, seed: int | None = None, presence_penalty: float | None = None,
                    frequency_penalty: float | None = None, stop: tuple[str, ...] = ()) -> SamplingParams:
    """SamplingParams from [sampling] and [penalties] and the flags. The penalties apply when [penalties]
    enabled is true; a penalty flag applies on its own. greedy: temperature 0 (argmax)."""
    cfg = with_defaults(cfg)
    s, p = cfg["sampling"], cfg["penalties"]
    pen = p if p["enabled"] else {}
    return SamplingParams(
        temperature=0.0 if greedy else float(_pick(temperature, s["temperature"])),
        top_k=_pick(top_k, s["top_k"]), top_p=float(_pick(top_p, s["top_p"])),
        min_p=float(_pick(min_p, s["min_p"])), max_new=_pick(max_new, s["max_new"]), seed=_pick(seed, s.get("seed")),
        presence_penalty=float(_pick(presence_penalty, pen.get("presence", 0.0))),
        frequency_penalty=float(_pick(frequency_penalty, pen.get("frequency", 0.0))),
        stop=tuple(stop), greedy=greedy)


def thinking_params(cfg: dict | None, *, mode: str | None = None, budget: int | None = None,
                    effort: str | None = None, max_new: int | None = None,
                    message: str | None = None) -> ThinkingParams:
    """ThinkingParams from [thinking] and the flags. mode: auto | on | off (None: the config's). A budget
    flag, else `effort` (a share of max_new that shrinks to leave the answer room), else the config's budget
    (0 = unlimited); none where thinking is off."""
    cfg = with_defaults(cfg)
    t = cfg["thinking"]
    if mode is None:
        mode = t["mode"]
        if mode not in THINKING_MODES:
            raise ConfigError(f"[thinking] mode = {mode!r} in your config is not one of {', '.join(THINKING_MODES)}")
    if t["budget"] < 0:
        raise ConfigError(f"[thinking] budget = {t['budget']} in your config must be >= 0 (0 = unlimited)")
    enabled = {"auto": None, "on": True, "off": False}[mode]
    fits = budget is None and effort is not None
    if fits:
        budget = int(_pick(max_new, cfg["sampling"]["max_new"]) * EFFORT_SHARE[effort])
    if budget is None:
        budget = t["budget"] or None
    return ThinkingParams(enabled=enabled, budget=None if enabled is False else budget,
                          message=_pick(message, t["message"]), open_marker=t.get("open_marker") or None,
                          close_marker=t.get("close_marker") or None, budget_fits=fits)


def generate_request(cfg: dict | None, *, spec: str | None = None, draft_tokens: int | None = None,
                     thinking: dict | None = None, **sampling) -> GenerateRequest:
    """A GenerateRequest: sampling_params(cfg, **sampling) and thinking_params(cfg, **thinking); spec and
    draft_tokens None leave the engine's (EngineArgs) for this reply."""
    cfg = with_defaults(cfg)
    s = sampling_params(cfg, **sampling)
    return GenerateRequest(sampling=s, thinking=thinking_params(cfg, max_new=s.max_new, **(thinking or {})),
                           spec=spec, draft_tokens=draft_tokens)
