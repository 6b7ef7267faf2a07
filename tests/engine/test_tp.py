"""TP2: the shard plan (uneven heads), shard tensors that reassemble into the originals, and TP2 == TP1
greedy tokens on tiny models: CPU "devices" (ref and cpu backends, host transport) in-process, and the cuda
backend with both logical ranks on one device for each forced transport (p2p, mapped) in the CUDA simulator
(subprocess; NINFER_CUDA_REAL=1 runs that part on a real GPU, see scripts/gpu_check.sh)."""
from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from engine.config import EngineArgs, ModelArgs  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from engine.quant import dequantize  # noqa: E402
from engine.backends.tp.plan import plan_shards, shard_tensors  # noqa: E402
from reference_forward import greedy, tiny_model  # noqa: E402

PROMPT = np.array([5, 17, 3, 90, 41, 41, 0, 12], np.int32)
UNEVEN = dict(d=64, n_head=9, n_kv_head=3, head_dim=32, d_ff=256)  # SmolLM2's 9 q / 3 kv heads, small
SIM_UNEVEN = dict(d=32, n_head=6, n_kv_head=3, head_dim=16, d_ff=64)  # kv {0,1}+q 0-3 | {2}+q 4-5


def smol_args():
    return ModelArgs(arch="llama", n_layer=30, d_model=576, n_head=9, n_kv_head=3, head_dim=64, d_ff=1536,
                     vocab_size=49152)


def test_plan_smollm2_uneven_heads():
    s0, s1 = plan_shards(smol_args(), 2, ff_unit=32)
    assert (s0.kv, s0.q, s1.kv, s1.q) == ((0, 2), (0, 6), (2, 3), (6, 9))
    assert (s0.q[1] - s0.q[0]) * 64 == 384 and (s1.q[1] - s1.q[0]) * 64 == 192  # Wo input split
    assert (s0.ff, s1.ff) == ((0, 768), (768, 1536))
    assert (s0.vocab, s1.vocab) == ((0, 24576), (24576, 49152))


def test_plan_rejects_bad_tp():
    with pytest.raises(ConfigError, match="--tp 3"):
        plan_shards(smol_args(), 3)
    one_kv = ModelArgs(arch="llama", n_layer=1, d_model=64, n_head=4, n_kv_head=1, head_dim=16, d_ff=64,
                       vocab_size=10)
    with pytest.raises(ConfigError, match="KV head"):
        plan_shards(one_kv, 2)


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q4_K, QT.Q8_0], ids=lambda q: q.name)
def test_shards_reassemble(qtype):
    # K-quant rows are 256 wide; 8 heads of 32 split 4|4 puts the Wo column split (128) inside a block: F32
    kw = dict(d=256, n_head=8, n_kv_head=2, head_dim=32, d_ff=512) if qtype == QT.Q4_K else UNEVEN
    a, t = tiny_model("qwen2", qtype=qtype, **kw, vocab=96)
    shards = plan_shards(a, 2, ff_unit=256 if qtype == QT.Q4_K else 32)
    parts = [shard_tensors(a, t, s) for s in shards]
    for name, axis in [("blk.0.attn_q.weight", 0), ("blk.0.attn_k.weight", 0), ("blk.1.ffn_up.weight", 0),
                       ("blk.0.attn_output.weight", 1), ("blk.1.ffn_down.weight", 1), ("blk.0.attn_v.bias", 0)]:
        whole = dequantize(t[name])
        got = np.concatenate([dequantize(p[name]) for p in parts], axis=axis)
        np.testing.assert_array_equal(got, whole, err_msg=name)
    if qtype == QT.Q4_K:
        assert parts[0]["blk.0.attn_output.weight"].qtype == QT.F32  # split inside a 256 block
    head = np.concatenate([dequantize(p["output.weight"]) for p in parts], axis=0)
    np.testing.assert_array_equal(head, dequantize(t["token_embd.weight"]))  # tied head split by vocab


def tp_pair(a, t, backend, transport="auto", devices=(0, 1), max_batch=4):
    from engine.backends.kernels import get_kernels
    from engine.model import Model
    from engine.backends.tp.model import build_tp_model
    one = Model(a, t, get_kernels(backend if backend != "cuda" else "ref"), max_batch=max_batch)
    two = build_tp_model(a, t, EngineArgs(backend=backend, tp=2, devices=devices, transport=transport),
                         max_batch=max_batch)
    return one, two


@pytest.mark.parametrize("backend", ["ref", "cpu"])
@pytest.mark.parametrize("arch,kv_dtype", [("llama", "f16"), ("qwen3", "int8"), ("qwen2", "f16")])
def test_tp2_cpu_devices_equal_tp1(backend, arch, kv_dtype):
    a, t = tiny_model(arch, seed=5, **UNEVEN, vocab=96)
    one, two = tp_pair(a, t, backend)
    assert two.transport.name == "host" and "host memory" in two.transport_reason
    want, want_rows, _ = greedy(one, PROMPT, 6, kv_dtype, chunk=3)
    got, got_rows, cache = greedy(two, PROMPT, 6, kv_dtype, chunk=3)
    assert got == want
    tol = 1e-3 if kv_dtype == "int8" else 1e-4  # int8 KV: a tiny difference can flip a quant rounding step
    np.testing.assert_allclose(got_rows, want_rows, rtol=0, atol=tol * np.abs(want_rows).max())
    assert cache.length == len(PROMPT) + 5 and all(c.length == cache.length for c in cache.caches)


def test_tp2_all_logits_and_truncate():
    a, t = tiny_model("llama", seed=2, **UNEVEN, vocab=96)
    one, two = tp_pair(a, t, "ref")
    c1, c2 = one.new_cache(32), two.new_cache(32)
    l1 = one.forward(PROMPT, 0, c1, all_logits=True)
    l2 = two.forward(PROMPT, 0, c2, all_logits=True)  # T=8 > max_batch=4: run state and transport grow
    assert l2.shape == (len(PROMPT), 96)
    np.testing.assert_allclose(l2, l1, atol=1e-4 * np.abs(l1).max())
    c2.truncate(5)
    again = two.forward(PROMPT[5:], 5, c2, all_logits=True)  # rolled-back positions are recomputed
    np.testing.assert_allclose(again, l2[5:], atol=1e-4 * np.abs(l1).max())  # BLAS sums differ with T


# ------------------------------------------------------------------------------ cuda (simulator/GPU)
def _sim_check(transport, kv_dtype):
    a, t = tiny_model("llama", seed=4, **SIM_UNEVEN, vocab=96)
    one, two = tp_pair(a, t, "cuda", transport=transport, devices=(0, 0))
    assert two.transport.name == transport, two.transport_reason
    want, want_rows, _ = greedy(one, PROMPT[:5], 3, kv_dtype, chunk=4)
    got, got_rows, _ = greedy(two, PROMPT[:5], 3, kv_dtype, chunk=4)
    assert got == want, f"tp2 {got} vs tp1 {want}"
    err = float(np.abs(got_rows - want_rows).max())
    assert err <= 2e-3 * float(np.abs(want_rows).max()), err
    return {"tokens": got, "reason": two.transport_reason}


SIM_CASES = {"p2p_f16": ("p2p", "f16"), "mapped_int8": ("mapped", "int8")}


def worker(names):
    if os.environ.get("NINFER_CUDA_REAL") != "1":
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    from engine.backends.cuda import kernels as ck
    if ck.SIMULATOR:
        ck.LAUNCH.lanes, ck.LAUNCH.rows = 1, 32
    res = {}
    for n in names or SIM_CASES:
        try:
            res[n] = _sim_check(*SIM_CASES[n])
        except Exception:
            res[n] = traceback.format_exc(limit=5)[-2500:]
    return res


@pytest.fixture(scope="module")
def sim_results():
    from test_cuda_model import run_worker
    return run_worker(__file__, list(SIM_CASES))


def _sim_job():
    from test_cuda_model import worker_job
    return worker_job(__file__, list(SIM_CASES))


BACKGROUND = [_sim_job]


@pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None, reason="numba-cuda not installed")
@pytest.mark.parametrize("name", list(SIM_CASES))
def test_tp2_cuda_one_device_each_transport(sim_results, name):
    r = sim_results.get(name)
    assert isinstance(r, dict), r
    assert len(r["tokens"]) == 3 and r["reason"]


if __name__ == "__main__":
    if "--worker" in sys.argv:
        import json
        print(json.dumps(worker(sys.argv[sys.argv.index("--worker") + 1:])))
