"""The training module computes the drafter the runtime runs: a numpy walk of the math (a KV cache of
first-step pairs, then a chain of steps, RoPE from the engine's ref kernel) on random weights equals the
torch module's unrolled forward; the export writes every field of the ninfer-mtp v1 format."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from engine.backends.ref.kernels import rope as ref_rope
from train.mtp_model import PARAM_NAMES, MTPConfig, MTPDrafter, rmsnorm
from train.mtp_train import FORMAT, VERSION, export_file, make_batch

CFG = MTPConfig(d_model=16, n_head=4, n_kv_head=2, head_dim=4, d_ff=24, rms_eps=1e-5, rope_base=10000.0)
VOCAB, N_HOT, STEPS = 50, 20, 3


def random_parts(seed=0):
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(0, 0.3, s).astype(np.float32) + (1.0 if len(s) == 1 else 0.0)
              for k, s in CFG.shapes().items()}
    embed = rng.normal(0, 1, (VOCAB, CFG.d_model)).astype(np.float32)
    hot_ids = np.sort(rng.choice(VOCAB, N_HOT, replace=False)).astype(np.int32)
    out_norm = rng.uniform(0.5, 1.5, CFG.d_model).astype(np.float32)
    return params, embed, hot_ids, out_norm


def np_rms(x, w):
    return x / np.sqrt(np.mean(x * x) + CFG.rms_eps) * w


class NumpyDrafter:
    """The drafter as the runtime walks it: one position at a time, an explicit list of keys and values."""

    def __init__(self, params, embed, head_hot, out_norm):
        self.w, self.embed, self.head, self.out_norm = params, embed, head_hot, out_norm
        inv = 1.0 / (CFG.rope_base ** (np.arange(0, CFG.head_dim, 2, dtype=np.float64) / CFG.head_dim))
        self.inv_freq = inv.astype(np.float32)

    def qkv(self, g, y, pos):
        w, c = self.w, CFG
        z = w["w_eh"] @ np.concatenate([np_rms(self.embed[y], w["enorm"]), np_rms(g, w["hnorm"])])
        n1 = np_rms(z, w["attn_norm"])
        q = (w["wq"] @ n1).reshape(1, c.n_head, c.head_dim)
        k = (w["wk"] @ n1).reshape(1, c.n_kv_head, c.head_dim)
        ref_rope(q, pos, self.inv_freq, False)
        ref_rope(k, pos, self.inv_freq, False)
        return z, q[0], k[0], (w["wv"] @ n1).reshape(c.n_kv_head, c.head_dim)

    def finish(self, z, q, keys, values):
        w, c = self.w, CFG
        group = c.n_head // c.n_kv_head
        kk, vv = np.stack(keys), np.stack(values)  # (n, n_kv, hd)
        att = np.zeros((c.n_head, c.head_dim))
        for h in range(c.n_head):
            s = kk[:, h // group] @ q[h] / np.sqrt(c.head_dim)
            p = np.exp(s - s.max())
            att[h] = (p / p.sum()) @ vv[:, h // group]
        u = z + w["wo"] @ att.reshape(-1)
        n2 = np_rms(u, w["ffn_norm"])
        gate = w["w_gate"] @ n2
        o = u + w["w_down"] @ (gate / (1 + np.exp(-gate)) * (w["w_up"] @ n2))
        return o, self.head @ np_rms(o, self.out_norm)

    def chain(self, h, x, p, steps):
        """[(o, logits)] of steps 1..steps of the chain drafted from position p with the true tokens."""
        keys, values = [], []
        for j in range(p + 1):  # the first-step cache: true pairs (h_j, x_{j+1}) at positions 0..p
            _, _, k, v = self.qkv(h[j], x[j + 1], j)
            keys.append(k)
            values.append(v)
        out, g = [], h[p]
        for s in range(1, steps + 1):
            z, q, k, v = self.qkv(g, x[p + s], p + s - 1)
            if s > 1:
                keys.append(k)
                values.append(v)
            g, logits = self.finish(z, q, keys, values)
            out.append((g, logits))
        return out


def test_unrolled_forward_matches_the_numpy_walk():
    params, embed, hot_ids, out_norm = random_parts()
    rng = np.random.default_rng(1)
    n = 12
    x = rng.integers(0, VOCAB, n).astype(np.int32)
    h = rng.normal(0, 2, (n, CFG.d_model)).astype(np.float32)
    model = MTPDrafter(CFG, embed, embed[hot_ids], out_norm, params)
    hot_index = np.full(VOCAB, -1, np.int64)
    hot_index[hot_ids] = np.arange(N_HOT)
    # a second, shorter sequence in the batch: padding must not change the first one's rows
    short = (x[:7], h[:7].astype(np.float16), 3, False)
    seqs = [(x, h, 2, False), short]
    bt = make_batch(seqs, [0, 1], STEPS, hot_index)
    with torch.no_grad():
        outs = model(bt["h"], bt["ys"], bt["valid"])
        logits = [model.logits(o) for o in outs]
    ref = NumpyDrafter({k: v.astype(np.float64) for k, v in params.items()}, embed, embed[hot_ids], out_norm)
    for p in range(n - STEPS - 1):
        for s, (o, lg) in enumerate(ref.chain(h, x, p, STEPS)):
            np.testing.assert_allclose(outs[s][0, p].numpy(), o, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(logits[s][0, p].numpy(), lg, rtol=1e-4, atol=1e-4)
    # targets: step s of chain p predicts x_{p+s+1}; drafted chains start at prompt_len - 2
    assert bt["tgt"][0][0, 0] == x[2] and bt["tgt"][2][0, 4] == x[8] and bt["tgt"][0][0, n - 2] == -1
    assert bt["drafted"][0].numpy().tolist() == [True] * (n - 1)
    assert bt["drafted"][1].numpy().tolist()[:6] == [False, True, True, True, True, True]


def test_rmsnorm_matches_the_formula():
    x = torch.randn(3, 16)
    w = torch.rand(16)
    want = x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(rmsnorm(x, w, 1e-5), want)


def test_export_writes_every_field(tmp_path):
    params, _, hot_ids, _ = random_parts()
    out = tmp_path / "m.mtp.npz"
    export_file(out, CFG, params, hot_ids, "ab" * 32, "base.gguf", STEPS, dict(optimizer_steps=1))
    with np.load(out, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        assert set(z.files) == {"meta", "hot_ids", *PARAM_NAMES}
        assert z["hot_ids"].dtype == np.int32 and z["hot_ids"].shape == (N_HOT,)
        for k, shape in CFG.shapes().items():
            assert z[k].dtype == np.float16 and z[k].shape == shape, k
        np.testing.assert_allclose(z["w_eh"], params["w_eh"], rtol=1e-3, atol=1e-3)
    assert meta["format"] == FORMAT == "ninfer-mtp" and meta["version"] == VERSION == 1
    for key in ("base_sha256", "base_name", "d_model", "n_head", "n_kv_head", "head_dim", "d_ff", "rms_eps",
                "rope_base", "rope_neox", "hot_vocab_size", "steps_trained", "training"):
        assert key in meta, key
    assert meta["hot_vocab_size"] == N_HOT and meta["steps_trained"] == STEPS and meta["rope_neox"] is False


def test_fake_q4_1_is_the_runtime_quantization():
    """train's fake quantization (qat) gives the values the runtime's Q4_1 block holds (engine/spec/mtp.py
    quantizes with gguf), and passes the gradient through."""
    from engine.quant import dequantize
    from engine.spec.mtp import _q4
    from train.mtp_model import fake_q4_1
    rng = np.random.default_rng(4)
    w = (rng.normal(0, 0.05, (48, 96)) * rng.uniform(0.2, 3, (48, 1))).astype(np.float32)
    w[3, :32] = 0.25  # a constant block: scale 0
    want = dequantize(_q4("w", w)).reshape(w.shape)
    t = torch.tensor(w, requires_grad=True)
    got = fake_q4_1(t)
    np.testing.assert_allclose(got.detach().numpy(), want, rtol=0, atol=1e-6)
    got.sum().backward()
    assert torch.equal(t.grad, torch.ones_like(t))
