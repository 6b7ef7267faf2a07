"""Self-distillation data for the MTP drafter: the target's own replies and its last-layer hidden states.

For every prompt (train/heldout.json first, then `prompts.training_prompts(seed)` in order) our engine
writes a reply (greedy, or one in four sampled with the users' preset: temperature 0.7, top-p 0.8, top-k 20),
then one forward pass over prompt + reply captures h_t, the residual stream after the last block (before
the final norm) at every position. Shards of `--shard-size` sequences go to train/data/{heldout,train}/
shard_NNNNN.npz:

    tokens      (N,) int32     prompt + reply ids of every sequence, back to back
    hidden      (N, d) f16     h_t of each of those positions
    seq_start, seq_len, prompt_len   (S,) int64 per sequence
    prompt_idx  (S,) int64     index into the prompt list (what resuming skips)
    sampled, predictable (S,) bool

Resumable: a prompt whose index is in a written shard is skipped, so a killed run (SIGTERM and Ctrl-C
write the pending sequences first) restarts with the same command. Long runs:

    nohup .venv/bin/python -m train.distill --minutes 600 >> train/data/distill.log 2>&1 &
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from .prompts import (
    HELDOUT_FILE,
    heldout_prompts,
    is_heldout_predictable,
    training_prompts,
)

DATA = Path(__file__).resolve().parent / "data"
SAMPLED_EVERY = 4  # prompt i is sampled when i % 4 == 3: a quarter of the replies


def shard_paths(split: str) -> list[Path]:
    return sorted((DATA / split).glob("shard_*.npz"))


def done_indices(split: str) -> set[int]:
    """Prompt indices already written to the split's shards."""
    out: set[int] = set()
    for p in shard_paths(split):
        with np.load(p) as z:
            out |= {int(i) for i in z["prompt_idx"]}
    return out


class ShardWriter:
    """Collects sequences and writes them `size` at a time as the next shard_NNNNN.npz (atomically)."""

    def __init__(self, split: str, size: int):
        self.dir = DATA / split
        self.dir.mkdir(parents=True, exist_ok=True)
        self.size = size
        self.rows: list[tuple] = []

    def add(self, tokens: np.ndarray, hidden: np.ndarray, prompt_len: int, idx: int, sampled: bool,
            predictable: bool) -> None:
        self.rows.append((tokens, hidden, prompt_len, idx, sampled, predictable))
        if len(self.rows) >= self.size:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        existing = shard_paths(self.dir.name)
        n = int(existing[-1].stem.split("_")[1]) + 1 if existing else 0
        lens = np.array([len(r[0]) for r in self.rows], np.int64)
        arrays = dict(
            tokens=np.concatenate([r[0] for r in self.rows]).astype(np.int32),
            hidden=np.concatenate([r[1] for r in self.rows]).astype(np.float16),
            seq_start=np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64), seq_len=lens,
            prompt_len=np.array([r[2] for r in self.rows], np.int64),
            prompt_idx=np.array([r[3] for r in self.rows], np.int64),
            sampled=np.array([r[4] for r in self.rows], bool), predictable=np.array([r[5] for r in self.rows], bool))
        path = self.dir / f"shard_{n:05d}.npz"
        tmp = self.dir / f".tmp_{n:05d}.npz"
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
        print(f"wrote {path.relative_to(DATA.parent)}: {len(self.rows)} sequences, {lens.sum()} tokens", flush=True)
        self.rows = []


class Distiller:
    """The engine, one session for replies and one scratch cache for the feature pass."""

    def __init__(self, threads: int | None, max_context: int):
        from engine.api import Engine
        from engine.config import EngineArgs
        self.eng = Engine.load(EngineArgs(max_context=max_context, threads=threads, prefix_reuse=False))
        self.session = self.eng.session()
        self.cache = self.eng.model.new_cache(self.eng.capacity)
        self.last = self.eng.model.args.n_layer - 1

    def request(self, sampled: bool, seed: int, max_new: int):
        from engine.config import GenerateRequest, SamplingParams, ThinkingParams
        sp = (SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=seed, max_new=max_new) if sampled
              else SamplingParams(greedy=True, max_new=max_new))
        return GenerateRequest(sampling=sp, thinking=ThinkingParams(enabled=False))

    def reply(self, messages, sampled: bool, seed: int, max_new: int) -> tuple[list[int], list[int]]:
        """(prompt ids, reply ids with the stop token when it stopped)."""
        from engine.events import FinalStats
        req = self.request(sampled, seed, max_new)
        prompt = self.session.prompt_tokens(messages, req)
        final = None
        for ev in self.session.generate(messages, req):
            if isinstance(ev, FinalStats):
                final = ev
        return prompt, list(final.token_ids)

    def features(self, tokens: list[int]) -> np.ndarray:
        """h (T, d) f32: the residual stream after the last block at every position, in prefill chunks."""
        self.cache.truncate(0)
        chunk = self.eng.args.prefill_chunk
        out = []
        for i in range(0, len(tokens), chunk):
            part = np.asarray(tokens[i:i + chunk], np.int32)
            self.eng.model.forward(part, i, self.cache, capture=(self.last,))
            out.append(self.eng.model.captured[self.last][:len(part)].copy())
        return np.concatenate(out)


def run_split(dist: Distiller, split: str, items: list, shard_size: int, deadline: float, stop) -> int:
    """Distill items [(idx, messages, sampled, predictable, max_new)] not yet written; returns how many."""
    have = done_indices(split)
    todo = [it for it in items if it[0] not in have]
    print(f"{split}: {len(have)} prompts done, {len(todo)} to do", flush=True)
    writer = ShardWriter(split, shard_size)
    n_tok, t0 = 0, time.time()
    try:
        for k, (idx, messages, sampled, predictable, max_new) in enumerate(todo):
            if time.time() > deadline or stop["now"]:
                break
            prompt, reply = dist.reply(messages, sampled, seed=idx, max_new=max_new)
            tokens = prompt + reply
            hidden = dist.features(tokens)
            writer.add(np.asarray(tokens, np.int32), hidden, len(prompt), idx, sampled, predictable)
            n_tok += len(reply)
            if k % 10 == 9:
                print(f"  {split} {k + 1}/{len(todo)}: {n_tok} reply tokens, "
                      f"{n_tok / (time.time() - t0):.0f} tok/s", flush=True)
    finally:
        writer.flush()
    return len(todo)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0, help="prompt list seed (keep it across resumes)")
    ap.add_argument("--n-prompts", type=int, default=20000)
    ap.add_argument("--minutes", type=float, default=60.0, help="stop (cleanly) after this long")
    ap.add_argument("--threads", type=int, default=None, help="numba threads (default: all cores)")
    ap.add_argument("--shard-size", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=256, help="reply limit of chat prompts")
    ap.add_argument("--max-new-predictable", type=int, default=384)
    ap.add_argument("--predictable-only", action="store_true", help="only the list's predictable prompts (same "
                    "indices: a later run without it adds the others)")
    a = ap.parse_args()
    deadline = time.time() + 60 * a.minutes
    stop = {"now": False}

    def on_term(signum, frame):  # finish the current reply, write the shard, exit
        stop["now"] = True
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    held = json.loads(HELDOUT_FILE.read_text())
    if held != heldout_prompts():
        sys.exit(f"{HELDOUT_FILE} differs from prompts.heldout_prompts(); rewrite it with "
                 "`python -m train.prompts --write-heldout` (and delete train/data/heldout)")
    dist = Distiller(a.threads, max_context=1024)
    held_items = [(i, m, False, is_heldout_predictable(m),
                   a.max_new_predictable if is_heldout_predictable(m) else a.max_new) for i, m in enumerate(held)]
    run_split(dist, "heldout", held_items, a.shard_size, deadline, stop)
    prompts = training_prompts(a.seed, a.n_prompts)
    items = [(i, p.messages, i % SAMPLED_EVERY == SAMPLED_EVERY - 1, p.predictable,
              a.max_new_predictable if p.predictable else a.max_new) for i, p in enumerate(prompts)
             if p.predictable or not a.predictable_only]
    run_split(dist, "train", items, a.shard_size, deadline, stop)
    print("stopped" if stop["now"] else "done (time or prompts)", flush=True)


if __name__ == "__main__":
    main()
