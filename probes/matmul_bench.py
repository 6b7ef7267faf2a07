"""Time the fast CPU matmuls (engine/backends/cpu/fast.py) per row count T, old vs new in one process.

One "layer" is the fused step's four calls on SmolLM2-135M shapes: q/k/v (576 -> 576, 192, 192 in one
region), o (576 -> 576), gate/up (576 -> 1536 x 2), down (1536 -> 576); the head is Q8_0 576 -> 49152.
N_LAYERS random layers are swept per timing, so the weights stream from memory as in a real forward (one
layer alone would sit in L2/L3). Variants alternate (A B A B ...) so the machine's load hits both alike.

GB/s counts the bytes the kernels read (repacked weights: nibbles/int8 + f32 scales), and also the GGUF
bytes of the same matrices (the roofline unit of bench/results-cpu.md).

    NUMBA_NUM_THREADS=2 .venv/bin/python probes/matmul_bench.py --base HEAD --t 1 2 4 8 16 64
--base REV: the old kernels are cpu_fast.py at that git revision (compiled uncached, same flags).
"""
from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import numba_env  # noqa: E402,F401  (flags before numba)

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

from engine.backends.cpu import fast as cpu_fast  # noqa: E402
from engine.quant import QTensor  # noqa: E402

N_LAYERS = 30
D, F, KV, VOCAB = 576, 1536, 192, 49152
SHAPES = {"q": (D, D), "k": (KV, D), "v": (KV, D), "o": (D, D), "gate": (F, D), "up": (F, D), "down": (D, F)}
GGUF_BYTES = {QT.Q4_1: 20, QT.Q8_0: 34}


def _prepare():
    try:
        from engine.backends.cpu.repack import prepare_weight  # where the repacking lives after the move
    except ImportError:
        prepare_weight = cpu_fast.prepare_weight
    return prepare_weight


def random_weight(rng, qtype, rows, cols):
    """A repacked random weight with sane f16 scales (as tests/engine/test_speed_guard.py builds them)."""
    bb = GGUF_BYTES[qtype]
    nb = cols // 32
    raw = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    raw[..., 0:2] = (rng.random((rows, nb)) * 0.02).astype(np.float16)[..., None].view(np.uint8)
    if qtype == QT.Q4_1:
        raw[..., 2:4] = (-rng.random((rows, nb)) * 0.1).astype(np.float16)[..., None].view(np.uint8)
    return _prepare()(QTensor("w", qtype, (rows, cols), raw.reshape(rows, -1)))


def load_old(rev: str):
    """cpu_fast.py at git revision rev, as module engine.backends.cpu.fast_old (numba cache off)."""
    src = subprocess.run(["git", "show", f"{rev}:engine/backends/cpu/fast.py"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "cpu_fast_old.py"
    path.write_text(src.replace("cache=True", "cache=False"))
    spec = importlib.util.spec_from_file_location("engine.backends.cpu.fast_old", path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "engine.backends.cpu"
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


class Bufs:
    def __init__(self, t_n, rng):
        f = np.float32
        self.x = rng.standard_normal((t_n, D)).astype(f)
        self.h = rng.standard_normal((t_n, F)).astype(f)
        self.q, self.k, self.v = np.zeros((t_n, D), f), np.zeros((t_n, KV), f), np.zeros((t_n, KV), f)
        self.o, self.g, self.u, self.dn = (np.zeros((t_n, D), f), np.zeros((t_n, F), f), np.zeros((t_n, F), f),
                                           np.zeros((t_n, D), f))
        self.logits = np.zeros((t_n, VOCAB), f)
        nb = F // 32
        self.qa, self.sa, self.xs = np.zeros((t_n, F), np.int8), np.zeros((t_n, nb), f), np.zeros((t_n, cpu_fast.XS * nb), f)
        self.qa2, self.sa2, self.xs2 = (np.zeros((t_n, F), np.int8), np.zeros((t_n, nb), f),
                                        np.zeros((t_n, cpu_fast.XS * nb), f))


def stack(layers):
    """Per role: the blocks stacked over layers (L, ...) plus one acc16, as FusedForward holds them."""
    return tuple((np.stack([w[r].blocks for w in layers]), layers[0][r].acc16) for r in SHAPES)


def make_sweep(m):
    """A jitted loop over all layers calling m's kernels as the fused step does (no Python per call)."""
    from numba import njit
    mm_q4, mm_q4x2, mm_q4x3 = m.mm_q4, m.mm_q4x2, m.mm_q4x3

    @njit(nogil=True)
    def sweep(bq, bk, bv, bo, bg, bu, bdn, qa, sa, xs, qa2, sa2, xs2, q, k, v, o, g, u, dn):
        for l in range(q[0].shape[0]):
            mm_q4x3(bq, bk, bv, qa, sa, xs, q[0][l], q[1], k[0][l], k[1], v[0][l], v[1])
            mm_q4(bo, qa, sa, xs, o[0][l], o[1])
            mm_q4x2(bg, bu, qa, sa, xs, g[0][l], g[1], u[0][l], u[1])
            mm_q4(bdn, qa2, sa2, xs2, dn[0][l], dn[1])
    return sweep


def run_layers(m, sweep, stacked, b):
    """The fused step's matmul calls over all layers (activations quantized once per input, as there)."""
    nd = D // 32
    qa, sa, xs = b.qa[:, :D], b.sa[:, :nd], b.xs[:, :cpu_fast.XS * nd]
    m.quantize_rows(qa, sa, xs, b.x)
    m.quantize_rows(b.qa2, b.sa2, b.xs2, b.h)
    sweep(b.q, b.k, b.v, b.o, b.g, b.u, b.dn, qa, sa, xs, b.qa2, b.sa2, b.xs2, *stacked)


def run_head(m, head, b):
    nd = D // 32
    batched = getattr(m, "mm_q8_batched", None)  # older revisions: mm_q8 chose by itself
    if batched is not None and b.logits.shape[0] >= m.BATCHED_MIN_T:
        try:  # with xs (each block's activation sum: the vpdpbusd form's correction) since 2026-12-06
            batched(b.logits, b.qa[:, :D], b.sa[:, :nd], b.xs[:, :cpu_fast.XS * nd], head.blocks)
        except TypeError:
            batched(b.logits, b.qa[:, :D], b.sa[:, :nd], head.blocks)
    else:
        m.mm_q8(b.logits, b.qa[:, :D], b.sa[:, :nd], head.blocks, head.acc32)


def outputs(b):
    return [a.copy() for a in (b.q, b.k, b.v, b.o, b.g, b.u, b.dn, b.logits)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="git revision of the old kernels (default: none, new only)")
    ap.add_argument("--t", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    ap.add_argument("--repeats", type=int, default=5, help="timed sweeps per variant and T (the fastest kept: the machine is shared)")
    ap.add_argument("--layers", type=int, default=N_LAYERS)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time (all threads) instead of the wall clock: steadier on a "
                         "machine other jobs load (a waiting thread's spin counts too)")
    a = ap.parse_args()
    import numba
    rng = np.random.default_rng(0)
    layers = [{r: random_weight(rng, QT.Q4_1, *s) for r, s in SHAPES.items()} for _ in range(a.layers)]
    stacked = stack(layers)
    head = random_weight(rng, QT.Q8_0, VOCAB, D)
    lw_bytes = sum(w.blocks.nbytes for w in layers[0].values())
    lw_gguf = sum(r * c // 32 * GGUF_BYTES[QT.Q4_1] for r, c in SHAPES.values())
    variants = {"new": cpu_fast}
    if a.base:
        variants = {"old": load_old(a.base), "new": cpu_fast}
    sweeps = {name: make_sweep(m) for name, m in variants.items()}
    print(f"threads {numba.get_num_threads()}, {a.layers} layers x {lw_bytes / 1e6:.2f} MB (GGUF "
          f"{lw_gguf / 1e6:.2f} MB), head {head.blocks.nbytes / 1e6:.1f} MB; ms per layer / head, GB/s of kernel bytes")
    print(f"{'T':>4} {'variant':>7} {'layer ms':>9} {'GB/s':>6} {'xT=1':>5} {'head ms':>8} {'GB/s':>6} {'xT=1':>5}")
    base = {}
    for t_n in a.t:
        b = Bufs(t_n, np.random.default_rng(t_n))
        res = {}
        for name, m in variants.items():  # compile + warm, and check the variants agree
            run_layers(m, sweeps[name], stacked, b)
            run_head(m, head, b)
            res[name] = outputs(b)
        if len(res) == 2:
            for x, y in zip(res["old"], res["new"]):
                np.testing.assert_array_equal(x, y)  # the integer sums and float order are kept
        clock = time.process_time if a.cpu_time else time.perf_counter
        times = {n: ([], []) for n in variants}
        for _ in range(a.repeats):
            for name, m in variants.items():
                t0 = clock()
                run_layers(m, sweeps[name], stacked, b)
                t1 = clock()
                run_head(m, head, b)
                t2 = clock()
                times[name][0].append((t1 - t0) / a.layers)
                times[name][1].append(t2 - t1)
        for name in variants:
            lt, ht = (min(v) for v in times[name])
            if t_n == a.t[0]:
                base[name] = (lt, ht)
            bl, bh = base.get(name, (lt, ht))
            print(f"{t_n:>4} {name:>7} {lt * 1e3:9.3f} {lw_bytes / lt / 1e9:6.1f} {lt / bl:5.2f} "
                  f"{ht * 1e3:8.3f} {head.blocks.nbytes / ht / 1e9:6.1f} {ht / bh:5.2f}", flush=True)


if __name__ == "__main__":
    main()
