"""Train the MTP drafter on distilled shards (torch, CPU), checkpoint, evaluate, export.

    python -m train.mtp_train --minutes 30              # a fresh run (init from the target's last layer)
    python -m train.mtp_train --minutes 60 --resume     # continue from train/ckpt/mtp.pt (weights + AdamW)
    python -m train.mtp_train --minutes 30 --init-from engine/spec/drafters/smollm2-135m-instruct.mtp.npz
                                                        # a fresh run from an exported file's weights
    python -m train.mtp_train --export                  # write engine/spec/drafters/<model>.mtp.npz

Loss: cross-entropy of every unrolled step (step s of chain p predicts x_{p+s+1}, teacher forcing: the true
tokens as y), weighted `--weights`, over the chains the runtime drafts (from y = the prompt's last token
on: the first round drafts the first reply token) and targets in the hot vocabulary. The hot vocabulary
(the `--n-hot` most frequent reply tokens of the training shards) is fixed at the first run and kept in
the checkpoint. Shards that distill.py
writes meanwhile are picked up at every epoch. Every `--eval-min` minutes the held-out shards are scored:
top-1 per step (targets outside the hot vocabulary count as misses) and the tokens per round that greedy
speculation with k = `steps` drafts would get on those replies (rounds walked as the runtime does: a
round accepts drafts up to the first miss, plus the target's own token). Lines go to train/logs/mtp.log.
"""
from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .common import (hot_index_of, logger, model_path, read_drafter_file, rel, save_checkpoint, sha256_of,
                     target_f32, timed_run, walk_rounds, write_drafter_file)
from .mtp_model import PARAM_NAMES, MTPConfig, MTPDrafter, init_from_target

HERE = Path(__file__).resolve().parent
DATA, CKPT, LOG = HERE / "data", HERE / "ckpt" / "mtp.pt", HERE / "logs" / "mtp.log"
EXPORT_DIR = HERE.parent / "engine" / "spec" / "drafters"
FORMAT, VERSION = "ninfer-mtp", 1
log = logger(LOG)


# ------------------------------------------------------------------------------------------- the target
def load_target(path: Path) -> tuple[MTPConfig, dict[str, np.ndarray]]:
    """The drafter's shapes and the target's frozen pieces: embed (vocab, d), head (vocab, d), output_norm,
    and its last layer under PARAM_NAMES' names, dequantized to float32."""
    a, top, (last,) = target_f32(path, "MTP", 1)
    cfg = MTPConfig(a.d_model, a.n_head, a.n_kv_head, a.head_dim, a.d_ff, float(a.rms_eps), float(a.rope_base),
                    bool(a.rope_neox))
    return cfg, {**last, **top}


# ------------------------------------------------------------------------------------------------ data
class Shards:
    """Every sequence of a split's shards in memory: tokens (L,) int32, hidden (L, d) f16, prompt_len,
    predictable. `refresh()` loads shards written since the last call."""

    def __init__(self, split: str):
        self.dir = DATA / split
        self.loaded: set[str] = set()
        self.seqs: list[tuple[np.ndarray, np.ndarray, int, bool]] = []

    def refresh(self) -> int:
        new = [p for p in sorted(self.dir.glob("shard_*.npz")) if p.name not in self.loaded]
        for p in new:
            with np.load(p) as z:
                tok, hid = z["tokens"], z["hidden"]
                for s, n, pl, pr in zip(z["seq_start"], z["seq_len"], z["prompt_len"], z["predictable"]):
                    if n - pl >= 2:  # a reply of 2+ tokens has at least one target
                        self.seqs.append((tok[s:s + n], hid[s:s + n], int(pl), bool(pr)))
            self.loaded.add(p.name)
        return len(new)

    def reply_tokens(self) -> np.ndarray:
        return np.concatenate([t[pl:] for t, _, pl, _ in self.seqs]) if self.seqs else np.zeros(0, np.int32)


def hot_vocab(train: Shards, n_hot: int) -> np.ndarray:
    """The n_hot most frequent reply tokens of the training data, sorted by id (int32)."""
    counts = np.bincount(train.reply_tokens())
    top = np.argsort(-counts, kind="stable")[:n_hot]
    return np.sort(top[counts[top] > 0]).astype(np.int32)


def make_batch(seqs: list, idx: list[int], steps: int, hot_index: np.ndarray) -> dict[str, torch.Tensor]:
    """Padded chains of a batch: h (B, P, d) = h_p; ys[s] (B, P) = x_{p+s+1}; tgt[s] = x_{p+s+2} or -1;
    hot[s] = its hot index or -1; valid (B, P) first-step rows; drafted (B, P): chains the runtime drafts
    (p >= prompt_len - 2: the first round drafts the first reply token from the prompt's
    last token)."""
    p_max = max(len(seqs[i][0]) - 1 for i in idx)
    b, d = len(idx), seqs[idx[0]][1].shape[1]
    h = np.zeros((b, p_max, d), np.float32)
    x = np.zeros((b, p_max + steps + 1), np.int64)
    ok = np.zeros((b, p_max + steps + 1), bool)
    valid = np.zeros((b, p_max), bool)
    drafted = np.zeros((b, p_max), bool)
    for r, i in enumerate(idx):
        tok, hid, pl, _ = seqs[i]
        n = len(tok)
        h[r, :n - 1] = hid[:n - 1]
        x[r, :n], ok[r, :n] = tok, True
        valid[r, :n - 1] = True
        drafted[r, max(pl - 2, 0):n - 1] = True
    ys = [torch.from_numpy(x[:, s:s + p_max].copy()) for s in range(1, steps + 1)]
    tgt = [np.where(ok[:, s:s + p_max], x[:, s:s + p_max], -1) for s in range(2, steps + 2)]
    hot = [np.where(t >= 0, hot_index[np.maximum(t, 0)], -1) for t in tgt]
    return dict(h=torch.from_numpy(h), ys=ys, valid=torch.from_numpy(valid), drafted=torch.from_numpy(drafted),
                tgt=[torch.from_numpy(t) for t in tgt], hot=[torch.from_numpy(t) for t in hot])


# --------------------------------------------------------------------------------------- loss and eval
def step_losses(model: MTPDrafter, bt: dict) -> list[torch.Tensor]:
    """Mean cross-entropy of each step over drafted chains whose target is in the hot vocabulary."""
    outs = model(bt["h"], bt["ys"], bt["valid"])
    losses = []
    for o, hot in zip(outs, bt["hot"]):
        sel = bt["drafted"] & (hot >= 0)
        losses.append(F.cross_entropy(model.logits(o[sel]), hot[sel]) if sel.any() else o.sum() * 0)
    return losses


@torch.no_grad()
def evaluate(model: MTPDrafter, held: Shards, steps: int, hot_ids: np.ndarray, hot_index: np.ndarray) -> dict:
    """Held-out top-1 per step (out-of-hot targets are misses), hot-vocab coverage, and greedy tokens/round
    with k = steps, for the chat and the predictable replies."""
    model.eval()
    res = {}
    for kind in ("chat", "predictable"):
        seqs = [s for s in held.seqs if s[3] == (kind == "predictable")]
        hits, n_tgt, n_hot, tokens, rounds = np.zeros(steps), np.zeros(steps), 0, 0, 0
        for i in range(len(seqs)):
            bt = make_batch(seqs, [i], steps, hot_index)
            outs = model(bt["h"], bt["ys"], bt["valid"])
            drafted = bt["drafted"][0].numpy()
            right = np.zeros((steps, drafted.shape[0]), bool)  # step s of chain p drafted the true token
            for s, (o, tgt) in enumerate(zip(outs, bt["tgt"])):
                t = tgt[0].numpy()
                sel = drafted & (t >= 0)
                pred = hot_ids[model.logits(o[0][torch.from_numpy(sel)]).argmax(-1).numpy()]
                right[s, sel] = pred == t[sel]
                hits[s] += right[s, sel].sum()
                n_tgt[s] += sel.sum()
                if s == 0:
                    n_hot += (hot_index[t[sel]] >= 0).sum()
            n, pl = len(seqs[i][0]), seqs[i][2]
            # a round from context position a drafts with chain p = a - 1 (y = x_a); the first from the prompt's
            # last token
            at = np.zeros((n, steps), bool)
            at[1:] = right.T[:n - 1]
            t, r = walk_rounds(at, pl - 1, n, steps)
            tokens, rounds = tokens + t, rounds + r
        res[kind] = dict(top1=(hits / np.maximum(n_tgt, 1)).round(4).tolist(), targets=int(n_tgt[0]),
                         coverage=round(float(n_hot / max(n_tgt[0], 1)), 4),
                         tok_per_round=round(tokens / max(rounds, 1), 3))
    model.train()
    return res


# -------------------------------------------------------------------------------------------- training
def save_ckpt(model, opt, state: dict) -> None:
    save_checkpoint(CKPT, state, {k: getattr(model, k).detach().clone() for k in PARAM_NAMES}, opt)


def build(resume: bool, n_hot: int, train: Shards, seed: int, steps: int, rehot: bool, qat: bool = False,
          init_from: str | None = None):
    """(model, optimizer state or None, run state): from the checkpoint, an exported file's weights
    (init_from: a fresh run, step 0, a new optimizer, the file's hot vocabulary) or the target's last layer.
    The hot vocabulary comes from the checkpoint unless rehot; it selects frozen head rows, so changing it
    keeps every trained weight valid."""
    file = read_file(init_from, "--init-from") if init_from is not None else None
    cfg, parts = load_target(model_path())
    ck = torch.load(CKPT, weights_only=False) if resume else None
    if file is not None:
        init, hot_ids = file_weights(file[0], cfg, "--init-from", init_from)
        meta = file[1]
        state = dict(hot_ids=hot_ids, steps=steps, step=0, tokens_seen=0, train_s=0.0, epoch=0, last_eval=None,
                     base_sha256=sha256_of(model_path()), init_from=str(init_from), init_training=meta.get("training"))
        log(f"new run from {init_from} (its training: {json.dumps(meta.get('training'))})")
    elif ck is not None:
        hot_ids = np.asarray(ck["hot_ids"], np.int32)
        init = {k: v.numpy() for k, v in ck["model"].items()}
        state = {k: ck[k] for k in ("hot_ids", "steps", "step", "tokens_seen", "train_s", "epoch", "last_eval",
                                    "base_sha256")}
        state["init_from"], state["init_training"] = ck.get("init_from"), ck.get("init_training")
        if rehot:
            state["hot_ids"] = hot_ids = hot_vocab(train, n_hot)
            log(f"hot vocab recomputed: {len(hot_ids)} from {len(train.seqs)} sequences")
    else:
        hot_ids = hot_vocab(train, n_hot)
        h_rms = float(np.sqrt(np.mean([np.mean(s[1][:256].astype(np.float32) ** 2) for s in train.seqs[:200]])))
        init = init_from_target(cfg, parts, h_rms, seed)
        state = dict(hot_ids=hot_ids, steps=steps, step=0, tokens_seen=0, train_s=0.0, epoch=0, last_eval=None,
                     base_sha256=sha256_of(model_path()))
        log(f"new run: hot vocab {len(hot_ids)} from {len(train.seqs)} sequences, h rms {h_rms:.3f}")
    model = MTPDrafter(cfg, parts["embed"], parts["head"][hot_ids], parts["output_norm"], init, qat=qat)
    return model, (ck["opt"] if ck else None), state


def train(a) -> None:
    torch.manual_seed(a.seed)
    train_set, held = Shards("train"), Shards("heldout")
    train_set.refresh(), held.refresh()
    if not train_set.seqs or not held.seqs:
        raise SystemExit(f"no shards under {DATA}/train or {DATA}/heldout: run `python -m train.distill` first")
    model, opt_state, st = build(a.resume, a.n_hot, train_set, a.seed, a.steps, a.rehot, not a.no_qat, a.init_from)
    hot_ids = st["hot_ids"]
    st["qat"] = not a.no_qat  # how this run's forward ran the block (a resumed run may switch; the last one is kept)
    hot_index = hot_index_of(hot_ids, model.embed.shape[0])
    decay = [getattr(model, k) for k in PARAM_NAMES if getattr(model, k).ndim == 2]
    rest = [getattr(model, k) for k in PARAM_NAMES if getattr(model, k).ndim == 1]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=a.wd), dict(params=rest, weight_decay=0.0)],
                            lr=a.lr, betas=(0.9, 0.95))
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    weights = [float(w) for w in a.weights.split(",")][:a.steps]
    log(f"run: {a.minutes} min, lr {a.lr}, weights {weights}, batch {a.batch_tokens} rows, "
        f"{len(train_set.seqs)} train sequences ({sum(len(s[0]) for s in train_set.seqs)} tokens), "
        f"{len(held.seqs)} held-out, step {st['step']}, threads {torch.get_num_threads()}")
    if st["step"] == 0:
        st["last_eval"] = evaluate(model, held, a.steps, hot_ids, hot_index)
        log(f"eval at init: {json.dumps(st['last_eval'])}")

    def one_step(idx, rng):
        bt = make_batch(train_set.seqs, idx, a.steps, hot_index)
        losses = step_losses(model, bt)
        return (sum(w * l for w, l in zip(weights, losses)), np.array([float(l.detach()) for l in losses]),
                bt["drafted"].sum())
    timed_run(a, st, train_set, opt, list(model.parameters()), one_step,
              lambda: evaluate(model, held, a.steps, hot_ids, hot_index), lambda: save_ckpt(model, opt, st), log,
              "tokens", "loss/step", ".3f")
    log(f"checkpoint {rel(CKPT)}: step {st['step']}, {st['train_s'] / 60:.1f} min trained in all")


# ---------------------------------------------------------------------------------------------- export
def export(steps: int) -> Path:
    """Write the runtime's drafter file from the checkpoint (format ninfer-mtp v1, see train/README.md)."""
    ck = torch.load(CKPT, weights_only=False)
    path = model_path()
    cfg, _ = load_target(path)
    sha = sha256_of(path)
    if ck["base_sha256"] != sha:
        raise SystemExit(f"the checkpoint was trained on a model with sha256 {ck['base_sha256']}, not {path} ({sha})")
    ev = ck.get("last_eval") or {}
    training = dict(reply_tokens=ck.get("train_tokens"), sequences=ck.get("train_sequences"),
                    tokens_seen=ck["tokens_seen"], optimizer_steps=ck["step"], minutes=round(ck["train_s"] / 60, 1),
                    heldout_top1_per_step=ev.get("chat", {}).get("top1"),
                    heldout_tok_per_round=ev.get("chat", {}).get("tok_per_round"),
                    heldout_predictable=ev.get("predictable"),
                    hot_vocab_coverage=ev.get("chat", {}).get("coverage"),
                    quantization_aware=ck.get("qat"), init_from=ck.get("init_from"),
                    init_training=ck.get("init_training"),
                    date=datetime.now(UTC).strftime("%Y-%m-%d"))
    out = EXPORT_DIR / (path.name.split(".")[0].lower() + ".mtp.npz")
    params = {k: v.numpy() for k, v in ck["model"].items()}
    export_file(out, cfg, params, np.asarray(ck["hot_ids"]), sha, path.name, ck.get("steps", steps), training)
    log(f"exported {rel(out)} ({out.stat().st_size / 1e6:.1f} MB), step {ck['step']}")
    return out


def export_file(out: Path, cfg: MTPConfig, params: dict[str, np.ndarray], hot_ids: np.ndarray, base_sha256: str,
                base_name: str, steps: int, training: dict) -> None:
    """The drafter file: np.savez (no pickle) of `meta` (a JSON string), `hot_ids` int32 (n_hot,) and the
    PARAM_NAMES arrays in float16, matrices (out, in); written atomically."""
    meta = dict(format=FORMAT, version=VERSION, base_sha256=base_sha256, base_name=base_name,
                d_model=cfg.d_model, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, head_dim=cfg.head_dim,
                d_ff=cfg.d_ff, rms_eps=cfg.rms_eps, rope_base=cfg.rope_base, rope_neox=cfg.rope_neox,
                hot_vocab_size=len(hot_ids), steps_trained=int(steps), training=training)
    write_drafter_file(out, meta, hot_ids, params, cfg.shapes())


def read_file(path: str, flag: str) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, meta) of an exported MTP drafter file made for this model (common.read_drafter_file)."""
    return read_drafter_file(path, flag, FORMAT, VERSION, sha256_of(model_path()), "MTP ")


def file_weights(arrays: dict[str, np.ndarray], cfg: MTPConfig, flag: str, path: str
                 ) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(the block's weights as float32, hot_ids) of a read file (read_file); SystemExit where one is missing."""
    missing = [k for k in (*cfg.shapes(), "hot_ids") if k not in arrays]
    if missing:
        raise SystemExit(f"{flag} {path}: lacks {', '.join(missing[:3])}")
    return {k: np.asarray(arrays[k], np.float32) for k in cfg.shapes()}, np.asarray(arrays["hot_ids"], np.int32)


def eval_file(path: str, steps: int = 3) -> dict:
    """The held-out eval (`evaluate`, the QAT forward) of an exported drafter file's weights: a committed
    file scored on the held-out replies of this checkout's distill, beside a run's eval lines."""
    arrays, _ = read_file(path, "--eval-file")
    cfg, parts = load_target(model_path())
    init, hot_ids = file_weights(arrays, cfg, "--eval-file", path)
    held = Shards("heldout")
    held.refresh()
    hot_index = hot_index_of(hot_ids, parts["embed"].shape[0])
    model = MTPDrafter(cfg, parts["embed"], parts["head"][hot_ids], parts["output_norm"], init, qat=True)
    return evaluate(model, held, steps, hot_ids, hot_index)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="training time of this run")
    ap.add_argument("--resume", action="store_true", help=f"continue from {rel(CKPT)}")
    ap.add_argument("--rehot", action="store_true", help="with --resume: recompute the hot vocabulary from "
                    "all training shards (more data than the first run saw)")
    ap.add_argument("--init-from", metavar="FILE", help="a fresh run from an exported drafter file's weights and "
                    "hot vocabulary (e.g. the committed file fine-tuned on new data)")
    ap.add_argument("--export", action="store_true", help="only export the checkpoint")
    ap.add_argument("--eval-file", metavar="FILE", help="only print the held-out eval of an exported drafter file")
    ap.add_argument("--steps", type=int, default=3, help="unrolled MTP steps")
    ap.add_argument("--weights", default="1,0.7,0.5", help="loss weight of each step")
    ap.add_argument("--no-qat", action="store_true", help="train the block's matrices in float (default: "
                    "as the runtime runs them, Q4_1, fake-quantized with a straight-through gradient)")
    ap.add_argument("--lr", type=float, default=7e-4)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=50, help="optimizer steps of linear warm-up per run")
    ap.add_argument("--batch-tokens", type=int, default=4096, help="rows (sequences x longest) per batch")
    ap.add_argument("--n-hot", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--eval-min", type=float, default=5.0)
    ap.add_argument("--ckpt-min", type=float, default=4.0)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.export:
        export(a.steps)
        return
    if a.eval_file:
        print(json.dumps(eval_file(a.eval_file, a.steps)))
        return
    if a.resume and a.init_from:
        raise SystemExit("--resume continues the checkpoint, --init-from starts a fresh run from a file: give one")
    if a.resume and not CKPT.exists():
        raise SystemExit(f"--resume: no checkpoint at {CKPT}")
    train(a)


if __name__ == "__main__":
    main()
