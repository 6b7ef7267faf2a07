"""`ninfer`: one-shot generation from the command line (option names follow the NInfer product).

    ninfer [MODEL] (--prompt TEXT | --messages FILE) [options]
    ninfer --endpoint URL [--api-key KEY] [--model-name NAME] (--prompt TEXT | --messages FILE) [options]

The answer streams to stdout; reasoning, progress and the stats report go to stderr. Every NinferError ends
as one line `ninfer: error: ...` on stderr with exit status 1 (argparse errors: status 2; Ctrl-C: 130 after
the partial answer). Defaults come from config.toml ([engine], [sampling], [penalties], [thinking], [spec];
[thinking] open_marker/close_marker name the reasoning markers of a model without native ones) under the
user's config; flags override them (engine.options builds the options, as for ninfer-chat).

--reasoning-effort maps to a thinking budget as a share of --max-new, so it always leaves room for the
answer: low = 1/4, medium = 1/2, high = 3/4 of --max-new reasoning tokens.

--endpoint (or [remote] endpoint in the config, unless a MODEL path is given) sends the request to an
OpenAI-compatible server instead (engine.remote): the same output and report, the figures measured from the
stream; the engine flags that configure a local model are refused there (docs/remote.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import unicodedata
from pathlib import Path

from . import options
from .config import BACKENDS, KV_DTYPES, SPEC_MODES, EngineArgs, GenerateRequest
from .errors import ConfigError, InputError, NinferError
from .events import FinalStats, Progress, ReasoningDelta, StepStats, TextDelta, ThinkingForced
from .tokenizer import check_text

EFFORT_SHARE = options.EFFORT_SHARE


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line (argparse prints the whole usage block first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog="ninfer", description="Generate one reply with a local GGUF model (answer to stdout, "
        "reasoning/progress/stats to stderr).",
        epilog="--reasoning-effort low|medium|high = a thinking budget of 1/4, 1/2, 3/4 of --max-new.")
    p.add_argument("model", nargs="?", help="GGUF file, or a name from `ninfer-chat --list-models` (default: config "
                   "`model`, else the embedded SmolLM2)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the user message")
    src.add_argument("--messages", metavar="FILE", help='JSON list of {"role","content"} (or {"messages": [...]}); - = stdin')
    p.add_argument("--system", help="a system message put first")
    p.add_argument("--config", metavar="FILE", help="extra config.toml layered over the defaults")
    g = p.add_argument_group("engine")
    g.add_argument("--backend", choices=BACKENDS)
    g.add_argument("--threads", type=int)
    g.add_argument("--max-context", type=int)
    g.add_argument("--kv-capacity", type=int)
    g.add_argument("--kv-dtype", choices=KV_DTYPES,
                   help="int8: ~half the KV memory, faster decode at long context on AVX512-VNNI CPUs")
    g.add_argument("--prefill-chunk", type=int)
    g.add_argument("--no-prefix-reuse", action="store_true")
    g.add_argument("--tp", type=int)
    g.add_argument("--devices", help="comma-separated device ids, e.g. 0,1")
    g.add_argument("--transport", choices=("auto", "p2p", "mapped"), help="--tp all-reduce path")
    g.add_argument("--spec", choices=SPEC_MODES)
    g.add_argument("--draft-tokens", type=int, help="tokens a drafter proposes per round (needs a --spec mode; a "
                   "prompt-lookup round of mtp / dflash: up to 15)")
    g.add_argument("--lm-head-draft", action="store_true",
                   help="draft through the trained drafter's hot-vocabulary head (cheaper drafts; the target "
                        "still verifies over the full vocabulary); needs --spec mtp or dflash")
    g.add_argument("--spec-lookup", type=int, metavar="N",
                   help="mtp / dflash: draft by prompt lookup first where the text's last N+ tokens occurred "
                        "before (default 3; 0 = the trained drafter alone)")
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new", type=int, help="new tokens, reasoning and answer together")
    s.add_argument("--greedy", action="store_true", help="argmax (temperature 0)")
    s.add_argument("--temperature", type=float)
    s.add_argument("--top-p", type=float)
    s.add_argument("--top-k", type=int)
    s.add_argument("--min-p", type=float)
    s.add_argument("--presence-penalty", type=float)
    s.add_argument("--frequency-penalty", type=float)
    s.add_argument("--seed", type=int)
    s.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    t = p.add_argument_group("thinking")
    tm = t.add_mutually_exclusive_group()
    tm.add_argument("--no-thinking", action="store_true", help="never reason (the template's switch if any)")
    tm.add_argument("--thinking", action="store_true", help="reason (prompted for models without native thinking)")
    tb = t.add_mutually_exclusive_group()
    tb.add_argument("--thinking-budget", type=int, metavar="N", help="force the close after N reasoning tokens")
    tb.add_argument("--reasoning-effort", choices=tuple(EFFORT_SHARE))
    t.add_argument("--thinking-message", help="text inserted before the forced close")
    r = p.add_argument_group("remote engine (default: config [remote]; a MODEL path runs here)")
    r.add_argument("--endpoint", metavar="URL", help="an OpenAI-compatible server's base URL, e.g. "
                   "http://127.0.0.1:8080/v1, instead of a local model")
    r.add_argument("--api-key", metavar="KEY", help="the server's API key (default: [remote] api_key, else "
                   "$NINFER_API_KEY)")
    r.add_argument("--model-name", "--model", dest="remote_model", metavar="NAME",
                   help="the served model to ask (default: the first the server lists)")
    o = p.add_argument_group("output")
    o.add_argument("--print-token-ids", action="store_true", help="print the generated token ids (stderr)")
    o.add_argument("--stats-json", metavar="FILE", help="write the final stats (with token ids) as JSON")
    o.add_argument("--log-stats-interval-ms", type=int, metavar="MS", help="print running stats every MS ms")
    o.add_argument("-q", "--quiet", action="store_true", help="no progress and no stats report")
    return p


# -- inputs -------------------------------------------------------------------------------------------------
def fix_argv_text(text: str, option: str) -> str:
    """argv text -> NFC str. Bytes the locale could not decode (surrogate escapes) are re-read as UTF-8."""
    if any("\udc80" <= ch <= "\udcff" for ch in text):
        try:
            text = os.fsencode(text).decode("utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{option} is not valid UTF-8; pass UTF-8 text") from None
    return unicodedata.normalize("NFC", text)


def read_messages(path: str) -> list[dict]:
    """A --messages file: UTF-8 JSON, a list of messages or an object with "messages"."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"--messages {path}: no such file") from None
    except OSError as e:
        raise InputError(f"--messages {path}: cannot read it ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InputError(f"--messages {path} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                         "save it as UTF-8") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"--messages {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise InputError(f"--messages {path}: its JSON is nested too deeply to be a list of messages") from None
    if isinstance(obj, dict) and "messages" in obj:
        obj = obj["messages"]
    if not isinstance(obj, list) or not obj:
        raise InputError(f'--messages {path} must hold a non-empty JSON list of {{"role", "content"}} objects')
    for i, m in enumerate(obj):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InputError(f'--messages {path}: message {i} must be an object with string "role" and "content"')
        check_text(m["content"], f"--messages {path}: message {i}")
    return [dict(m, content=unicodedata.normalize("NFC", m["content"])) for m in obj]


def build_options(a: argparse.Namespace, cfg: dict) -> tuple[EngineArgs, GenerateRequest, str | None]:
    """(EngineArgs, GenerateRequest, config model) from the flags over the config (engine.options)."""
    eargs = options.engine_args_from_flags(cfg, a)
    if a.lm_head_draft and eargs.spec not in ("mtp", "dflash"):
        raise ConfigError("--lm-head-draft selects an MTP or DFlash drafter's head; it needs --spec mtp or --spec dflash")
    if a.spec_lookup is not None and eargs.spec not in ("mtp", "dflash"):
        raise ConfigError("--spec-lookup sets where a trained drafter drafts second to prompt lookup; it needs "
                          "--spec mtp or --spec dflash (--spec ngram is prompt lookup alone)")
    if a.draft_tokens is not None and eargs.spec == "off":
        raise ConfigError("--draft-tokens needs a speculative mode: add --spec ngram (or mtp, dflash)")
    if a.no_thinking and (a.thinking_budget is not None or a.reasoning_effort):
        raise ConfigError("--no-thinking leaves nothing for --thinking-budget / --reasoning-effort to limit; "
                          "drop one of them")
    mode = "off" if a.no_thinking else "on" if a.thinking else None
    req = options.generate_request(
        cfg, greedy=a.greedy, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
        max_new=a.max_new, seed=a.seed, presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty, stop=tuple(fix_argv_text(s, "--stop") for s in a.stop),
        thinking={"mode": mode, "budget": a.thinking_budget, "effort": a.reasoning_effort,
                  "message": fix_argv_text(a.thinking_message, "--thinking-message") if a.thinking_message
                  else None})
    return eargs, req, options.config_model(cfg)


# -- output -------------------------------------------------------------------------------------------------
def format_report(st: FinalStats) -> str:
    think = ""
    if st.reasoning_tokens or st.thinking_forced:
        think = f" (reasoning {st.reasoning_tokens}, answer {st.answer_tokens}" + \
                (", close forced" if st.thinking_forced else "") + ")"
    spec = ""
    if st.spec_mode != "off" and not st.rounds:  # a remote server that reports drafts but not rounds
        spec = f"\n[ninfer] spec {st.spec_mode}: {st.drafted} drafted, acceptance {st.acceptance:.1%}"
    elif st.spec_mode != "off":
        blocks = (f" (+ {st.block_rounds} decode blocks, {st.block_tokens} tok, where drafting did not pay)"
                  if st.block_rounds else "")
        if st.lookup_rounds:
            blocks = f"; {st.lookup_rounds} of the rounds by lookup ({st.lookup_tokens} tok)" + blocks
        spec = (f"\n[ninfer] spec {st.spec_mode}: {st.rounds - st.block_rounds} rounds, {st.tokens_per_round:.2f} "
                f"tok/round, acceptance {st.acceptance:.1%}, {st.ms_per_round:.1f} ms/round{blocks}")
    detail = f" ({st.stop_reason_detail})" if st.stop_reason_detail else ""
    return (f"[ninfer] prompt {st.prompt_tokens} tok (cached {st.cached_prompt_tokens}) | output {st.output_tokens} "
            f"tok{think} | ttft {st.ttft_s:.3f} s | prefill {st.prefill_tok_s:.1f} tok/s | decode "
            f"{st.decode_tok_s:.1f} tok/s | wall {st.wall_s:.2f} s | finish {st.finish_reason}{detail}{spec}\n"
            f"[ninfer] output sha256 {st.output_sha256}")


def stats_dict(st: FinalStats, answer: str, reasoning: str, model: str) -> dict:
    d = dataclasses.asdict(st)
    d.update(token_ids=list(st.token_ids), per_position_accept=list(st.per_position_accept),
             acceptance=st.acceptance, tokens_per_round=st.tokens_per_round, ms_per_round=st.ms_per_round,
             answer=answer, reasoning=reasoning, model=model)
    return d


# Flags that configure the model in this process: a remote endpoint's server has its own.
LOCAL_ONLY = ("backend", "threads", "max_context", "kv_capacity", "kv_dtype", "prefill_chunk", "no_prefix_reuse",
              "tp", "devices", "transport", "lm_head_draft", "spec_lookup",
              "print_token_ids")


def remote_from(a: argparse.Namespace, cfg: dict):
    """RemoteOptions for --endpoint (or [remote] endpoint when no MODEL path is given), else None; ConfigError
    for flags that cannot go with where the model runs."""
    from .remote import remote_options
    if a.endpoint is not None and a.model:
        raise ConfigError("--endpoint runs the model on a server; drop the MODEL path or --endpoint")
    opts = None if a.model else remote_options(cfg, endpoint=a.endpoint, api_key=a.api_key, model=a.remote_model)
    if opts is None:
        if a.remote_model is not None or a.api_key is not None:
            raise ConfigError("--model-name and --api-key go with a remote --endpoint URL (or [remote] endpoint in "
                              "the config); a local GGUF file is the MODEL argument")
        return None
    for name in LOCAL_ONLY:
        if getattr(a, name) not in (None, False):
            flag = "--" + name.replace("_", "-")
            why = "a remote server streams text, not token ids" if name == "print_token_ids" else \
                "it configures a model run here; the server at the endpoint has its own settings"
            raise ConfigError(f"{flag} does not go with --endpoint: {why}")
    return opts


def _load_engine(eargs: EngineArgs, model_cfg, progress, cfg: dict):
    """MODEL (or the config's `model`) is a path or a name from `ninfer-chat --list-models` (engine.models)."""
    from .api import Engine
    from .models import choose_model
    path, _ = choose_model(eargs.model, cfg)
    return Engine.load(dataclasses.replace(eargs, model=str(path)), progress=progress, config_model=None)


def run(argv=None, engine_factory=None) -> int:
    """The CLI body; returns the exit status. engine_factory(EngineArgs, config_model, progress) -> Engine
    replaces model loading (tests use the fake engine)."""
    a = build_parser().parse_args(argv)
    out, err = sys.stdout, sys.stderr
    from .paths import load_config
    cfg = load_config(a.config)
    eargs, req, model_cfg = build_options(a, cfg)
    if a.prompt is not None:
        messages = [{"role": "user", "content": fix_argv_text(a.prompt, "--prompt")}]
    else:
        messages = read_messages(a.messages)
    if a.system is not None:
        messages.insert(0, {"role": "system", "content": fix_argv_text(a.system, "--system")})
    if a.stats_json is not None:  # checked before the reply, not after it (the reply would be spent)
        sj = Path(a.stats_json).expanduser()
        if not a.stats_json.strip() or sj.is_dir():
            raise InputError(f"--stats-json {a.stats_json!r}: give the path of a file to write")
        if not sj.resolve().parent.is_dir():
            raise InputError(f"--stats-json {a.stats_json}: its directory does not exist")
        if not os.access(sj if sj.exists() else sj.resolve().parent, os.W_OK):
            raise InputError(f"--stats-json {a.stats_json}: cannot write there (permissions or a read-only disk)")
    if a.log_stats_interval_ms is not None and a.log_stats_interval_ms < 0:
        raise ConfigError(f"--log-stats-interval-ms must be >= 0, got {a.log_stats_interval_ms}")

    def progress(p: Progress):
        if not a.quiet:
            print(f"[ninfer] {p.stage}: {p.message}" if p.message else f"[ninfer] {p.stage} {p.done}/{p.total}",
                  file=err, flush=True)

    remote = remote_from(a, cfg)
    if remote is not None:  # the server's speculation is the request's (ninfer-serve takes it); None: the server's
        req = dataclasses.replace(req, spec=a.spec, draft_tokens=a.draft_tokens)
    if remote is not None and engine_factory is None:
        from .remote import RemoteEngine

        def engine_factory(_eargs, _model_cfg, progress):
            return RemoteEngine.connect(remote, progress=progress)
    engine = (engine_factory or functools.partial(_load_engine, cfg=cfg))(eargs, model_cfg, progress)
    session = engine.session()
    if a.log_stats_interval_ms is not None:
        session.stats_interval_s = a.log_stats_interval_ms / 1000.0
    cancel = threading.Event()
    events = session.generate(messages, req, cancel=cancel)
    answer, reasoning, final = [], [], None
    in_reasoning = False
    prev = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if prev is not None:  # Ctrl-C: stop between steps and keep what was generated
        signal.signal(signal.SIGINT, lambda *_: cancel.set())
    try:
        for ev in events:
            if isinstance(ev, TextDelta):
                if in_reasoning:
                    print(file=err, flush=True)
                    in_reasoning = False
                answer.append(ev.text)
                out.write(ev.text)
                out.flush()
            elif isinstance(ev, ReasoningDelta):
                if not reasoning and not a.quiet:
                    err.write("[reasoning] ")
                reasoning.append(ev.text)
                in_reasoning = True
                if not a.quiet:
                    err.write(ev.text)
                    err.flush()
            elif isinstance(ev, ThinkingForced):
                if not a.quiet:
                    err.write(f"\n[ninfer] thinking budget reached after {ev.reasoning_tokens} tokens: close forced\n")
                in_reasoning = False
            elif isinstance(ev, Progress):
                if not a.quiet and ev.stage == "prefill":
                    err.write(f"\r[ninfer] prefill {ev.done}/{ev.total}")
                    if ev.done >= ev.total:
                        err.write("\n")
            elif isinstance(ev, StepStats):
                if a.log_stats_interval_ms is not None and not a.quiet:
                    print(f"[ninfer] {ev.output_tokens} tok (reasoning {ev.reasoning_tokens}) "
                          f"{ev.decode_tok_s:.1f} tok/s, context {ev.context_used}", file=err, flush=True)
            elif isinstance(ev, FinalStats):
                final = ev
    finally:
        if prev is not None:
            signal.signal(signal.SIGINT, prev)
    if answer and not answer[-1].endswith("\n"):
        out.write("\n")
    out.flush()
    if in_reasoning and not a.quiet:
        err.write("\n")
    if final is not None:
        if not a.quiet:
            print(format_report(final), file=err)
        if a.print_token_ids:
            print("[ninfer] token ids: " + " ".join(map(str, final.token_ids)), file=err)
        if a.stats_json:
            try:
                with open(Path(a.stats_json).expanduser(), "w", encoding="utf-8") as f:
                    json.dump(stats_dict(final, "".join(answer), "".join(reasoning),
                                         getattr(engine, "chat_name", engine.name)), f,
                              ensure_ascii=False, indent=1)
            except OSError as e:
                raise InputError(f"--stats-json {a.stats_json}: cannot write it ({e.strerror or e})") from None
        if final.finish_reason == "cancelled":
            return 130
    return 0


def main(argv=None, engine_factory=None) -> int:
    """Console-script entry point: run() with one-line errors instead of tracebacks."""
    for stream in (sys.stdout, sys.stderr):  # CJK output must not crash on a non-UTF-8 locale
        if (getattr(stream, "encoding", "") or "").lower().replace("-", "") != "utf8" and hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8", errors="replace")
    try:
        code = run(argv, engine_factory)
    except NinferError as e:
        print(f"ninfer: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("ninfer: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:
        code = 0
    return code


if __name__ == "__main__":
    sys.exit(main())
