"""`ninfer-bench`: A-B-A-B benchmark of named engine configurations (and llama.cpp) on one workload.

    ninfer-bench                                   # ours vs llama.cpp (if installed), synthetic 512 + 128
    ninfer-bench --variant base: --variant i8:kv_dtype=int8 --variant llama.cpp --repeats 3
    ninfer-bench --variant a: --variant a-busy:busy=1          # decode with another process on one core
    ninfer-bench --workload count300_en --sampled --variant plain: --variant ngram:spec=ngram,draft_tokens=3
    ninfer-bench --variants bench.toml --json out.json --markdown out.md
    ninfer-bench --variant new: --variant old:tree=../base --variant llama.cpp   # two builds, one run
    ninfer-bench speculative --help     # other benchmarks: speculative decoding (speculative.py), gpu (gpu.py)

Synthetic workload (default): exactly --prompt-tokens prompt tokens (the same ids for every variant), then
exactly --decode-tokens greedy tokens, end-of-sequence ignored. Message workloads (--workload / --messages /
--prompt) go through the chat template and the sampling chain and stop where the model stops.
Prefix reuse is disabled in every run (each run is its own process with an empty cache) for repeatability.
Results: a table on stdout (mean [min-max] per variant, ratios vs --baseline), progress on stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

from ..errors import NinferError
from .variants import Variant, Workload, load_variants_toml, parse_variant, read_messages_file, workload_file

FILLER = ("In the valley below the old mill, farmers counted their sheep at dawn and wrote the numbers in a "
          "ledger: {i} sheep on the north field, {j} near the river, and a few strays by the {w} fence. ")
WORDS = ("red", "stone", "cedar", "broken", "eastern", "painted", "iron", "willow")


def synthetic_prompt_ids(model_path: str, n_tokens: int) -> list[int]:
    """Exactly n_tokens ids of a fixed filler text (deterministic; same ids for every variant)."""
    from ..gguf import load_gguf
    from ..tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(load_gguf(model_path))
    text, i = "", 0
    ids: list[int] = []
    while len(ids) < n_tokens:
        text += "".join(FILLER.format(i=i * 7 + k, j=i * 3 + k, w=WORDS[(i + k) % len(WORDS)]) for k in range(8))
        i += 8
        ids = tok.encode(text, add_bos=bool(getattr(tok, "add_bos", False)))
    return ids[:n_tokens]


def llama_cpp_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("llama_cpp") is not None


def machine_description() -> dict:
    """CPU model, cores, memory, OS and versions: goes next to every committed result."""
    info = {"platform": platform.platform(), "python": platform.python_version(), "machine": platform.machine()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
        flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
        info["simd"] = " ".join(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx")) or f == "sse4_2")
    except OSError:
        info["cpu"] = platform.processor()
    import os
    info["cores"] = os.cpu_count()
    try:
        with open("/proc/meminfo") as f:
            info["mem_gb"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    from importlib import metadata
    for pkg in ("numba", "llvmlite", "numpy", "llama_cpp_python"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return info


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("model", nargs="?", help="GGUF file (default: the configured/embedded model)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:key=val,...",
                   help="a configuration; keys: EngineArgs fields (backend, kv_dtype, spec, draft_tokens, "
                        "prefill_chunk ...), threads, busy, cold, kind=llama.cpp, env.NAME, tree=PATH (another "
                        "checkout of ours, e.g. a git worktree of an earlier commit)")
    p.add_argument("--variants", metavar="FILE.toml", help="variants from [variant.NAME] tables")
    p.add_argument("--baseline", help="variant the ratios are relative to (default: llama.cpp if present, else "
                                      "the first)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--workload", help="a message file in ../shared/workloads (e.g. count300_en) or a path")
    src.add_argument("--messages", metavar="FILE", help="a messages JSON file")
    src.add_argument("--prompt", help="one user message")
    p.add_argument("--prompt-tokens", type=int, default=512, help="synthetic prompt length (default 512)")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens decoded per run (default 128)")
    p.add_argument("--sampled", action="store_true", help="user preset T=0.7 top-p 0.8 top-k 20 presence 1.5 "
                                                           "seed 42 (message workloads); default greedy")
    p.add_argument("--presence-penalty", type=float, metavar="P",
                   help="presence penalty: with --sampled instead of the preset's 1.5; without, greedy with it")
    p.add_argument("--top-k", type=int, metavar="K", help="with --sampled: top-k K instead of the preset's 20 "
                                                          "(0: off, the full-vocabulary path)")
    p.add_argument("--thinking-budget", type=int, metavar="N",
                   help="message workloads, our engine only: reason first (the model's markers, or prompted "
                        "ones) with a budget of N tokens")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per variant, interleaved A-B, B-A (the order turns each round; default 2)")
    p.add_argument("--idle-gap", type=float, default=2.0, help="seconds of idle between runs (default 2)")
    p.add_argument("--threads", type=int, default=2, help="threads for variants that do not set them (default 2)")
    p.add_argument("--busy-core", action="store_true", help="run every variant with a busy process on core 0")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--no-warmup", action="store_true", help="skip the unmeasured cache-populating first pass")
    p.add_argument("--no-roofline", action="store_true", help="skip the bandwidth measurement")
    p.add_argument("--json", metavar="FILE", help="write all runs + aggregates as JSON")
    p.add_argument("--markdown", metavar="FILE", help="write the table as Markdown")
    return p


def _variants(a) -> list[Variant]:
    vs = load_variants_toml(a.variants) if a.variants else []
    vs += [parse_variant(t) for t in a.variant]
    if not vs:
        vs = [Variant("ours")]
        if llama_cpp_available() and a.thinking_budget is None:
            vs.append(Variant("llama.cpp", kind="llama.cpp"))
    if a.thinking_budget is not None and any(v.kind == "llama.cpp" for v in vs):
        raise NinferError("--thinking-budget: llama.cpp has no thinking budget; leave its variant out")
    names = [v.name for v in vs]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise NinferError(f"variant names must be unique: {', '.join(sorted(dup))}")
    explicit_threads = {t.partition(":")[0] for t in a.variant if "threads=" in t}
    out = []
    for v in vs:
        if v.name not in explicit_threads and a.threads != 2:
            v = replace(v, threads=a.threads)
        if a.busy_core:
            v = replace(v, busy=True)
        if v.kind == "llama.cpp" and not llama_cpp_available():
            raise NinferError(f"variant {v.name!r} needs llama-cpp-python: pip install llama-cpp-python "
                              "(a benchmark/test tool only, never a runtime dependency)")
        out.append(v)
    return out


def _message_option(a, option: str, value) -> bool:
    """Whether a message-workload-only option is given; one-line errors for a negative value or the
    synthetic token prompt (which decodes plain greedy)."""
    if value is None:
        return False
    if value < 0:
        raise NinferError(f"{option} {value}: give a value >= 0")
    if not (a.workload or a.messages or a.prompt):
        raise NinferError(f"{option} applies to message workloads (--workload, --messages or --prompt); the "
                          "synthetic token prompt decodes plain greedy")
    return True


def _workload(a, model: str) -> Workload:
    sampling = {} if not a.sampled else {"greedy": False}
    if _message_option(a, "--presence-penalty", a.presence_penalty):
        sampling["presence_penalty" if a.sampled else "greedy_presence_penalty"] = a.presence_penalty
    if _message_option(a, "--top-k", a.top_k):
        if not a.sampled:
            raise NinferError("--top-k applies with --sampled (greedy runs take the top token)")
        sampling["top_k"] = a.top_k
    if _message_option(a, "--thinking-budget", a.thinking_budget):
        sampling["thinking_budget"] = a.thinking_budget
    if a.workload or a.messages or a.prompt:
        if a.prompt:
            msgs, name = [{"role": "user", "content": a.prompt}], "prompt"
        else:
            path = workload_file(a.workload) if a.workload else workload_file(a.messages)
            msgs, name = read_messages_file(path), path.stem
        return Workload(name=name, mode="messages", messages=msgs, decode_tokens=a.decode_tokens, **sampling)
    if a.prompt_tokens + a.decode_tokens > a.max_context:  # else the runs stop short, reported as if whole
        raise NinferError(f"--prompt-tokens {a.prompt_tokens} + --decode-tokens {a.decode_tokens} do not fit "
                          f"--max-context {a.max_context}; raise --max-context or lower one of them")
    ids = synthetic_prompt_ids(model, a.prompt_tokens)
    return Workload(name=f"synthetic-{a.prompt_tokens}+{a.decode_tokens}", mode="synthetic", prompt_ids=ids,
                    prompt_tokens=len(ids), decode_tokens=a.decode_tokens, **sampling)


def probe_context(wl: Workload) -> int:
    """Positions of context the bandwidth probe adds KV bytes for: the workload's mean context while it
    decodes (the prompt and half the reply) - a synthetic prompt's length is known; a message workload's is
    not before its chat template is applied, so only the reply counts there (a lower bound: a smaller probe,
    a faster memory level, a lower share)."""
    return (wl.prompt_tokens if wl.mode == "synthetic" else 0) + wl.decode_tokens // 2


def step_bytes(wbytes: int, kv: dict[str, int], variants: list, wl: Workload) -> int:
    """Bytes a decode step reads at the workload's mean context: the weights (wbytes) plus the KV cache of
    probe_context positions, in the smallest cache layout among our variants (kv: variant -> bytes per
    position; int8 when one decodes with it: again the smaller probe)."""
    return wbytes + min(kv[v.name] for v in variants if v.kind == "ours") * probe_context(wl)


# The other benchmarks, each a module of this package with its own options: `ninfer-bench NAME ...`.
SUBCOMMANDS = ("speculative", "gpu", "accuracy", "scale")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS and not Path(argv[0]).exists():  # a model file of that name wins
        import importlib
        return importlib.import_module(f".{argv[0]}", __package__).main(argv[1:])
    a = build_parser().parse_args(argv)
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        from .. import paths
        model = str(paths.resolve_model(a.model))
        variants = _variants(a)
        if a.repeats < 1:
            raise NinferError("--repeats must be >= 1")
        if not (math.isfinite(a.idle_gap) and 0 <= a.idle_gap <= 3600):
            raise NinferError(f"--idle-gap must be a number of seconds in [0, 3600], got {a.idle_gap}")
        baseline = a.baseline or next((v.name for v in variants if v.kind == "llama.cpp"), variants[0].name)
        if baseline not in {v.name for v in variants}:
            raise NinferError(f"--baseline {baseline!r} is not one of the variants ({', '.join(v.name for v in variants)})")
        wl = _workload(a, model)
        for flag, out in (("--json", a.json), ("--markdown", a.markdown)):
            _check_writable(flag, out)
    except NinferError as e:
        print(f"ninfer-bench: {e}", file=sys.stderr)
        return 2
    from .report import aggregate, markdown_table, ratios, roofline, table
    from .runner import run_bench
    machine = machine_description()
    log(f"ninfer-bench: {len(variants)} variant(s) x {a.repeats} repeat(s), interleaved A-B, B-A, "
        f"idle gap {a.idle_gap} s; "
        f"workload {wl.name}; prefix reuse disabled in every run (fresh process, empty cache)")
    log(f"machine: {machine.get('cpu')} ({machine.get('cores')} cores), {machine.get('simd')}")
    t0 = time.time()
    probe = wbytes = kv = None
    if not a.no_roofline and any(v.kind == "ours" for v in variants):
        from .bandwidth import kv_bytes_per_position, measure_read_bandwidth, probe_bytes, weight_bytes_per_token
        threads = max(v.threads for v in variants)
        wbytes = weight_bytes_per_token(model)["bytes"]
        kv = {v.name: kv_bytes_per_position(model, v.engine.get("kv_dtype", "f16") if v.kind == "ours" else "f16")
              for v in variants}
        sbytes = step_bytes(wbytes, kv, variants, wl)
        nbytes = probe_bytes(sbytes, threads)
        log(f"[bandwidth] probe: {nbytes >> 20} MiB, what a decode step reads at {probe_context(wl)} positions of "
            f"context ({wbytes / 1e6:.1f} MB of weights, {(sbytes - wbytes) / 1e6:.1f} MB of KV cache)")
        probe = partial(measure_read_bandwidth, threads, nbytes)
    results = run_bench(variants, wl, model, repeats=a.repeats, idle_gap_s=a.idle_gap,
                        max_context=a.max_context, log=log, warmup=not a.no_warmup, bandwidth=probe)
    agg = aggregate(results, [v.name for v in variants])
    rat = ratios(agg, baseline)
    roof = {}
    if probe:
        roof = roofline(results, [v.name for v in variants], wbytes, kv)
        if roof:
            roof["probe_bytes"] = nbytes
    print(table(agg, rat, baseline, roof))
    doc = {"machine": machine, "model": model, "workload": {k: v for k, v in asdict(wl).items() if k != "prompt_ids"},
           "variants": [asdict(v) for v in variants], "baseline": baseline, "repeats": a.repeats,
           "idle_gap_s": a.idle_gap, "prefix_reuse": False, "started": t0, "elapsed_s": time.time() - t0,
           "aggregate": agg, "ratios": rat, "roofline": roof, "runs": results}
    written = True
    for flag, out, text in (("--json", a.json, lambda: json.dumps(doc, indent=1)),
                            ("--markdown", a.markdown, lambda: markdown_table(agg, rat, baseline) + "\n")):
        if out:
            try:
                Path(out).write_text(text(), encoding="utf-8")
            except OSError as e:  # checked before the runs; the disk can still fill meanwhile
                print(f"ninfer-bench: cannot write {flag} {out} ({e.strerror or e}); the table above has the "
                      "figures", file=sys.stderr)
                written = False
    return 0 if written and all(r.get("ok") for r in results) else 1


def _check_writable(flag: str, out: str | None) -> None:
    """Fail before the runs (minutes) rather than after them when an output file cannot be written."""
    if not out:
        return
    p = Path(out)
    if p.is_dir():
        raise NinferError(f"{flag} {out} is a directory; give a file name")
    if not p.parent.is_dir():
        raise NinferError(f"{flag} {out}: the folder {p.parent} does not exist; create it or pick another path")
    if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise NinferError(f"{flag} {out} is not writable; pick another path")


if __name__ == "__main__":
    sys.exit(main())
