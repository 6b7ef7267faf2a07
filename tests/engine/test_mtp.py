"""MTP drafter runtime (engine/spec/mtp.py) on a tiny llama with a random drafter file:

- the block's step equals a numpy implementation of the math (the contract with train/mtp_train.py), for a
  batch of first-step pairs and a recursive chain over the cache;
- speculation with it is lossless (greedy and seeded sampling), full head and hot head;
- drafter files of another version, another base model, or damaged ones give one-line reasons.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine.config import EngineArgs, GenerateRequest, SamplingParams
from engine.spec import drafter_file as dfile
from reference_forward import norm, rope_one

N_HOT = 64


def write_drafter(path, model_path, args, seed=0, version=1, base_sha=None):
    """A random drafter file for the model at model_path (the format train/mtp_train.py exports)."""
    rng = np.random.default_rng(seed)
    d, q, kv, ff = args.d_model, args.q_dim, args.kv_dim, args.d_ff

    def mat(rows, cols):
        return rng.normal(0, 0.3 / np.sqrt(cols), (rows, cols)).astype(np.float16)

    def vec():
        return (1 + rng.normal(0, 0.1, d)).astype(np.float16)
    arrays = dict(enorm=vec(), hnorm=vec(), w_eh=mat(d, 2 * d), attn_norm=vec(), wq=mat(q, d), wk=mat(kv, d),
                  wv=mat(kv, d), wo=mat(d, q), ffn_norm=vec(), w_gate=mat(ff, d), w_up=mat(ff, d), w_down=mat(d, ff),
                  hot_ids=rng.permutation(args.vocab_size)[:N_HOT].astype(np.int32))
    meta = dict(format="ninfer-mtp", version=version, base_sha256=base_sha or dfile.base_sha256(model_path),
                base_name="tiny-llama", d_model=d, n_head=args.n_head, n_kv_head=args.n_kv_head,
                head_dim=args.head_dim, d_ff=ff, hot_vocab_size=N_HOT, steps_trained=3)
    np.savez(path, meta=np.array(json.dumps(meta)), **arrays)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_models, tmp_path_factory, monkeypatch_module):
    from engine.gguf import load_gguf
    path = tiny_models["llama"]
    mf = load_gguf(path)
    d = tmp_path_factory.mktemp("drafters")
    write_drafter(d / "tiny.mtp.npz", path, mf.args)
    monkeypatch_module.setenv("NINFER_DRAFTER_DIRS", str(d))
    return path, mf


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


# ------------------------------------------------------------------------------ the math, in numpy


class NumpyMTP:
    """The MTP step as the module docstring writes it, over the weights the runtime uses (dequantized: W_eh
    Q8_0, the block's matrices Q4_1)."""

    def __init__(self, arrays, mf):
        from engine.quant import dequantize
        from engine.spec.mtp import _q4, _q8
        self.a, w = mf.args, {"w_eh": dequantize(_q8("w_eh", arrays["w_eh"]))}
        for k in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"):
            w[k] = dequantize(_q4(k, arrays[k]))
        for k in ("enorm", "hnorm", "attn_norm", "ffn_norm"):
            w[k] = arrays[k].astype(np.float32)
        self.w = w
        self.emb = dequantize(mf.tensors["token_embd.weight"])
        self.out_norm = dequantize(mf.tensors["output_norm.weight"]).reshape(-1)
        self.keys, self.vals = [], []

    def step(self, y, g, pos):
        a, w, eps = self.a, self.w, self.a.rms_eps
        z = w["w_eh"] @ np.concatenate([norm(self.emb[y], w["enorm"], eps), norm(g, w["hnorm"], eps)])
        xb = norm(z, w["attn_norm"], eps)
        q = rope_one((w["wq"] @ xb).reshape(a.n_head, a.head_dim), pos, a.rope_base)
        k = rope_one((w["wk"] @ xb).reshape(a.n_kv_head, a.head_dim), pos, a.rope_base)
        v = (w["wv"] @ xb).reshape(a.n_kv_head, a.head_dim)
        self.keys, self.vals = self.keys[:pos] + [k], self.vals[:pos] + [v]
        K, V = np.stack(self.keys), np.stack(self.vals)  # (P, n_kv, hd)
        att = np.zeros((a.n_head, a.head_dim))
        for h in range(a.n_head):
            kvh = h // (a.n_head // a.n_kv_head)
            s = K[:, kvh] @ q[h] / np.sqrt(a.head_dim)
            p = np.exp(s - s.max())
            att[h] = (p / p.sum()) @ V[:, kvh]
        u = z + w["wo"] @ att.reshape(-1)
        n2 = norm(u, w["ffn_norm"], eps)
        gate = w["w_gate"] @ n2
        o = u + w["w_down"] @ (gate / (1 + np.exp(-gate)) * (w["w_up"] @ n2))
        return self.emb @ norm(o, self.out_norm, eps), o


def test_block_step_is_the_math(tiny):
    from engine.spec import mtp
    path, mf = tiny
    found, why = dfile.find(mtp.FORMAT, mtp.VERSION, str(path))
    assert found is not None, why
    df = dfile.load(found, mtp.FORMAT, mtp.VERSION, str(path), mtp.WEIGHTS)
    block = mtp.MTPBlock(df, mf, capacity=64, hot=False)
    ref = NumpyMTP(df.arrays, mf)
    rng = np.random.default_rng(1)
    ys, gs = rng.integers(0, mf.args.vocab_size, 6), rng.normal(0, 1, (6, mf.args.d_model)).astype(np.float32)
    logits, hidden = block.run(ys, gs, 0, rows_out=6)  # six first-step pairs in one pass
    want = [ref.step(int(y), g, i) for i, (y, g) in enumerate(zip(ys, gs))]
    y, g, want_o = int(np.argmax(logits[-1])), hidden[-1:], want[-1][1]
    for i in range(2):  # a recursive chain after them, one step at a time
        lg, g = block.run([y], g, 6 + i)
        want_lg, want_o = ref.step(y, want_o, 6 + i)
        np.testing.assert_allclose(lg[0], want_lg, atol=5e-2 * np.abs(want_lg).max())
        y = int(np.argmax(want_lg))
    for (wl, wo), gl, go in zip(want, logits, hidden):
        np.testing.assert_allclose(go, wo, atol=5e-2 * np.abs(wo).max())
        np.testing.assert_allclose(gl, wl, atol=5e-2 * np.abs(wl).max())
    hot = mtp.MTPBlock(df, mf, capacity=64, hot=True)
    hl, hh = hot.run(ys, gs, 0, rows_out=6)
    np.testing.assert_array_equal(hh, hidden)  # the same block; the hot head: the same rows in 4 bits
    assert hot.model.output.kind == "q4" and tuple(hot.model.output.shape) == (N_HOT, mf.args.d_model)
    full = logits[:, df.arrays["hot_ids"]]
    np.testing.assert_allclose(hl, full, atol=0.1 * np.abs(full).max())
    assert not np.array_equal(hl, full)


def _final(eng, spec, **sp):
    req = GenerateRequest(SamplingParams(**{"greedy": True, "max_new": 40, **sp}), spec=spec, draft_tokens=3)
    msgs = [{"role": "user", "content": "Count from one to twenty: one, two, three"}]
    return list(eng.session().generate(msgs, req))[-1]


@pytest.mark.parametrize("hot", [False, True])
def test_mtp_speculation_is_lossless(tiny, hot):
    from engine.api import Engine
    path, _ = tiny
    eng = Engine.load(EngineArgs(model=str(path), max_context=256, prefix_reuse=False, lm_head_draft=hot))
    assert eng.spec_modes()["mtp"] is None
    for sp in ({}, dict(greedy=False, temperature=0.9, top_k=40, seed=3, presence_penalty=0.5)):
        want, got = _final(eng, "off", **sp), _final(eng, "mtp", **sp)
        assert got.token_ids == want.token_ids and got.spec_mode == "mtp"
        assert got.drafted > 0 and got.rounds < got.output_tokens + 1


def test_drafter_reports_confidence_and_stops_when_unsure(tiny, tmp_path, monkeypatch):
    """Each draft's confidence is the softmax top of its step's logits; stop_below (set by the adaptive
    length) ends a round's drafting once the running product of the confidences falls below it."""
    from engine.api import Engine
    from engine.spec import mtp
    from engine.spec.base import top_probability
    path, mf = tiny
    write_drafter(tmp_path / "tiny.mtp.npz", path, mf.args)  # this test's own drafter dir, whatever ran before
    monkeypatch.setenv("NINFER_DRAFTER_DIRS", str(tmp_path))
    eng = Engine.load(EngineArgs(model=str(path), max_context=256, prefix_reuse=False))
    d, m = mtp.make_drafter(eng.model, str(path), adaptive=False, capacity=256), eng.model
    toks = list(range(5, 25))
    cache = m.new_cache(64)
    m.forward(np.asarray(toks[:-1], np.int32), 0, cache, capture=d.features_needed)
    d.observe(toks[:-1], {i: m.captured[i] for i in d.features_needed})
    drafts = d.propose(toks, 3, None)
    assert len(drafts) == 3 and len(d.confidence) == 3 and all(0 < c <= 1 for c in d.confidence)
    lg, g = d.block.run(drafts[:1], d.block.run([toks[-1]], d.pending[None], d.n - 1)[1], d.n)
    assert d.confidence[1] == pytest.approx(top_probability(lg[0]), rel=1e-5)
    d.stop_below = 1.01  # nothing is that sure: one draft, the one the pairs' pass gives anyway
    assert d.propose(toks, 3, None) == drafts[:1] and len(d.confidence) == 1
    d.stop_below = d.confidence[0] * 0.99
    assert d.propose(toks, 3, None) == drafts[:2]  # the second draft's confidence takes the product under


def test_wrong_version_base_or_damage_is_one_line(tiny, tmp_path, monkeypatch):
    from engine.spec import available_modes, mtp
    path, mf = tiny
    monkeypatch.setenv("NINFER_DRAFTER_DIRS", str(tmp_path))
    (tmp_path / "broken.npz").write_bytes(b"not a zip")
    write_drafter(tmp_path / "other.npz", path, mf.args, base_sha="0" * 64)
    why = available_modes(str(path))["mtp"]
    assert why and "no ninfer-mtp drafter" in why and "tiny-llama" in why and "\n" not in why
    write_drafter(tmp_path / "v2.npz", path, mf.args, version=2)
    why = available_modes(str(path))["mtp"]
    assert "version 2" in why and "re-export" in why
    with pytest.raises(dfile.DrafterFileError, match="damaged"):
        dfile.load(tmp_path / "broken.npz", mtp.FORMAT, mtp.VERSION, str(path), mtp.WEIGHTS)
    with pytest.raises(dfile.DrafterFileError, match="trained for tiny-llama"):
        dfile.load(tmp_path / "other.npz", mtp.FORMAT, mtp.VERSION, str(path), mtp.WEIGHTS)


def test_cli_spec_mtp_with_the_hot_head(tiny, tmp_path):
    """`ninfer --spec mtp --lm-head-draft` on the tiny model with its drafter: the stats say mtp, drafts
    were made, and the answer is plain decode's; without a drafter for the model, one line that says so."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    path, _ = tiny
    root = Path(__file__).resolve().parents[2]

    def run(*args, dirs=None):
        env = dict(os.environ, PYTHONPATH=str(root), NUMBA_NUM_THREADS="2", NINFER_CONFIG_DIR=str(tmp_path))
        if dirs is not None:
            env["NINFER_DRAFTER_DIRS"] = dirs
        r = subprocess.run([sys.executable, "-m", "engine.oneshot", str(path), "--prompt", "Count: one, two",
                            "--greedy", "--max-new", "24", "--stats-json", str(tmp_path / "s.json"), *args],
                           cwd=root, env=env, capture_output=True, text=True, timeout=300)
        return r.returncode, r.stdout, r.stderr
    code, plain, err = run()
    assert code == 0, err
    code, out, err = run("--spec", "mtp", "--draft-tokens", "3", "--lm-head-draft")
    assert code == 0, err
    stats = json.loads((tmp_path / "s.json").read_text())
    assert out == plain and stats["spec_mode"] == "mtp" and stats["drafted"] > 0
    code, out, err = run("--spec", "mtp", dirs=str(tmp_path / "none"))
    assert code == 1 and "--spec mtp: no" in err and "drafter for this model" in err and "Traceback" not in err


# ------------------------------------------------------------- the block on the target's fused step

@pytest.fixture(scope="module")
def tiny_q4(make_tiny, tmp_path_factory, monkeypatch_module):
    """A tiny llama whose layers the cpu fused step takes (Q4_0 / Q4_1, the default model's types), its
    fused step compiled in this process (numba's cache: one compile for every model of these types), and a
    random drafter file."""
    from gguf import GGMLQuantizationType as QT

    from engine.backends.cpu import build_model
    from engine.backends.cpu.step import build
    from engine.gguf import load_gguf
    d = tmp_path_factory.mktemp("fused_mtp")
    q4 = dict(attn_q=QT.Q4_1, attn_k=QT.Q4_1, attn_v=QT.Q4_0, attn_output=QT.Q4_1, ffn_gate=QT.Q4_0,
              ffn_up=QT.Q4_1, ffn_down=[QT.Q4_1])
    path = make_tiny(d / "tiny-q4.gguf", "llama", seed=7, qtypes=q4)
    mf = load_gguf(path)
    model = build_model(mf, 16)
    ff = build(model)
    assert ff is not None
    ff(np.array([1, 2, 3], np.int32), 0, model.new_cache(8))  # the target's step: compiled / loaded here
    write_drafter(d / "tiny-q4.mtp.npz", path, mf.args, seed=3)
    monkeypatch_module.setenv("NINFER_DRAFTER_DIRS", f"{tmp_path_factory.getbasetemp()}/drafters0:{d}")
    return path, mf


@pytest.mark.parametrize("hot", [False, True])
def test_block_runs_the_targets_fused_step_with_the_plain_walks_bits(tiny_q4, hot, monkeypatch):
    """The block's passes on the cpu fused step (one call; the target's compiled function, the same argument
    types: nothing compiled for the drafter) equal its plain walk bit for bit: a batch of pairs, then a
    recursive chain."""
    from engine.spec import mtp
    path, mf = tiny_q4
    found, _ = dfile.find(mtp.FORMAT, mtp.VERSION, str(path))
    df = dfile.load(found, mtp.FORMAT, mtp.VERSION, str(path), mtp.WEIGHTS)
    fused = mtp.MTPBlock(df, mf, capacity=64, hot=hot)
    monkeypatch.setenv("NINFER_MTP_FUSED", "0")
    plain = mtp.MTPBlock(df, mf, capacity=64, hot=hot)
    assert fused.fused_ready() and not plain.fused_ready()
    rng = np.random.default_rng(2)
    ys, gs = rng.integers(0, mf.args.vocab_size, 9), rng.normal(0, 1, (9, mf.args.d_model)).astype(np.float32)
    runs = []
    for block in (fused, plain):
        out = [block.run(ys[:5], gs[:5], 0, rows_out=0), block.run(ys[5:], gs[5:], 5, rows_out=2)]
        y, g = int(np.argmax(out[-1][0][-1])), out[-1][1][-1:]
        for i in range(3):
            lg, g = block.run([block.token(y)], g, 9 + i)
            out.append((lg, g))
            y = int(np.argmax(lg[0]))
        runs.append(out)
    assert runs[0][0][0] is None and runs[1][0][0] is None
    for (lf, hf), (lp, hp) in zip(*runs):
        np.testing.assert_array_equal(hf, hp)
        if lf is not None:
            np.testing.assert_array_equal(lf, lp)


def test_fused_drafter_is_lossless_and_leaves_the_thread_count(tiny_q4, monkeypatch):
    """Speculation with the fused block: greedy and seeded sampling give plain decode's tokens, and the block
    ran the fused step. Its passes never set numba's thread count: the target's ContentionGuard chooses it
    and keeps its own record of what it set (a guard of the drafter's own once left the target's verify
    passes on one thread)."""
    import numba

    from engine.api import Engine
    from engine.spec import mtp
    path, _ = tiny_q4
    eng = Engine.load(EngineArgs(model=str(path), max_context=256, prefix_reuse=False, lm_head_draft=False))
    for sp in ({}, {"greedy": False, "temperature": 0.8, "top_k": 20, "seed": 5}):
        want, got = _final(eng, "off", **sp), _final(eng, "mtp", **sp)
        assert got.token_ids == want.token_ids and got.spec_mode == "mtp" and got.drafted > 0
    block = next(iter(mtp._BLOCKS.values()))[0]
    assert block.ff is not None and block.fused_ok
    calls = []
    monkeypatch.setattr(numba, "set_num_threads", lambda n: calls.append(n))
    g = np.zeros((1, block.enorm.shape[0]), np.float32)
    block.cache.truncate(0)
    for i in range(40):  # the guard's first step, its probe period (32) and a probe window
        block.run([i % 7], g, i)
    assert calls == []


def test_rounds_that_draft_nothing_run_decode_blocks_and_feed_the_drafter(tiny_q4):
    """A drafter that is never right (random weights): once the adaptive length has measured its costs it
    plans no drafts, and the round runs a decode block instead (Round.block, FinalStats.block_rounds), still
    plain decode's tokens (greedy and seeded sampling). The drafter observes every fed position once, in
    order, with the target's last hidden rows: those a forward over the whole reply computes."""
    from engine.api import Engine
    from engine.spec import SpecRound, make_drafter
    path, mf = tiny_q4
    eng = Engine.load(EngineArgs(model=str(path), max_context=256, prefix_reuse=False, lm_head_draft=False))
    msgs = [{"role": "user", "content": "Count from one to twenty: one, two, three"}]
    last = mf.args.n_layer - 1
    for sp in ({"greedy": True}, {"greedy": False, "temperature": 0.8, "top_k": 20, "seed": 5}):
        req = GenerateRequest(SamplingParams(**{"max_new": 80, **sp}), spec="mtp", draft_tokens=3)
        want = list(eng.session().generate(msgs, GenerateRequest(req.sampling, spec="off")))[-1]
        drafter = make_drafter("mtp", eng.model, str(path), adaptive=True, capacity=eng.capacity)
        seen: list[tuple[list[int], np.ndarray | None]] = []
        observe = drafter.inner.observe
        drafter.inner.observe = lambda toks, feats: (seen.append((list(toks), None if feats is None else
                                                                  feats[last].copy())), observe(toks, feats))
        got = list(eng.session().generate(msgs, req, round_fn=SpecRound(drafter, 3, eng.capacity)))[-1]
        assert got.token_ids == want.token_ids
        assert got.block_rounds > 0 and got.block_tokens >= 2 * got.block_rounds, got
        assert got.tokens_per_round < got.output_tokens / got.rounds  # per speculative round: blocks left out
        fed = [t for toks, _ in seen for t in toks]
        prompt_len = len(fed) - len(got.token_ids) + 1  # fed = prompt + reply but its last token
        assert fed[prompt_len:] == list(got.token_ids[:-1])
        assert all(h is not None and h.shape == (len(toks), mf.args.d_model) for toks, h in seen)
        rows = np.concatenate([h for _, h in seen])
        cache = eng.model.new_cache(len(fed))
        eng.model.forward(np.asarray(fed, np.int32), 0, cache, capture=(last,))
        np.testing.assert_allclose(rows, eng.model.captured[last], rtol=1e-4, atol=1e-4)


def test_lookup_first_over_mtp_is_lossless(tiny, tmp_path, monkeypatch):
    """make_drafter(lookup=3): n-gram drafts first where the context's last 3+ tokens occurred before, MTP's
    otherwise (engine.spec.lookup); greedy and seeded sampling give plain decode's tokens, both sources drafted
    (a counting prompt repeats its words). Lookup-first needs the adaptive length (one line otherwise)."""
    from engine.api import Engine
    from engine.errors import ConfigError
    from engine.spec import SpecRound, make_drafter
    from engine.spec.lookup import LookupFirst
    path, mf = tiny
    write_drafter(tmp_path / "tiny.mtp.npz", path, mf.args)  # (tiny_q4, if it ran first, pointed the drafter
    monkeypatch.setenv("NINFER_DRAFTER_DIRS", str(tmp_path))  # dirs at its own model's file)
    eng = Engine.load(EngineArgs(model=str(path), max_context=256, prefix_reuse=False))
    msgs = [{"role": "user", "content": "Say one two three, one two three, one two three, one two three"}]
    for sp in ({"greedy": True}, {"greedy": False, "temperature": 0.9, "top_k": 40, "seed": 3}):
        req = GenerateRequest(SamplingParams(**{"max_new": 60, **sp}), spec="mtp", draft_tokens=3)
        want = list(eng.session().generate(msgs, GenerateRequest(req.sampling, spec="off")))[-1]
        drafter = make_drafter("mtp", eng.model, str(path), capacity=eng.capacity, lookup=3)
        assert isinstance(drafter, LookupFirst)
        sources, propose = [], drafter.propose

        def traced(context, k, features):
            drafts = propose(context, k, features)
            sources.extend([drafter.source] if drafts else [])
            return drafts
        drafter.propose = traced
        got = list(eng.session().generate(msgs, req, round_fn=SpecRound(drafter, 3, eng.capacity)))[-1]
        assert got.token_ids == want.token_ids
        by_lookup = [s for s in sources if s in (drafter.lookup, drafter.fresh)]  # (a copy going on, or started)
        assert drafter.drafter in sources and by_lookup
        assert got.lookup_rounds == len(by_lookup) and got.lookup_tokens >= got.lookup_rounds
    with pytest.raises(ConfigError, match="adaptive"):
        make_drafter("mtp", eng.model, str(path), capacity=eng.capacity, adaptive=False, lookup=3)


def test_smollm2_with_the_committed_drafter_is_lossless(smollm2_path, monkeypatch):
    """The packaged MTP drafter of the default model: greedy (chat and counting; full head and hot head, 3
    drafts) and seeded sampling with penalties give plain decode's tokens."""
    from packaged_drafters import greedy_lossless
    monkeypatch.delenv("NINFER_DRAFTER_DIRS", raising=False)
    eng = greedy_lossless(smollm2_path, "mtp", lambda hot: 3)
    sp = dict(greedy=False, temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=42, max_new=48)
    msgs = [{"role": "user", "content": "List three colours, then count to five."}]
    outs = [list(eng.session().generate(msgs, GenerateRequest(SamplingParams(**sp), spec=spec, draft_tokens=3)))[-1]
            for spec in ("off", "mtp")]
    assert outs[1].token_ids == outs[0].token_ids


def test_bench_noconf_variant_turns_the_confidence_cut_off(tiny, tmp_path, monkeypatch):
    from engine.api import Engine
    from engine.bench.speculative import parse_variant, variant_name, variant_round
    path, mf = tiny
    write_drafter(tmp_path / "tiny.mtp.npz", path, mf.args)  # (a later fixture of this module points the
    monkeypatch.setenv("NINFER_DRAFTER_DIRS", str(tmp_path))  # drafter dirs at its own model's file)
    eng = Engine.load(EngineArgs(model=str(path), max_context=256, prefix_reuse=False))
    mode, k, flags = parse_variant("mtp:3:hot:noconf")
    assert (mode, k, flags) == ("mtp", 3, frozenset({"hot", "noconf"}))
    assert variant_name(mode, k, flags) == "mtp:3:hot:noconf"
    assert variant_round(eng, mode, k, flags).drafter.gate is False
    assert variant_round(eng, "mtp", 3, frozenset({"hot"})).drafter.gate is True


def test_the_users_drafter_dirs_come_before_the_packaged_one(tiny, tmp_path, monkeypatch):
    """$NINFER_DRAFTER_DIRS is searched before the packaged drafters (a user's own file for the model serves);
    a file there of another version is passed over for one that fits, and named when none does."""
    from engine.spec import mtp
    path, mf = tiny
    packaged, user = tmp_path / "packaged", tmp_path / "user"
    packaged.mkdir()
    user.mkdir()
    monkeypatch.setattr(dfile, "PACKAGED", packaged)
    monkeypatch.setenv("NINFER_DRAFTER_DIRS", str(user))
    write_drafter(packaged / "a.npz", path, mf.args, seed=1)
    assert dfile.find(mtp.FORMAT, mtp.VERSION, str(path)) == (packaged / "a.npz", None)
    write_drafter(user / "b.npz", path, mf.args, seed=2)
    assert dfile.find(mtp.FORMAT, mtp.VERSION, str(path)) == (user / "b.npz", None)
    write_drafter(user / "b.npz", path, mf.args, seed=2, version=2)
    assert dfile.find(mtp.FORMAT, mtp.VERSION, str(path)) == (packaged / "a.npz", None)
    (packaged / "a.npz").unlink()
    found, why = dfile.find(mtp.FORMAT, mtp.VERSION, str(path))
    assert found is None and "version 2" in why and "\n" not in why
