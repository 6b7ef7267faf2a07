"""llama.cpp as the oracle (slow, needs llama-cpp-python): tokenization, logits, greedy, teacher forcing.

Run: .venv/bin/python -m pytest -m slow tests/engine/test_oracle.py   (figures: probes/oracle_agreement.py)
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
pytestmark = [pytest.mark.slow, pytest.mark.oracle]

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "probes"))
import oracle_agreement as oa  # noqa: E402

sys.path.pop(0)


@pytest.fixture(scope="module")
def smol_ours(smollm2_path):
    return oa.load_ours(smollm2_path)


def test_tokenization_smollm2(smollm2_path):
    r = oa.tokenization(smollm2_path)
    assert r["mismatches"] == [] and r["tokens"] > 500


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tokenization_tiny(tiny_models, arch):
    r = oa.tokenization(tiny_models[arch])
    assert r["mismatches"] == []


def _tiny_logits(path):
    tok, model = oa.load_ours(path)
    ids = tok.encode(oa.CORPUS[0] + " " + oa.CORPUS[2] + oa.CORPUS[6])
    cache = model.new_cache(len(ids))
    ours = model.forward(ids, 0, cache, all_logits=True)  # (T, vocab)
    ref = oa.llama_cpp_model(path, n_ctx=256, n_batch=256, logits_all=True)
    ref.eval(ids)
    theirs = np.array(ref.scores[:len(ids)], dtype=np.float32)  # (T, vocab)
    assert ours.shape == theirs.shape == (len(ids), model.args.vocab_size)
    return ours, theirs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_f32_model_matches_llama_cpp_exactly(make_tiny, tmp_path, arch):
    """With F32 weights llama.cpp does not quantize activations: any architecture slip (rope style, bias,
    q/k norm, GQA mapping, tied head) would show far above this tolerance."""
    from gguf import GGMLQuantizationType as QT
    f32 = {k: QT.F32 for k in ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                               "ffn_down", "output")}
    ours, theirs = _tiny_logits(make_tiny(tmp_path / f"{arch}-f32.gguf", arch, qtypes=f32))
    assert np.abs(ours - theirs).max() < 2e-3 * theirs.std()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_quantized_model_close_to_llama_cpp(tiny_models, arch):
    """Mixed quant types: llama.cpp rounds activations to 8 bits, so logits differ by ~1%; top-1 flips only
    where llama.cpp itself has a near tie."""
    ours, theirs = _tiny_logits(tiny_models[arch])
    assert np.abs(ours - theirs).mean() < 0.02 * theirs.std()
    a, b = ours.argmax(-1), theirs.argmax(-1)
    bad = np.nonzero(a != b)[0]
    assert np.all(theirs[bad, b[bad]] - theirs[bad, a[bad]] < oa.NEAR_TIE)


# On the Q4_1 file llama.cpp rounds activations to 8 bits per 32 values (Q8_1) before each matmul. Its batched
# and one-token attention kernels differ in the last bit (f16 K.q / softmax.V summation order); the next Q8_1
# rounding turns that into whole quanta and the difference cascades, so llama.cpp agrees with itself (batch vs
# token by token, flash_attn=False as the oracle runs it) on only 96.65% of 2059 teacher-forced positions (mean
# |logit diff| 0.160) and 5/10 greedy prompts. Any implementation that is not bit-exact with llama.cpp's own
# summation order lands at the same distance (probes/llama_numerics.py: one emulation with f64 vs f32 sums).
# The targets (>= 99.5%, >= 9/10) are therefore asserted on an F32 copy of the same weights, where
# llama.cpp does not round activations; on the Q4_1 file we must agree with llama.cpp at least as well as
# llama.cpp agrees with itself. probes/oracle_agreement.py --explain prints all the figures.


def test_q4_1_matmul_recipe_is_bit_exact(smollm2_path):
    """probes/llama_bitexact.py's recipe of llama.cpp's Q8_1 activation rounding + Q4_1 dot (AVX2) gives
    llama.cpp's own matmul outputs bit for bit from its own inputs (read through the ggml eval callback)."""
    from engine.gguf import load_gguf
    from engine.tokenizer import Tokenizer
    probes = str(Path(oa.__file__).parent)
    sys.path.insert(0, probes)
    try:
        import llama_bitexact as lb
        ids = Tokenizer.from_gguf(smollm2_path).encode(oa.CORPUS[0] + " " + oa.CORPUS[2])
        got = lb.capture(smollm2_path, ids, one_by_one=False)
        tensors = load_gguf(smollm2_path).tensors
        for layer in (0, 17):
            for out, w, inp in lb.MATMULS:
                x = got[f"{inp}-{layer}"][0].reshape(len(ids), -1)
                want = got[f"{out}-{layer}"][0].reshape(len(ids), -1)
                mine = lb.exact_matmul(tensors[f"blk.{layer}.{w}.weight"], x)
                assert np.array_equal(mine, want), (layer, out, np.abs(mine - want).max())
    finally:
        sys.path.remove(probes)


@pytest.fixture(scope="module")
def smol_f32(smollm2_path, tmp_path_factory):
    path = oa.write_f32_copy(smollm2_path, tmp_path_factory.mktemp("f32") / "smollm2-f32.gguf")
    return path, oa.load_ours(path)


def test_teacher_forced_f32_copy(smol_f32):
    path, ours = smol_f32
    r = oa.teacher_forced(path, *ours)
    assert r["positions"] >= 2000 and r["rate"] >= 0.995, r


def test_greedy_f32_copy(smol_f32):
    path, ours = smol_f32
    r = oa.greedy(path, *ours, n_new=32)
    assert r["prompts"] == 10 and r["identical"] >= 9, [row for row in r["rows"] if not row["match"]]


def test_teacher_forced_q4_1_within_llama_cpp_noise(smollm2_path, smol_ours):
    r = oa.teacher_forced(smollm2_path, *smol_ours)
    floor = oa.llama_self_agreement(smollm2_path, smol_ours[0])
    assert r["positions"] >= 2000
    assert r["rate"] >= min(0.995, floor["rate"] - 0.005), (r["rate"], floor["rate"])
    assert r["mean_abs_logit_diff"] <= 1.2 * floor["mean_abs_logit_diff"]


def test_teacher_forced_int8_kv_within_llama_cpp_noise(smollm2_path, smol_ours):
    """The int8 KV cache (its scores in integer dot products where the CPU has AVX512-VNNI) against llama.cpp's
    f16 cache, the same bound as the f16 cache; read one token per pass, through the decode step's attention
    (2026-12-03: 96.36%, mean |diff| 0.1810, where llama.cpp agrees with itself at 96.65%, 0.160)."""
    r = oa.teacher_forced(smollm2_path, *smol_ours, chunk=1, kv_dtype="int8")
    floor = oa.llama_self_agreement(smollm2_path, smol_ours[0])
    assert r["rate"] >= min(0.995, floor["rate"] - 0.005), (r["rate"], floor["rate"])
    assert r["mean_abs_logit_diff"] <= 1.2 * floor["mean_abs_logit_diff"]


def test_greedy_q4_1_within_llama_cpp_noise(smollm2_path, smol_ours):
    r = oa.greedy(smollm2_path, *smol_ours, n_new=32)
    floor = oa.llama_greedy_self_agreement(smollm2_path, smol_ours[0], n_new=32)
    assert r["identical"] >= min(9, floor["identical"] - 1), (r["identical"], floor["identical"])
    # every divergence starts where llama.cpp itself is unsure (its top-2 logits within 0.5)
    assert all(row["ref_gap"] < 0.5 for row in r["rows"] if not row["match"]), r["rows"]
