"""DFlash drafter runtime (engine/spec/dflash.py, dflash_taps.py) on a tiny llama with a random drafter file:

- the network's block forward equals a numpy implementation of the math (the contract with
  train/dflash_model.py): context rows from features, then one bidirectional block;
- the drafter places the target's features right: its drafts equal the numpy walk over features built from
  the target's own forward (h captured, K/V read from its cache and unroped), also across rounds;
- unrope inverts the engine's RoPE; KV taps read the same from an f16 and an int8 cache (to int8 precision);
- speculation with it is lossless (greedy and seeded sampling, full and hot head, a reused prefix);
- drafter files whose taps or block size do not fit the model, or of another version, give one-line reasons.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine.config import EngineArgs, GenerateRequest, SamplingParams
from engine.spec import drafter_file as dfile
from reference_forward import norm, rope_one

N_HOT = 64
BLOCK = 5


def write_dflash(path, model_path, args, seed=0, version=1, block=BLOCK, n_layers=2, taps=None, **meta_over):
    """meta_over: meta fields to set (e.g. weights="q4_1")."""
    """A random DFlash drafter file for the model at model_path (the format train/dflash_train.py exports)."""
    from engine.spec.dflash_taps import default_taps
    taps = taps or default_taps(args)
    rng = np.random.default_rng(seed)
    d, q, kv, ff = args.d_model, args.q_dim, args.kv_dim, args.d_ff

    def mat(rows, cols):
        return rng.normal(0, 0.5 / np.sqrt(cols), (rows, cols)).astype(np.float16)

    def vec():
        return (1 + rng.normal(0, 0.1, d)).astype(np.float16)
    arrays = {"fc": mat(d, taps.width), "hidden_norm": vec(), "mask_emb": rng.normal(0, 1, d).astype(np.float16),
                  "norm": vec(), "hot_ids": rng.permutation(args.vocab_size)[:N_HOT].astype(np.int32)}
    for i in range(n_layers):
        arrays.update({f"l{i}.attn_norm": vec(), f"l{i}.wq": mat(q, d), f"l{i}.wk": mat(kv, d), f"l{i}.wv": mat(kv, d),
                       f"l{i}.wo": mat(d, q), f"l{i}.ffn_norm": vec(), f"l{i}.w_gate": mat(ff, d),
                       f"l{i}.w_up": mat(ff, d), f"l{i}.w_down": mat(d, ff)})
    meta = {"format": "ninfer-dflash", "version": version, "base_sha256": dfile.base_sha256(model_path),
                "base_name": "tiny-llama", "d_model": d, "n_head": args.n_head, "n_kv_head": args.n_kv_head,
                "head_dim": args.head_dim, "d_ff": ff, "n_layers": n_layers, "block_size": block,
                "feat_width": taps.width,
                "tap_kv_layers": list(taps.kv_layers), "tap_hidden_layer": taps.hidden_layer, "kv_dim": taps.kv_dim,
                "hot_vocab_size": N_HOT}
    meta.update(meta_over)
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    return path


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def tiny(tiny_models, tmp_path_factory, monkeypatch_module):
    from engine.gguf import load_gguf
    path = tiny_models["llama"]
    mf = load_gguf(path)
    d = tmp_path_factory.mktemp("drafters")
    write_dflash(d / "tiny.dflash.npz", path, mf.args)
    monkeypatch_module.setenv("NINFER_DRAFTER_DIRS", str(d))
    return path, mf


def _load(path):
    from engine.spec import dflash
    found, why = dfile.find(dflash.FORMAT, dflash.VERSION, str(path))
    assert found is not None, why
    return dfile.load(found, dflash.FORMAT, dflash.VERSION, str(path), ())


# ------------------------------------------------------------------------------ the math, in numpy


class NumpyDFlash:
    """The drafter as engine/spec/dflash.py's docstring writes it, over the weights the runtime uses
    (matrices dequantized from Q8_0)."""

    def __init__(self, arrays, mf, n_layers=2, block=BLOCK, weights="q8_0"):
        from engine.quant import dequantize
        from engine.spec.mtp import _q4, _q8
        quant = _q4 if weights == "q4_1" else _q8
        self.a, self.block, self.n_layers = mf.args, block, n_layers
        self.w = {k: (dequantize(quant(k, v)) if v.ndim == 2 else v.astype(np.float32)) for k, v in arrays.items()
                  if k != "hot_ids"}
        self.emb = dequantize(mf.tensors["token_embd.weight"])  # tied head
        self.head = dequantize(quant("head", self.emb)) if weights == "q4_1" else self.emb  # 4-bit head rows
        self.keys = [{} for _ in range(n_layers)]  # layer -> position -> (k, v)

    def context(self, feats, pos0):
        a, w = self.a, self.w
        for t, f in enumerate(feats):
            c = norm(w["fc"] @ f, w["hidden_norm"], a.rms_eps)
            for i in range(self.n_layers):
                k = rope_one((w[f"l{i}.wk"] @ c).reshape(a.n_kv_head, a.head_dim), pos0 + t, a.rope_base)
                self.keys[i][pos0 + t] = (k, (w[f"l{i}.wv"] @ c).reshape(a.n_kv_head, a.head_dim))

    def draft(self, token, pos):
        a, w, eps, b = self.a, self.w, self.a.rms_eps, self.block
        x = np.stack([self.emb[token]] + [w["mask_emb"]] * (b - 1)).astype(np.float64)
        g = a.n_head // a.n_kv_head
        for i in range(self.n_layers):
            L = lambda k: w[f"l{i}.{k}"]  # noqa: B023
            n1 = norm(x, L("attn_norm"), eps)
            q = [rope_one((L("wq") @ r).reshape(a.n_head, a.head_dim), pos + t, a.rope_base) for t, r in enumerate(n1)]
            kb = [rope_one((L("wk") @ r).reshape(a.n_kv_head, a.head_dim), pos + t, a.rope_base)
                  for t, r in enumerate(n1)]
            vb = [(L("wv") @ r).reshape(a.n_kv_head, a.head_dim) for r in n1]
            K = np.stack([self.keys[i][p][0] for p in range(pos)] + kb)  # (pos + B, n_kv, hd)
            V = np.stack([self.keys[i][p][1] for p in range(pos)] + vb)
            att = np.zeros((b, a.n_head, a.head_dim))
            for t in range(b):
                for h in range(a.n_head):
                    s = K[:, h // g] @ q[t][h] / np.sqrt(a.head_dim)
                    p = np.exp(s - s.max())
                    att[t, h] = (p / p.sum()) @ V[:, h // g]
            x = x + att.reshape(b, -1) @ L("wo").T
            n2 = norm(x, L("ffn_norm"), eps)
            gate = n2 @ L("w_gate").T
            x = x + (gate / (1 + np.exp(-gate)) * (n2 @ L("w_up").T)) @ L("w_down").T
        return norm(x[1:], w["norm"], eps) @ self.head.T  # (B-1, vocab)


def test_block_forward_is_the_math(tiny):
    from engine.spec import dflash
    path, mf = tiny
    df = _load(path)
    net = dflash.DFlashNet(df, mf, capacity=64, hot=False)
    ref = NumpyDFlash(df.arrays, mf)
    rng = np.random.default_rng(1)
    feats = rng.normal(0, 1, (9, net.taps.width)).astype(np.float32)
    net.add_context(feats[:6], 0)  # two passes, as rounds add them
    net.add_context(feats[6:], 6)
    ref.context(feats, 0)
    logits = net.draft(7, 9)
    want = ref.draft(7, 9)
    assert logits.shape == (BLOCK - 1, mf.args.vocab_size)
    np.testing.assert_allclose(logits, want, atol=5e-2 * np.abs(want).max())
    assert (np.argmax(logits, -1) == np.argmax(want, -1)).mean() >= 0.75
    hot = dflash.DFlashNet(df, mf, capacity=64, hot=True)
    hot.add_context(feats, 0)
    np.testing.assert_array_equal(hot.draft(7, 9), logits[:, df.arrays["hot_ids"]])  # the hot head: the same rows
    for k in range(1, BLOCK - 1):  # fewer drafts: the last layer carries rows 1..k only, the same bits
        net.cache.truncate(9)
        np.testing.assert_array_equal(net.draft(7, 9, k), logits[:k])


def test_unrope_inverts_rope_and_int8_taps_match():
    from engine.backends.ref.kernels import rope
    from engine.spec.dflash_taps import unrope
    rng = np.random.default_rng(0)
    inv = (1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
    for neox in (False, True):
        x = rng.normal(0, 1, (5, 3, 16)).astype(np.float32)
        y = x.copy()
        rope(y, 11, inv, neox)
        assert not np.allclose(y, x)
        np.testing.assert_allclose(unrope(y, 11, inv, neox), x, atol=1e-5)


def _target_feats(eng, tokens, taps):
    """(features rows (n, width) of tokens 0..n-1, the cache) from one forward of the tiny target."""
    from engine.spec.dflash_taps import kv_rows
    m = eng.model
    cache = m.new_cache(64)
    m.forward(np.asarray(tokens, np.int32), 0, cache, capture=(taps.hidden_layer,))
    h = m.captured[taps.hidden_layer]
    inv = (1.0 / m.args.rope_base ** (np.arange(0, m.args.head_dim, 2) / m.args.head_dim)).astype(np.float32)
    return np.concatenate([h, kv_rows(cache, taps, 0, len(tokens), inv, False)], 1), cache


def test_drafter_places_target_features(tiny):
    """Prefill-like observe of positions 0..9, a propose at 10, then a 'round' that kept 3 positions and
    a propose at 13: the drafts are the numpy walk's over features built from the target itself."""
    from engine.api import Engine
    from engine.spec import dflash
    path, mf = tiny
    eng = Engine.load(EngineArgs(model=str(path), max_context=64, prefix_reuse=False))
    df = _load(path)
    drafter = dflash.DFlashDrafter(dflash.DFlashNet(df, mf, capacity=64, hot=False))
    taps = drafter.net.taps
    rng = np.random.default_rng(2)
    toks = rng.integers(3, mf.args.vocab_size, 14).tolist()
    feats, cache = _target_feats(eng, toks, taps)
    ref = NumpyDFlash(df.arrays, mf)
    ref.context(feats, 0)
    cache.truncate(10)
    drafter.observe(toks[:10], {taps.hidden_layer: feats[:10, :taps.d_model]})
    drafter.bind_target(eng.model, cache)
    got = drafter.propose(toks[:11], 3, None)
    assert got == np.argmax(ref.draft(toks[10], 10), -1)[:3].tolist()
    cache.length = 13  # the round fed positions 10..12 (the same tokens: the cache rows are already there)
    drafter.observe(toks[10:13], {taps.hidden_layer: feats[10:13, :taps.d_model]})
    got = drafter.propose(toks[:14], 9, None)  # asks for more than the block holds: B - 1
    assert got == np.argmax(ref.draft(toks[13], 13), -1).tolist()
    # int8 cache: the same taps to int8 precision
    from engine.spec.dflash_taps import kv_rows
    c8 = eng.model.new_cache(64, "int8")
    eng.model.forward(np.asarray(toks, np.int32), 0, c8)
    inv = drafter.net.inv_freq
    a, b = kv_rows(cache, taps, 0, 13, inv, False), kv_rows(c8, taps, 0, 13, inv, False)
    np.testing.assert_allclose(b, a, atol=0.05 * np.abs(a).max())


def _final(eng, spec, msgs=None, *, session=None, fixed=False, max_new=40, **sp):
    """A reply's final stats (greedy unless sp says otherwise, up to 4 drafts a round); fixed: rounds of 4 drafts
    every time (DFlash without the adaptive length), in `session` where given."""
    from engine.spec import SpecRound, make_drafter
    req = GenerateRequest(SamplingParams(**{"greedy": True, "max_new": max_new, **sp}), spec=spec, draft_tokens=4)
    msgs = msgs or [{"role": "user", "content": "Count from one to twenty: one, two, three"}]
    round_fn = SpecRound(make_drafter("dflash", eng.model, str(eng.model_path), lm_head_draft=eng.args.lm_head_draft,
                                      adaptive=False, capacity=eng.capacity), 4, eng.capacity) if fixed else None
    return list((session or eng.session()).generate(msgs, req, round_fn=round_fn))[-1]


@pytest.mark.parametrize("hot", [False, True])
@pytest.mark.parametrize("gate", [False, True])
def test_dflash_speculation_is_lossless(tiny, hot, gate, monkeypatch):
    """The users' rounds (the adaptive length; gate: rows verified by their calibrated confidence) and rounds of
    4 drafts every time give plain decode's tokens, greedy and sampled. Drafts are asserted of the fixed rounds:
    the adaptive length may plan none for a random drafter once its costs are measured (a full CI run on a
    loaded 2-core machine drafted none in 40 tokens, gate off, 2026-12-06)."""
    from engine.api import Engine
    from engine.spec.dflash import DFlashAdaptive
    monkeypatch.setattr(DFlashAdaptive, "gate", gate)
    path, _ = tiny
    eng = Engine.load(EngineArgs(model=str(path), max_context=256, prefix_reuse=False, lm_head_draft=hot))
    assert eng.spec_modes()["dflash"] is None
    for sp in ({}, {"greedy": False, "temperature": 0.9, "top_k": 40, "seed": 3, "presence_penalty": 0.5}):
        want, got = _final(eng, "off", **sp), _final(eng, "dflash", **sp)
        assert got.token_ids == want.token_ids and got.spec_mode == "dflash"
        every = _final(eng, "dflash", fixed=True, **sp)
        assert every.token_ids == want.token_ids and every.drafted > 0


def test_lossless_over_a_reused_prefix(tiny):
    """A second turn in one session reuses the first's cache: positions without observed hidden rows. The
    second turn's drafter drafts every round (no adaptive length: on a loaded machine its measured costs could
    plan no drafts at all over 30 tokens of a random-weight drafter, and nothing would be tested)."""
    from engine.api import Engine
    path, _ = tiny
    eng = Engine.load(EngineArgs(model=str(path), max_context=256, prefix_reuse=True))
    turn1 = [{"role": "user", "content": "Say hello"}]
    msgs = turn1 + [{"role": "assistant", "content": "Hello there!"}, {"role": "user", "content": "Count to ten"}]
    outs = {}
    for spec in ("off", "dflash"):
        s = eng.session()
        list(s.generate(turn1, GenerateRequest(SamplingParams(greedy=True, max_new=20), spec=spec)))
        outs[spec] = _final(eng, spec, msgs, session=s, fixed=spec == "dflash", max_new=30)
    assert outs["dflash"].token_ids == outs["off"].token_ids and outs["dflash"].drafted > 0
    assert outs["dflash"].cached_prompt_tokens > 0


def test_taps_block_and_version_are_checked(tiny, tmp_path, monkeypatch):
    from engine.spec import available_modes, dflash
    from engine.spec.dflash_taps import Taps
    path, mf = tiny
    monkeypatch.setenv("NINFER_DRAFTER_DIRS", str(tmp_path))
    a = mf.args
    bad = Taps((a.n_layer + 3,), a.n_layer - 1, a.d_model, a.kv_dim)
    write_dflash(tmp_path / "bad.npz", path, a, taps=bad)
    df = dfile.load(tmp_path / "bad.npz", dflash.FORMAT, dflash.VERSION, str(path), ())
    with pytest.raises(dfile.DrafterFileError) as e:
        dflash.DFlashNet(df, mf, 64, hot=False)
    assert f"taps KV layer {a.n_layer + 3}" in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "bad.npz").unlink()
    write_dflash(tmp_path / "b1.npz", path, a, block=1)
    df = dfile.load(tmp_path / "b1.npz", dflash.FORMAT, dflash.VERSION, str(path), ())
    with pytest.raises(dfile.DrafterFileError, match="block size 1"):
        dflash.DFlashNet(df, mf, 64, hot=False)
    (tmp_path / "b1.npz").unlink()
    write_dflash(tmp_path / "v2.npz", path, a, version=2)
    why = available_modes(str(path))["dflash"]
    assert "version 2" in why and "re-export" in why and "\n" not in why


def test_bench_measures_the_draft_cost_per_round(tiny):
    """engine/bench/speculative.draft_cost: the drafter's own time per round, for dflash and its hot head."""
    from engine.api import Engine
    from engine.bench.speculative import draft_cost
    path, _ = tiny
    eng = Engine.load(EngineArgs(model=str(path), max_context=512, prefix_reuse=False))
    for flags in (frozenset(), frozenset({"hot"})):
        ms = draft_cost(eng, "dflash", 4, flags, ctx_len=40, repeats=6)
        assert 0 < ms < 1000


def test_adaptive_length_prices_a_round_per_k():
    """DFlashAdaptive: with cheap verify passes and sure drafts it drafts the most; when a round's drafting
    costs more than the tokens it wins, none; a k never drafted is priced from the nearest one."""
    from engine.spec.dflash import DFlashAdaptive

    class Inner:
        name, features_needed = "dflash", (1,)

        def reset(self):
            pass

        def observe(self, tokens, features):
            pass

        def propose(self, context, k, features):
            return [1] * k
    ad = DFlashAdaptive(Inner(), cost_table={1: 10.0, 8: 12.0})
    ad.hits, ad.tries = [9.0] * 7, [9.0] * 7  # every position accepted
    ad.draft_by_k = {7: 3.0}
    assert ad.choose_k(7) == 7 and ad.draft_cost(3) == pytest.approx(3.0 * 5 / 9)
    ad.draft_by_k = {7: 500.0}
    assert ad.choose_k(7) == 0
    assert ad.propose([5, 6], 7, None) == [] and ad.observe([5], None) is None


def test_smollm2_with_the_committed_drafter_is_lossless(smollm2_path, monkeypatch):
    """The packaged drafter of the default model: greedy (chat and counting; full head with 3 drafts, hot head
    with 7) and seeded sampling with penalties and a thinking budget give plain decode's tokens."""
    from packaged_drafters import greedy_lossless

    from engine.config import ThinkingParams
    monkeypatch.delenv("NINFER_DRAFTER_DIRS", raising=False)
    eng = greedy_lossless(smollm2_path, "dflash", lambda hot: 7 if hot else 3)
    sp = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, frequency_penalty=0.2,
                        seed=42, max_new=48)
    msgs = [{"role": "user", "content": "List three colours, then count to five."}]
    outs = [list(eng.session().generate(msgs, GenerateRequest(sp, ThinkingParams(enabled=True, budget=12),
                                                              spec=spec, draft_tokens=7)))[-1]
            for spec in ("off", "dflash")]
    assert outs[1].token_ids == outs[0].token_ids and outs[1].thinking_forced == outs[0].thinking_forced


def test_jitted_kv_taps_equal_the_numpy_form():
    """backends/cpu/kv_taps (one jitted call per tapped layer, cos / sin from a kept table) gives the numpy
    reference's features bit for bit: both RoPE layouts, rows at the start, the middle and the end of a cache
    the table has to grow for."""
    from engine.backends.kernels import get_kernels
    from engine.kv_cache import KVCache
    from engine.spec.dflash_taps import Taps, kv_rows, kv_rows_numpy
    rng = np.random.default_rng(5)
    cache = KVCache(get_kernels("cpu"), n_layer=4, capacity=700, n_kv_head=2, head_dim=16)
    for j in range(4):
        k, v = cache.layer(j)
        k[:] = rng.normal(0, 3, k.shape)
        v[:] = rng.normal(0, 1, v.shape)
    taps = Taps((0, 2), 3, 24, 32)
    inv = (1.0 / 10000 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
    for neox in (False, True):
        for lo, hi in ((0, 64), (200, 202), (5, 6), (630, 700)):
            fast, ref = kv_rows(cache, taps, lo, hi, inv, neox), kv_rows_numpy(cache, taps, lo, hi, inv, neox)
            assert fast.shape == (hi - lo, 2 * 32 * 2)
            np.testing.assert_array_equal(fast, ref)


@pytest.mark.parametrize("shapes", [(576, 192, 192), (40, 24, 24), (1536, 1536)])
def test_stacked_matmul_rows_are_separate_matmuls_bitwise(shapes):
    """DFlashNet runs [Wq; Wk; Wv] and [Wgate; Wup] as one Q8_0 matmul each: every output row must be the bits
    of its own matrix's call (any row count, groups shared between matrices where rows are not 32-aligned)."""
    from engine.backends.kernels import get_kernels
    from engine.spec.mtp import _q8
    be = get_kernels("cpu")
    rng = np.random.default_rng(3)
    n = 64
    parts = [rng.normal(0, 0.3, (r, n)).astype(np.float32) for r in shapes]
    stacked = be.prepare_weight(_q8("w", np.concatenate(parts)))
    alone = [be.prepare_weight(_q8("w", p)) for p in parts]
    scratch = be.new_scratch(8, n)
    for t_n in (1, 2, 3, 4, 7, 8):
        x = rng.normal(0, 1, (t_n, n)).astype(np.float32)
        out = np.zeros((t_n, sum(shapes)), np.float32)
        be.matmul(out, x, stacked, scratch)
        lo = 0
        for p, w in zip(parts, alone):
            want = np.zeros((t_n, p.shape[0]), np.float32)
            be.matmul(want, x, w, scratch)
            np.testing.assert_array_equal(out[:, lo:lo + p.shape[0]], want)
            lo += p.shape[0]


@pytest.mark.parametrize("neox", [False, True])
def test_rope_store_is_rope_then_the_f16_store(neox):
    """backends/cpu/dflash_kernels.rope_store on column ranges of one buffer: the bits of kernels.rope on each
    part and numpy's f16 cast into the cache (the per-kernel calls it replaces), and against the numpy
    reference rope (ref.kernels) to rounding."""
    from engine.backends.cpu import kernels as cpu
    from engine.backends.cpu.dflash_kernels import rope_store
    from engine.backends.ref.kernels import rope as ref_rope
    rng = np.random.default_rng(4)
    n_head, n_kv, hd, t_n, pos = 6, 2, 16, 5, 37
    inv = (1.0 / 10000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
    buf = rng.normal(0, 2, (8, (n_head + 2 * n_kv) * hd)).astype(np.float32)
    q_lo = 1  # rows 1.. of q at positions pos + 1.. (the last draft layer's)
    want_q = buf[q_lo:t_n, :n_head * hd].copy().reshape(-1, n_head, hd)
    want_k = buf[:t_n, n_head * hd:(n_head + n_kv) * hd].copy().reshape(t_n, n_kv, hd)
    want_v = buf[:t_n, (n_head + n_kv) * hd:].copy().reshape(t_n, n_kv, hd)
    ref_q, ref_k = want_q.copy(), want_k.copy()
    cpu.rope(want_q, pos + q_lo, inv, neox)
    cpu.rope(want_k, pos, inv, neox)
    ref_rope(ref_q, pos + q_lo, inv, neox)
    ref_rope(ref_k, pos, inv, neox)
    k16 = np.zeros((64, n_kv, hd), np.float16)
    v16 = np.zeros((64, n_kv, hd), np.float16)
    rope_store(buf[q_lo:t_n, :n_head * hd], pos + q_lo, buf[:t_n, n_head * hd:], k16.view(np.uint16),
               v16.view(np.uint16), pos, inv, neox, n_kv, hd)
    np.testing.assert_array_equal(buf[q_lo:t_n, :n_head * hd].reshape(-1, n_head, hd), want_q)
    np.testing.assert_array_equal(k16[pos:pos + t_n], want_k.astype(np.float16))
    np.testing.assert_array_equal(v16[pos:pos + t_n], want_v.astype(np.float16))
    np.testing.assert_allclose(want_q, ref_q, atol=1e-5)
    np.testing.assert_allclose(want_k, ref_k, atol=1e-5)
    assert not k16[:pos].any() and not k16[pos + t_n:].any()


def test_a_4bit_file_runs_its_matrices_and_head_rows_in_q4_1(tiny, tmp_path, monkeypatch):
    """A file trained quantization-aware (meta weights "q4_1", train/dflash_model.py) drafts with every matrix
    and the hot head rows in Q4_1: the numpy walk over those weights; an unknown weights value is refused."""
    from engine.spec import dflash
    path, mf = tiny
    write_dflash(tmp_path / "tiny.dflash.npz", path, mf.args, seed=5, weights="q4_1")
    monkeypatch.setenv("NINFER_DRAFTER_DIRS", str(tmp_path))
    df = _load(path)
    net = dflash.DFlashNet(df, mf, capacity=64, hot=False)
    assert net.weights == "q4_1" and net.fc.kind == "q4" and net.layers[0].wqkv.kind == "q4" and net.head.kind == "q4"
    ref = NumpyDFlash(df.arrays, mf, weights="q4_1")
    feats = np.random.default_rng(2).normal(0, 1, (9, net.taps.width)).astype(np.float32)
    net.add_context(feats, 0)
    ref.context(feats, 0)
    logits, want = net.draft(7, 9), ref.draft(7, 9)
    np.testing.assert_allclose(logits, want, atol=5e-2 * np.abs(want).max())
    assert (np.argmax(logits, -1) == np.argmax(want, -1)).mean() >= 0.75
    from engine.api import Engine
    eng = Engine.load(EngineArgs(model=str(path), max_context=256, prefix_reuse=False))
    msgs = [{"role": "user", "content": "Count to ten"}]
    plain = _final(eng, "off", msgs, max_new=24)
    spec = _final(eng, "dflash", msgs, fixed=True, max_new=24)
    assert spec.token_ids == plain.token_ids and spec.drafted > 0  # lossless with the 4-bit network too
    write_dflash(tmp_path / "tiny.dflash.npz", path, mf.args, seed=5, weights="q2_k")
    with pytest.raises(dfile.DrafterFileError, match="weights 'q2_k'"):
        dflash.DFlashNet(_load(path), mf, capacity=64, hot=False)


def test_bench_times_decode_steps_back_to_back(tiny):
    """engine/bench/speculative.decode_step_cost: one-token passes at consecutive positions (the cache rolled
    back after each run), the baseline the verify and draft costs are set against."""
    from engine.api import Engine
    from engine.bench.speculative import decode_step_cost
    path, _ = tiny
    eng = Engine.load(EngineArgs(model=str(path), max_context=512, prefix_reuse=False))
    seen = []
    fwd = eng.model.forward

    def forward(tokens, pos0, cache, **kw):
        seen.append((len(tokens), pos0, cache.length))
        return fwd(tokens, pos0, cache, **kw)
    ms = decode_step_cost(eng.model, ctx_len=20, steps=5, repeats=2, forward=forward)
    assert 0 < ms < 1000
    assert seen[0] == (20, 0, 0) and [s[1] for s in seen[1:6]] == [20, 21, 22, 23, 24]
    assert all(n == 1 and pos == length for n, pos, length in seen[1:]) and seen[6][1] == 20


def test_bench_times_verify_passes_at_one_position(tiny):
    """engine/bench/speculative.verify_cost: each size's pass at position ctx_len on a cache rolled back to
    ctx_len after every pass (compiled once per size first, then the sizes interleaved), token ids inside the
    model's vocabulary."""
    from engine.api import Engine
    from engine.bench.speculative import verify_cost
    path, _ = tiny
    eng = Engine.load(EngineArgs(model=str(path), max_context=512, prefix_reuse=False))
    seen = []
    fwd = eng.model.forward

    def forward(tokens, pos0, cache, **kw):
        seen.append((len(tokens), pos0, cache.length, int(np.max(tokens))))
        return fwd(tokens, pos0, cache, **kw)
    cost = verify_cost(eng.model, sizes=(1, 4), ctx_len=20, repeats=2, forward=forward)
    assert set(cost) == {1, 4} and all(0 < ms < 1000 for ms in cost.values())
    assert seen[0][:3] == (20, 0, 0)
    assert [n for n, *_ in seen[1:]] == [1, 4] * 3  # warm-up, then two interleaved rounds
    assert all(pos == 20 and length == 20 for _, pos, length, _ in seen[1:])
    assert max(top for *_, top in seen) < eng.model.args.vocab_size
