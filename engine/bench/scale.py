"""`ninfer-bench scale`: cost against size. Random-weight GGUFs with the exact shapes of real models
(engine/bench/shapes.py) in a Q4_K_M mix (llama.cpp's own per-tensor choice) and in Q4_1 (our fast path),
each benchmarked against llama.cpp with ninfer-bench's A-B protocol (runner.run_bench: one process per run,
ours and llama.cpp alternating, the order turned each round, the memory bandwidth probed around each round).

    ninfer-bench scale --models smollm2-360m,qwen3-0.6b            # the two smallest, both mixes
    ninfer-bench scale --models qwen3-4b --mixes q4_k_m --repeats 1 --decode-tokens 24
    ninfer-bench scale --list                                       # the shapes, parameters and file sizes

Per model and mix: the file is written (under --dir, default /tmp/ninfer-scale; deleted after its runs unless
--keep), then the synthetic workload (exactly --prompt-tokens prompt tokens, 1024 by default: the issue's
"1K context", then exactly --decode-tokens greedy tokens) runs as `ninfer-bench` runs it. Reported: decode and
prefill tok/s, peak RSS, ours / llama.cpp, and the roofline share of each at the run's mean context:
decode tok/s x (weight bytes + KV bytes per token) / the read bandwidth measured around its round
(engine/bench/bandwidth.py; the issue's target for ours: >= 70%). A size whose file does not fit on the disk,
or whose two processes' weights do not fit in the available memory, is skipped with the reason.

Our runs have the weight store off (NINFER_WEIGHT_STORE=0): a random model's repacked arrays would push the
real models' out of the store (it keeps 4); loads repack each time, which costs load time, not tok/s.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from functools import partial
from pathlib import Path

from ..errors import NinferError
from .shapes import MIXES, SHAPES, file_bytes, write_shaped

DEFAULT_DIR = Path("/tmp/ninfer-scale")
SMALLEST = ("smollm2-360m", "qwen3-0.6b")


def mem_available() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def fits(nbytes: int, folder: Path) -> str | None:
    """Why a model of nbytes cannot be measured here (None: it can). Disk: the file plus 1 GiB. Memory: one
    process at a time holds the weights (ours repacked, llama.cpp mapped) while the file sits in the page
    cache and the bandwidth probe holds a step's bytes: 2x the file plus 1 GiB."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < nbytes + (1 << 30):
        return f"needs {(nbytes + (1 << 30)) / 2**30:.1f} GiB of disk in {folder}, {free / 2**30:.1f} free"
    avail = mem_available()
    if avail and avail < 2 * nbytes + (1 << 30):
        return f"needs {(2 * nbytes + (1 << 30)) / 2**30:.1f} GiB of memory, {avail / 2**30:.1f} available"
    return None


def measure(path: Path, a, log) -> dict:
    """One model file through run_bench (ours vs llama.cpp): aggregate, ratios, roofline."""
    from .bandwidth import (
        kv_bytes_per_position,
        measure_read_bandwidth,
        probe_bytes,
        weight_bytes_per_token,
    )
    from .main import llama_cpp_available, step_bytes, synthetic_prompt_ids
    from .report import aggregate, ratios, roofline
    from .runner import run_bench
    from .variants import Variant, Workload
    variants = [Variant("ours", threads=a.threads, env={"NINFER_WEIGHT_STORE": "0"})]
    if not a.no_llama and llama_cpp_available():
        variants.append(Variant("llama.cpp", kind="llama.cpp", threads=a.threads))
    ids = synthetic_prompt_ids(str(path), a.prompt_tokens)
    wl = Workload(name=f"synthetic-{a.prompt_tokens}+{a.decode_tokens}", mode="synthetic", prompt_ids=ids,
                  prompt_tokens=len(ids), decode_tokens=a.decode_tokens)
    wbytes = weight_bytes_per_token(str(path))["bytes"]
    kv = {v.name: kv_bytes_per_position(str(path), "f16") for v in variants}
    nbytes = probe_bytes(step_bytes(wbytes, kv, variants, wl), a.threads)
    probe = partial(measure_read_bandwidth, a.threads, nbytes)
    results = run_bench(variants, wl, str(path), repeats=a.repeats, idle_gap_s=a.idle_gap,
                        max_context=a.prompt_tokens + a.decode_tokens + 16, log=log, warmup=not a.no_warmup,
                        bandwidth=probe)
    names = [v.name for v in variants]
    agg = aggregate(results, names)
    base = "llama.cpp" if "llama.cpp" in names else "ours"
    return {"aggregate": agg, "ratios": ratios(agg, base), "roofline": roofline(results, names, wbytes, kv),
            "weight_bytes_per_token": wbytes, "kv_bytes_per_position": kv["ours"], "probe_bytes": nbytes,
            "runs": results}


def row_of(model: str, mix: str, res: dict) -> dict:
    """The figures of one model and mix that the table shows."""
    agg, roof = res.get("aggregate", {}), res.get("roofline", {})
    row = {"model": model, "mix": mix, "params_b": SHAPES[model].params / 1e9, "file_gib": res.get("file_gib")}
    if "skipped" in res:
        return {**row, "note": f"skipped: {res['skipped']}"}
    for name in ("ours", "llama.cpp"):
        a = agg.get(name, {})
        for key in ("decode_tok_s", "decode_steady_tok_s", "prefill_tok_s", "peak_rss_mb"):
            if key in a:
                row[f"{name}:{key}"] = a[key]["mean"]
        if a.get("errors"):
            row[f"{name}:error"] = a["errors"][0]
        s = roof.get("steady", {}).get("share_with_kv", {}).get(name) or roof.get("share_with_kv", {}).get(name)
        if s:
            row[f"{name}:roofline_kv"] = s["pooled"]
    if roof.get("read_bandwidth_gb_s"):
        row["bandwidth_gb_s"] = roof["read_bandwidth_gb_s"]["mean"]
    return row


def markdown(rows: list[dict], a) -> str:
    def f(row, key, fmt):
        return fmt.format(row[key]) if row.get(key) is not None else "-"

    def ratio(row, key):
        o, p = row.get(f"ours:{key}"), row.get(f"llama.cpp:{key}")
        return f"{o / p:.2f}x" if o and p else "-"

    out = [(f"Synthetic workload: {a.prompt_tokens} prompt tokens, then {a.decode_tokens} greedy tokens; "
           f"{a.repeats} repeat(s) per engine, A-B alternating; {a.threads} threads. Decode: the steady rate "
           "(after the first 17 tokens) where measured. Roofline: decode x (weights + f16 KV at the mean "
           "context) / read bandwidth, pooled."), "",
           ("| model | params | mix | file GiB | decode ours | decode llama.cpp | ratio | prefill ours | "
           "prefill llama.cpp | ratio | RSS MB ours | RSS MB llama.cpp | GB/s | roofline ours | roofline llama.cpp "
           "| notes |"), "|" + "---|" * 16]
    for r in rows:
        dec = "decode_steady_tok_s" if r.get("ours:decode_steady_tok_s") else "decode_tok_s"
        notes = r.get("note") or "; ".join(f"{k.split(':')[0]}: {r[k][:160]}" for k in r if k.endswith(":error"))
        out.append(f"| {r['model']} | {r['params_b']:.2f}B | {r['mix']} | {f(r, 'file_gib', '{:.2f}')} | "
                   f"{f(r, 'ours:' + dec, '{:.1f}')} | {f(r, 'llama.cpp:' + dec, '{:.1f}')} | {ratio(r, dec)} | "
                   f"{f(r, 'ours:prefill_tok_s', '{:.1f}')} | {f(r, 'llama.cpp:prefill_tok_s', '{:.1f}')} | "
                   f"{ratio(r, 'prefill_tok_s')} | {f(r, 'ours:peak_rss_mb', '{:.0f}')} | "
                   f"{f(r, 'llama.cpp:peak_rss_mb', '{:.0f}')} | {f(r, 'bandwidth_gb_s', '{:.1f}')} | "
                   f"{f(r, 'ours:roofline_kv', '{:.0%}')} | {f(r, 'llama.cpp:roofline_kv', '{:.0%}')} | {notes} |")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer-bench scale", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--models", default=",".join(SMALLEST), help=f"comma-separated, of {', '.join(SHAPES)}, or "
                                                                f"'all' (default {','.join(SMALLEST)})")
    p.add_argument("--mixes", default=",".join(MIXES), help=f"comma-separated, of {', '.join(MIXES)}")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"where the files go (default {DEFAULT_DIR})")
    p.add_argument("--keep", action="store_true", help="keep the files after their runs")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="runs per engine, A-B alternating (default 2)")
    p.add_argument("--idle-gap", type=float, default=2.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-llama", action="store_true", help="ours only")
    p.add_argument("--no-warmup", action="store_true", help="skip ours' unmeasured first pass")
    p.add_argument("--list", action="store_true", help="print the shapes and file sizes, and exit")
    p.add_argument("--json", metavar="FILE", help="all runs and figures (rewritten after every model)")
    p.add_argument("--markdown", metavar="FILE", help="the table (rewritten after every model)")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    models = list(SHAPES) if a.models == "all" else [m.strip() for m in a.models.split(",") if m.strip()]
    mixes = [m.strip() for m in a.mixes.split(",") if m.strip()]
    bad = [m for m in models if m not in SHAPES] + [m for m in mixes if m not in MIXES]
    if bad or not models or not mixes or a.repeats < 1 or a.prompt_tokens < 1 or a.decode_tokens < 1:
        print(f"ninfer-bench scale: give --models of {', '.join(SHAPES)}, --mixes of {', '.join(MIXES)} and "
              f"counts >= 1{' (unknown: ' + ', '.join(bad) + ')' if bad else ''}", file=sys.stderr)
        return 2
    if a.list:
        for m in models:
            s = SHAPES[m]
            sizes = ", ".join(f"{x} {file_bytes(s, x) / 2**30:.2f} GiB" for x in mixes)
            print(f"{m}: {s.arch}, {s.params / 1e9:.2f}B, d {s.d_model}, {s.n_layer} layers, heads {s.n_head}/"
                  f"{s.n_kv_head} x {s.head_dim}, ffn {s.d_ff}, vocab {s.vocab}, rope {s.rope_base:g}, "
                  f"{'tied' if s.tied else 'untied'}; {sizes}")
        return 0
    from .main import machine_description
    doc = {"machine": machine_description(), "load": os.getloadavg(), "args": {k: str(v) for k, v in vars(a).items()},
           "results": {}}
    rows = []
    for m in models:
        for mix in mixes:
            nbytes = file_bytes(SHAPES[m], mix)
            res: dict = {"file_gib": nbytes / 2**30}
            why = fits(nbytes, a.dir)
            path = a.dir / f"{m}.{mix}.gguf"
            try:
                if why:
                    res["skipped"] = why
                    log(f"[scale] {m} {mix}: skipped, {why}")
                else:
                    t = time.perf_counter()
                    write_shaped(path, m, mix)
                    log(f"[scale] {m} {mix}: wrote {path} ({path.stat().st_size / 2**30:.2f} GiB, "
                        f"{time.perf_counter() - t:.0f} s); load average {os.getloadavg()[0]:.1f}")
                    res.update(measure(path, a, log))
            except NinferError as e:
                res["skipped"] = str(e)
                log(f"[scale] {m} {mix}: {e}")
            finally:
                if not a.keep:
                    path.unlink(missing_ok=True)
            res["load_after"] = os.getloadavg()
            doc["results"][f"{m}/{mix}"] = res
            rows.append(row_of(m, mix, res))
            md = markdown(rows, a)
            if a.json:
                Path(a.json).write_text(json.dumps(doc, indent=1), encoding="utf-8")
            if a.markdown:
                Path(a.markdown).write_text(md + "\n", encoding="utf-8")
    print(markdown(rows, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
