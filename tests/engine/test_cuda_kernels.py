"""cuda kernels: type-checked for sm_70 and sm_90 with compile_ptx, and run against kernels/ref.py.

Without a GPU the runs go through the CUDA simulator. NUMBA_ENABLE_CUDASIM must be set before numba is
imported, so the simulated checks run in ONE subprocess (this file executed as a script, `--worker`) whose
JSON verdicts the tests below read; the pytest process itself keeps a normal numba. With `NINFER_CUDA_REAL=1`
(scripts/gpu_check.sh, on a GPU) the worker runs on the real device with full-size launch geometry instead.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
HAVE_NUMBA_CUDA = __import__("importlib").util.find_spec("numba_cuda") is not None
needs_numba_cuda = pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda (the cuda extra) not installed")


# -------------------------------------------------------------------------------- checks (worker side)
def _close(got, want, rtol, atol_rel):
    scale = float(np.abs(want).max()) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol_rel * max(scale, 1e-6))


def _checks():
    """name -> zero-argument function raising on mismatch; runs wherever numba.cuda points (sim or GPU)."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    from gguf import GGMLQuantizationType as QT

    from engine.backends.cuda import kernels as ck
    from engine.backends.ref import kernels as ref
    from reference_forward import random_qtensor

    rng = np.random.default_rng(7)
    dev, host = ck.to_device, ck.to_host
    checks = {}

    def matmul_check(qtype, t_n, d=22, n=512):
        def run():
            qt = random_qtensor(qtype, d, n, rng)
            x = rng.standard_normal((t_n, n)).astype(np.float32)
            want = np.zeros((t_n, d), np.float32)
            ref.matmul(want, x, ref.prepare_weight(qt), None)
            out = dev(np.full((t_n, d), np.nan, np.float32))
            ck.matmul(out, dev(x), ck.prepare_weight(qt), ck.new_scratch(t_n, n))
            _close(host(out), want, 1e-4, 1e-4)
        return run

    for qt in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K, QT.F16, QT.F32, QT.BF16):
        checks[f"matmul_{qt.name}_T1"] = matmul_check(qt, 1)
        checks[f"matmul_{qt.name}_T5"] = matmul_check(qt, 5)
    checks["matmul_Q4_1_T11"] = matmul_check(QT.Q4_1, 11, d=9, n=256)  # two T tiles, d not a multiple of rows

    def embed_check(qtype):
        def run():
            qt = random_qtensor(qtype, 40, 256, rng)
            tok = np.array([3, 0, 39, 3], np.int32)
            want = np.zeros((4, 256), np.float32)
            ref.embed(want, ref.prepare_weight(qt), tok)
            out = dev(np.zeros((4, 256), np.float32))
            ck.embed(out, ck.prepare_weight(qt), dev(tok))
            _close(host(out), want, 1e-6, 1e-6)
        return run

    for qt in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q6_K, QT.F16, QT.F32):
        checks[f"embed_{qt.name}"] = embed_check(qt)

    def elementwise():
        x = rng.standard_normal((3, 64)).astype(np.float32)
        y = rng.standard_normal((3, 64)).astype(np.float32)
        w = rng.standard_normal(64).astype(np.float32)
        for name, args in [("rmsnorm", (x, w, 1e-5)), ("swiglu", (x, y))]:
            want = np.zeros_like(x)
            getattr(ref, name)(want, *args)
            out = dev(np.zeros_like(x))
            getattr(ck, name)(out, *[dev(a) if isinstance(a, np.ndarray) else a for a in args])
            _close(host(out), want, 1e-5, 1e-6)
        for name, arg in [("residual_add", y), ("bias_add", w)]:
            want = x.copy()
            getattr(ref, name)(want, arg)
            out = dev(x)
            getattr(ck, name)(out, dev(arg))
            _close(host(out), want, 1e-6, 1e-7)
    checks["elementwise"] = elementwise

    def argmax():
        logits = rng.standard_normal((3, 1000)).astype(np.float32)
        logits[1, 10] = logits[1, 500] = 9.0  # tie: the first wins
        want = np.zeros(3, np.int32)
        ref.argmax(want, logits)
        out = dev(np.full(3, -1, np.int32))
        ck.argmax(out, dev(logits))
        np.testing.assert_array_equal(host(out), want)
    checks["argmax"] = argmax

    def rope_check(neox):
        def run():
            x = rng.standard_normal((3, 4, 16)).astype(np.float32)
            inv = (1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
            want = x.copy()
            ref.rope(want, 1000, inv, neox)
            out = dev(x)
            ck.rope(out, 1000, dev(inv), neox)
            _close(host(out), want, 1e-5, 1e-6)
        return run
    checks["rope_norm"] = rope_check(False)
    checks["rope_neox"] = rope_check(True)

    def rope_qkv(neox, store):
        """The fused QKV epilogue (cuda/fused.py): bias, RoPE of q and k, v copied, k and v into an f16 cache
        at pos0 + t when store; == ref's bias_add, rope and the f16 store."""
        def run():
            t_n, n_h, n_kv, hd, pos0, cap = 2, 3, 1, 16, 5, 9
            qkv = rng.standard_normal((t_n, (n_h + 2 * n_kv) * hd)).astype(np.float32)
            bias = rng.standard_normal(qkv.shape[1]).astype(np.float32)
            inv = (1.0 / 10000.0 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
            full = qkv + bias
            q = full[:, :n_h * hd].reshape(t_n, n_h, hd).copy()
            k = full[:, n_h * hd:(n_h + n_kv) * hd].reshape(t_n, n_kv, hd).copy()
            v = full[:, (n_h + n_kv) * hd:].reshape(t_n, n_kv, hd)
            ref.rope(q, pos0, inv, neox)
            ref.rope(k, pos0, inv, neox)
            oq, okk, ov = (dev(np.zeros(a.shape, np.float32)) for a in (q, k, v))
            kc, vc = dev(np.zeros((cap, n_kv, hd), np.float16)), dev(np.zeros((cap, n_kv, hd), np.float16))
            ck._launch("rope_qkv", 1, ck.LAUNCH.elt, oq, okk, ov, dev(qkv), dev(bias), 1, *ck._pos_args(pos0),
                       dev(inv), int(neox), kc, vc, int(store))
            for got, want in ((oq, q), (okk, k), (ov, v)):
                _close(host(got), want, 1e-5, 1e-6)
            want_k, want_v = np.zeros((cap, n_kv, hd), np.float16), np.zeros((cap, n_kv, hd), np.float16)
            if store:
                want_k[pos0:pos0 + t_n], want_v[pos0:pos0 + t_n] = host(okk), host(ov)
            np.testing.assert_array_equal(host(kc), want_k)
            np.testing.assert_array_equal(host(vc), want_v)
        return run
    checks["rope_qkv_store"] = rope_qkv(False, True)
    checks["rope_qkv_neox_nostore"] = rope_qkv(True, False)

    def attention_check(kv_dtype, hd, split=False):
        def run():
            if split:  # split attention: 4 splits of 8 positions over a 32-slot cache, the last ones empty
                saved = (ck.LAUNCH.split_min_cap, ck.LAUNCH.split_len)
                ck.LAUNCH.split_min_cap, ck.LAUNCH.split_len = 16, 8
                try:
                    n0 = ck.LAUNCHES[0]
                    body(3, 4, 2, 32, 13)
                    assert ck.LAUNCHES[0] - n0 == 4, "expected 2 stores + split + combine"
                    return
                finally:
                    ck.LAUNCH.split_min_cap, ck.LAUNCH.split_len = saved
            n0 = ck.LAUNCHES[0]
            body(3, 4, 2, 16, 5)
            assert ck.LAUNCHES[0] - n0 == 3, "expected 2 stores + one attention launch"

        def body(t_n, n_head, n_kv, cap, pos0):
            q = rng.standard_normal((t_n, n_head, hd)).astype(np.float32)
            k = rng.standard_normal((cap, n_kv, hd)).astype(np.float32)
            v = rng.standard_normal((cap, n_kv, hd)).astype(np.float32)
            scale = 1.0 / np.sqrt(hd)
            want = np.zeros_like(q)
            out = dev(np.zeros_like(q))
            if kv_dtype == "f16":
                rk, rv = np.zeros((cap, n_kv, hd), np.float16), np.zeros((cap, n_kv, hd), np.float16)
                ref.kv_store_f16(rk, rv, k[:pos0 + t_n], v[:pos0 + t_n], 0)
                ref.attention_f16(want, q, rk, rv, pos0, scale)
                dk, dv = dev(np.zeros_like(rk)), dev(np.zeros_like(rv))
                ck.kv_store_f16(dk, dv, dev(k[:pos0]), dev(v[:pos0]), 0)  # two stores: offsets matter
                ck.kv_store_f16(dk, dv, dev(k[pos0:pos0 + t_n]), dev(v[pos0:pos0 + t_n]), pos0)
                np.testing.assert_array_equal(host(dk), rk)
                ck.attention_f16(out, dev(q), dk, dv, pos0, scale)
            else:
                g = ref.kv_group(hd)
                arrs = [np.zeros((cap, n_kv, hd), np.int8), np.zeros((cap, n_kv, hd // g), np.float32),
                        np.zeros((cap, n_kv, hd), np.int8), np.zeros((cap, n_kv, hd // g), np.float32)]
                ref.kv_store_int8(*arrs, k[:pos0 + t_n], v[:pos0 + t_n], 0)
                ref.attention_int8(want, q, *arrs, pos0, scale)
                darrs = [dev(np.zeros_like(a)) for a in arrs]
                ck.kv_store_int8(*darrs, dev(k[:pos0]), dev(v[:pos0]), 0)
                ck.kv_store_int8(*darrs, dev(k[pos0:pos0 + t_n]), dev(v[pos0:pos0 + t_n]), pos0)
                got_q = host(darrs[0]).astype(np.int32)
                assert np.abs(got_q - arrs[0]).max() <= 1, "int8 K quants differ by more than one step"
                _close(host(darrs[1]), arrs[1], 1e-6, 1e-7)
                ck.attention_int8(out, dev(q), *darrs, pos0, scale)
            _close(host(out), want, 1e-4, 1e-4)
        return run
    for kvd in ("f16", "int8"):
        checks[f"attention_{kvd}_hd64"] = attention_check(kvd, 64)
        checks[f"attention_split_{kvd}"] = attention_check(kvd, 32, split=True)
    checks["attention_f16_hd16"] = attention_check("f16", 16)
    return checks


def worker(names: list[str] | None = None) -> dict:
    """Run the checks (all, or `names`); name -> "ok" | error text."""
    real = os.environ.get("NINFER_CUDA_REAL") == "1"
    if not real:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # must precede the first numba import
    results = {}
    for name, fn in _checks().items():
        if names and name not in names:
            continue
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=3)[-1500:]
    return results


# ---------------------------------------------------------------------------------- tests (pytest side)
EXPECTED = (
    [f"matmul_{q}_T{t}" for q in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "F16", "F32", "BF16") for t in (1, 5)]
    + ["matmul_Q4_1_T11"] + [f"embed_{q}" for q in ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "F16", "F32")]
    + ["elementwise", "argmax", "rope_norm", "rope_neox", "rope_qkv_store", "rope_qkv_neox_nostore",
       "attention_f16_hd64", "attention_int8_hd64", "attention_f16_hd16", "attention_split_f16", "attention_split_int8"])


def _sim_job():
    """The simulated checks in one subprocess, started with the session (tests/background.py)."""
    import background  # tests/ (not on the path of a --worker run)
    if not HAVE_NUMBA_CUDA:
        return None
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", NUMBA_NUM_THREADS="2", PYTHONPATH=str(ROOT))
    env.pop("NINFER_CUDA_REAL", None) if os.environ.get("NINFER_CUDA_REAL") != "1" else None
    return background.Job("cuda-sim:kernels", [sys.executable, __file__, "--worker"], env=env, timeout=600)


BACKGROUND = [_sim_job]


@pytest.fixture(scope="module")
def sim_results():
    import background
    return background.result_json(_sim_job(), "cuda worker")


@needs_numba_cuda
@pytest.mark.parametrize("name", EXPECTED)
def test_kernel_vs_ref(sim_results, name):
    assert name in sim_results, f"check {name} did not run"
    assert sim_results[name] == "ok", sim_results[name]


def ptx_report() -> dict:
    """{"sm70"|"sm90": {"n": kernels compiled, "failures": [...]}}: every kernel, every explicit signature."""
    from numba import cuda

    from engine.backends.cuda import ops as cuda_ops
    from engine.backends.cuda import quant as cuda_quant
    out = {}
    for cc in ((7, 0), (9, 0)):
        failures, n = [], 0
        for table in (cuda_quant.KERNELS, cuda_ops.KERNELS):
            for name, (fn, sigs) in table.items():
                for sig in sigs:
                    try:
                        ptx, _ = cuda.compile_ptx(fn, sig, cc=cc)
                        assert f".target sm_{cc[0]}{cc[1]}" in ptx
                        n += 1
                    except Exception as e:  # collect all, report once
                        failures.append(f"{name}{sig}: {str(e)[:300]}")
        out[f"sm{cc[0]}{cc[1]}"] = {"n": n, "failures": failures}
    return out


def _ptx_job():
    """ptx_report() in a subprocess (no simulator: compile_ptx needs none), started with the session."""
    import background
    if not HAVE_NUMBA_CUDA:
        return None
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    return background.Job("cuda-ptx", [sys.executable, __file__, "--ptx"], env=dict(env, PYTHONPATH=str(ROOT)),
                          timeout=600)


BACKGROUND.append(_ptx_job)


@pytest.fixture(scope="module")
def ptx():
    import background
    return background.result_json(_ptx_job(), "compile_ptx worker")


@needs_numba_cuda
@pytest.mark.parametrize("cc", ["sm70", "sm90"])
def test_compile_ptx_all_kernels(ptx, cc):
    """Every kernel, every explicit signature, typed and lowered for V100 (sm_70) and H100/H200 (sm_90)."""
    assert not ptx[cc]["failures"], "\n".join(ptx[cc]["failures"])
    assert ptx[cc]["n"] >= 14


def _fresh_cuda_backend(monkeypatch):
    from engine.backends import kernels as backend
    monkeypatch.setattr(backend, "_cache", {})
    monkeypatch.delitem(sys.modules, "engine.backends.cuda.kernels", raising=False)
    return backend


@needs_numba_cuda
def test_backend_cuda_unavailable_without_gpu(monkeypatch):
    """--backend cuda on a machine without a GPU: BackendUnavailable with a one-line reason and a way out."""
    from numba import cuda

    from engine.errors import BackendUnavailable
    if cuda.is_available():
        pytest.skip("a GPU is available here")
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    backend = _fresh_cuda_backend(monkeypatch)
    with pytest.raises(BackendUnavailable, match="no usable NVIDIA GPU.*--backend cpu") as e:
        backend.get_kernels("cuda")
    assert "\n" not in str(e.value)


def test_backend_cuda_unavailable_without_numba_cuda(monkeypatch):
    import importlib.util as iu

    from engine.errors import BackendUnavailable
    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "numba_cuda" else real(name, *a))
    backend = _fresh_cuda_backend(monkeypatch)
    with pytest.raises(BackendUnavailable, match="needs numba-cuda.*cuda"):
        backend.get_kernels("cuda")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        print(json.dumps(worker(sys.argv[sys.argv.index("--worker") + 1:] or None)))
    elif "--ptx" in sys.argv:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(ptx_report()))
