"""Where the fused decode step's time goes, phase by phase, and an A-B of step versions in one process.

    PYTHONPATH=. .venv/bin/python probes/step_phases.py [--ctx 60] [--steps 400] [--rows 256] [--with MODULE]
        [--kv-dtype int8] [--model FILE.gguf] [REV ...]

--rows N (> 1) times a prompt's pass of N rows at positions ctx.. instead of a decode step (figures are
then us per pass); a pass of 32+ rows has a tail phase after each phase ("+tail").

Each REV (a git revision, or "." for the working tree; default ".") gives the source of
engine/backends/cpu/step.py, which is copied with cycle stamps (`llvm.readcyclecounter`) added after
each thread's share of a phase and after each wait, and compiled uncached; with --with MODULE (e.g.
cpu_fast: the matmuls and the quantizer; cpu_attn) also that kernel module's source at REV, where the step
imports it. The copies use this tree's other kernels and the model's weights (SmolLM2, or --model's), and run
alternately (A-B-B-A...) on the same cache and tokens, both threads, the contention guard off. Printed
per version: the step's wall time, whether its logits equal the first version's, and per phase kind,
summed over the layers (us per token, medians over the steps):
  span    from the previous phase opening to this one opening (the phases' spans add up to the step)
  work_f  the finishing thread's claimed items; work_o the other thread's
  tail    the serial tail the finisher runs (norms, rope, KV store, merges, activation quantization)
  imb     how long the other thread had nothing left while the finisher still worked on items
  wake    from the phase opening to the other thread seeing it
A version must take the same arguments as this tree's fused_forward (extra trailing buffers and
arguments are cut off).
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("NUMBA_NUM_THREADS", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STAMPS = '''

from fused_engine import cycles as _cyc
'''


def absolute(src: str) -> str:
    """A kernels module's source made importable from outside the package, compiled uncached."""
    src = re.sub(r"from \.\.\. import", "from engine import", src)
    src = re.sub(r"from \.\.\.(\w+)", r"from engine.\1", src)
    src = re.sub(r"from \.\. import", "from engine.backends import", src)
    src = re.sub(r"from \.\.(\w+)", r"from engine.backends.\1", src)
    src = re.sub(r"from \. import", "from engine.backends.cpu import", src)
    src = re.sub(r"from \.(\w+)", r"from engine.backends.cpu.\1", src)
    return src.replace("cache=True", "cache=False")


def rewire(src: str, with_mods: list[str], j: int) -> str:
    """src importing version j's copies (module_vJ) of the kernel modules in with_mods instead of the tree's."""
    def names(m):
        keep, out = [], []
        for name in (n.strip() for n in m.group(1).split(",")):
            base = name.split(" as ")[0].strip()
            alias = name.split(" as ")[-1].strip()
            if base in with_mods:
                out.append(f"import {base}_v{j} as {alias}")
            else:
                keep.append(name)
        if keep:
            out.insert(0, "from engine.backends.cpu import " + ", ".join(keep))
        return "\n".join(out)
    src = re.sub(r"^from engine\.backends\.cpu import ([\w ,]+)$", names, src, flags=re.M)
    for m in with_mods:
        src = src.replace(f"from engine.backends.cpu.{m} import", f"from {m}_v{j} import")
    return src


def instrument(src: str) -> str:
    """The step's source with stamps T[tid, phase, 0 | 1 | 2] (items done, wait over, was the finisher)."""
    src = absolute(src)
    src = src[:src.index("class FusedForward")]
    out, lines, i, in_step = [], src.split("\n"), 0, False
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("def _step_thread("):
            in_step = True
            ln = ln.replace("def _step_thread(", "def _step_thread(T, ")
        elif ln.startswith("def fused_forward(") or ln.startswith("def _passes("):
            in_step = False
            ln = ln.replace("def fused_forward(", "def fused_forward(T, ").replace("def _passes(", "def _passes(T, ")
        elif re.search(r"\b(_step_thread|_passes)\((np\.int64\(tid\)|tid),", ln):  # tid, or np.int64(tid) since 841feec
            ln = re.sub(r"\b(_step_thread|_passes)\(", r"\1(T, ", ln)
        if in_step and re.match(r"\s+\w+(, \w+)* = bufs$", ln):  # an older step: fewer buffers
            ln = ln.replace("= bufs", f"= bufs[:{ln.split('=')[0].count(',') + 1}]")
        if in_step and ln.strip() in ("ph = 0", "ph = ph0"):
            out += [ln, re.sub(r"ph = \w+", "T[tid, 0, 0] = _cyc()", ln)]
            i += 1
            continue
        if in_step and ln.strip() == "if f_:":  # a phase whose call is already "f_ = _x_phase(...)"
            ind = re.match(r"(\s+)", ln).group(1)
            out += [f"{ind}T[tid, ph, 0] = _cyc()", f"{ind}T[tid, ph, 2] = 1 if f_ else 0", ln]
            i += 1
            continue
        if in_step and re.match(r"\s+if _\w+_phase\(", ln):  # a phase: stamp between its items and its tail
            ind = re.match(r"(\s+)", ln).group(1)
            call = [ln.replace("if _", "f_ = _", 1)]
            while not call[-1].rstrip().endswith("):"):
                i += 1
                call.append(lines[i])
            call[-1] = call[-1].rstrip()[:-1]
            out += call + [f"{ind}T[tid, ph, 0] = _cyc()", f"{ind}T[tid, ph, 2] = 1 if f_ else 0", f"{ind}if f_:"]
            i += 1
            continue
        out.append(ln)
        if in_step and (ln.strip() == "wait_open(sync, ph)" or ln.strip().startswith("_wait_next(sync, ph,")):
            out.append(re.match(r"(\s+)", ln).group(1) + "T[tid, ph, 1] = _cyc()")
        i += 1
    return "\n".join(out) + STAMPS


def source(rev: str, path: str = "engine/backends/cpu/step.py") -> str:
    if rev == ".":
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            return f.read()
    return subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def used_phases(recs, n_layer: int) -> int:
    """How many phases a version's passes had: 5 per layer + 2, or for a prompt's pass (tails as phases of
    their own, cpu_attn_prefill.wide) 10 per layer + 2."""
    import numpy as np
    return 10 * n_layer + 2 if np.asarray(recs)[:, :, 5 * n_layer + 2:].any() else 5 * n_layer + 2


def breakdown(recs, us_per_tick: float, n_layer: int) -> list[tuple[str, list[float]]]:
    import numpy as np
    layer = ["qkv", "attn", "o", "gateup", "down"]
    if used_phases(recs, n_layer) > 5 * n_layer + 2:  # a prompt's pass: a tail phase after each
        layer = [k + t for k in layer for t in ("", "+tail")]
    kinds = ["embed"] + layer * n_layer + ["head"]
    acc: dict[str, list] = {}
    for r in np.asarray(recs, np.float64)[:, :, :len(kinds)] * us_per_tick:
        for p in range(1, r.shape[1]):
            fin = int(np.argmax(r[:, p, 2]))
            oth = 1 - fin
            opened_before = max(r[0, p - 1, 1], r[1, p - 1, 1])
            acc.setdefault(kinds[p], []).append((
                max(r[0, p, 1], r[1, p, 1]) - opened_before, r[fin, p, 0] - r[fin, p - 1, 1],
                r[oth, p, 0] - r[oth, p - 1, 1], r[fin, p, 1] - r[fin, p, 0], r[fin, p, 0] - r[oth, p, 0],
                r[oth, p, 1] - r[fin, p, 1]))
    n = len(recs)
    return [(k, list(np.median(np.asarray(v).reshape(n, -1, 6).sum(axis=1), axis=0))) for k, v in acc.items()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("revs", nargs="*", default=["."])
    ap.add_argument("--ctx", type=int, default=60, help="context length before the measured steps")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rows", type=int, default=1,
                    help="tokens per pass: 1 is a decode step; more is one prefill chunk (e.g. 256)")
    ap.add_argument("--with", dest="with_mods", action="append", default=[], metavar="MODULE",
                    help="each version also uses its revision's engine/backends/cpu/MODULE.py where the step imports it "
                         "(e.g. cpu_fast: the matmuls and the quantizer; cpu_attn); repeatable")
    ap.add_argument("--with-attn", action="store_true", help="the same as --with cpu_attn")
    ap.add_argument("--kv-dtype", default="f16", help="the KV cache's type (f16, int8)")
    ap.add_argument("--model", help="a GGUF file with a fused step (default: SmolLM2)")
    a = ap.parse_args()
    import numba
    import numpy as np
    from numba import njit

    from fused_engine import load_fused
    loaded = load_fused(model=a.model)
    if loaded is None:
        return 2
    eng, model, ff = loaded
    while subprocess.run(["pgrep", "-f", "engine.backends.cpu.compile_bg"], capture_output=True).stdout:
        time.sleep(1)  # a first start's helper still compiling: it would share the cores
    tmp = tempfile.mkdtemp(prefix="step_phases_")
    sys.path.insert(0, tmp)
    mods = {}
    for j, rev in enumerate(a.revs):
        with_mods = list(dict.fromkeys(a.with_mods + (["cpu_attn"] if a.with_attn else [])))
        for m in with_mods:  # each copy imports the other copies of this version (cpu_fast -> cpu_avx2, ...)
            with open(os.path.join(tmp, f"{m}_v{j}.py"), "w", encoding="utf-8") as f:
                f.write(rewire(absolute(source(rev, f"engine/backends/cpu/{m}.py")), with_mods, j))
        step_src = rewire(instrument(source(rev)), with_mods, j)
        with open(os.path.join(tmp, f"step_v{j}.py"), "w", encoding="utf-8") as f:
            f.write(step_src)
        mods[rev] = importlib.import_module(f"step_v{j}")
    n_layer = len(ff.norms[0])
    arity = {r: m.fused_forward.py_func.__code__.co_argcount - 1 for r, m in mods.items()}  # older: fewer
    cache = model.new_cache(max(2048, a.ctx + 64 + a.rows), a.kv_dtype)
    if a.ctx:  # the context before the measured passes (--ctx 0: a prompt's first chunk)
        model.forward(np.arange(1, a.ctx + 1, dtype=np.int32) % 1000 + 100, 0, cache)
    ff.guard.before = lambda: None
    ff.guard.after = lambda steps=1: None
    numba.set_num_threads(2)
    stamps = {r: np.zeros((2, 10 * n_layer + 2, 3), np.int64) for r in a.revs}  # room for a prompt's tail phases
    stamp = mods[a.revs[0]]._cyc
    cyc = njit(lambda: stamp())
    cyc()
    edges = np.zeros(2, np.int64)  # cycle count just before and just after the jitted call

    def step(rev, pos):
        def run(kv, scratch):
            edges[0] = cyc()
            args = ff.call_args(np.full(a.rows, 5, np.int32), pos, 1, kv, scratch, 2)
            mods[rev].fused_forward(stamps[rev], *args[:arity[rev]])
            edges[1] = cyc()
        cache.length = pos
        ff.guarded(a.rows, pos, cache, 1, run)
        return ff.bufs[13][0].copy()

    for rev in a.revs:
        t = time.perf_counter()
        step(rev, a.ctx)
        print(f"{rev}: compiled in {time.perf_counter() - t:.0f} s", flush=True)
    c0, t0 = cyc(), time.perf_counter()
    time.sleep(0.2)
    us_per_tick = (time.perf_counter() - t0) * 1e6 / (cyc() - c0)
    wall = {r: [] for r in a.revs}
    recs = {r: [] for r in a.revs}
    outer = {r: [] for r in a.revs}
    differ = {r: 0 for r in a.revs}
    pos = a.ctx
    for i in range(a.steps):
        outs = {}
        for rev in (a.revs if i % 2 == 0 else a.revs[::-1]):
            t = time.perf_counter()
            outs[rev] = step(rev, pos)
            wall[rev].append(time.perf_counter() - t)
            recs[rev].append(stamps[rev].copy())
            outer[rev].append(edges.copy())
        for rev in a.revs[1:]:
            differ[rev] += not np.array_equal(outs[rev], outs[a.revs[0]])
        pos = a.ctx + (pos - a.ctx + 1) % 40  # positions ctx .. ctx + 39, over and over
    warm = 20
    print(f"context {a.ctx}-{a.ctx + 39}, {a.steps} steps per version (first {warm} not counted), 2 threads")
    for rev in a.revs:
        w = np.asarray(wall[rev][warm:]) * 1e3
        same = "" if rev == a.revs[0] else f"; logits differ from {a.revs[0]} in {differ[rev]} steps"
        print(f"== {rev}: step median {np.median(w):.3f} ms, mean {w.mean():.3f} ms{same}")
        print(f"   {'phase':8s} {'span':>7s} {'work_f':>7s} {'work_o':>7s} {'tail':>7s} {'imb':>7s} {'wake':>7s}"
              "   us per token")
        total = 0.0
        for kind, vals in breakdown(recs[rev][warm:], us_per_tick, n_layer):
            total += vals[0]
            print(f"   {kind:8s} " + " ".join(f"{x:7.1f}" for x in vals))
        print(f"   spans add up to {total:.0f} us")
        t, e = np.asarray(recs[rev][warm:], np.float64), np.asarray(outer[rev][warm:], np.float64)
        pre = np.median(t[:, :, 0, 0].min(axis=1) - e[:, 0]) * us_per_tick
        emb = np.median(t[:, :, 0, 1].max(axis=1) - t[:, :, 0, 0].min(axis=1)) * us_per_tick
        post = np.median(e[:, 1] - t[:, :, used_phases(t, n_layer) - 1, 1].max(axis=1)) * us_per_tick
        call = np.median(e[:, 1] - e[:, 0]) * us_per_tick
        print(f"   the jitted call {call:.0f} us; outside the phases: call to the first stamp {pre:.1f} us, phase 0 (embedding) {emb:.1f} us, "
              f"last phase to return {post:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
