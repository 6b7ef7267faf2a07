"""The DFlash drafter's extra features: the tapped KV rows of every distilled sequence (engine/spec/dflash_taps).

distill.py stored each sequence's tokens and h (the last block's output). This pass runs every stored
sequence through our engine again (prefill chunks, the fused step) and reads the target's KV cache at the
tapped layers, keys unroped: train/data/dflash/{heldout,train}/shard_NNNNN.npz, one per distill shard, rows
aligned with its `tokens`:

    kv     (N, 2 kv_dim len(kv_layers)) f16     per tapped layer [K unroped | V] (dflash_taps.kv_rows)
    taps   JSON string: kv_layers, hidden_layer, d_model, kv_dim

Resumable: a shard whose output exists (with the same taps) is skipped; outputs are written atomically, so
a killed run restarts with the same command and loses at most the shard in progress. New distill shards are
picked up by running it again. One thread leaves the other core to training:

    nohup .venv/bin/python -m train.dflash_features --threads 1 >> train/logs/dflash_features.log 2>&1 &
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from engine.spec.dflash_taps import Taps, default_taps, kv_rows, taps_from_dict

DATA = Path(__file__).resolve().parent / "data"
OUT = DATA / "dflash"


def out_path(src: Path) -> Path:
    return OUT / src.parent.name / src.name


def taps_of(path: Path) -> Taps | None:
    """The taps a written feature shard holds, None if it is not readable."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return taps_from_dict(json.loads(str(z["taps"])))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class TapReader:
    """The engine (one scratch cache) and the taps of its model."""

    def __init__(self, threads: int | None):
        from engine.api import Engine
        from engine.config import EngineArgs
        self.eng = Engine.load(EngineArgs(max_context=2048, threads=threads, prefix_reuse=False))
        m = self.eng.model
        self.taps = default_taps(m.args)
        self.cache = m.new_cache(self.eng.capacity)
        from engine.model import rope_inv_freq
        self.inv_freq, self.neox = rope_inv_freq(m.args.head_dim, m.args.rope_base), bool(m.args.rope_neox)

    def rows(self, tokens: np.ndarray) -> np.ndarray:
        """(len(tokens), width of the KV part) f32: the sequence prefilled in chunks, then its tapped rows."""
        self.cache.truncate(0)
        chunk = self.eng.args.prefill_chunk
        for i in range(0, len(tokens), chunk):
            self.eng.model.forward(np.asarray(tokens[i:i + chunk], np.int32), i, self.cache)
        return kv_rows(self.cache, self.taps, 0, len(tokens), self.inv_freq, self.neox)


def run(reader: TapReader, stop: dict, deadline: float) -> None:
    want = reader.taps
    for split in ("heldout", "train"):
        srcs = sorted((DATA / split).glob("shard_*.npz"))
        todo = [s for s in srcs if taps_of(out_path(s)) != want]
        print(f"{split}: {len(srcs) - len(todo)} shards done, {len(todo)} to do (taps {want})", flush=True)
        for src in todo:
            if stop["now"] or time.time() > deadline:
                return
            t0 = time.time()
            with np.load(src) as z:
                tok, starts, lens = z["tokens"], z["seq_start"], z["seq_len"]
            kv = np.zeros((len(tok), want.width - want.d_model), np.float16)
            for s, n in zip(starts, lens):
                kv[s:s + n] = reader.rows(tok[s:s + n])
            dst = out_path(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(".tmp-" + dst.name)
            with open(tmp, "wb") as f:
                np.savez(f, kv=kv, taps=np.array(json.dumps(asdict(want))))
            os.replace(tmp, dst)
            print(f"wrote {dst.relative_to(DATA.parent)}: {len(tok)} rows, {len(tok) / (time.time() - t0):.0f} "
                  "tok/s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="numba threads (default 1: the machine is shared)")
    ap.add_argument("--minutes", type=float, default=600.0, help="stop (cleanly, between shards) after this long")
    a = ap.parse_args()
    stop = {"now": False}

    def on_term(signum, frame):  # finish the shard in progress, then exit
        stop["now"] = True
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    run(TapReader(a.threads), stop, time.time() + 60 * a.minutes)
    print("stopped" if stop["now"] else "done", flush=True)


if __name__ == "__main__":
    main()
