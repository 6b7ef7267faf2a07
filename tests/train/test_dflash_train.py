"""The DFlash training module computes the drafter the runtime runs: a numpy walk of the math (context rows
from features, one bidirectional block per anchor, RoPE from the engine's ref kernel) on random weights
equals the torch module's forward over many anchors and a padded batch; batches anchor where the runtime
drafts; the export writes every field of the ninfer-dflash v1 format and the runtime's loader accepts it."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engine.backends.ref.kernels import rope as ref_rope
from engine.spec.dflash_taps import Taps
from train.dflash_model import DFlashConfig, DFlashDrafter
from train.dflash_train import (
    FORMAT,
    VERSION,
    block_loss,
    export_file,
    make_batch,
    position_weights,
)

TAPS = Taps(kv_layers=(1,), hidden_layer=2, d_model=16, kv_dim=8)
CFG = DFlashConfig(d_model=16, n_head=4, n_kv_head=2, head_dim=4, d_ff=24, rms_eps=1e-5, rope_base=10000.0,
                   rope_neox=False, feat_width=TAPS.width, n_layers=2, block=4)
VOCAB, N_HOT = 50, 20


def random_parts(seed=0):
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(0, 0.4, s).astype(np.float32) + (1.0 if len(s) == 1 else 0.0)
              for k, s in CFG.shapes().items()}
    embed = rng.normal(0, 1, (VOCAB, CFG.d_model)).astype(np.float32)
    hot_ids = np.sort(rng.choice(VOCAB, N_HOT, replace=False)).astype(np.int32)
    return params, embed, hot_ids


def np_rms(x, w):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + CFG.rms_eps) * w


def np_rope(x, pos):
    """x (H, hd) at position pos, through the engine's reference kernel."""
    inv = (1.0 / (CFG.rope_base ** (np.arange(0, CFG.head_dim, 2, dtype=np.float64) / CFG.head_dim))).astype(np.float32)
    y = x[None].astype(np.float32).copy()
    ref_rope(y, pos, inv, False)
    return y[0].astype(np.float64)


def numpy_block(params, embed, feats, tokens, a):
    """Output hiddens (B, d) of the block at anchor a: context rows p < a, the block [E[x_a], m, ...]."""
    c, w = CFG, {k: v.astype(np.float64) for k, v in params.items()}
    g = c.n_head // c.n_kv_head
    ctx = np_rms(feats[:a].astype(np.float64) @ w["fc"].T, w["hidden_norm"])  # (a, d)
    x = np.stack([embed[tokens[a]]] + [w["mask_emb"]] * (c.block - 1)).astype(np.float64)
    for i in range(c.n_layers):
        L = {k: w[f"l{i}.{k}"] for k in ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up", "w_down")}
        n1 = np_rms(x, L["attn_norm"])
        keys = [np_rope((L["wk"] @ r).reshape(c.n_kv_head, c.head_dim), p) for p, r in enumerate(ctx)]
        vals = [(L["wv"] @ r).reshape(c.n_kv_head, c.head_dim) for r in ctx]
        keys += [np_rope((L["wk"] @ r).reshape(c.n_kv_head, c.head_dim), a + t) for t, r in enumerate(n1)]
        vals += [(L["wv"] @ r).reshape(c.n_kv_head, c.head_dim) for r in n1]
        K, V = np.stack(keys), np.stack(vals)
        att = np.zeros((c.block, c.n_head, c.head_dim))
        for t, r in enumerate(n1):
            q = np_rope((L["wq"] @ r).reshape(c.n_head, c.head_dim), a + t)
            for h in range(c.n_head):
                s = K[:, h // g] @ q[h] / np.sqrt(c.head_dim)
                p = np.exp(s - s.max())
                att[t, h] = (p / p.sum()) @ V[:, h // g]
        x = x + att.reshape(c.block, -1) @ L["wo"].T
        n2 = np_rms(x, L["ffn_norm"])
        gate = n2 @ L["w_gate"].T
        x = x + (gate / (1 + np.exp(-gate)) * (n2 @ L["w_up"].T)) @ L["w_down"].T
    return x


def test_forward_matches_the_numpy_walk_and_batches_anchor_where_the_runtime_drafts():
    params, embed, hot_ids = random_parts()
    rng = np.random.default_rng(1)
    model = DFlashDrafter(CFG, embed, embed[hot_ids], params)
    hot_index = np.full(VOCAB, -1, np.int64)
    hot_index[hot_ids] = np.arange(N_HOT)
    x1, f1 = rng.integers(0, VOCAB, 12).astype(np.int32), rng.normal(0, 2, (12, CFG.feat_width)).astype(np.float16)
    x2, f2 = rng.integers(0, VOCAB, 7).astype(np.int32), rng.normal(0, 2, (7, CFG.feat_width)).astype(np.float16)
    seqs = [(x1, f1, 3, False), (x2, f2, 5, False)]  # (tokens, feats, prompt_len, predictable)
    bt = make_batch(seqs, [0, 1], CFG.block, hot_index, None, None, (0, 100))  # every anchor
    assert bt["anchors"][0].tolist() == list(range(2, 11))  # prompt_len - 1 .. n - 2
    assert bt["anchors"][1, :1].tolist() == [4] and bt["tgt"][1, 0].tolist() == [x2[5], x2[6], -1]
    assert bt["tgt"][0, 0].tolist() == x1[3:6].tolist() and bt["tgt"][0, -1].tolist() == [x1[11], -1, -1]
    with torch.no_grad():
        z = model(bt["feats"], bt["tokens"], bt["anchors"], bt["valid"])
    for r, (x, f, _, _) in enumerate(seqs):  # padding and other anchors change nothing
        for j, a in enumerate(bt["anchors"][r].tolist()):
            if r == 1 and j > 0:
                break  # padded anchor slots of the short sequence
            want = numpy_block(params, embed, f.astype(np.float32), x, a)
            np.testing.assert_allclose(z[r, j].numpy(), want, rtol=2e-4, atol=2e-4)
    rb = make_batch(seqs, [0], CFG.block, hot_index, 3, np.random.default_rng(0))
    assert rb["anchors"].shape == (1, 3) and all(2 <= a <= 10 for a in rb["anchors"][0].tolist())


def test_loss_weights_later_rows_less_and_trains():
    params, embed, hot_ids = random_parts(2)
    w = position_weights(CFG.block, 2.0)
    assert w[0] == 1 and torch.all(w[1:] < w[:-1])
    model = DFlashDrafter(CFG, embed, embed[hot_ids], params)
    hot_index = np.full(VOCAB, -1, np.int64)
    hot_index[hot_ids] = np.arange(N_HOT)
    rng = np.random.default_rng(3)
    x = hot_ids[rng.integers(0, N_HOT, 20)]
    seqs = [(x, rng.normal(0, 1, (20, CFG.feat_width)).astype(np.float16), 2, False)]
    bt = make_batch(seqs, [0], CFG.block, hot_index, None, None, (0, 100))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(30):
        loss, per_row = block_loss(model, bt, w)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert per_row.shape == (CFG.block - 1,) and float(loss.detach()) < 0.5 * first


def test_export_writes_every_field_and_the_runtime_reads_it(tmp_path):
    from engine.spec.dflash import check_meta, file_taps
    params, _, hot_ids = random_parts()
    out = tmp_path / "m.dflash.npz"
    export_file(out, CFG, TAPS, params, hot_ids, "ab" * 32, "base.gguf", {"optimizer_steps": 1})
    with np.load(out, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        assert set(z.files) == {"meta", "hot_ids", *CFG.param_names()}
        assert z["hot_ids"].dtype == np.int32 and z["hot_ids"].shape == (N_HOT,)
        for k, shape in CFG.shapes().items():
            assert z[k].dtype == np.float16 and z[k].shape == shape, k
        np.testing.assert_allclose(z["l1.wq"], params["l1.wq"], rtol=1e-3, atol=1e-3)
    assert meta["format"] == FORMAT == "ninfer-dflash" and meta["version"] == VERSION == 1
    for key in ("base_sha256", "base_name", "d_model", "n_head", "n_kv_head", "head_dim", "d_ff", "rms_eps",
                "rope_base", "rope_neox", "n_layers", "block_size", "feat_width", "tap_kv_layers",
                "tap_hidden_layer", "kv_dim", "hot_vocab_size", "training"):
        assert key in meta, key
    assert file_taps(meta) == TAPS and meta["block_size"] == 4 and meta["n_layers"] == 2

    class Args:  # a target with three layers of these widths
        n_layer, d_model, n_kv_head, head_dim, arch = 3, 16, 2, 4, "llama"
    check_meta(meta, Args, out)
    Args.n_layer = 5  # the hidden tap is no longer the last layer
    with pytest.raises(Exception, match="last layer is 4"):
        check_meta(meta, Args, out)


def test_init_from_reads_an_exported_file_back_and_refuses_others(tmp_path, monkeypatch):
    """--init-from: a fresh run starts from an exported file's weights (float16 as written) and hot vocabulary;
    a file of other taps, another model or not a DFlash file stops with one line."""
    from train import dflash_train
    monkeypatch.setattr(dflash_train, "sha256_of", lambda path: "ab" * 32)
    monkeypatch.setattr(dflash_train, "model_path", lambda: "base.gguf")
    params, _, hot_ids = random_parts(1)
    out = tmp_path / "m.dflash.npz"
    export_file(out, CFG, TAPS, params, hot_ids, "ab" * 32, "base.gguf", {"optimizer_steps": 7})
    got = dflash_train.init_file(str(out), TAPS)
    assert (got["n_layers"], got["block"], got["training"]) == (2, 4, {"optimizer_steps": 7})
    np.testing.assert_array_equal(got["hot_ids"], hot_ids)
    assert set(got["params"]) == set(CFG.param_names())
    for k, v in params.items():
        np.testing.assert_array_equal(got["params"][k], v.astype(np.float16).astype(np.float32))
    DFlashDrafter(CFG, np.zeros((VOCAB, CFG.d_model), np.float32), np.zeros((N_HOT, CFG.d_model), np.float32),
                  got["params"])  # the module takes them as they are
    with pytest.raises(SystemExit, match="taps"):
        dflash_train.init_file(str(out), Taps(kv_layers=(0,), hidden_layer=2, d_model=16, kv_dim=8))
    monkeypatch.setattr(dflash_train, "sha256_of", lambda path: "cd" * 32)
    with pytest.raises(SystemExit, match="another model"):
        dflash_train.init_file(str(out), TAPS)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(SystemExit, match="not a readable drafter file"):
        dflash_train.init_file(str(tmp_path / "bad.npz"), TAPS)


def test_quantization_aware_forward_is_the_float_forward_of_the_q4_1_weights():
    """weights "q4_1": fc, every layer matrix and the hot head rows enter the forward as gguf's Q4_1 values
    (what the runtime holds), the norms and mask as they are; the gradient still reaches the float weights."""
    from gguf import GGMLQuantizationType as QT
    from gguf.quants import dequantize, quantize
    cfg = DFlashConfig(d_model=32, n_head=4, n_kv_head=2, head_dim=8, d_ff=64, rms_eps=1e-5, rope_base=10000.0,
                       rope_neox=False, feat_width=64, n_layers=1, block=4)
    rng = np.random.default_rng(5)
    params = {k: rng.normal(0, 0.4, s).astype(np.float32) + (1.0 if len(s) == 1 else 0.0)
              for k, s in cfg.shapes().items()}
    embed = rng.normal(0, 1, (VOCAB, cfg.d_model)).astype(np.float32)
    hot = embed[:N_HOT]

    def q4(w):
        return dequantize(quantize(w, QT.Q4_1), QT.Q4_1).reshape(w.shape).astype(np.float32)
    rounded = {k: (q4(v) if v.ndim == 2 and k != "mask_emb" else v) for k, v in params.items()}
    qat = DFlashDrafter(cfg, embed, hot, params, weights="q4_1")
    flt = DFlashDrafter(cfg, embed, q4(hot), rounded)
    feats = torch.from_numpy(rng.normal(0, 1, (1, 9, cfg.feat_width)).astype(np.float32))
    tokens = torch.from_numpy(rng.integers(0, VOCAB, (1, 9)))
    anchors, valid = torch.tensor([[3, 6]]), torch.ones(1, 9, dtype=torch.bool)
    z = qat(feats, tokens, anchors, valid)
    np.testing.assert_allclose(z.detach().numpy(), flt(feats, tokens, anchors, valid).detach().numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(qat.logits(z).detach().numpy(), flt.logits(z).detach().numpy(), rtol=1e-5, atol=1e-5)
    qat.logits(z).sum().backward()
    assert qat.p("l0.wq").grad is not None and float(qat.p("l0.wq").grad.abs().sum()) > 0
    with pytest.raises(ValueError, match="weights"):
        DFlashDrafter(cfg, embed, hot, params, weights="q2_k")


def test_evaluate_walks_rounds_of_the_blocks_own_lengths():
    """The held-out eval reports top-1 per block row and the tokens per round of greedy speculation with B-1
    drafts (and 7, 3 where the block has them): a block of 4 walks 3 drafts; a perfect drafter gets B tokens a
    round, one that is always wrong gets 1."""
    from types import SimpleNamespace

    from train.dflash_train import evaluate
    params, embed, hot_ids = random_parts(4)
    model = DFlashDrafter(CFG, embed, embed[hot_ids], params)
    hot_index = np.full(VOCAB, -1, np.int64)
    hot_index[hot_ids] = np.arange(N_HOT)
    rng = np.random.default_rng(6)
    seqs = [(hot_ids[rng.integers(0, N_HOT, 30)], rng.normal(0, 1, (30, CFG.feat_width)).astype(np.float16), 4, k)
            for k in (False, True)]
    res = evaluate(model, SimpleNamespace(seqs=seqs), hot_ids, hot_index)
    for kind in ("chat", "predictable"):
        r = res[kind]
        assert set(r) == {"top1", "targets", "coverage", "tok_per_round_k3"} and len(r["top1"]) == CFG.block - 1
        assert 1.0 <= r["tok_per_round_k3"] <= CFG.block and r["coverage"] == 1.0

    class Oracle(DFlashDrafter):  # logits that name the true next tokens: every draft right
        def logits(self, z):
            return self._want
    oracle = Oracle(CFG, embed, embed[hot_ids], params)
    tok = seqs[0][0]
    n, pl = len(tok), seqs[0][2]

    def forward(feats, tokens, anchors, valid):
        a = anchors[0].numpy()
        want = np.full((1, len(a), CFG.block - 1, N_HOT), -1.0, np.float32)
        for j, s in enumerate(a):
            for i in range(1, CFG.block):
                if s + i < n:
                    want[0, j, i - 1, hot_index[tok[s + i]]] = 1.0
        oracle._want = torch.from_numpy(want[0])
        return torch.zeros((1, len(a), CFG.block, CFG.d_model))
    oracle.forward = forward
    got = evaluate(oracle, SimpleNamespace(seqs=[seqs[0]]), hot_ids, hot_index)["chat"]
    assert got["top1"] == [1.0] * (CFG.block - 1)
    rounds = -(-(n - pl) // CFG.block)  # the reply's n - pl tokens, B a round (the last round what is left)
    assert got["tok_per_round_k3"] == round((n - pl) / rounds, 3)


def test_eval_file_refuses_what_it_cannot_score(tmp_path, monkeypatch):
    """--eval-file: a file that is not a drafter of the format, or of another model, stops with one line
    before the target is loaded."""
    from train import dflash_train, mtp_train
    monkeypatch.setattr(mtp_train, "sha256_of", lambda path: "ab" * 32)
    monkeypatch.setattr(mtp_train, "model_path", lambda: "base.gguf")
    monkeypatch.setattr(mtp_train, "load_target", lambda path: pytest.fail("the target loaded"))
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(SystemExit, match="not a readable MTP drafter file"):
        mtp_train.eval_file(str(tmp_path / "bad.npz"))
    params, _, hot_ids = random_parts(7)
    export_file(tmp_path / "d.npz", CFG, TAPS, params, hot_ids, "ab" * 32, "base.gguf", {})
    with pytest.raises(SystemExit, match="not ninfer-mtp"):
        mtp_train.eval_file(str(tmp_path / "d.npz"))
    monkeypatch.setattr(dflash_train, "current_taps", lambda: TAPS)
    monkeypatch.setattr(dflash_train, "sha256_of", lambda path: "cd" * 32)
    monkeypatch.setattr(dflash_train, "load_target", lambda *a: pytest.fail("the target loaded"))
    with pytest.raises(SystemExit, match="another model"):
        dflash_train.eval_file(str(tmp_path / "d.npz"))
