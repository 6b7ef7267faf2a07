"""The fused CPU step on models whose matrices mix the fast layouts per role and per layer (a Q4_K_M file's
mix: Q4_0 / Q4_1 / Q4_K, Q8_0, Q5_0 / Q5_1, Q6_K; step_weights.py, step_mm.py): the fused step, its decode
blocks and the start-up tier give the plain walk's bits; the role tables view the weights (no copy); and
on a real Q4_K_M copy of the default model made by llama.cpp's quantizer (skipped when it cannot be made).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fast_cpu import PROMPT, equal_to_plain_walk, passes
from gguf import GGMLQuantizationType as QT

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

DIMS = dict(n_layer=4, d_model=256, n_head=4, n_kv_head=2, head_dim=64, d_ff=512)  # rows K-quants take
# no role all in 4-bit blocks (all stacked here, as in SmolLM2's Q4_K_M); ffn_down one layout per layer
MIXED = dict(token_embd=QT.Q6_K, output=QT.Q5_0, attn_q=QT.Q5_0, attn_k=QT.Q8_0, attn_v=QT.Q6_K,
             attn_output=QT.Q5_1, ffn_gate=QT.Q6_K, ffn_up=QT.Q5_0,
             ffn_down=[QT.Q4_K, QT.Q6_K, QT.Q8_0, QT.Q4_1])
# with roles all in 4-bit blocks (fast.prepare_layers' per-thread parts) beside stacked ones: a Qwen3 Q4_K_M
PARTS = MIXED | dict(token_embd=QT.Q4_K, attn_q=QT.Q4_K, ffn_gate=QT.Q4_1, ffn_up=QT.Q4_K,
                     ffn_down=[QT.Q6_K, QT.Q4_K, QT.Q4_K, QT.Q5_0])


def _load(tmp_path_factory, make_tiny, arch, qtypes, seed=3):
    return _load_in(tmp_path_factory.mktemp("mixed"), make_tiny, arch, qtypes, seed)


def _load_in(folder, make_tiny, arch, qtypes, seed=3):
    from engine.gguf import load_gguf
    path = make_tiny(Path(folder) / f"mixed-{arch}-{seed}.gguf", arch, seed=seed, qtypes=qtypes, **DIMS)
    return load_gguf(path)


# The checks that run the fused step compile it for the mixed argument types, twice (the stacks of MIXED
# are all C-contiguous arrays, PARTS has prepare_layers' non-contiguous views beside them): ~3 minutes of one
# core each on a cold cache. They run as one background job (tests/background.py) on the core the main
# pytest process leaves idle; the tests below wait for its result.
CHECKS = """
import sys, tempfile
sys.path.insert(0, sys.argv[1])
from make_tiny_models import make_tiny_model
import test_step_mixed as t
with tempfile.TemporaryDirectory() as d:
    t.run_checks(d, make_tiny_model)
print("checks ok")
"""


def _checks_job():
    import background
    return background.python_job("step-mixed", CHECKS.replace("sys.argv[1]", repr(str(FIXTURES))), {},
                                 timeout=1500)


BACKGROUND = [_checks_job]


def run_checks(folder, make_tiny) -> None:
    """The fused step on MIXED files (llama, qwen2, qwen3) and on PARTS (prepare_layers' per-thread parts beside
    stacked roles) at one and at all threads: the plain walk's bits; the tier too; decode blocks."""
    import numba
    for arch in ("llama", "qwen2", "qwen3"):
        model, ff = _model(_load_in(folder, make_tiny, arch, MIXED))
        assert ff is not None and ff.mixed
        equal_to_plain_walk(model, ff)
        _block_equals_plain_greedy(model, ff)
    old = numba.get_num_threads()
    for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
        numba.set_num_threads(threads)
        try:
            model, ff = _model(_load_in(folder, make_tiny, "qwen3", PARTS, seed=4))
            wq, gate, down = ff.roles["wq"], ff.roles["w_gate"], ff.roles["w_down"]
            assert wq[8] is model.layers[0].wq.stack and wq[8].shape[1] == threads  # prepare_layers' view (Q4_K)
            assert gate[0] is model.layers[0].w_gate.stack and gate[0].shape[1] == threads  # (Q4_1)
            assert down[8].shape[:2] == (2, threads) and down[2].tolist()[0] != down[2].tolist()[1]
            equal_to_plain_walk(model, ff)
            _block_equals_plain_greedy(model, ff)
        finally:
            numba.set_num_threads(old)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def mixed_file(request, tmp_path_factory, make_tiny):
    return _load(tmp_path_factory, make_tiny, request.param, MIXED)


def _model(model_file, max_batch=16):
    from engine.backends.cpu import build_model
    from engine.backends.cpu.step import build
    model = build_model(model_file, max_batch)
    return model, build(model)


def _block_equals_plain_greedy(model, ff, n=6):
    """A decode block (one call, each token the argmax of the pass before) == n plain forwards + argmax."""
    c1, c2 = model.new_cache(64), model.new_cache(64)
    tok = int(model.forward(PROMPT, 0, c1)[0].argmax())
    ff(PROMPT, 0, c2)
    want, t = [], tok
    for i in range(n):
        t = int(model.forward([t], len(PROMPT) + i, c1)[0].argmax())
        want.append(t)
    assert ff.block(tok, len(PROMPT), c2, n, frozenset()) == want
    assert c2.length == len(PROMPT) + n


def test_fused_step_on_mixed_layouts_is_the_plain_walk():
    """run_checks, in the background job (see CHECKS)."""
    import background
    proc = background.result(_checks_job())
    assert proc.returncode == 0 and "checks ok" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-4000:])


def test_plain_and_mixed_models_have_argument_types_of_their_own(mixed_file, tmp_path_factory, make_tiny):
    """A model all in 4-bit blocks with a Q4 / Q8 embedding and head (the default model) passes (stack, acc16)
    pairs and 3- / 5-tuple tables: the step it compiles has no other layout's kernels (step_mm's overloads
    pick by these types); a mixed model passes 9-tuple role tables and 4- / 6-tuple ones."""
    from engine.backends.cpu.tier import fused_signature
    q4 = dict(attn_q=QT.Q4_1, attn_k=QT.Q4_1, attn_v=QT.Q4_0, attn_output=QT.Q4_1, ffn_gate=QT.Q4_0,
              ffn_up=QT.Q4_1, ffn_down=[QT.Q4_1], token_embd=QT.Q8_0)
    plain_model, plain = _model(_load(tmp_path_factory, make_tiny, "llama", q4))
    model, mixed = _model(mixed_file)
    assert not plain.mixed and mixed.mixed
    assert {len(t) for t in plain.roles.values()} == {2} and len(plain.emb) == 3 and len(plain.head) == 5
    assert {len(t) for t in mixed.roles.values()} == {9} and len(mixed.emb) == 4 and len(mixed.head) == 6
    sig = fused_signature(plain, plain.kv_tuple(plain_model.new_cache(4)))
    assert "int8, 4d" not in str(sig[8:15])  # no Q8 / K-quant stacks in a plain model's role arguments


def test_role_tables_view_the_weights(mixed_file):
    """Per role the layer's layout and slot; the weights (which the plain walk reads) view the stacks."""
    from engine.backends.cpu.step_mm import Q4, Q4K, Q5, Q6, Q8
    model, ff = _model(mixed_file)
    down = ff.roles["w_down"]
    assert down[2].tolist() == [Q4K, Q6, Q8, Q4] and down[3].tolist() == [0, 0, 0, 0]
    layers = model.layers
    assert np.shares_memory(layers[0].w_down.blocks, down[8][0]) and np.shares_memory(layers[3].w_down.blocks,
                                                                                      down[0][0])
    assert np.shares_memory(layers[1].w_down.blocks, down[7][0]) and np.shares_memory(layers[2].w_down.blocks,
                                                                                      down[4][0])
    assert ff.roles["wq"][2].tolist() == [Q5] * 4 and ff.roles["wv"][6].shape[0] == 0
    assert all(np.shares_memory(lw.wv.blocks, ff.roles["wv"][7][i]) for i, lw in enumerate(layers))
    assert ff.emb[0] == Q6 and ff.head[0] == (Q5 if mixed_file.args.arch == "qwen2" else Q6)


@pytest.fixture(scope="module")
def q4km_path(smollm2_path):
    """A Q4_K_M copy of the default model made by llama.cpp's quantizer (scripts/make_q4km.py), in the copies
    folder; skips when llama-cpp-python is missing or the copy cannot be made."""
    from engine.bench.quantize import copy_path, ensure_copies
    from engine.errors import NinferError
    p = copy_path(smollm2_path, "Q4_K_M")
    if not p.exists():
        try:
            p = ensure_copies(smollm2_path, ["Q4_K_M"], log=lambda s: None)["Q4_K_M"]
        except (NinferError, OSError) as e:
            pytest.skip(f"no Q4_K_M copy: {e}")
    return p


def test_fused_step_on_a_real_q4_k_m_file(q4km_path):
    """SmolLM2's Q4_K_M (llama.cpp's mix: Q5_0 where rows are not a multiple of 256, Q4_K, Q6_K, Q8_0): the
    fused step takes it and gives the plain walk's bits (real weights: a swiglu an ulp off shows here, where
    the int8 quantization after it hides it in the tiny models)."""
    from engine.gguf import load_gguf
    from engine.backends.cpu.step_mm import Q4K, Q5, Q6, Q8
    model, ff = _model(load_gguf(q4km_path), 16)
    assert ff is not None
    kinds = {int(k) for t in ff.roles.values() for k in t[2]}
    assert len(kinds) >= 3 and kinds <= {Q4K, Q8, Q5, Q6}
    want = passes(lambda t, p, c, all_: model.forward(t, p, c, all_logits=all_), model.new_cache(64))
    got = passes(lambda t, p, c, all_: ff(t, p, c, all_logits=all_), model.new_cache(64))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


def test_plain_walk_and_fused_step_share_swiglu():
    from engine.backends.cpu import fast, step
    assert step.swiglu_fast is fast.swiglu
