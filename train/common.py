"""What the two drafters' training scripts (mtp_train, dflash_train) share: the run log, the target's pieces in
float32, a timed run's loop (its cosine schedule, evals and checkpoints), the checkpoint and drafter-file
writes, and the walk of greedy rounds their held-out evals count tokens a round with."""
from __future__ import annotations

import json
import math
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Callable

import numpy as np
import torch

# a model file's sha256 as the runtime checks a drafter file against it (cached per path, size and mtime)
from engine.spec.drafter_file import base_sha256 as sha256_of  # noqa: F401  (the trainings' name)

# a draft layer's parameters -> the target layer's GGUF tensor names (blk.N.<name>.weight)
LAYER_GGUF = {"attn_norm": "attn_norm", "wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
              "ffn_norm": "ffn_norm", "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}


def model_path() -> Path:
    from engine.paths import default_model_path
    p = default_model_path()
    if p is None:
        raise SystemExit("the default model is not installed (scripts/dev setup)")
    return p


def batches(seqs: list, budget: int, rng: np.random.Generator) -> list[list[int]]:
    """Sequence indices grouped by length, each group's (count x longest) within budget rows; shuffled."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(seqs[i][0]) > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def hot_index_of(hot_ids: np.ndarray, vocab: int) -> np.ndarray:
    """Token id -> its row in the hot head (hot_ids: the hot vocabulary's ids), -1 for the rest (vocab,)."""
    index = np.full(vocab, -1, np.int64)
    index[hot_ids] = np.arange(len(hot_ids))
    return index


def rel(p: Path) -> str:
    """p relative to the repository where it lies inside it (for the log), else as it is."""
    root = Path(__file__).resolve().parent.parent
    return str(p.relative_to(root)) if p.is_relative_to(root) else str(p)


def logger(path: Path) -> Callable[[str], None]:
    """log(msg): msg stamped with the UTC time, printed and appended to path."""
    def log(msg: str) -> None:
        line = f"{datetime.now(UTC):%Y-%m-%dT%H:%M:%SZ} {msg}"
        print(line, flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(line + "\n")
    return log


def target_f32(path: Path, drafter: str, last: int):
    """(the target's ModelArgs, {embed, head, output_norm}, [the LAYER_GGUF parameters of each of its `last`
    last layers]), dequantized to float32; SystemExit where the drafter's block cannot copy the target's
    (q/k/v biases, q/k norms)."""
    from engine.gguf import load_gguf
    from engine.quant import dequantize
    mf = load_gguf(path)
    a, t = mf.args, mf.tensors
    if a.qkv_bias or a.qk_norm:
        raise SystemExit(f"{path.name}: the {drafter} drafter has no q/k/v biases or q/k norms ({a.arch})")

    def f32(name):
        return np.asarray(dequantize(t[name]), np.float32).reshape(t[name].shape)
    embed = f32("token_embd.weight")
    top = {"embed": embed, "head": f32("output.weight") if "output.weight" in t else embed,
           "output_norm": f32("output_norm.weight")}
    return a, top, [{k: f32(f"blk.{j}.{v}.weight") for k, v in LAYER_GGUF.items()}
                    for j in range(a.n_layer - last, a.n_layer)]


def save_checkpoint(path: Path, state: dict, model_arrays: dict, opt) -> None:
    """The run's state, the model's parameters and the optimizer's state, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(dict(state, model=model_arrays, opt=opt.state_dict()), tmp)
    os.replace(tmp, path)


def write_drafter_file(out: Path, meta: dict, hot_ids: np.ndarray, params: dict, shapes: dict) -> None:
    """The drafter file: np.savez (no pickle) of `meta` (a JSON string), `hot_ids` int32 (n_hot,) and each
    parameter of `shapes` in float16, matrices (out, in); ValueError on a shape the format does not take;
    written atomically."""
    arrays = {k: np.asarray(params[k]).astype(np.float16) for k in shapes}
    for k, shape in shapes.items():
        if arrays[k].shape != shape:
            raise ValueError(f"{k} has shape {arrays[k].shape}, the format wants {shape}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(".tmp-" + out.name)
    with open(tmp, "wb") as f:
        np.savez(f, meta=np.array(json.dumps(meta)), hot_ids=np.asarray(hot_ids, np.int32), **arrays)
    os.replace(tmp, out)


def read_drafter_file(path: str, flag: str, fmt: str, version: int, base_sha: str, kind: str = ""
                      ) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, meta) of an exported drafter file of format fmt / version made for the model of sha256 base_sha
    (the caller's model: its own module's sha256_of, which tests replace); SystemExit with one line naming `flag`
    when it is not one (`kind`: a word for the message, e.g. "MTP "). Reads no target."""
    try:
        z = np.load(path, allow_pickle=False)
        meta = json.loads(str(z["meta"]))
        arrays = {k: z[k] for k in z.files if k != "meta"}
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"{flag} {path}: not a readable {kind}drafter file ({e})") from None
    if meta.get("format") != fmt or meta.get("version") != version:
        raise SystemExit(f"{flag} {path}: format {meta.get('format')} v{meta.get('version')}, not {fmt} v{version}")
    if meta.get("base_sha256") != base_sha:
        raise SystemExit(f"{flag} {path}: made for another model ({meta.get('base_name')})")
    return arrays, meta


def walk_rounds(right: np.ndarray, first: int, n: int, k: int) -> tuple[int, int]:
    """(tokens, rounds) of greedy speculation with k drafts a round over a reply of n context positions, as the
    runtime walks it: the first round's last context position is `first` (the prompt's last token); a round
    from position a keeps its leading right drafts (right[a, j]: draft j + 1 is the reply's token at a + j +
    1) and the target's own token, and the next round starts where it ended."""
    tokens = rounds = 0
    a = first
    while a + 1 < n:  # something left to draft
        acc = 0
        while acc < k and a + acc + 1 < n and right[a, acc]:
            acc += 1
        step = min(acc + 1, n - 1 - a)
        tokens, rounds, a = tokens + step, rounds + 1, a + step
    return tokens, rounds


def timed_run(a, st: dict, train_set, opt, params: list, one_step: Callable, evaluate: Callable,
              save: Callable, log: Callable[[str], None], units: str, label: str, fmt: str) -> None:
    """The training loop of a run of a.minutes: epochs over train_set's batches (`batches`,
    new shards picked up at each epoch), lr a.lr with a.warmup steps of linear warm-up and a cosine from 1 to
    0.1 over the run's time, the gradient norm clipped at 1; an eval (st["last_eval"] = evaluate()) every
    a.eval_min minutes and at the end, a checkpoint (save()) every a.ckpt_min minutes and at the end.
    one_step(idx, rng) -> (loss, per-part losses (np array, logged as `label` with their running mean in `fmt`),
    `units` seen, counted in st["tokens_seen"])."""
    t_start = time.time()
    budget = 60 * a.minutes
    last_ckpt = last_eval = t_start
    local, run_loss = 0, None
    while True:
        rng = np.random.default_rng(a.seed * 1000 + st["epoch"])
        if st["epoch"] > 0 and train_set.refresh():
            log(f"epoch {st['epoch']}: {len(train_set.seqs)} train sequences now")
        for idx in batches(train_set.seqs, a.batch_tokens, rng):
            frac = (time.time() - t_start) / budget
            if frac >= 1:
                break
            lr = a.lr * min(1.0, (local + 1) / a.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:
                g["lr"] = lr
            loss, parts, seen = one_step(idx, rng)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            st["step"], local = st["step"] + 1, local + 1
            st["tokens_seen"] += int(seen)
            run_loss = parts if run_loss is None else 0.95 * run_loss + 0.05 * parts
            now = time.time()
            if local % a.log_every == 0:
                losses = " ".join(format(x, fmt) for x in run_loss)
                log(f"step {st['step']} {units} {st['tokens_seen']} {label} {losses} lr {lr:.2e} "
                    f"{(now - t_start) / 60:.1f} min")
            if now - last_eval > 60 * a.eval_min:
                st["last_eval"] = evaluate()
                log(f"eval step {st['step']}: {json.dumps(st['last_eval'])}")
                last_eval = time.time()
            if now - last_ckpt > 60 * a.ckpt_min:
                st["train_s"] += now - last_ckpt
                save()
                last_ckpt = now
        else:
            st["epoch"] += 1
            continue
        break
    st["train_s"] += time.time() - last_ckpt
    st["last_eval"] = evaluate()
    log(f"eval step {st['step']}: {json.dumps(st['last_eval'])}")
    st["train_tokens"] = int(sum(len(s[0]) - s[2] for s in train_set.seqs))
    st["train_sequences"] = len(train_set.seqs)
    save()

