"""What a benchmark runs: named variants x one workload, as plain dataclasses that travel to the worker as JSON.

A *variant* is a named configuration: our engine (`kind="ours"`, EngineArgs fields such as backend, kv_dtype,
spec, draft_tokens, threads) or the llama.cpp peer (`kind="llama.cpp"`, via llama-cpp-python when installed).
Written on the command line as `--variant NAME:key=val,key=val` or in a TOML file:

    [variant.fast]            # kind defaults to "ours"
    backend = "cpu"
    kv_dtype = "int8"
    [variant.peer]
    kind = "llama.cpp"

Run-level keys a variant may also set: `busy=1` (run it while another process spins on one core), `cold=1`
(empty numba/tokenizer caches: a cold start), `threads=N`, `env.NAME=value` (an environment variable of
the run, e.g. `env.NINFER_THREADING_LAYER=workqueue` or `env.GOMP_SPINCOUNT=10000`), and `tree=PATH`: run
our engine from another checkout of ninfer-chat (e.g. `git worktree add ../base HEAD~1`), so that two builds
alternate in one run. Its worker takes this one's run (as JSON); its numba cache and its stored weights
are its own (both keyed on the code: the kernels' sources, backends/cpu/weight_store.py's digest). A checkout from
before that store keyed its file names on the code (802d084) deletes the other's stored weights whenever it
writes its own, i.e. only on a start that found none.
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..config import EngineArgs
from ..errors import ConfigError
from ..tokenizer import check_text

KINDS = ("ours", "llama.cpp")
RUN_KEYS = {"kind", "busy", "cold", "threads", "tree"}  # not EngineArgs fields
ENGINE_KEYS = {f.name for f in fields(EngineArgs)} - {"model", "prefix_reuse"}
# text-valued fields: their value is kept as written (spec=off is the mode "off", not False)
TEXT_KEYS = {f.name for f in fields(EngineArgs) if isinstance(f.default, str)}
WORKLOAD_DIR = Path(__file__).resolve().parents[3] / "shared" / "workloads"


@dataclass
class Variant:
    """One named configuration. `engine` holds EngineArgs overrides (ours) and is ignored for llama.cpp."""

    name: str
    kind: str = "ours"
    threads: int = 2
    busy: bool = False
    cold: bool = False
    engine: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)  # extra environment variables of this variant's runs
    tree: str = ""  # another checkout to run ours from (runner.variant_root); not sent to the worker

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError(f"variant {self.name!r}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        for k in ("busy", "cold"):
            if not isinstance(getattr(self, k), bool):
                raise ConfigError(f"variant {self.name!r}: {k} must be true or false, got {getattr(self, k)!r}")
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1:
            raise ConfigError(f"variant {self.name!r}: threads must be an integer >= 1, got {self.threads!r}")
        unknown = set(self.engine) - ENGINE_KEYS
        if unknown:
            raise ConfigError(f"variant {self.name!r}: unknown key(s) {', '.join(sorted(unknown))}; "
                              f"known: {', '.join(sorted(ENGINE_KEYS | RUN_KEYS))}")
        if self.kind == "ours":
            try:
                EngineArgs(**self.engine)  # validate now, not in the worker
            except (TypeError, ValueError) as e:
                raise ConfigError(f"variant {self.name!r}: a value has the wrong type ({e}); see --help for "
                                  "each key's values") from None
        if self.tree:
            self.tree = str(self.tree)
            if self.kind != "ours":
                raise ConfigError(f"variant {self.name!r}: tree= runs our engine from another checkout; "
                                  "llama.cpp takes none")
            if not (Path(self.tree).expanduser() / "engine" / "bench" / "worker.py").is_file():
                raise ConfigError(f"variant {self.name!r}: tree={self.tree!r} is not a ninfer-chat checkout (no "
                                  "engine/bench/worker.py there); give the folder of one, e.g. a git worktree")

    @property
    def label(self) -> str:
        return self.name


def _coerce(value: str):
    """'2' -> 2, '0.5' -> 0.5, 'true'/'false' -> bool, else the string."""
    low = value.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            pass
    return value.strip()


def _from_mapping(name: str, items: dict) -> Variant:
    items = dict(items)
    kind = items.pop("kind", "ours")
    if kind in ("llama", "llamacpp", "llama-cpp"):
        kind = "llama.cpp"
    run = {k: items.pop(k) for k in list(items) if k in RUN_KEYS}
    env = {k[4:]: str(items.pop(k)) for k in list(items) if k.startswith("env.")}
    if isinstance(items.get("env"), dict):  # TOML: env = { NAME = "value" }
        env.update({k: str(v) for k, v in items.pop("env").items()})
    for k in ("busy", "cold"):  # 1 / 0 as well as true / false; anything else is refused by Variant
        if k in run and (isinstance(run[k], bool) or run[k] in (0, 1)):
            run[k] = bool(run[k])
    engine = {k: (tuple(v) if isinstance(v, list) else v) for k, v in items.items()}
    if isinstance(engine.get("devices"), int) and not isinstance(engine["devices"], bool):
        engine["devices"] = (engine["devices"],)  # devices=0: one id, as --devices 0
    if kind != "ours" and engine:
        raise ConfigError(f"variant {name!r}: llama.cpp takes only threads/busy/cold, not {', '.join(sorted(engine))}")
    return Variant(name=name, kind=kind, engine=engine, env=env, **run)


def parse_variant(text: str) -> Variant:
    """`NAME:key=val,key=val` (or just `NAME`; `llama.cpp`/`llama` alone means the peer) -> Variant."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if not name:
        raise ConfigError(f"--variant {text!r}: give a name, e.g. --variant fast:kv_dtype=int8")
    items = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, val = part.partition("=")
        if not eq:
            raise ConfigError(f"--variant {text!r}: {part!r} is not key=value")
        key = key.strip()
        key = key if key.startswith("env.") else key.replace("-", "_")
        items[key] = val.strip() if key.startswith("env.") or key in TEXT_KEYS else _coerce(val)
    if not rest and name.lower() in ("llama.cpp", "llama", "llamacpp"):
        items["kind"] = "llama.cpp"
    return _from_mapping(name, items)


def load_variants_toml(path: str | Path) -> list[Variant]:
    """Variants from a TOML file with [variant.NAME] tables (in file order)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--variants {p}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--variants {p}: cannot read it ({getattr(e, 'strerror', None) or e}); give a TOML "
                          "file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--variants {p} is not valid TOML ({e})") from None
    table = data.get("variant")
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"--variants {p}: expected [variant.NAME] tables")
    return [_from_mapping(name, items) for name, items in table.items()]


@dataclass
class Workload:
    """What each run does.

    mode "synthetic": prefill exactly `prompt_tokens` tokens (a fixed filler text, same ids for every variant),
    then decode exactly `decode_tokens` greedy tokens ignoring end-of-sequence: pure engine throughput (ours
    through Session.generate_ids: the product's reply loop, so its decode blocks and speculation count).
    mode "messages": the product path (chat template, sampling, stop rules, speculation) on `messages`, up
    to `decode_tokens` new tokens.
    """

    name: str
    mode: str = "synthetic"
    messages: list = field(default_factory=list)
    prompt_ids: list = field(default_factory=list)  # synthetic: the exact prompt token ids (set by the runner)
    prompt_tokens: int = 512
    decode_tokens: int = 128
    greedy: bool = True
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    presence_penalty: float = 1.5
    greedy_presence_penalty: float = 0.0  # greedy runs' presence penalty (--presence-penalty without --sampled)
    seed: int = 42
    thinking_budget: int | None = None  # ours, message workloads: reasoning (prompted if not native) with this budget

    def __post_init__(self):
        if self.mode not in ("synthetic", "messages"):
            raise ConfigError(f"workload mode {self.mode!r} is not synthetic or messages")
        if self.prompt_tokens < 1 or self.decode_tokens < 1:
            raise ConfigError("--prompt-tokens and --decode-tokens must be >= 1")


def workload_file(name: str) -> Path:
    """A message file by path, or by name in ../shared/workloads (with or without .json)."""
    p = Path(name)
    if p.exists():
        return p
    for cand in (WORKLOAD_DIR / name, WORKLOAD_DIR / f"{name}.json"):
        if cand.exists():
            return cand
    known = ", ".join(sorted(f.stem for f in WORKLOAD_DIR.glob("*.json"))) if WORKLOAD_DIR.exists() else "none"
    raise ConfigError(f"workload {name!r}: no such file (shared workloads: {known})")


def read_messages_file(path: Path) -> list:
    """A messages file: a JSON list of {role, content} (or {"messages": [...]})."""
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"messages file {path}: cannot read it as UTF-8 JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"messages file {path}: its JSON is nested too deeply to be a messages file") from None
    if isinstance(obj, dict):
        obj = obj.get("messages")
    if not isinstance(obj, list) or not obj or not all(isinstance(m, dict) and "content" in m for m in obj):
        raise ConfigError(f'messages file {path} must hold a non-empty list of {{"role", "content"}} objects')
    for i, m in enumerate(obj):
        check_text(str(m["content"]), f"messages file {path}: message {i}")
    return obj


@dataclass
class Run:
    """One measured run: sent to the worker process as JSON."""

    variant: Variant
    workload: Workload
    model: str
    repeat: int = 0
    max_context: int = 2048

    def to_json(self) -> str:
        d = asdict(self)
        del d["variant"]["tree"]  # the runner's business (where the worker runs), and unknown to older trees
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> "Run":
        d = json.loads(text)
        v = Variant(**d["variant"])
        w = Workload(**d["workload"])
        return cls(variant=v, workload=w, model=d["model"], repeat=d["repeat"], max_context=d["max_context"])
