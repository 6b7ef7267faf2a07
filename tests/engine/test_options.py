"""One source of defaults: config.toml. `ninfer`, `ninfer-chat` and the settings screen build their options
with engine.options from it, and the dataclass defaults that remain agree with it."""
from __future__ import annotations

import pytest

from engine import options, paths
from engine.config import EngineArgs, GenerateRequest, SamplingParams, ThinkingParams
from engine.errors import ConfigError

# SamplingParams' truncation filters default to off (the bare chain the engine's API and its tests sample
# with); config.toml turns them on for the apps. Every other default must agree.
BARE_CHAIN = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}


@pytest.fixture(autouse=True)
def no_user_config(monkeypatch, tmp_path):
    monkeypatch.setenv("NINFER_CONFIG_DIR", str(tmp_path / "config"))


def test_dataclass_defaults_agree_with_config_toml():
    d = paths.load_defaults()
    e, s, t, sx = d["engine"], d["sampling"], d["thinking"], d["spec"]
    ea = EngineArgs()
    assert (ea.backend, ea.kv_dtype, ea.prefill_chunk, ea.prefix_reuse) == \
        (e["backend"], e["kv_dtype"], e["prefill_chunk"], e["prefix_reuse"])
    assert (ea.spec, ea.draft_tokens, ea.spec_lookup) == (sx["mode"], sx["draft_tokens"], sx["lookup"])
    for key in set(paths.OPTIONAL_KEYS["engine"]) & {"threads", "max_context", "kv_capacity"}:
        assert getattr(ea, key) is None and key not in e  # left out: "choose for me"
    sp = SamplingParams()
    assert (sp.temperature, sp.max_new, sp.seed) == (s["temperature"], s["max_new"], s.get("seed"))
    assert {k: getattr(sp, k) for k in BARE_CHAIN} == BARE_CHAIN
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.0, 0.0) and not d["penalties"]["enabled"]
    tp = ThinkingParams()
    assert tp.message == t["message"] and tp.budget is None and t["budget"] == 0  # 0 = unlimited = None
    assert tp.enabled is None and t["mode"] == "auto"


def test_the_builders_give_config_toml_values():
    d = paths.load_defaults()
    s = options.sampling_params({})
    assert {k: getattr(s, k) for k in ("temperature", "top_k", "top_p", "min_p", "max_new")} == \
        {k: d["sampling"][k] for k in ("temperature", "top_k", "top_p", "min_p", "max_new")}
    assert options.engine_args({}) == EngineArgs()
    assert options.thinking_params({}) == ThinkingParams()


def test_ninfer_ninfer_chat_and_the_settings_build_the_same_options():
    from engine.oneshot import build_options, build_parser
    from ninfer_tui.__main__ import build_parser as chat_parser
    from ninfer_tui.__main__ import engine_args_from, settings_layer
    from ninfer_tui.settings import ChatSettings

    cfg = paths.load_config()
    eargs, req, model = build_options(build_parser().parse_args(["--prompt", "x"]), cfg)
    ns = chat_parser().parse_args([])
    assert engine_args_from(cfg, ns) == eargs
    settings = ChatSettings.from_config(paths.merge(cfg, settings_layer(ns)))
    chat = settings.request()
    assert chat.sampling == req.sampling and chat.thinking == req.thinking
    assert (chat.spec, chat.draft_tokens) == (eargs.spec, eargs.draft_tokens)
    # every value the settings screen shows is config.toml's
    d = paths.load_defaults()
    shown = {"sampling": ("temperature", "top_k", "top_p", "min_p", "max_new"),
             "penalties": {"enabled": "penalties_on", "presence": "presence", "frequency": "frequency"},
             "thinking": {"mode": "thinking", "budget": "budget", "budget_step": "budget_step",
                          "message": "thinking_message"},
             "spec": {"mode": "spec", "draft_tokens": "draft_tokens"}, "ui": tuple(d["ui"])}
    for section, keys in shown.items():
        names = keys if isinstance(keys, dict) else {k: k for k in keys}
        for key, attr in names.items():
            assert getattr(settings, attr) == d[section][key], (section, key)
    assert settings.keymap == d["keymap"]


def test_flags_override_the_config_and_the_config_overrides_the_defaults():
    cfg = paths.merge(paths.load_defaults(), {"sampling": {"top_k": 7, "seed": 3}, "penalties": {"enabled": True},
                                              "engine": {"threads": 2, "devices": [0, 1], "tp": 2},
                                              "spec": {"mode": "ngram"}})
    s = options.sampling_params(cfg, top_k=9)
    assert (s.top_k, s.seed, s.presence_penalty) == (9, 3, cfg["penalties"]["presence"])
    assert options.sampling_params(cfg, greedy=True).is_greedy
    e = options.engine_args(cfg, kv_dtype="int8")
    assert (e.threads, e.devices, e.tp, e.spec, e.kv_dtype) == (2, (0, 1), 2, "ngram", "int8")
    t = options.thinking_params(cfg, effort="low", max_new=100)
    assert t.budget == 25 and t.budget_fits
    assert options.thinking_params(cfg, mode="off", budget=5).budget is None
    r = options.generate_request(cfg)
    assert isinstance(r, GenerateRequest) and r.spec is None  # the engine's mode
    with pytest.raises(ConfigError, match="unknown key"):
        options.sampling_params({"sampling": {"topk": 3}})
    with pytest.raises(ConfigError, match="threads"):
        options.engine_args({"engine": {"threads": 0}})


def test_spec_lookup_from_the_config_and_the_flag():
    """[spec] lookup and --spec-lookup N (ninfer, ninfer-serve) reach EngineArgs.spec_lookup; a negative N is one
    line saying what to give."""
    from engine.oneshot import build_options, build_parser
    from engine.serve.main import build_parser as serve_parser
    assert options.engine_args({"spec": {"lookup": 0}}).spec_lookup == 0
    assert options.engine_args({"spec": {"lookup": 0}}, spec_lookup=5).spec_lookup == 5
    eargs, _, _ = build_options(build_parser().parse_args(["--prompt", "x", "--spec", "mtp", "--spec-lookup", "2"]), {})
    assert eargs.spec_lookup == 2
    assert options.engine_args_from_flags({}, serve_parser().parse_args(["--spec-lookup", "0"])).spec_lookup == 0
    with pytest.raises(ConfigError, match="--spec-lookup must be a whole number >= 0"):
        options.engine_args({"spec": {"lookup": -1}})


def test_config_toml_is_the_packaged_defaults_file():
    """engine/defaults.toml is the top-level config.toml (a link in the source tree), never a second copy."""
    top = paths.DEFAULTS_FILE.parent.parent / "config.toml"
    assert paths.DEFAULTS_FILE.resolve() == top.resolve()
