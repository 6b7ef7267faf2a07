"""train/common.py: the round walk both held-out evals count tokens a round with, and a whole timed MTP run
(train/mtp_train.train over its shared loop) on synthetic shards of a tiny target: steps taken, the log's
lines, the checkpoint, a resumed run, the export the runtime reads."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from train.common import walk_rounds  # noqa: E402
from train.mtp_model import MTPConfig  # noqa: E402

# (32 wide: the quantization-aware forward takes rows of 32)
CFG = MTPConfig(d_model=32, n_head=4, n_kv_head=2, head_dim=8, d_ff=64, rms_eps=1e-5, rope_base=10000.0)
VOCAB = 40


def test_walk_rounds_keeps_leading_right_drafts_and_the_targets_token():
    right = np.zeros((10, 3), bool)
    right[2] = [True, True, False]  # the round from 2 keeps 2 drafts + the target's token: 3 tokens, to 5
    right[5] = [True, True, True]  # from 5: all 3 + 1, to 9
    assert walk_rounds(right, 2, 10, 3) == (3 + 4, 2)  # 9 + 1 == n: nothing left to draft
    assert walk_rounds(right, 2, 10, 1) == (2 + 1 + 2 + 1 + 1, 5)  # k = 1: 2 -> 4 -> 5 -> 7 -> 8 -> 9
    assert walk_rounds(right, 9, 10, 3) == (0, 0)
    right[0] = True  # a round near the end stops at the reply's last token whatever it drafted
    assert walk_rounds(right, 0, 3, 3) == (2, 1)


def _shards(root, split, n_seq, rng, d):
    (root / split).mkdir(parents=True)
    lens = rng.integers(12, 20, n_seq)
    np.savez(root / split / "shard_00000.npz", tokens=rng.integers(0, VOCAB, lens.sum()).astype(np.int32),
             hidden=rng.normal(0, 1, (lens.sum(), d)).astype(np.float16),
             seq_start=np.concatenate([[0], np.cumsum(lens)[:-1]]), seq_len=lens,
             prompt_len=np.full(n_seq, 4), prompt_idx=np.arange(n_seq), sampled=np.zeros(n_seq, bool),
             predictable=np.arange(n_seq) % 2 == 1)


def _args(**kw):
    a = dict(minutes=0.03, resume=False, rehot=False, steps=3, weights="1,0.7,0.5", no_qat=False, lr=1e-3, wd=0.05,
             warmup=2, batch_tokens=64, n_hot=24, eval_min=100.0, ckpt_min=100.0, log_every=1, seed=0,
             init_from=None)
    return argparse.Namespace(**dict(a, **kw))


def test_an_mtp_run_trains_checkpoints_resumes_and_exports(tmp_path, monkeypatch):
    from engine.spec.drafter_file import load
    from train import mtp_train
    rng = np.random.default_rng(0)
    layer = {k: rng.normal(0, 0.2, s).astype(np.float32) + (1.0 if len(s) == 1 else 0.0)
             for k, s in CFG.shapes().items()}
    parts = dict(layer, embed=rng.normal(0, 1, (VOCAB, CFG.d_model)).astype(np.float32),
                 output_norm=np.ones(CFG.d_model, np.float32))
    parts["head"] = parts["embed"]
    lines = []
    monkeypatch.setattr(mtp_train, "DATA", tmp_path / "data")
    monkeypatch.setattr(mtp_train, "CKPT", tmp_path / "ckpt" / "mtp.pt")
    monkeypatch.setattr(mtp_train, "EXPORT_DIR", tmp_path / "drafters")
    monkeypatch.setattr(mtp_train, "log", lines.append)
    monkeypatch.setattr(mtp_train, "model_path", lambda: tmp_path / "Tiny-Model.Q4_1.gguf")
    monkeypatch.setattr(mtp_train, "sha256_of", lambda path: "ab" * 32)
    monkeypatch.setattr(mtp_train, "load_target", lambda path: (CFG, parts))
    _shards(tmp_path / "data", "train", 24, rng, CFG.d_model)
    _shards(tmp_path / "data", "heldout", 4, rng, CFG.d_model)

    mtp_train.train(_args())
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert steps and all(" tokens " in ln and " loss/step " in ln for ln in steps)
    assert len(steps[-1].split("loss/step ")[1].split(" lr ")[0].split()) == 3  # one running loss a step
    ck = torch.load(tmp_path / "ckpt" / "mtp.pt", weights_only=False)
    assert ck["step"] == len(steps) and ck["tokens_seen"] > 0 and ck["train_sequences"] == 24
    ev = ck["last_eval"]
    assert set(ev) == {"chat", "predictable"} and 1.0 <= ev["chat"]["tok_per_round"] <= 4.0

    lines.clear()
    mtp_train.train(_args(resume=True, minutes=0.01))
    again = torch.load(tmp_path / "ckpt" / "mtp.pt", weights_only=False)
    assert again["step"] > ck["step"] and again["train_s"] > ck["train_s"]
    assert not any(ln.startswith("eval at init") for ln in lines)  # a resumed run does not evaluate at step 0

    out = mtp_train.export(3)
    df = load(out, mtp_train.FORMAT, mtp_train.VERSION, None, ("w_eh", "hot_ids"))
    assert df.meta["training"]["optimizer_steps"] == again["step"]
    assert df.meta["base_sha256"] == "ab" * 32

    # --init-from: a fresh run (step 0, its own checkpoint) from the file's weights as written and its hot vocabulary
    model, opt_state, st = mtp_train.build(False, 24, None, 0, 3, False, True, str(out))
    assert opt_state is None and st["step"] == 0 and st["init_from"] == str(out)
    np.testing.assert_array_equal(st["hot_ids"], df.arrays["hot_ids"])
    for k in CFG.shapes():
        np.testing.assert_array_equal(getattr(model, k).detach().numpy(), df.arrays[k].astype(np.float32))
    monkeypatch.setattr(mtp_train, "CKPT", tmp_path / "ckpt2" / "mtp.pt")
    lines.clear()
    mtp_train.train(_args(init_from=str(out), minutes=0.01))
    assert any(ln.startswith(f"new run from {out}") for ln in lines)
    assert any(ln.startswith("eval at init") for ln in lines)
    training = load(mtp_train.export(3), mtp_train.FORMAT, mtp_train.VERSION, None, ()).meta["training"]
    assert training["init_from"] == str(out) and training["init_training"] == df.meta["training"]
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(SystemExit, match="--init-from .*not a readable MTP drafter file"):
        mtp_train.build(False, 24, None, 0, 3, False, True, str(tmp_path / "bad.npz"))
    monkeypatch.setattr(mtp_train, "sha256_of", lambda path: "cd" * 32)
    with pytest.raises(SystemExit, match="another model"):
        mtp_train.build(False, 24, None, 0, 3, False, True, str(out))


def test_a_dflash_run_trains_and_checkpoints_on_the_shared_loop(tmp_path, monkeypatch):
    from dataclasses import asdict

    from engine.spec.dflash_taps import Taps
    from train import dflash_train
    from train.dflash_model import LAYER_PARAMS, DFlashConfig
    taps = Taps(kv_layers=(1,), hidden_layer=2, d_model=32, kv_dim=16)
    cfg = DFlashConfig(d_model=32, n_head=4, n_kv_head=2, head_dim=8, d_ff=64, rms_eps=1e-5, rope_base=10000.0,
                       rope_neox=False, feat_width=taps.width, n_layers=1, block=4)
    rng = np.random.default_rng(1)
    shapes = cfg.shapes()
    layer = {k: rng.normal(0, 0.2, shapes[f"l0.{k}"]).astype(np.float32) + (1.0 if k.endswith("norm") else 0.0)
             for k in LAYER_PARAMS}
    embed = rng.normal(0, 1, (VOCAB, cfg.d_model)).astype(np.float32)
    tg = {"embed": embed, "head": embed, "output_norm": np.ones(cfg.d_model, np.float32), "layers": [layer]}
    lines = []
    for name, value in [("DATA", tmp_path / "data"), ("FEAT_DIR", tmp_path / "feat"), ("log", lines.append),
                        ("current_taps", lambda: taps), ("mtp_hot_ids", lambda: None),
                        ("load_target", lambda path, n, t, b: (cfg, tg)), ("sha256_of", lambda path: "cd" * 32),
                        ("model_path", lambda: tmp_path / "Tiny-Model.Q4_1.gguf")]:
        monkeypatch.setattr(dflash_train, name, value)
    for split, n in (("train", 16), ("heldout", 4)):
        _shards(tmp_path / "data", split, n, rng, cfg.d_model)
        rows = len(np.load(tmp_path / "data" / split / "shard_00000.npz")["tokens"])
        (tmp_path / "feat" / split).mkdir(parents=True)
        np.savez(tmp_path / "feat" / split / "shard_00000.npz", kv=rng.normal(0, 1, (rows, 2 * taps.kv_dim)).astype(
            np.float16), taps=np.array(json.dumps(asdict(taps))))
    a = _args(layers=1, block=4, gamma=4.0, anchors=6, n_hot=24, init_from=None, weights="q8_0",
              ckpt=tmp_path / "ckpt" / "dflash.pt", eval_min=100.0)
    dflash_train.train(a)
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert steps and all(" blocks " in ln and " loss/row " in ln for ln in steps)
    assert len(steps[-1].split("loss/row ")[1].split(" lr ")[0].split()) == cfg.block - 1  # one loss a row
    ck = torch.load(tmp_path / "ckpt" / "dflash.pt", weights_only=False)
    assert ck["step"] == len(steps) and ck["tokens_seen"] > 0 and ck["train_sequences"] == 16
    assert {"top1", "tok_per_round_k3"} <= set(ck["last_eval"]["chat"])
