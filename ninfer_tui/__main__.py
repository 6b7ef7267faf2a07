"""`ninfer-chat`: the Textual chat app, its plain line mode, and transcript commands that need no UI.

    ninfer-chat [MODEL | --model NAME_OR_PATH] [--config FILE] [--theme NAME] [--plain] [--save | --no-save]
    ninfer-chat --list-models                                       (the GGUF files found; ctrl+l in the chat)
    ninfer-chat --endpoint URL [--api-key KEY] [--model NAME] ...   (any OpenAI-compatible server; docs/remote.md)
    ninfer-chat --list | --export ID [--format md|json] [-o FILE] | --import FILE
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine import options, paths
from engine.config import SPEC_MODES, EngineArgs
from engine.errors import ConfigError, NinferError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer-chat", description="Chat with a local GGUF model in the terminal.")
    p.add_argument("model", nargs="?", help="GGUF file or a name from --list-models (default: config `model`, "
                   "else the embedded SmolLM2)")
    p.add_argument("--config", help="an extra TOML config merged over the defaults and your user config")
    p.add_argument("--theme", help="theme name (ninfer-dark, ninfer-light, ninfer-high-contrast, or a user theme)")
    p.add_argument("--plain", action="store_true", help="line-based prompt-toolkit interface (no full screen); "
                   "with stdin not a terminal, answers the one prompt piped in and exits")
    p.add_argument("--save", action=argparse.BooleanOptionalAction, default=None,
                   help="keep this chat in the transcripts (default: yes, except a prompt piped to --plain, "
                        "which is saved only with --save or config [ui] save_piped = true)")
    p.add_argument("--backend", help="cpu | ref | cuda (default: config [engine] backend)")
    p.add_argument("--threads", type=int, help="CPU threads (default: all)")
    p.add_argument("--kv-dtype", choices=("f16", "int8"), help="KV cache type (default: config [engine] kv_dtype)")
    p.add_argument("--max-context", type=int, help="context length (default: min(model context, 4096))")
    p.add_argument("--kv-capacity", type=int, help="KV cache positions, >= --max-context (default: the same)")
    p.add_argument("--spec", choices=SPEC_MODES, help="speculative decoding mode for the first reply")
    p.add_argument("--max-new", type=int, help="tokens per reply (reasoning + answer)")
    p.add_argument("--temperature", type=float, help="0 = greedy")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--no-thinking", action="store_true", help="never think")
    p.add_argument("--thinking-budget", type=int, help="reasoning tokens before the close is forced (0: unlimited)")
    r = p.add_argument_group("remote engine (instead of loading a model here; default: config [remote])")
    r.add_argument("--endpoint", metavar="URL", help="an OpenAI-compatible server's base URL, e.g. "
                   "http://127.0.0.1:8080/v1 (ninfer-serve, vLLM, SGLang, llama.cpp's server, Ollama)")
    r.add_argument("--api-key", metavar="KEY", help="the server's API key (default: [remote] api_key, else "
                   "$NINFER_API_KEY)")
    r.add_argument("--model", "--model-name", dest="remote_model", metavar="NAME",
                   help="with an endpoint: the served model to chat with (default: the first the server "
                        "lists); without one: the local model, a GGUF path or a name from --list-models "
                        "(ORG/REPO/FILE.gguf not on this machine is downloaded from the Hugging Face Hub)")
    p.add_argument("--fake", action="store_true", help="a scripted fake engine (demo/tests; loads no model)")
    p.add_argument("--fake-delay", type=float, default=0.02, help="seconds per token of --fake")
    g = p.add_argument_group("transcripts (no UI)")
    g.add_argument("--list", action="store_true", help="list saved conversations and exit")
    g.add_argument("--list-models", action="store_true", help="list the GGUF files found (config model_dirs, "
                   "the Hugging Face cache, LM Studio, Ollama) and exit")
    g.add_argument("--export", type=int, metavar="ID", help="print conversation ID as Markdown/JSON and exit")
    g.add_argument("--format", choices=("md", "json"), help="export format (default md)")
    g.add_argument("-o", "--output", help="write the export to this file instead of stdout")
    g.add_argument("--import", dest="import_file", metavar="FILE", help="import a JSON export and exit")
    return p


def engine_args_from(cfg: dict, ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the engine flags over the config (engine.options, as for `ninfer`)."""
    return options.engine_args(cfg, backend=ns.backend, threads=ns.threads, kv_dtype=ns.kv_dtype,
                               max_context=ns.max_context, kv_capacity=ns.kv_capacity, spec=ns.spec)


def settings_layer(ns: argparse.Namespace) -> dict:
    """The chat flags as a config layer (config.toml's layout) laid over the config for ChatSettings."""
    layer = {"ui": {"theme": ns.theme}, "spec": {"mode": ns.spec},
             "sampling": {"max_new": ns.max_new, "temperature": ns.temperature, "seed": ns.seed},
             "thinking": {"mode": "off" if ns.no_thinking else None, "budget": ns.thinking_budget}}
    return {k: {key: v for key, v in body.items() if v is not None} for k, body in layer.items()}


def real_loader(args: EngineArgs, progress=None):
    try:
        from engine.api import Engine
    except ImportError as e:
        raise NinferError(f"the engine API is not available ({e}); try --fake for a demo") from None
    return Engine.load(args, progress=progress)


def _transcript_commands(ns) -> int:
    from .export import export, import_json
    from .store import Store
    store = Store(readonly=not ns.import_file)  # listing and exporting write nothing (a read-only disk is fine)
    try:
        if ns.list:
            convs = store.list_conversations()
            for c in convs:
                print(f"{c.id:6d}  {c.n_messages:4d} msgs  {c.title}")
            if not convs:
                print(f"no saved conversations yet in {store.path}", file=sys.stderr)
            return 0
        if ns.import_file:
            try:
                text = Path(ns.import_file).read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise NinferError(f"{ns.import_file} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                                  f"{e.start}); pass a transcript exported with --format json") from None
            except OSError as e:
                raise NinferError(f"cannot read {ns.import_file} ({e.strerror or e}); check the path") from None
            print(f"imported as conversation {import_json(store, text)}")
            return 0
        text = export(store, ns.export, ns.format)
        if ns.output:
            try:
                Path(ns.output).write_text(text, encoding="utf-8")
            except OSError as e:
                raise NinferError(f"cannot write {ns.output} ({e.strerror or e}); pick a writable path with -o, "
                                  f"or leave -o out to print the export") from None
        else:
            sys.stdout.write(text)
        return 0
    finally:
        store.close()


def _list_models(ns) -> int:
    """`--list-models`: the model list as the model screen shows it, one model a line (no UI)."""
    from engine.models import find_models, model_dirs
    from engine.models.finder import COLUMNS
    cfg = paths.load_config(ns.config)
    found = find_models(model_dirs(cfg), options.config_model(cfg))
    rows = [COLUMNS] + [m.row() for m in found]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    for r in rows:  # the last column (a reason can be long) is not padded
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    if not found:
        print("no GGUF files found; add folders to model_dirs in the config", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.export is None and (ns.format or ns.output):
        parser.error("--format and -o go with --export ID (`ninfer-chat --list` shows the ids)")
    ns.format = ns.format or "md"
    try:
        if ns.list_models:
            return _list_models(ns)
        if ns.list or ns.export is not None or ns.import_file:
            return _transcript_commands(ns)
        return _run(ns)
    except NinferError as e:
        print(f"ninfer-chat: {e}", file=sys.stderr)
        return 2


def remote_from(cfg: dict, ns: argparse.Namespace):
    """RemoteOptions where --endpoint or [remote] endpoint names a server (a GGUF argument or --fake runs here);
    ConfigError for remote flags that have nothing to go with."""
    from engine.remote import remote_options
    if ns.endpoint is not None and (ns.model or ns.fake):
        raise ConfigError(f"--endpoint runs the model on a server; drop {'the GGUF path' if ns.model else '--fake'}"
                          " or --endpoint")
    if ns.model or ns.fake:
        if ns.api_key is not None:
            raise ConfigError("--api-key goes with a remote --endpoint; a local model needs none")
        if ns.model and ns.remote_model is not None:
            raise ConfigError(f"two models given ({ns.model} and --model {ns.remote_model}); give one")
        if ns.fake and ns.remote_model is not None:
            raise ConfigError("--fake loads no model; drop --model or --fake")
        return None
    opts = remote_options(cfg, endpoint=ns.endpoint, api_key=ns.api_key, model=ns.remote_model)
    if opts is None and ns.api_key is not None:
        raise ConfigError("--api-key goes with a remote --endpoint URL (or [remote] endpoint in the config)")
    return opts  # None: --model (if given) names the local model


def _model_choice(app, cfg: dict, ns, remote) -> None:
    """What the model screen (ctrl+l) searches, or why this chat cannot switch model."""
    from engine.models import model_dirs
    app.model_dirs, app.config_model = tuple(model_dirs(cfg)), options.config_model(cfg)
    if remote is not None:
        app.no_model_switch = "the model is chosen where it runs: start with --endpoint URL --model NAME"
    elif ns.fake:
        app.no_model_switch = "--fake runs a scripted engine; start without it to choose a model"


def _run(ns) -> int:
    from .settings import ChatSettings
    cfg = paths.load_config(ns.config)
    settings = ChatSettings.from_config(paths.merge(cfg, settings_layer(ns)))
    args = engine_args_from(cfg, ns)
    remote = remote_from(cfg, ns)
    telemetry = None
    if remote is not None:
        from .remote_ui import RemoteTelemetry, remote_loader
        loader, model_name = remote_loader(remote)
        telemetry = RemoteTelemetry(remote.endpoint)
        if ns.plain:  # plain mode connects before its first line: the chat is named after the served model
            engine = loader(args, progress=lambda p: print(f"{p.stage} {p.done}/{p.total} {p.message}",
                                                           file=sys.stderr, flush=True))
            loader, model_name = (lambda a, progress=None: engine), engine.chat_name
    elif ns.fake:
        from engine.fake import Script, ScriptedEngine
        script = Script(delay=ns.fake_delay)
        loader = (lambda a, progress=None: ScriptedEngine.load(a, progress=progress, script=script))
        model_name = "fake-model"
    else:
        from engine.models import choose_model
        model, model_name = choose_model(ns.model or ns.remote_model, cfg)
        args.model = str(model)
        loader = real_loader
    if ns.plain:
        from .plain import run_plain
        try:
            return run_plain(settings, args, loader, model_name, save=ns.save)
        finally:
            if remote is not None:
                engine.close()
    from .app import ChatApp
    from .store import Store, StoreError
    store, store_error = None, None
    if ns.save is not False:
        try:
            store = Store()
        except StoreError as e:
            store_error = str(e)
    remote_kw = {"telemetry": telemetry} if telemetry is not None else {}  # the GPU section says why it is empty
    app = ChatApp(settings, args, loader, store=store, store_error=store_error, model_name=model_name, **remote_kw)
    _model_choice(app, cfg, ns, remote)
    app.run()
    if remote is not None and callable(close := getattr(app.engine, "close", None)):
        close()  # the remote engine's connections and loop thread
    if store is not None:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
