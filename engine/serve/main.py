"""`ninfer-serve [MODEL]`: the engine behind an OpenAI-compatible HTTP API (engine.serve).

    ninfer-serve                                   # the default model on http://127.0.0.1:8080/v1
    ninfer-serve model.gguf --port 8000 --api-key-file key.txt --spec ngram --max-queue 4

Engine options are the `ninfer` ones (--backend --threads --max-context --kv-capacity --kv-dtype
--prefill-chunk --no-prefix-reuse --spec --draft-tokens --lm-head-draft --tp --devices --transport) over the
same config (config.toml, your config, --config FILE; engine.options builds them), and the config's
[sampling] [penalties] [thinking] [spec] tables are each request's defaults, which request fields override.
The key comes from --api-key-file or $NINFER_API_KEY (not a flag: a flag shows in the process list).
SIGINT / SIGTERM stop it: no new connections, replies in flight get --shutdown-timeout seconds to finish,
then they are cancelled, the engine thread is joined and the process exits.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket
import sys
import threading
from pathlib import Path

from .. import options
from ..config import BACKENDS, KV_DTYPES, SPEC_MODES
from ..errors import ConfigError, NinferError

DEFAULT_PORT = 8080  # llama.cpp's server's


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog="ninfer-serve", description="Serve a local GGUF model over the OpenAI HTTP API "
                       "(/v1/chat/completions, /v1/completions, /v1/models, /metrics).")
    p.add_argument("model", nargs="?", help="GGUF file, or a name from `ninfer-chat --list-models` (default: config "
                   "`model`, else the embedded SmolLM2)")
    p.add_argument("--config", metavar="FILE", help="extra config.toml layered over the defaults")
    h = p.add_argument_group("server")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    h.add_argument("--port", type=int, default=DEFAULT_PORT)
    h.add_argument("--alias", metavar="NAME", help="the model id clients send (default: the file name's stem)")
    h.add_argument("--api-key-file", metavar="FILE", help="require this key (the file's first line) as a "
                   "Bearer token on /v1/*; or set $NINFER_API_KEY")
    h.add_argument("--max-queue", type=int, default=8, metavar="N",
                   help="requests that may wait behind the one being generated; more get 429 (default 8)")
    h.add_argument("--max-body-bytes", type=int, default=4 << 20, metavar="N",
                   help="largest request body; larger gets 413 (default 4 MiB)")
    h.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                   help="seconds replies in flight get to finish on SIGTERM/SIGINT (default 5)")
    h.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    h.add_argument("--fake", action="store_true", help="the fake engine (no model; demos and tests)")
    h.add_argument("--fake-delay", type=float, default=0.02, help="seconds per token of --fake")
    g = p.add_argument_group("engine (as in ninfer)")
    g.add_argument("--backend", choices=BACKENDS)
    g.add_argument("--threads", type=int)
    g.add_argument("--max-context", type=int)
    g.add_argument("--kv-capacity", type=int)
    g.add_argument("--kv-dtype", choices=KV_DTYPES)
    g.add_argument("--prefill-chunk", type=int)
    g.add_argument("--no-prefix-reuse", action="store_true")
    g.add_argument("--tp", type=int)
    g.add_argument("--devices", help="comma-separated device ids, e.g. 0,1")
    g.add_argument("--transport", choices=("auto", "p2p", "mapped"))
    g.add_argument("--spec", choices=SPEC_MODES, help="the default speculative mode (a request's spec_mode "
                   "overrides it)")
    g.add_argument("--draft-tokens", type=int)
    g.add_argument("--lm-head-draft", action="store_true")
    g.add_argument("--spec-lookup", type=int, metavar="N", help="mtp / dflash: prompt lookup first (0 = off)")
    return p


def api_key(a: argparse.Namespace) -> str | None:
    if a.api_key_file:
        try:
            key = Path(a.api_key_file).read_text(encoding="utf-8").splitlines()[:1]
        except OSError as e:
            raise ConfigError(f"--api-key-file {a.api_key_file}: cannot read it ({e.strerror or e})") from None
        if not key or not key[0].strip():
            raise ConfigError(f"--api-key-file {a.api_key_file}: its first line is empty")
        return key[0].strip()
    return os.environ.get("NINFER_API_KEY") or None


def load_engine(a: argparse.Namespace, cfg: dict):
    if a.fake:
        from ..config import EngineArgs
        from ..fake import echo_policy, fake_engine
        return fake_engine(echo_policy, delay_s=a.fake_delay, args=EngineArgs(max_context=a.max_context or 1024))
    eargs = options.engine_args_from_flags(cfg, a)
    from ..api import Engine
    from ..models import choose_model
    path, _ = choose_model(eargs.model, cfg)  # a path, or a name from `ninfer-chat --list-models`
    return Engine.load(dataclasses.replace(eargs, model=str(path)),
                       progress=lambda p: print(f"[ninfer-serve] {p.stage}: {p.message}", file=sys.stderr,
                                                flush=True) if p.message else None)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one; its port is sock.getsockname()[1])."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port") from None
    sock.listen(128)
    return sock


def uvicorn_server(app, log_level: str = "info", shutdown_timeout: float = 5.0):
    import uvicorn
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout,
                            lifespan="on", access_log=log_level == "debug")
    return uvicorn.Server(config)


@contextlib.contextmanager
def background(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
    """Serve `app` from a thread (tests, the load test); yields the base URL (…/v1) and stops it on exit."""
    sock = bind(host, port)
    server = uvicorn_server(app, log_level=log_level, shutdown_timeout=2.0)
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="ninfer-serve", daemon=True)
    t.start()
    try:
        while not server.started:
            if not t.is_alive():
                raise RuntimeError("the server thread ended before it started")
            t.join(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        t.join(15)
        sock.close()


def run(argv=None) -> int:
    a = build_parser().parse_args(argv)
    from ..paths import load_config
    cfg = load_config(a.config)
    for name, v, lo in (("--max-queue", a.max_queue, 0), ("--max-body-bytes", a.max_body_bytes, 1024)):
        if v < lo:
            raise ConfigError(f"{name} must be >= {lo}, got {v}")
    key = api_key(a)
    try:
        from .app import ServeSettings, create_app
    except ImportError as e:
        raise ConfigError(f"ninfer-serve needs its extra: pip install 'ninfer-chat[serve]' ({e})") from None
    sock = bind(a.host, a.port)  # before the model loads: a taken port fails at once
    engine = load_engine(a, cfg)
    model_id = a.alias or Path(engine.name).stem
    app = create_app(engine, ServeSettings(model_id=model_id, api_key=key, max_queue=a.max_queue,
                                           max_body_bytes=a.max_body_bytes, config=cfg))
    host = f"[{a.host}]" if ":" in a.host else a.host
    print(f"[ninfer-serve] serving {model_id!r} on http://{host}:{sock.getsockname()[1]}/v1"
          f"{' (API key required)' if key else ''}", file=sys.stderr, flush=True)
    if not is_loopback(a.host) and not key:
        print("[ninfer-serve] warning: listening beyond loopback without an API key; anyone who can reach "
              "this port can use the model", file=sys.stderr, flush=True)
    logging.basicConfig(level=a.log_level.upper(), format="[ninfer-serve] %(levelname)s %(message)s")
    uvicorn_server(app, a.log_level, a.shutdown_timeout).run(sockets=[sock])
    return 0


def main(argv=None) -> int:
    try:
        return run(argv)
    except NinferError as e:
        print(f"ninfer-serve: error: {(str(e).splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
