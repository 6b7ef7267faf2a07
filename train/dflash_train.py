"""Train the DFlash drafter on the distilled shards and their tapped features (torch, CPU); checkpoint, eval, export.

    python -m train.dflash_features --threads 1          # first: the KV taps of every distilled sequence
    python -m train.dflash_train --minutes 60            # a fresh run (draft layer = the target's last layer)
    python -m train.dflash_train --minutes 60 --resume   # continue from train/ckpt/dflash.pt (weights + AdamW)
    python -m train.dflash_train --minutes 60 --init-from engine/spec/drafters/smollm2-135m-instruct.dflash.npz
                                                         # a fresh run (new AdamW) from an exported file's weights
    python -m train.dflash_train --export                # write engine/spec/drafters/<model>.dflash.npz

Each visit of a sequence samples `--anchors` block starts a among the positions the runtime drafts from
(prompt_len - 1 <= a <= n - 2: the prefill feeds the prompt but its last token, so the first round's block
starts at the prompt's last token and drafts the first reply tokens) and scores all those
blocks in one forward (train/dflash_model.py). Loss: cross-entropy of block row i (predicting x_{a+i}) over
targets in the hot vocabulary, weighted exp(-(i - 1) / gamma): a later draft counts only when every earlier
one was accepted, so it matters less. The hot vocabulary is the MTP drafter's (engine/spec/drafters/*.mtp.npz).
Every `--eval-min` minutes the held-out shards are scored at every anchor: top-1 per block position
(out-of-hot targets are misses) and the tokens per round greedy speculation with 7 and 3 drafts would get
(rounds walked as the runtime does), chat and predictable prompts apart. Lines go to train/logs/dflash.log.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.spec.dflash_taps import Taps, taps_from_dict

from .dflash_features import OUT as FEAT_DIR
from .dflash_features import taps_of
from .dflash_model import WEIGHTS, DFlashConfig, DFlashDrafter, init_from_target
from .common import (hot_index_of, logger, model_path, read_drafter_file, rel, save_checkpoint, sha256_of,
                     target_f32, timed_run, walk_rounds, write_drafter_file)

HERE = Path(__file__).resolve().parent
DATA, CKPT, LOG = HERE / "data", HERE / "ckpt" / "dflash.pt", HERE / "logs" / "dflash.log"
EXPORT_DIR = HERE.parent / "engine" / "spec" / "drafters"
FORMAT, VERSION = "ninfer-dflash", 1
log = logger(LOG)


# ------------------------------------------------------------------------------------------- the target
def load_target(path: Path, n_layers: int, taps: Taps, block: int) -> tuple[DFlashConfig, dict]:
    """The drafter's shapes and the target's pieces (float32): embed, head, output_norm and its last n_layers
    layers (`layers`, keys as LAYER_PARAMS)."""
    a, top, layers = target_f32(path, "DFlash", n_layers)
    cfg = DFlashConfig(a.d_model, a.n_head, a.n_kv_head, a.head_dim, a.d_ff, float(a.rms_eps), float(a.rope_base),
                       bool(a.rope_neox), taps.width, n_layers, block)
    return cfg, {**top, "layers": layers, "args": a}


def mtp_hot_ids() -> np.ndarray | None:
    """The hot vocabulary of the committed MTP drafter of the default model (None if there is none)."""
    p = EXPORT_DIR / (model_path().name.split(".")[0].lower() + ".mtp.npz")
    if not p.exists():
        return None
    with np.load(p, allow_pickle=False) as z:
        return np.asarray(z["hot_ids"], np.int32)


# ------------------------------------------------------------------------------------------------ data
class Shards:
    """Sequences of a split whose tapped features exist: (tokens (L,) int32, feats (L, W) f16 = [h | kv],
    prompt_len, predictable). `refresh()` loads shards written since the last call."""

    def __init__(self, split: str, taps: Taps):
        self.split, self.taps = split, taps
        self.loaded: set[str] = set()
        self.seqs: list[tuple[np.ndarray, np.ndarray, int, bool]] = []

    def refresh(self) -> int:
        n_new = 0
        for src in sorted((DATA / self.split).glob("shard_*.npz")):
            feat = FEAT_DIR / self.split / src.name
            if src.name in self.loaded or not feat.exists() or taps_of(feat) != self.taps:
                continue
            with np.load(src) as z, np.load(feat) as zf:
                tok, hid, kv = z["tokens"], z["hidden"], zf["kv"]
                if len(kv) != len(tok):
                    raise SystemExit(f"{feat}: {len(kv)} rows for {len(tok)} tokens; delete it and rerun "
                                     "train.dflash_features")
                for s, n, pl, pr in zip(z["seq_start"], z["seq_len"], z["prompt_len"], z["predictable"]):
                    if n - pl >= 2:  # one anchor with a target at least
                        feats = np.concatenate([hid[s:s + n], kv[s:s + n]], 1).astype(np.float16)
                        self.seqs.append((tok[s:s + n], feats, int(pl), bool(pr)))
            self.loaded.add(src.name)
            n_new += 1
        return n_new


def make_batch(seqs: list, idx: list[int], block: int, hot_index: np.ndarray, n_anchors: int | None,
               rng: np.random.Generator | None, window: tuple[int, int] | None = None) -> dict:
    """A padded batch: feats (S, L, W), tokens (S, L), ctx_valid (S, L), anchors (S, N), and per block row
    i = 1..B-1 targets tgt (S, N, B-1) = x_{a+i} or -1, hot (S, N, B-1) their hot index or -1.
    n_anchors None: every anchor in window [lo, hi) (eval); else a random sample of n_anchors."""
    l_max = max(len(seqs[i][0]) for i in idx)
    w = seqs[idx[0]][1].shape[1]
    per = []
    for r, i in enumerate(idx):
        tok, _, pl, _ = seqs[i]
        cand = np.arange(pl - 1, len(tok) - 1)
        if n_anchors is None:
            cand = cand[(cand >= window[0]) & (cand < window[1])]
        elif len(cand) > n_anchors:
            cand = np.sort(rng.choice(cand, n_anchors, replace=False))
        per.append(cand)
    n = max(len(c) for c in per)
    s = len(idx)
    feats = np.zeros((s, l_max, w), np.float32)
    toks = np.zeros((s, l_max), np.int64)
    valid = np.zeros((s, l_max), bool)
    anchors = np.zeros((s, n), np.int64)
    tgt = np.full((s, n, block - 1), -1, np.int64)
    for r, i in enumerate(idx):
        tok, ft, _, _ = seqs[i]
        L = len(tok)
        feats[r, :L], toks[r, :L], valid[r, :L] = ft, tok, True
        a = per[r]
        anchors[r, :len(a)] = a
        pos = a[:, None] + np.arange(1, block)  # (n_r, B-1)
        tgt[r, :len(a)] = np.where(pos < L, tok[np.minimum(pos, L - 1)], -1)
    hot = np.where(tgt >= 0, hot_index[np.maximum(tgt, 0)], -1)
    return {"feats": torch.from_numpy(feats), "tokens": torch.from_numpy(toks), "valid": torch.from_numpy(valid),
                "anchors": torch.from_numpy(anchors), "tgt": torch.from_numpy(tgt), "hot": torch.from_numpy(hot)}


# --------------------------------------------------------------------------------------- loss and eval
def position_weights(block: int, gamma: float) -> torch.Tensor:
    """(B-1,) exp(-(i - 1) / gamma) for block rows i = 1..B-1."""
    return torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)


def block_loss(model: DFlashDrafter, bt: dict, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean cross-entropy over the hot targets, per-row mean CE (B-1,) for the log)."""
    z = model(bt["feats"], bt["tokens"], bt["anchors"], bt["valid"])[:, :, 1:]  # (S, N, B-1, d)
    hot = bt["hot"]
    sel = hot >= 0
    ce = F.cross_entropy(model.logits(z[sel]), hot[sel], reduction="none")
    row = torch.arange(hot.shape[-1]).expand_as(hot)[sel]
    w = weights[row]
    per_row = torch.zeros(hot.shape[-1]).index_add(0, row, ce.detach()) / torch.bincount(
        row, minlength=hot.shape[-1]).clamp(min=1)
    return (w * ce).sum() / w.sum(), per_row


@torch.no_grad()
def evaluate(model: DFlashDrafter, held: Shards, hot_ids: np.ndarray, hot_index: np.ndarray,
             chunk: int = 96) -> dict:
    """Held-out top-1 per block row (out-of-hot targets are misses), hot coverage, and greedy tokens per round
    with B-1, 7 and 3 drafts (those the block has), for the chat and the predictable replies."""
    model.eval()
    b = model.cfg.block
    res = {}
    for kind in ("chat", "predictable"):
        seqs = [s for s in held.seqs if s[3] == (kind == "predictable")]
        hits, n_tgt, n_hot = np.zeros(b - 1), np.zeros(b - 1), 0
        walk = {k: [0, 0] for k in sorted({b - 1, 7, 3}) if k <= b - 1}  # drafts per round walked
        for i, (tok, _, pl, _) in enumerate(seqs):
            n = len(tok)
            right = np.zeros((n, b - 1), bool)  # block at anchor a: row i right
            for lo in range(pl - 1, n - 1, chunk):
                bt = make_batch(seqs, [i], b, hot_index, None, None, (lo, lo + chunk))
                a = bt["anchors"][0].numpy()
                z = model(bt["feats"], bt["tokens"], bt["anchors"], bt["valid"])[0, :, 1:]
                pred = hot_ids[model.logits(z).argmax(-1).numpy()]  # (N, B-1)
                t = bt["tgt"][0].numpy()
                ok = t >= 0
                right[a] = (pred == t) & ok
                hits += right[a].sum(0)
                n_tgt += ok.sum(0)
                n_hot += int((hot_index[t[:, 0][ok[:, 0]]] >= 0).sum())
            for k, tally in walk.items():  # rounds from the prompt's last token on
                t, r = walk_rounds(right, pl - 1, n, k)
                tally[0], tally[1] = tally[0] + t, tally[1] + r
        res[kind] = {"top1": (hits / np.maximum(n_tgt, 1)).round(4).tolist(), "targets": int(n_tgt[0]),
                         "coverage": round(n_hot / max(n_tgt[0], 1), 4),
                         **{f"tok_per_round_k{k}": round(t[0] / max(t[1], 1), 3) for k, t in sorted(walk.items(),
                                                                                                   reverse=True)}}
    model.train()
    return res


# -------------------------------------------------------------------------------------------- training
def save_ckpt(ckpt: Path, model: DFlashDrafter, opt, state: dict) -> None:
    save_checkpoint(ckpt, state, model.state_arrays(), opt)


def build(a, taps: Taps, train: Shards):
    """(model, optimizer state or None, run state) from the checkpoint or the target."""
    ck = torch.load(a.ckpt, weights_only=False) if a.resume else None
    file = None if ck is not None or a.init_from is None else init_file(a.init_from, taps)
    n_layers, block = (ck["n_layers"], ck["block"]) if ck else (
        (file["n_layers"], a.block or file["block"]) if file else (a.layers, a.block or 8))
    cfg, tg = load_target(model_path(), n_layers, taps, block)

    def fresh(hot_ids, init_from=None) -> dict:  # a fresh run's state: step 0, new optimizer
        return {"hot_ids": hot_ids, "step": 0, "tokens_seen": 0, "train_s": 0.0, "epoch": 0, "last_eval": None,
                "base_sha256": sha256_of(model_path()), "taps": asdict(taps), "n_layers": n_layers, "block": block,
                "init_from": init_from, "weights": a.weights}
    if file is not None:  # from the file's weights and hot vocabulary
        init, hot_ids = file["params"], file["hot_ids"]
        state = fresh(hot_ids, file["training"])
        log(f"new run from {a.init_from} (its training: {json.dumps(file['training'])}), weights {a.weights}")
    elif ck is not None:
        if taps_from_dict(ck["taps"]) != taps:
            raise SystemExit(f"the checkpoint taps {ck['taps']}, the features are {asdict(taps)}")
        init, hot_ids = ck["model"], np.asarray(ck["hot_ids"], np.int32)
        state = {k: ck[k] for k in ("hot_ids", "step", "tokens_seen", "train_s", "epoch", "last_eval",
                                    "base_sha256", "taps", "n_layers", "block")}
        state["init_from"] = ck.get("init_from")
        state["weights"] = ck.get("weights", "q8_0")
    else:
        hot_ids = mtp_hot_ids()
        if hot_ids is None:
            counts = np.bincount(np.concatenate([t[pl:] for t, _, pl, _ in train.seqs]))
            top = np.argsort(-counts, kind="stable")[:a.n_hot]
            hot_ids = np.sort(top[counts[top] > 0]).astype(np.int32)
        emb = tg["embed"]
        mask = np.random.default_rng(a.seed).normal(0, 1, emb.shape[1]) * emb.std(0)
        init = init_from_target(cfg, tg["layers"], tg["output_norm"], mask, a.seed)
        state = fresh(hot_ids)
        log(f"new run: {n_layers} draft layer(s), block {block}, taps {asdict(taps)}, hot vocab {len(hot_ids)}, "
            f"weights {a.weights}")
    model = DFlashDrafter(cfg, tg["embed"], tg["head"][hot_ids], init, state["weights"])
    return model, (ck["opt"] if ck else None), state


def init_file(path: str, taps: Taps, flag: str = "--init-from") -> dict:
    """An exported drafter file's parameters (float32), hot vocabulary, layers, block and training record, for
    --init-from; SystemExit (one line) when it is not a DFlash file of these taps and this model."""
    z, meta = read_drafter_file(path, flag, FORMAT, VERSION, sha256_of(model_path()))
    if taps_from_dict({"kv_layers": meta["tap_kv_layers"], "hidden_layer": meta["tap_hidden_layer"],
                       "d_model": meta["d_model"], "kv_dim": meta["kv_dim"]}) != taps:
        raise SystemExit(f"{flag} {path}: its taps are not the features' {asdict(taps)}")
    return {"params": {k: np.asarray(v, np.float32) for k, v in z.items() if k != "hot_ids"},
            "hot_ids": np.asarray(z["hot_ids"], np.int32), "n_layers": int(meta["n_layers"]),
            "block": int(meta["block_size"]), "training": meta.get("training", {}),
            "weights": meta.get("weights", "q8_0")}


def train(a) -> None:
    torch.manual_seed(a.seed)
    taps = current_taps()
    train_set, held = Shards("train", taps), Shards("heldout", taps)
    train_set.refresh(), held.refresh()
    if not train_set.seqs or not held.seqs:
        raise SystemExit(f"no tapped features under {FEAT_DIR}: run `python -m train.dflash_features` first")
    model, opt_state, st = build(a, taps, train_set)
    hot_ids = np.asarray(st["hot_ids"], np.int32)
    hot_index = hot_index_of(hot_ids, model.embed.shape[0])
    params = list(model.params.values())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim == 2], "weight_decay": a.wd},
                             {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    weights = position_weights(st["block"], a.gamma)
    log(f"run: {a.minutes} min, lr {a.lr}, gamma {a.gamma}, anchors/seq {a.anchors}, batch {a.batch_tokens} rows, "
        f"{len(train_set.seqs)} train sequences ({sum(len(s[0]) for s in train_set.seqs)} tokens), "
        f"{len(held.seqs)} held-out, step {st['step']}, threads {torch.get_num_threads()}")
    if st["step"] == 0:
        st["last_eval"] = evaluate(model, held, hot_ids, hot_index)
        log(f"eval at init: {json.dumps(st['last_eval'])}")

    def one_step(idx, rng):
        bt = make_batch(train_set.seqs, idx, st["block"], hot_index, a.anchors, rng)
        loss, per_row = block_loss(model, bt, weights)
        return loss, per_row.numpy(), (bt["tgt"][..., 0] >= 0).sum()
    timed_run(a, st, train_set, opt, params, one_step, lambda: evaluate(model, held, hot_ids, hot_index),
              lambda: save_ckpt(a.ckpt, model, opt, st), log, "blocks", "loss/row", ".2f")
    log(f"checkpoint {rel(a.ckpt)}: step {st['step']}, {st['train_s'] / 60:.1f} min trained in all")


def eval_file(path: str) -> dict:
    """The held-out eval (`evaluate`) of an exported drafter file's weights, in the form its meta says the
    runtime holds them (weights q8_0: float; q4_1: the 4-bit forward)."""
    taps = current_taps()
    file = init_file(path, taps, "--eval-file")
    cfg, tg = load_target(model_path(), file["n_layers"], taps, file["block"])
    held = Shards("heldout", taps)
    held.refresh()
    hot_ids = file["hot_ids"]
    hot_index = hot_index_of(hot_ids, tg["embed"].shape[0])
    model = DFlashDrafter(cfg, tg["embed"], tg["head"][hot_ids], file["params"], file["weights"])
    return evaluate(model, held, hot_ids, hot_index)


def current_taps() -> Taps:
    """The taps the feature shards were written with (the engine's default taps of the default model)."""
    from engine.gguf import load_gguf
    from engine.spec.dflash_taps import default_taps
    return default_taps(load_gguf(model_path()).args)


# ---------------------------------------------------------------------------------------------- export
def export(ckpt: Path = CKPT) -> Path:
    """Write the runtime's drafter file from the checkpoint (format ninfer-dflash v1, see train/README.md)."""
    ck = torch.load(ckpt, weights_only=False)
    path = model_path()
    sha = sha256_of(path)
    if ck["base_sha256"] != sha:
        raise SystemExit(f"the checkpoint was trained on a model with sha256 {ck['base_sha256']}, not {path} ({sha})")
    taps = taps_from_dict(ck["taps"])
    cfg, _ = load_target(path, ck["n_layers"], taps, ck["block"])
    ev = ck.get("last_eval") or {}
    training = {"reply_tokens": ck.get("train_tokens"), "sequences": ck.get("train_sequences"),
                "init_from": ck.get("init_from"), "blocks_seen": ck["tokens_seen"], "optimizer_steps": ck["step"],
                "minutes": round(ck["train_s"] / 60, 1), "heldout_chat": ev.get("chat"),
                "heldout_predictable": ev.get("predictable"), "date": datetime.now(UTC).strftime("%Y-%m-%d")}
    out = EXPORT_DIR / (path.name.split(".")[0].lower() + ".dflash.npz")
    export_file(out, cfg, taps, ck["model"], np.asarray(ck["hot_ids"]), sha, path.name, training,
                ck.get("weights", "q8_0"))
    log(f"exported {rel(out)} ({out.stat().st_size / 1e6:.1f} MB), step {ck['step']}")
    return out


def export_file(out: Path, cfg: DFlashConfig, taps: Taps, params: dict[str, np.ndarray], hot_ids: np.ndarray,
                base_sha256: str, base_name: str, training: dict, weights: str = "q8_0") -> None:
    """The drafter file: np.savez (no pickle) of `meta` (a JSON string), `hot_ids` int32 (n_hot,) and the
    parameters (DFlashConfig.param_names) in float16, matrices (out, in); written atomically. weights: the
    form the runtime quantizes the matrices to (the one training saw: DFlashDrafter's `weights`)."""
    meta = {"format": FORMAT, "version": VERSION, "base_sha256": base_sha256, "base_name": base_name,
                "d_model": cfg.d_model, "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head, "head_dim": cfg.head_dim,
                "d_ff": cfg.d_ff, "rms_eps": cfg.rms_eps, "rope_base": cfg.rope_base, "rope_neox": cfg.rope_neox,
                "n_layers": cfg.n_layers, "block_size": cfg.block, "feat_width": cfg.feat_width,
                "tap_kv_layers": list(taps.kv_layers), "tap_hidden_layer": taps.hidden_layer, "kv_dim": taps.kv_dim,
                "hot_vocab_size": len(hot_ids), "weights": weights, "training": training}
    if taps.width != cfg.feat_width:
        raise ValueError(f"taps width {taps.width} != the model's feature width {cfg.feat_width}")
    write_drafter_file(out, meta, hot_ids, params, cfg.shapes())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="training time of this run")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint (--ckpt)")
    ap.add_argument("--export", action="store_true", help="only export the checkpoint")
    ap.add_argument("--layers", type=int, default=1, help="draft decoder layers (a fresh run)")
    ap.add_argument("--block", type=int, default=None,
                    help="block size B: the bonus token + B-1 drafts (a fresh run: default 8; with --init-from: the "
                         "file's, or another: its weights serve any block)")
    ap.add_argument("--gamma", type=float, default=4.0, help="loss weight of block row i: exp(-(i-1)/gamma)")
    ap.add_argument("--anchors", type=int, default=48, help="blocks sampled per sequence and visit")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--wd", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=50, help="optimizer steps of linear warm-up per run")
    ap.add_argument("--batch-tokens", type=int, default=2048, help="context rows (sequences x longest) per batch")
    ap.add_argument("--n-hot", type=int, default=8192, help="hot vocabulary size when there is no MTP drafter")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    ap.add_argument("--eval-min", type=float, default=10.0)
    ap.add_argument("--ckpt-min", type=float, default=4.0)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-file", metavar="FILE", help="only print the held-out eval of an exported drafter file")
    ap.add_argument("--weights", choices=WEIGHTS, default="q8_0",
                    help="a fresh run's matrices as the runtime will hold them: q4_1 trains quantization-aware "
                         "(fc, the layers' matrices and the hot head rows in 4 bits: fewer bytes a round)")
    ap.add_argument("--init-from", default=None, metavar="FILE",
                    help="a fresh run from an exported drafter file's weights and hot vocabulary (not with --resume)")
    ap.add_argument("--ckpt", default=None, metavar="PATH",
                    help=f"checkpoint of this run (default {rel(CKPT)}): a second design "
                         "trained beside the first, e.g. --layers 2 --ckpt train/ckpt/dflash_l2.pt")
    a = ap.parse_args()
    a.ckpt = Path(a.ckpt).resolve() if a.ckpt else CKPT
    torch.set_num_threads(a.threads)
    if a.export:
        export(a.ckpt)
        return
    if a.eval_file:
        print(json.dumps(eval_file(a.eval_file)))
        return
    if a.resume and not a.ckpt.exists():
        raise SystemExit(f"--resume: no checkpoint at {a.ckpt}")
    train(a)


if __name__ == "__main__":
    main()
