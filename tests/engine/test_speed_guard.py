"""CI guard for the fast CPU path without timing anything absolute.

- the fast kernels match the reference (kernels/ref.py) within quantization tolerance;
- the fused forward matches Model.forward on the same backend (logits and greedy tokens);
- a decode step allocates nothing (numba NRT allocation counter + tracemalloc around the jitted step);
- the integer kernels compile to SIMD code (AVX2/AVX-512 registers and multiply-add instructions).
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from fast_cpu import fast_model

from engine.quant import QTensor, dequantize

ROOT = Path(__file__).resolve().parents[2]
ALL_Q4 = dict(attn_q=QT.Q4_1, attn_k=QT.Q4_1, attn_v=QT.Q4_0, attn_output=QT.Q4_1, ffn_gate=QT.Q4_0,
              ffn_up=QT.Q4_1, ffn_down=[QT.Q4_1])


def _qtensor(rng, qtype, rows, cols) -> QTensor:
    """Random blocks with sane f16 scales (and Q4_1 mins)."""
    bb = {QT.Q4_1: 20, QT.Q4_0: 18, QT.Q8_0: 34}[qtype]
    nb = cols // 32
    raw = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    raw[..., 0:2] = (rng.random((rows, nb)) * 0.02).astype(np.float16)[..., None].view(np.uint8)
    if qtype == QT.Q4_1:
        raw[..., 2:4] = (-rng.random((rows, nb)) * 0.1).astype(np.float16)[..., None].view(np.uint8)
    return QTensor("w", qtype, (rows, cols), raw.reshape(rows, -1))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0])
@pytest.mark.parametrize("rows, cols", [(96, 64), (45, 96)])  # 45: a padded last row group
@pytest.mark.parametrize("t_n", [1, 3])
def test_fast_matmul_matches_reference(qtype, rows, cols, t_n):
    from engine.backends.cpu import fast as cpu_fast
    rng = np.random.default_rng(rows * 7 + t_n)
    qt = _qtensor(rng, qtype, rows, cols)
    w = cpu_fast.prepare_weight(qt)
    assert isinstance(w, cpu_fast.FastWeight) and w.shape == (rows, cols)
    x = rng.standard_normal((t_n, cols)).astype(np.float32)
    out = np.full((t_n, rows), np.nan, np.float32)
    cpu_fast.matmul(out, x, w, cpu_fast.new_scratch(4, cols))
    ref = x @ dequantize(qt).T
    # int8 activations: error ~ |x|/254 per element, relative to the row norm
    tol = 0.02 * np.abs(ref).max() + 1e-6
    np.testing.assert_allclose(out, ref, atol=tol)
    tokens = np.array([0, rows - 1, rows // 2], np.int32)
    emb = np.zeros((3, cols), np.float32)
    cpu_fast.embed(emb, w, tokens)
    np.testing.assert_allclose(emb, dequantize(qt)[tokens], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["store", "soft", "hw"])
def test_f16_store_bits_match_numpy(kind):
    """store_f16 (the cache's writes) and both converters it may use: F16C's and the bit-by-bit fallback."""
    from numba import njit

    from engine.backends.cpu import attn as cpu_attn
    if kind == "hw" and not cpu_attn.HAS_F16C:
        pytest.skip("no F16C on this CPU")
    rng = np.random.default_rng(0)
    vals = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.integers(-9, 6, 4000),
                           [0.0, -0.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.98e-8, 6.1e-5, np.inf, -np.inf]])
    x = vals.astype(np.float32).reshape(-1, 1, 1)
    cache = np.zeros((x.shape[0], 1, 1), np.uint16)
    if kind == "store":
        cpu_attn.store_f16(cache, x, 0)
    else:
        conv = cpu_attn.f32_to_f16_bits if kind == "soft" else cpu_attn.f2h_hw

        @njit
        def run(out, x):
            for i in range(x.shape[0]):
                out[i] = conv(x[i])
        run(cache.ravel(), x.ravel())
    np.testing.assert_array_equal(cache.ravel(), x.ravel().astype(np.float16).view(np.uint16))


def test_exp_fast_accuracy():
    from numba import njit

    from engine.backends.cpu.attn import exp_fast

    @njit
    def run(out, x):
        for i in range(x.shape[0]):
            out[i] = exp_fast(x[i])
    x = np.linspace(-80, 80, 20001).astype(np.float32)
    out = np.empty_like(x)
    run(out, x)
    np.testing.assert_allclose(out, np.exp(x.astype(np.float64)), rtol=3e-6)


def test_fast_attention_matches_reference():
    from engine.backends.ref import kernels as ref
    from engine.backends.cpu.attn import SPLITS, attention_f16_split
    import numba
    rng = np.random.default_rng(1)
    cap, n_kv, hd, n_head, t_n, pos0 = 40, 2, 16, 6, 3, 20
    k = rng.standard_normal((cap, n_kv, hd)).astype(np.float16)
    v = rng.standard_normal((cap, n_kv, hd)).astype(np.float16)
    q = rng.standard_normal((t_n, n_head, hd)).astype(np.float32)
    want = np.zeros_like(q)
    ref.attention_f16(want, q, k, v, pos0, 0.25)
    got = np.zeros_like(q)
    nt = numba.config.NUMBA_NUM_THREADS
    attention_f16_split(got, q, k.view(np.uint16), v.view(np.uint16), pos0, np.float32(0.25),
                        np.zeros((nt, n_head, cap), np.float32),
                        np.zeros((t_n, n_kv, SPLITS, n_head // n_kv, hd + 2), np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def q4_tiny(tmp_path_factory, make_tiny):
    """A tiny llama whose matrices are all Q4_0/Q4_1 (head Q8_0, vocab not a multiple of 32)."""
    return make_tiny(tmp_path_factory.mktemp("q4") / "tiny-q4.gguf", "llama", seed=3, qtypes=ALL_Q4)


# 40 rows: a prompt's pass (row tiles for an f16 cache; tails shared out by rows either way). The int8 fused
# step is compiled anyway by test_model's int8 prefill test; its 11-row case adds nothing the others lack.
@pytest.mark.parametrize("kv_dtype,n_prompt", [("f16", 11), ("f16", 40), ("int8", 40),
                                               pytest.param("int8", 11, marks=pytest.mark.slow)])
def test_fused_forward_matches_model_forward(q4_tiny, kv_dtype, n_prompt):
    model, fused = fast_model(q4_tiny)
    assert fused is not None
    toks = np.resize(np.array([3, 17, 42, 5, 99, 7, 1, 250, 31, 8, 77], np.int32), n_prompt)
    c1, c2 = model.new_cache(64, kv_dtype), model.new_cache(64, kv_dtype)
    want = model.model.forward(toks, 0, c1, all_logits=True)
    got = fused(toks, 0, c2, all_logits=True)
    assert c2.length == len(toks)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, atol=2e-3 * scale)
    a, b = int(want[-1].argmax()), int(got[-1].argmax())
    for i in range(6):  # greedy decode, T = 1 steps
        la = model.model.forward(np.array([a], np.int32), len(toks) + i, c1)
        lb = fused(np.array([b], np.int32), len(toks) + i, c2)
        np.testing.assert_allclose(lb, la, atol=2e-3 * scale)
        assert a == b
        a, b = int(la[0].argmax()), int(lb[0].argmax())


def test_fused_step_compiles_each_thread_function_once_per_array_types(q4_tiny):
    """The fused step's big callee _step_thread (~50-65 s of compiling on a 2-core machine; and _passes, were
    it not inlined) gets one signature per set of array types: prange's index (uint64 in the gufunc, int64
    where numba types the loop) or a literal int argument would each add a whole compile of their own."""
    from numba import types
    from engine.backends.cpu import step as cpu_fast_step
    model, fused = fast_model(q4_tiny)
    fused(np.array([3, 17], np.int32), 0, model.new_cache(16), all_logits=True)
    funcs = (cpu_fast_step._passes, cpu_fast_step._step_thread)
    if not any(f.signatures for f in funcs):
        pytest.skip("the fused step came from numba's cache: its callees were not compiled in this process")
    for f in funcs:
        arrays = [tuple(t for t in sig if not isinstance(t, types.Integer)) for sig in f.signatures]
        assert len(arrays) == len(set(arrays)), (f.__name__, f.signatures)


def test_fused_verify_rows_equal_decode_steps(q4_tiny):
    """Lossless speculation: a T-row pass must give each row bit-identical to a one-token step. (A prompt of
    cpu_attn_prefill.MIN_ROWS rows or more takes row tiles, which sum in another order: every verify pass
    must stay below that, and does: --draft-tokens <= 15, so at most 16 rows.)"""
    from engine.config import EngineArgs, GenerateRequest
    from engine.errors import ConfigError
    from engine.backends.cpu import attn_prefill as cpu_attn_prefill
    for make in (EngineArgs, GenerateRequest):  # the engine's setting and a reply's override
        with pytest.raises(ConfigError):
            make(draft_tokens=cpu_attn_prefill.MIN_ROWS - 1)
    model, fused = fast_model(q4_tiny)
    toks = np.array([3, 17, 42, 5, 99, 7, 1, 250, 31, 8, 77, 4, 9], np.int32)
    cache = model.new_cache(64)
    fused(toks[:8], 0, cache)
    steps = np.concatenate([fused(toks[8 + i:9 + i], 8 + i, cache) for i in range(5)])
    cache.truncate(8)
    rows = fused(toks[8:13], 8, cache, all_logits=True)
    np.testing.assert_array_equal(rows, steps)


def _run_py(code: str, env_extra: dict, timeout: int = 600) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMBA_NUM_THREADS="2", **env_extra)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(ROOT),
                       timeout=timeout)
    import background
    return background.process_json(p)


def _asm_job(key: str):
    """ASM_CODE[key] with a numba cache of its own (numba cannot show the assembly of code loaded from its
    cache): every kernel it inspects compiles afresh, a minute or more on one core, so it starts with the
    session (tests/background.py)."""
    import background
    return background.python_job(key, ASM_CODE[key], {"NUMBA_NUM_THREADS": "2"}, timeout=900, cold_numba=True)


def _asm(key: str) -> dict:
    import background
    return background.result_json(_asm_job(key), f"assembly check {key}")


NO_ALLOC = """
import json, sys, tracemalloc
import numpy as np
from engine.backends.cpu import build_model
from engine.backends.cpu import step as cpu_fast_step
from engine.gguf import load_gguf
from numba import njit, prange
from numba.core.runtime import rtsys

@njit(parallel=True)
def empty_region(a):
    for i in prange(a.shape[0]):
        a[i] += 1.0

probe = np.zeros(64)
empty_region(probe)
b0 = rtsys.get_allocation_stats()
empty_region(probe)
per_region = rtsys.get_allocation_stats().alloc - b0.alloc  # numba's own bookkeeping per prange launch


@njit
def unbox_only(*args):  # the same arguments, no work: what crossing into numba costs (array wrappers)
    return 0
mf = load_gguf(sys.argv[1] if len(sys.argv) > 1 else {path!r})
model = build_model(mf, 8)
fz = cpu_fast_step.build(model)
cache = model.new_cache(64)
fz.run(np.arange(5, dtype=np.int32), 0, cache, 1)
tok = np.array([7], np.int32)
for i in range(3):  # compile + first use; the contention guard's averages exist from the second step on
    fz.run(tok, 5 + i, cache, 1)
before = rtsys.get_allocation_stats()
tracemalloc.start()
snap0 = tracemalloc.take_snapshot()
for i in range(3):
    fz.run(tok, 8 + i, cache, 1)
snap1 = tracemalloc.take_snapshot()
tracemalloc.stop()
after = rtsys.get_allocation_stats()
args = fz.call_args(tok, 11, 1, fz.kv_tuple(cache), fz._attn_scratch(cache.capacity), 2)
unbox_only(*args)
u0 = rtsys.get_allocation_stats().alloc
unbox_only(*args)
unbox = rtsys.get_allocation_stats().alloc - u0
fz.block(7, 11, cache, 4, frozenset({{3}}))  # a greedy block of 4 passes (its stop array made once)
cache.truncate(11)
g0 = rtsys.get_allocation_stats().alloc
got = fz.block(7, 11, cache, 4, frozenset({{3}}))
block = rtsys.get_allocation_stats().alloc - g0 - unbox
from engine.config import SamplingParams
from engine.sampling import TokenChooser
ch = TokenChooser(SamplingParams(temperature=1.0, top_k=0, top_p=0.9, seed=1), mf.args.vocab_size)
cache.truncate(11)
fz.block(7, 11, cache, 4, frozenset({{3}}), ch.block(4))  # a sampled block on the full-vocabulary path
cache.truncate(11)
choice = ch.block(4)
w0 = rtsys.get_allocation_stats().alloc
wide = fz.block(7, 11, cache, 4, frozenset({{3}}), choice)
wide_allocs = rtsys.get_allocation_stats().alloc - w0 - unbox
tracemalloc.start()
snap2 = tracemalloc.take_snapshot()
for i in range(3):  # Python memory a block keeps per call (a NamedTuple argument once did: numba's dispatcher)
    cache.truncate(11)
    fz.block(7, 11, cache, 4, frozenset({{3}}), choice)
snap3 = tracemalloc.take_snapshot()
tracemalloc.stop()
py_block = sum(s.count_diff for s in snap3.compare_to(snap2, "filename") if s.count_diff > 0
               and "tracemalloc" not in str(s.traceback))
py_new = sum(s.count_diff for s in snap1.compare_to(snap0, "filename") if s.count_diff > 0
             and "tracemalloc" not in str(s.traceback))
print(json.dumps({{"nrt_allocs": (after.alloc - before.alloc) / 3 - unbox, "unbox": unbox,
                  "py_blocks": py_new, "py_block_calls": py_block, "per_region": per_region, "block": block,
                  "block_passes": len(got), "wide": wide_allocs, "wide_passes": len(wide), "regions": 1}}))
"""


def test_decode_step_allocates_nothing(q4_tiny):
    """No array is allocated per decode step: beyond wrapping the argument arrays at the call boundary, the
    only NRT allocations are numba's per-launch bookkeeping of its one parallel region and the head's
    padded last row group (this vocab is not a multiple of 32); none in Python. A greedy block of passes
    (FusedForward.greedy) the same per pass, and a sampled one on the full-vocabulary path (top-k off)."""
    res = _run_py(NO_ALLOC.format(path=str(q4_tiny)), {"NUMBA_NRT_STATS": "1"})
    assert res["unbox"] > 0, res  # the probe works
    assert res["nrt_allocs"] <= res["regions"] * res["per_region"] + 1, res
    assert res["py_blocks"] <= 2, res  # the call's argument tuples are reused/freed; no array per step
    assert res["py_block_calls"] <= 2, res  # the same for a sampled block and its BlockChoice
    assert res["block"] <= res["per_region"] + res["block_passes"], res  # a greedy block: the same per pass
    assert res["wide"] <= res["per_region"] + res["wide_passes"], res


ASM = """
import json, re
import numpy as np
from engine.backends.cpu import fast as F
G, ng, nb, t = F.G, 2, 3, 2
out = np.zeros((t, ng * G), np.float32); qa = np.zeros((t, nb * 32), np.int8); sa = np.zeros((t, nb), np.float32)
xs = np.zeros((t, F.XS * nb), np.float32)  # per block: its sums (F.quantize_rows)
blk = np.zeros((ng, nb, F.avx2.BLK4), np.uint8)  # 4-bit blocks: nibbles, scales, mins
F.q4_group(out, qa, sa, xs, blk, np.zeros(G, np.int16), 0)
F.q4_group_batched(out, qa, sa, xs, blk, 0)
F.q8_group(out, qa, sa, np.zeros((ng, nb, F.avx2.BLK8), np.int8), np.zeros(G, np.int32), 0)
F.q8_group_batched(out, qa, sa, xs, np.zeros((ng, nb, F.avx2.BLK8), np.int8), 0)
F.quantize_rows(qa, sa, xs, np.ones((t, nb * 32), np.float32))
from engine.backends.cpu.attn import store_f16
store_f16(np.zeros((4, 3, 64), np.uint16), np.ones((1, 3, 64), np.float32), 2)
from engine.backends.cpu import avx2 as cpu_avx2, kquant as K, kquant_avx2 as KX, q4k as Q
from numba import njit
@njit
def q4k_decode(out, qa, sa, xs, blk):  # the 'q4k' decode form as the fused step inlines it
    Q.item(out, qa, sa, xs, blk, 0, 0)
q4k_blk = np.zeros((ng, 1, F.avx2.SB4K), np.uint8)
q4k_out = np.zeros((1, ng * G), np.float32)
q4k_decode(q4k_out, qa[:1], sa[:1], xs[:1], q4k_blk)
Q.group(out, qa, sa, xs, q4k_blk, 0)  # the multi-row form (2 rows)
qa6, sa6, xs6 = np.zeros((1, 256), np.int8), np.zeros((1, 8), np.float32), np.zeros((1, F.XS * 8), np.float32)
K.group(out[:1], qa6, sa6, xs6, np.zeros((ng, 1, KX.SB6), np.uint8), 0, 6)  # the Q6_K decode form (1 super-block)
asm6 = "\\n".join(K.group.inspect_asm().values())
res = {{"VNNI": cpu_avx2.VNNI, "VNNI512": cpu_avx2.VNNI512, "GF512": KX.GF512,
        "q6_gf512": len(re.findall(r"vgf2p8affineqb\\s[^\\n]*%zmm", asm6))}}
for name, f in (("q4_group", F.q4_group), ("q4_group_batched", F.q4_group_batched), ("q4k_decode", q4k_decode),
                ("q4k_group", Q.group), ("q8_group", F.q8_group),
                ("q8_group_batched", F.q8_group_batched), ("quantize_rows", F.quantize_rows), ("store_f16", store_f16)):
    asm = "\\n".join(f.inspect_asm().values())
    res[name] = {{"wide": len(re.findall(r"%[yz]mm", asm)),
                       "madd": len(re.findall(r"vpmull[wd]|vpmaddwd|vpmaddubsw|vpdpbusd|vpdpwssd", asm)),
                       "cvtph": len(re.findall(r"vcvtph2ps", asm)),
                       "cvtps2ph": len(re.findall(r"vcvtps2ph", asm)),
                       "round": len(re.findall(r"vroundps|vrndscaleps", asm)),  # (the AVX-512 form)
                       "prefetch": len(re.findall(r"prefetcht[012]", asm)),  # (into L1 or L2: PREFETCH_LOCALITY)
                       "dpbusd": len(re.findall(r"vpdpbusd", asm)),
                       "dp512": len(re.findall(r"vpdp(?:busd|wssd)\\s[^\\n]*%zmm", asm)),
                       "f16_calls": len(re.findall(r"call[^\\n]*(?:truncsfhf|f2h_ieee)", asm))}}
print(json.dumps(res))
"""


def _has_avx2() -> bool:
    try:
        return " avx2" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx2(), reason="checks x86 AVX2+ code generation")
def test_integer_kernels_are_vectorized():
    res = _asm("asm:integer-kernels")
    f16c = " f16c" in Path("/proc/cpuinfo").read_text()
    # the activations' quantization (every matmul's input, the decode step's serial tails) rounds 8 values per
    # instruction; the KV cache's f16 writes convert 8 per vcvtps2ph
    quant, store, vnni, vnni512 = res.pop("quantize_rows"), res.pop("store_f16"), res.pop("VNNI"), res.pop("VNNI512")
    gf512, q6_gf512 = res.pop("GF512"), res.pop("q6_gf512")
    if gf512:  # the Q6_K decode form merges its value vector pairs in 512 bits (kquant_avx2._merged_pairs)
        assert q6_gf512 >= 16, q6_gf512
    if vnni:  # the 4-bit decode kernel's block sums: vpdpbusd where the target has VNNI (cpu_avx2.VNNI)
        assert res["q4_group"]["dpbusd"] >= 16 and res["q4k_decode"]["dpbusd"] >= 16, res
    if vnni512:  # 512-bit vpdpbusd / vpdpwssd in the multi-row forms (2 rows here) where the target has them
        assert res["q4_group_batched"]["dp512"] >= 16 and res["q8_group_batched"]["dp512"] >= 16, res
        assert res["q4k_group"]["dp512"] >= 16, res
    for name in ("q4k_decode", "q4k_group"):  # 'q4k': f16(d sc) rounded in vector registers, no runtime call
        assert res[name]["f16_calls"] == 0 and (not f16c or res[name]["cvtps2ph"] >= 2), (name, res[name])
    assert quant["round"] >= 1 and quant["wide"] >= 8, quant
    if f16c:
        assert store["cvtps2ph"] >= 1, store
    for name, r in res.items():
        assert r["wide"] >= 16, (name, r)  # 256/512-bit registers in the hot loop
        assert r["madd"] >= 2, (name, r)  # packed integer multiplies, not scalar imul
        if f16c:
            assert r["cvtph"] >= 1, (name, r)  # f16 scales converted in vector registers, no per-value call
    for name in ("q4_group", "q4k_decode", "q8_group"):  # the decode kernels prefetch the weight stream (PREFETCH)
        assert res[name]["prefetch"] >= 8, (name, res[name])


SAMPLER_ASM = """
import json, re
import numpy as np
from engine import sampling_fast as S
V = 200
x = np.zeros(V, np.float32); ids = np.zeros(V, np.int64); vals = np.zeros(V, np.float32)
S.top_scan(x, x.copy(), 5, ids, vals)
S.select_wide(x, x.copy(), 0.7, 0, 0.8, 0.0, x.copy(), ids, vals, np.zeros(V))
res = {}
for name, f in (("top_scan", S.top_scan), ("select_wide", S.select_wide), ("collect", S._collect)):
    asm = "\\n".join(f.inspect_asm().values())
    res[name] = {"cmpps": len(re.findall(r"vcmp\\w*ps\\s", asm)), "maxps": len(re.findall(r"vmaxps\\s", asm))}
print(json.dumps(res))
"""


@pytest.mark.skipif(not _has_avx2(), reason="checks x86 AVX2+ code generation")
def test_sampler_scans_are_vectorized():
    """The per-token scans over the vocabulary: top_scan's chunk test (both copies, with and without a penalty
    row) and select_wide's collect compare packed floats (a count over min(base + CHUNK, V) had 10 and 0 packed
    compares, ~5x slower), select_wide's maximum runs in vector lanes (a running scalar maximum had 1)."""
    res = _asm("asm:sampler")
    assert res["top_scan"]["cmpps"] >= 16, res
    assert res["collect"]["cmpps"] >= 8, res
    assert res["select_wide"]["maxps"] >= 4, res


INT8_ATTN_ASM = """
import json, re
import numpy as np
from engine.backends.cpu import attn_int8 as A
from engine.backends.cpu.attn import SPLITS
cap, n_kv, hd, H = 32, 3, 64, 9
kq = np.zeros((cap, n_kv, hd), np.int8); ks = np.zeros((cap, n_kv, hd // 32), np.float32)
part = np.zeros((1, n_kv, SPLITS, 3, hd + 2), np.float32)
A.attn_item_int8(part, np.zeros((H, cap), np.float32), np.zeros((1, H, hd), np.float32), kq, ks, kq, ks, 0, 20,
                 np.float32(0.125))
asm = "\\n".join(A.attn_item_int8.inspect_asm().values())
print(json.dumps({"VNNI512": A.VNNI512, "dpbusd": len(re.findall(r"vpdpbusd\\s", asm)),
                  "sx16": len(re.findall(r"vpmovsxbd\\s[^\\n]*%zmm", asm))}))
"""


ASM_CODE = {"asm:int8-attention": INT8_ATTN_ASM, "asm:integer-kernels": ASM.format(), "asm:sampler": SAMPLER_ASM}
BACKGROUND = [functools.partial(_asm_job, key) for key in ASM_CODE] if _has_avx2() else []


@pytest.mark.skipif(not _has_avx2(), reason="checks x86 AVX2+ code generation")
def test_int8_attention_scores_in_integer_dot_products():
    """Where the target has AVX512-VNNI, an int8 cache's scores run in vpdpbusd (two per query head and 8
    positions: the 16-bit query's parts) and its V sums convert 16 values per instruction."""
    res = _asm("asm:int8-attention")
    if not res["VNNI512"]:
        pytest.skip("target without AVX512-VNNI")
    assert res["dpbusd"] >= 16, res
    assert res["sx16"] >= 2, res


def test_int8_attention_scores_leave_their_stack_buffers_unset():
    """The VNNI scores kernel's stack buffers (the item's quantized queries, 16 KB and more) are written before
    they are read: nothing zeroes them on each call. numba's cgutils.alloca_once stored a zero aggregate there,
    a 19 KB memset on every work item of every layer, and LLVM's InstCombine unpacked it into 16384 one-byte
    stores: 33 s of one core to compile the kernel (0.4 s without)."""
    import re

    from numba import njit
    from numba import types as T

    from engine.backends.cpu.attn_int8_vnni import VNNI512, scores_q8_vnni
    if not VNNI512:
        pytest.skip("target without AVX512-VNNI")

    @njit(fastmath=True)
    def scores(s, q, kq, ks, lo, n, scale):
        scores_q8_vnni(s, q, kq, ks, lo, n, scale)
    scores.compile((T.float32[:, ::1], T.float32[:, ::1], T.int8[:, :, ::1], T.float32[:, :, ::1], T.int64, T.int64,
                    T.float32))
    llvm_ir = scores.inspect_llvm(scores.signatures[0])
    zeroed = [int(n) for n in re.findall(r"call void @llvm\.memset\S*\(.*?, i8 0, i64 (\d+)", llvm_ir)]
    assert all(n < 1024 for n in zeroed), zeroed  # (numba's own small array structs may be zeroed)


@pytest.fixture
def guard_clock(monkeypatch):
    """(a fresh ContentionGuard on 2 numba threads, its clocks: [wall, process CPU] seconds, advanced by the
    test)."""
    import time

    import numba

    from engine.backends.cpu.guard import ContentionGuard
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 numba threads")
    numba.set_num_threads(2)
    clock = [0.0, 0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(time, "process_time", lambda: clock[1])
    try:
        yield ContentionGuard(), clock
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)


QUIET = {2: (0.007, 1.9), 1: (0.012, 1.0)}  # thread count -> (step seconds, CPU seconds per wall second)
BUSY = {2: (0.047, 1.0), 1: (0.012, 1.0)}  # another process holds one of the two cores


def _guarded_steps(g, clock, n, cost_of, block=1):
    """n calls under g, each a decode block of up to `block` steps (as many as g.block_limit() allows);
    cost_of(thread count) -> (seconds, CPU share) of one step; the thread count of each call."""
    import numba
    used = []
    for _ in range(n):
        g.before()
        steps = min(block, g.block_limit())
        used.append(numba.get_num_threads())
        dt, share = cost_of(used[-1])
        clock[0] += steps * dt
        clock[1] += steps * dt * share
        g.after(steps)
    return used


def test_contention_guard_quiet_runs_no_probe_step(guard_clock):
    """Quiet, the guard never leaves the full team, even when the steps get slower (a longer context, a
    slower machine): it looks at one thread only when the process gets less CPU time than its threads."""
    g, clock = guard_clock
    cost = dict(QUIET)
    used = _guarded_steps(g, clock, 500, cost.get)
    cost[2] = (0.020, 1.9)  # three times slower, every thread still busy
    used += _guarded_steps(g, clock, 500, cost.get)
    assert set(used) == {2} and g.probes == 0 and g.best == 2


def test_contention_guard_uses_the_faster_thread_count(guard_clock):
    g, clock = guard_clock
    cost = dict(QUIET)

    def run(n):
        return _guarded_steps(g, clock, n, cost.get)
    run(3 * g.PERIOD)
    cost.update(BUSY)  # another process now holds a core: two threads collapse
    used = run(2 * g.PERIOD)
    assert g.best == 1 and g.fallbacks == 1
    assert used.index(1) <= g.PERIOD  # seen within a period of the load arriving
    used = run(g.PERIOD)
    assert used.count(2) <= g.PROBE
    cost.update(QUIET)  # the load is gone: back to two threads within the longest period
    run(g.MAX_PERIOD + 2 * g.PERIOD)
    assert g.best == 2
    probes = g.probes
    used = run(1000)
    assert g.best == 2 and used.count(1) == 0 and g.probes == probes


def test_contention_guard_probes_rarely_when_two_threads_still_win(guard_clock):
    """Another process takes some of the CPU but two threads stay clearly faster: every probe finds one
    thread slower, so the probes get rarer (each probe step runs in the slower mode)."""
    g, clock = guard_clock
    used = _guarded_steps(g, clock, 1000, {2: (0.008, 1.2), 1: (0.012, 1.0)}.get)
    assert g.best == 2 and g.period == g.MAX_PERIOD
    assert used.count(1) <= 8 * g.PROBE


def test_contention_guard_counts_a_probe_windows_fastest_step(guard_clock):
    """Loaded from the first step. Under contention one probe step may land on the busy core: the window's
    fastest step stands for the mode (with the last step, 0.058 > 0.047 would keep two collapsing threads
    for a whole period)."""
    g, clock = guard_clock
    one_thread = iter([0.012, 0.058])  # the probe window's last step is the unlucky one
    used = _guarded_steps(g, clock, 3 * g.PERIOD,
                          lambda n: (next(one_thread, 0.012), 1.0) if n == 1 else BUSY[2])
    first = used.index(1)
    assert first <= g.PERIOD and used[first:first + g.PROBE] == [1] * g.PROBE
    # after the window: one thread for the rest of the period (its probes of two threads aside)
    assert g.best == 1 and used[first + g.PROBE:first + g.PROBE + g.PERIOD].count(2) == 0


def test_contention_guard_sees_contention_through_decode_blocks(guard_clock):
    """A reply decodes in blocks (FusedForward.block: up to 8 steps per call, after(steps)). The CPU share
    is the call's CPU time over the call's wall time: taken over one step's time it read ~8x the threads
    (14.4 on a quiet 2-core host), so a busy core never started a probe and two collapsing threads ran on."""
    g, clock = guard_clock
    cost = dict(QUIET)
    _guarded_steps(g, clock, 3 * g.PERIOD, cost.get, block=8)
    assert g.probes == 0 and g.cpu_share < 2.0
    cost.update(BUSY)
    _guarded_steps(g, clock, 2 * g.PERIOD, cost.get, block=8)
    assert g.best == 1 and g.fallbacks == 1


@pytest.mark.parametrize("pos0", [0, 2, 37])  # fewer positions than splits, uneven chunks
def test_split_decode_attention_matches_reference(pos0):
    import numba

    from engine.backends.ref import kernels as ref
    from engine.backends.cpu.attn import SPLITS, attention_f16_split
    rng = np.random.default_rng(pos0)
    cap, n_kv, hd, n_head = 40, 2, 16, 6
    k = rng.standard_normal((cap, n_kv, hd)).astype(np.float16)
    v = rng.standard_normal((cap, n_kv, hd)).astype(np.float16)
    q = rng.standard_normal((1, n_head, hd)).astype(np.float32)
    want = np.zeros_like(q)
    ref.attention_f16(want, q, k, v, pos0, 0.25)
    got = np.zeros_like(q)
    nt = numba.config.NUMBA_NUM_THREADS
    attention_f16_split(got, q, k.view(np.uint16), v.view(np.uint16), pos0, np.float32(0.25),
                        np.zeros((nt, n_head, cap), np.float32),
                        np.zeros((1, n_kv, SPLITS, 3, hd + 2), np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
