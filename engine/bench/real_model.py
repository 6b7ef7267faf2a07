"""The real default model on a machine that cannot download it: split the file into parts that travel one per
call, record greedy replies here, and compare a backend's greedy replies with them there.

The device machine (scripts/device_model.sh) takes at most 64 MiB a call with the working tree (~21 MB) and
keeps /tmp while it stays warm, so SmolLM2-135M-Instruct Q4_1 (98 MB) travels in three parts over three
calls made back to back, and the last call joins them and checks the file's sha256 before anything runs.

    python -m engine.bench.real_model split [--model PATH] [--parts 3] [--out .devmodel]
    python -m engine.bench.real_model expected [--model PATH] [--tokens 48] [--out bench/gpu_expected.json]
    python -m engine.bench.real_model join --parts-dir DIR --manifest .devmodel/manifest.json --out FILE
    python -m engine.bench.real_model check --model FILE --expected bench/gpu_expected.json --backend cuda
                                             [--tp 2] [--plain] [--json out.json]
    ncu --profile-from-start off --csv --metrics gpu__time_duration.sum \
        python -m engine.bench.real_model profile --model FILE > ncu.csv      # one decode step, plain launches
    python -m engine.bench.real_model ncu-summary ncu.csv                     # us and launches per kernel name

`expected` records, per prompt (the shared workloads and held-out chat prompts, rendered by the model's chat
template; token ids, so the device needs no tokenizer), the greedy tokens of the cpu backend (int8
activations) and of the numpy reference backend (f32 activations, the same arithmetic as the cuda kernels in
another order), and the reference's top-1 - top-2 logit margin at every step. `check` decodes the same prompts
on the given backend and reports, per prompt, whether its tokens equal each record, where they first differ,
and the reference's margin there, teacher-forced on the common prefix: a difference at a near tie (a margin
well under the backends' logit error) is rounding, not a bug.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from ..models.digest import sha256_file

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = ROOT / "bench" / "gpu_expected.json"
def split(model: Path, out: Path, parts: int) -> dict:
    """model -> out/part1..N (sizes within one byte of each other) + out/manifest.json; the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    size = model.stat().st_size
    step = -(-size // parts)
    manifest = {"file": model.name, "size": size, "sha256": sha256_file(model), "parts": []}
    with open(model, "rb") as f:
        for i in range(parts):
            p = out / f"part{i + 1}"
            p.write_bytes(f.read(step))
            manifest["parts"].append({"name": p.name, "size": p.stat().st_size, "sha256": sha256_file(p)})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def join(parts_dir: Path, manifest: dict, out: Path) -> Path:
    """The parts named by the manifest, found in parts_dir, joined into out; raises with what to do when a part
    is missing or the result's sha256 differs."""
    missing = [p["name"] for p in manifest["parts"] if not (parts_dir / p["name"]).is_file()]
    if missing:
        raise SystemExit(f"join: {', '.join(missing)} not in {parts_dir}: carry each part in its own call "
                         "while the machine stays warm (scripts/device_model.sh)")
    tmp = out.with_suffix(out.suffix + ".tmp")
    with open(tmp, "wb") as f:
        for p in manifest["parts"]:
            f.write((parts_dir / p["name"]).read_bytes())
    got = sha256_file(tmp)
    if got != manifest["sha256"]:
        tmp.unlink()
        raise SystemExit(f"join: sha256 {got[:12]} != the manifest's {manifest['sha256'][:12]}: a part is stale "
                         "or cut short; split again here and carry the parts again")
    tmp.replace(out)
    return out


def prompts() -> list[tuple[str, list[dict]]]:
    """(name, messages): the shared workloads in English and six held-out chat prompts (never trained on)."""
    out = []
    wl = ROOT.parent / "shared" / "workloads"
    for name in ("count300_plain_en", "count300_en", "geometry_en"):
        f = wl / f"{name}.json"
        if f.is_file():
            out.append((name, json.loads(f.read_text())))
    held = json.loads((ROOT / "train" / "heldout.json").read_text())
    out += [(f"heldout_{i}", m) for i, m in enumerate(held[:6])]
    return out


def greedy(model, prompt: list[int], n_new: int, kv: str = "f16") -> tuple[list[int], list[float]]:
    """Greedy tokens (no stop token: a fixed length to compare) and the top-1 - top-2 margin at each step
    (gpu.decode's walk: the prompt in one pass up to 256 tokens)."""
    from .gpu import decode
    margins: list[float] = []
    toks, _, _ = decode(model, np.asarray(prompt, np.int32), n_new, kv, margins=margins)
    return toks, margins


def runner(path: Path, backend: str, max_batch: int, tp: int = 1, plain: bool = False,
           devices: tuple[int, ...] | None = None):
    """What a user of `--backend backend [--tp N]` runs (the cpu fused step, cuda's graph decoder, TP ranks:
    Engine.load's runner); `plain`: engine.model.Model over the backend's kernels instead (max_batch rows)."""
    if plain:
        from ..backends.kernels import get_kernels
        from ..gguf import load_gguf
        from ..model import Model
        mf = load_gguf(path)
        return Model(mf.args, mf.tensors, get_kernels(backend), max_batch=max_batch)
    from ..api import Engine
    from ..config import EngineArgs
    return Engine.load(EngineArgs(model=str(path), backend=backend, tp=tp, devices=devices or (0,) * tp)).model


def expected(model_path: Path, n_new: int, items: list[tuple[str, list[int]]] | None = None) -> dict:
    """The record `check` compares with: per prompt (default: `prompts()` rendered by the file's chat template)
    its ids, the reference's and the cpu backend's greedy tokens, the reference's margins; and the instruction
    set the cpu backend compiled for (cpu_isa: its replies, and numpy's for the reference, differ between
    AVX2 and AVX-512 hosts in near ties)."""
    tok = None
    if items is None:
        from ..gguf import load_gguf
        from ..tokenizer import Tokenizer
        tok = Tokenizer.from_gguf(load_gguf(model_path))
        items = [(name, tok.encode_chat(msgs)) for name, msgs in prompts()]
    longest = max(len(ids) for _, ids in items)
    ref = runner(model_path, "ref", longest)
    cpu = runner(model_path, "cpu", longest)
    from ..backends.cpu.target import isa
    rec = {"model": model_path.name, "sha256": sha256_file(model_path), "tokens": n_new, "cpu_isa": isa(),
           "prompts": []}
    for name, ids in items:
        r_toks, r_margin = greedy(ref, ids, n_new)
        c_toks, _ = greedy(cpu, ids, n_new)
        p = {"name": name, "ids": list(ids), "ref": r_toks, "ref_margin": r_margin, "cpu": c_toks}
        p["cpu_vs_ref"] = compare(c_toks, p)  # the int8 activations' own differences from the reference
        if tok is not None:
            p["text"] = tok.decode(r_toks)
        rec["prompts"].append(p)
        print(f"{name}: {len(ids)} prompt tokens, cpu == ref: {c_toks == r_toks}", file=sys.stderr)
    return rec


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare(got: list[int], rec: dict) -> dict:
    """One prompt's report: equal to each record, where it first differs, and the reference's margin there
    (computed on the reference's own path, so it is the margin on the common prefix)."""
    out = {"name": rec["name"]}
    for key in ("ref", "cpu"):
        i = first_diff(got, rec[key])
        out[f"same_as_{key}"] = i is None
        if i is not None:
            out[f"first_diff_{key}"] = i
    i = out.get("first_diff_ref")
    if i is not None and i < len(rec["ref_margin"]):
        out["ref_margin_at_diff"] = rec["ref_margin"][i]
    return out


def check(model_path: Path, rec: dict, backend: str, tp: int = 1, plain: bool = False,
          devices: tuple[int, ...] | None = None) -> dict:
    if rec["sha256"] != sha256_file(model_path):
        raise SystemExit(f"check: {model_path} is not the file the record was made from "
                         f"({rec['model']}, sha256 {rec['sha256'][:12]}): make the record again")
    longest = max(len(p["ids"]) for p in rec["prompts"])
    t0 = time.perf_counter()
    r = runner(model_path, backend, longest, tp, plain, devices)
    res = {"backend": backend, "tp": tp, "runner": type(r).__name__, "load_s": round(time.perf_counter() - t0, 2),
           "prompts": []}
    n_tok, dt = 0, 0.0
    for p in rec["prompts"]:
        t = time.perf_counter()
        toks, _ = greedy(r, p["ids"], rec["tokens"])
        dt += time.perf_counter() - t
        n_tok += len(toks)
        res["prompts"].append(compare(toks, p))
    res["same_as_ref"] = sum(r["same_as_ref"] for r in res["prompts"])
    res["same_as_cpu"] = sum(r["same_as_cpu"] for r in res["prompts"])
    res["n_prompts"] = len(rec["prompts"])
    res["tok_s_incl_prefill"] = round(n_tok / dt, 1)
    return res


def profile(model_path: Path, steps: int = 1, prompt_len: int = 64) -> dict:
    """Decode steps of the cuda runner with plain launches (fused kernels, no graph) inside
    cuda.profile_start/stop, for `ncu --profile-from-start off` to time each kernel of one step; the prefill
    and two warm steps stay outside the profiled range."""
    from numba import cuda
    r = runner(model_path, "cuda", prompt_len)
    r.enabled, r.fallback_reason = False, "profiling"  # GraphDecoder: plain launches, so ncu sees kernels
    rec = json.loads(EXPECTED.read_text())
    vocab = r.args.vocab_size
    ids = [t % vocab for t in (rec["prompts"][0]["ids"] * 8)[:prompt_len]]
    cache = r.new_cache(prompt_len + steps + 4)
    logits = r.forward(np.asarray(ids, np.int32), 0, cache)
    pos = len(ids)
    for i in range(2 + steps):
        if i == 2:
            cuda.synchronize()
            getattr(cuda, "profile_start", lambda: None)()  # (the CUDA simulator has no profiler calls)
        logits = r.forward(np.array([int(np.argmax(logits[-1]))], np.int32), pos, cache)
        pos += 1
    cuda.synchronize()
    getattr(cuda, "profile_stop", lambda: None)()
    return {"profiled_steps": steps, "context": pos, "runner": r.describe()}


US_PER = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}  # ncu's time units in microseconds


def kernel_name(full: str) -> str:
    """The function's own name from ncu's kernel name: demangled ("cudapy::engine::...::matmul_q4[abi:..](..)")
    or Itanium-mangled ("_ZN6cudapy6engine...9matmul_q4B..." as numba emits it)."""
    if full.startswith("_ZN"):
        i, parts = 3, []
        while i < len(full) and full[i].isdigit():
            j = i
            while full[j].isdigit():
                j += 1
            n = int(full[i:j])
            parts.append(full[j:j + n])
            i = j + n
        return parts[-1] if parts else full
    return re.split(r"[\[(<]", full)[0].split("::")[-1].strip()


def ncu_summary(csv_text: str, steps: int = 1) -> dict:
    """ncu --csv --metrics gpu__time_duration.sum output -> per kernel name: launches a step, us a step, share."""
    import csv
    import io
    lines = csv_text[csv_text.find('"ID"'):] if '"ID"' in csv_text else ""
    per: dict[str, list] = {}
    for row in csv.DictReader(io.StringIO(lines)):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(row["Metric Value"].replace(",", "")) * US_PER.get(row.get("Metric Unit"), 1e-3)
        name = kernel_name(row["Kernel Name"])
        e = per.setdefault(name, [0, 0.0])
        e[0] += 1
        e[1] += v
    total = sum(v for _, v in per.values())
    kernels = {k: {"launches": n // steps, "us": round(v / steps, 1), "mean_us": round(v / n, 2),
                   "share": round(v / total, 3) if total else 0.0}
               for k, (n, v) in sorted(per.items(), key=lambda kv: -kv[1][1])}
    return {"us_per_step": round(total / steps, 1), "launches_per_step": sum(n for n, _ in per.values()) // steps,
            "kernels": kernels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.bench.real_model", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("--model")
    s.add_argument("--parts", type=int, default=3)
    s.add_argument("--out", default=str(ROOT / ".devmodel"))
    e = sub.add_parser("expected")
    e.add_argument("--model")
    e.add_argument("--tokens", type=int, default=48)
    e.add_argument("--out", default=str(EXPECTED))
    j = sub.add_parser("join")
    j.add_argument("--parts-dir", required=True)
    j.add_argument("--manifest", required=True)
    j.add_argument("--out", required=True)
    c = sub.add_parser("check")
    c.add_argument("--model", required=True)
    c.add_argument("--expected", default=str(EXPECTED))
    c.add_argument("--backend", default="cuda")
    c.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (both on device 0 with one GPU)")
    c.add_argument("--devices", help="the ranks' GPUs, e.g. 0,1 (default: every rank on GPU 0)")
    c.add_argument("--plain", action="store_true", help="engine.model.Model over the backend's kernels instead "
                   "of the backend's runner (cuda: no fused kernels, no graph)")
    c.add_argument("--json")
    f = sub.add_parser("profile", help="one decode step on the cuda runner, for ncu (scripts/device_model.sh)")
    f.add_argument("--model", required=True)
    f.add_argument("--steps", type=int, default=1)
    n = sub.add_parser("ncu-summary", help="per-kernel GPU time of ncu's --csv output")
    n.add_argument("csv")
    n.add_argument("--steps", type=int, default=1)
    n.add_argument("--json")
    o = ap.parse_args(argv)

    if o.cmd in ("split", "expected"):
        from ..paths import default_model_path
        model = Path(o.model) if o.model else default_model_path()
        if model is None or not model.is_file():
            raise SystemExit("no model file: pass --model PATH or install the default model (scripts/dev setup)")
    if o.cmd == "split":
        m = split(model, Path(o.out), o.parts)
        print(json.dumps({"size": m["size"], "sha256": m["sha256"], "parts": [p["size"] for p in m["parts"]]}))
    elif o.cmd == "expected":
        rec = expected(model, o.tokens)
        Path(o.out).write_text(json.dumps(rec) + "\n")
        print(f"wrote {o.out}: {len(rec['prompts'])} prompts, cpu == ref on "
              f"{sum(p['cpu'] == p['ref'] for p in rec['prompts'])}")
    elif o.cmd == "profile":
        print(json.dumps(profile(Path(o.model), o.steps)))
    elif o.cmd == "ncu-summary":
        res = ncu_summary(Path(o.csv).read_text(errors="replace"), o.steps)
        print(json.dumps(res))
        if o.json:
            Path(o.json).write_text(json.dumps(res) + "\n")
    elif o.cmd == "join":
        join(Path(o.parts_dir), json.loads(Path(o.manifest).read_text()), Path(o.out))
        print(f"joined {o.out}")
    else:
        res = check(Path(o.model), json.loads(Path(o.expected).read_text()), o.backend, o.tp, o.plain,
                    tuple(int(d) for d in o.devices.split(",")) if o.devices else None)
        line = json.dumps(res)
        print(line)
        if o.json:
            Path(o.json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
