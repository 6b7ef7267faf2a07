"""A tiny random model end to end on the cuda backend (CUDA simulator without a GPU) gives the same greedy
tokens as the numpy reference backend, with close logits, for f16 and int8 KV caches and each architecture.

As in test_cuda_kernels.py, the simulated runs happen in one subprocess (`--worker`, NUMBA_ENABLE_CUDASIM=1 set
before numba is imported); NINFER_CUDA_REAL=1 runs the same checks on a real GPU (scripts/gpu_check.sh).
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
needs_numba_cuda = pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                      reason="numba-cuda (the cuda extra) not installed")

PROMPT = np.array([5, 17, 3, 90, 41, 41, 0], np.int32)
N_NEW = 4
SMALL = dict(d=32, n_head=2, n_kv_head=1, head_dim=16, d_ff=64)  # the simulator runs ~1 ms per GPU thread
# name -> (tiny_model kwargs, kv dtype, slow?)
CASES = {
    "llama_f16": (dict(arch="llama", **SMALL), "f16", False),
    "qwen3_qknorm_int8": (dict(arch="qwen3", qtype="Q8_0", embd_qtype="Q4_1", tied=False, **SMALL), "int8", False),
    "qwen2_bias": (dict(arch="qwen2", qtype="Q4_0", embd_qtype="F16", **SMALL), "f16", True),
    "llama_gqa_int8": (dict(arch="llama", seed=1), "int8", True),
    "graph_qwen2_int8": (dict(arch="qwen2", qtype="Q4_1", embd_qtype="Q8_0", seed=2, **SMALL), "int8", False),
    "graph_llama_gqa_f16": (dict(arch="llama", qtype="Q8_0", seed=3), "f16", True),
}


def _check(name):
    from gguf import GGMLQuantizationType as QT

    from engine.backends.kernels import get_kernels
    from engine.backends.cuda import kernels as ck
    from engine.model import Model
    from reference_forward import greedy, tiny_model

    kw, kv_dtype, _ = CASES[name]
    kw = {k: (QT[v] if k.endswith("qtype") else v) for k, v in kw.items()}
    a, tensors = tiny_model(**kw, vocab=96)
    want, want_logits, _ = greedy(Model(a, tensors, get_kernels("ref"), max_batch=4), PROMPT, N_NEW, kv_dtype)
    model = Model(a, tensors, get_kernels("cuda"), max_batch=4)
    if name.startswith("graph_"):  # decode steps replay a captured graph (a recorded launch list in the sim)
        from engine.backends.cuda.graph import GraphDecoder
        model = GraphDecoder(model)
        if ck.SIMULATOR:  # and decode attention is split (4 splits of 8 over the 32-slot cache) as on a GPU
            ck.LAUNCH.split_min_cap, ck.LAUNCH.split_len = 16, 8
    n0 = ck.LAUNCHES[0]
    got, got_logits, _ = greedy(model, PROMPT, N_NEW, kv_dtype)
    launches = (ck.LAUNCHES[0] - n0)
    if name.startswith("graph_"):
        assert model.fused, model.fused_reason  # prefill and the captured steps ran the fused kernels
        assert model.fallback_reason is None, model.fallback_reason
        assert model.replays == N_NEW - 2, model.replays  # the first decode step runs plainly and captures
    assert got == want, f"greedy tokens differ: cuda {got} vs ref {want}"
    err = float(np.abs(got_logits - want_logits).max())
    assert err <= 2e-3 * float(np.abs(want_logits).max()), f"logits differ by {err}"
    return {"tokens": got, "launches": launches, "max_err": err}


def worker(names):
    if os.environ.get("NINFER_CUDA_REAL") != "1":
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    sys.path[:0] = [str(ROOT), str(HERE)]
    from engine.backends.cuda import kernels as ck
    if ck.SIMULATOR:  # one thread per weight row, 32 rows a block: same code, fewer simulated threads
        ck.LAUNCH.lanes, ck.LAUNCH.rows = 1, 32
    res = {}
    for name in names or CASES:
        try:
            res[name] = _check(name)
        except Exception:
            res[name] = traceback.format_exc(limit=4)[-2000:]
    return res


def worker_job(script, names, timeout=900):
    """`script --worker names...` under the CUDA simulator, as a background job (tests/background.py); None
    without numba-cuda. The job's key names the cases: a job of other cases is another job (the slow cases'
    test once got the default cases' verdicts, queued with the session under the script's name alone)."""
    import background  # tests/ (not on the path of a --worker run)
    if importlib.util.find_spec("numba_cuda") is None:
        return None
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", NUMBA_NUM_THREADS="2", PYTHONPATH=str(ROOT))
    return background.Job(f"cuda-sim:{Path(script).name}[{','.join(names)}]",
                          [sys.executable, str(script), "--worker", *names], env=env, timeout=timeout)


def run_worker(script, names, timeout=900):
    """The JSON verdicts of `script --worker names...` under the CUDA simulator (started with the session)."""
    import background
    return background.result_json(worker_job(script, names, timeout), "cuda worker")


FAST = [n for n, c in CASES.items() if not c[2]]
BACKGROUND = [lambda: worker_job(__file__, FAST)]


@pytest.fixture(scope="module")
def results():
    return run_worker(__file__, FAST)


@needs_numba_cuda
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if not c[2]])
def test_tiny_model_greedy_matches_ref(results, name):
    r = results.get(name)
    assert isinstance(r, dict), r
    assert len(r["tokens"]) == N_NEW and r["launches"] > 0


@needs_numba_cuda
@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[2]])
def test_tiny_model_greedy_matches_ref_slow(name):
    r = run_worker(__file__, [name])[name]
    assert isinstance(r, dict), r


if __name__ == "__main__":
    if "--worker" in sys.argv:
        print(json.dumps(worker(sys.argv[sys.argv.index("--worker") + 1:])))
