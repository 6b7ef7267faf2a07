"""Where a warm start's time to first token goes, phase by phase, in fresh processes.

    PYTHONPATH=. .venv/bin/python probes/load_phases.py [--runs 5] [--workload count300_en]

Each run is a fresh process (this script's --child mode) that stamps the clock around Engine.load's phases
(engine imports, the GGUF header, the tokenizer, numba's import, the model's weights, the fused step's
warm-up: numba's first cache load, which also pays numba's own lazy set-up) and then the first token of a greedy reply to the workload. Printed: seconds per phase, median
[min-max] over the runs. Run it with warm caches (after any start of this tree); NINFER_WEIGHT_STORE=0 in
the environment shows the weights repacked instead of read from the store.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

T0 = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG = "LOAD_PHASES "


def child(workload: str) -> None:
    stamps: list[tuple[str, float]] = []

    def stamp(name):
        stamps.append((name, time.perf_counter()))

    def around(owner, attr, name):
        fn = getattr(owner, attr)

        def wrapped(*a, **k):
            stamps.append(("before " + name, time.perf_counter()))
            out = fn(*a, **k)
            stamp(name)
            return out
        setattr(owner, attr, wrapped)

    sys.path.insert(0, ROOT)
    import engine.api as api
    import engine.backends.cpu as cpu_backend
    import engine.gguf as gguf
    import engine.model as model
    from engine.config import EngineArgs, GenerateRequest, SamplingParams
    from engine.events import TextDelta
    from engine.tokenizer import Tokenizer
    stamp("python, numpy, engine imports")
    around(gguf, "load_gguf", "GGUF header")
    around(api, "set_threads", "numba import, thread count")
    around(cpu_backend, "prepare_numba", "numba cache set-up")
    around(cpu_backend.Backend, "warm_up", "fused step warm-up")
    build = Tokenizer.from_gguf.__func__
    Tokenizer.from_gguf = classmethod(lambda cls, m: (stamps.append(("before tokenizer", time.perf_counter())),
                                                       build(cls, m), stamp("tokenizer"))[1])
    init = model.Model.__init__

    def model_init(self, *a, **k):
        stamps.append(("before model weights", time.perf_counter()))
        init(self, *a, **k)
        stamp("model weights")
    model.Model.__init__ = model_init
    eng = api.Engine.load(EngineArgs(threads=2))
    stamp("rest of load")
    with open(os.path.join(ROOT, "..", "shared", "workloads", f"{workload}.json")) as f:
        msgs = json.load(f)
    msgs = msgs["messages"] if isinstance(msgs, dict) else msgs
    req = GenerateRequest(sampling=SamplingParams(greedy=True, max_new=2))
    for ev in eng.session().generate(msgs, req):
        if isinstance(ev, TextDelta):
            stamp("template, tokens, prefill, first token")
            break
    out, prev = {}, T0
    for name, t in stamps:
        if not name.startswith("before "):
            out[name] = out.get(name, 0.0) + t - prev
        else:
            out["(between phases)"] = out.get("(between phases)", 0.0) + t - prev
        prev = t
    out["total"] = prev - T0
    print(TAG + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--workload", default="count300_en")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.workload)
        return
    runs = []
    for _ in range(a.runs):
        p = subprocess.run([sys.executable, __file__, "--child", "--workload", a.workload], capture_output=True,
                           text=True, cwd=ROOT)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith(TAG)), None)
        if line is None:
            sys.exit(f"load_phases: a run failed:\n{p.stderr[-2000:]}")
        runs.append(json.loads(line[len(TAG):]))
    for name in runs[0]:
        v = [r[name] for r in runs]
        print(f"{name:40s} {statistics.median(v):6.3f} [{min(v):.3f}-{max(v):.3f}] s")


if __name__ == "__main__":
    main()
