#!/usr/bin/env python3
"""Make quantized copies of a model with llama.cpp's own quantizer (llama-cpp-python), on demand, into a cache
folder (never committed): an F32 copy first (the source's weights dequantized by our reference, engine.quant),
then each type quantized from it by `llama_model_quantize`.

    scripts/make_q4km.py                            # the default model: F32 + Q4_K_M
    scripts/make_q4km.py --types Q4_K_M,Q6_K,Q8_0,F16,Q4_1
    scripts/make_q4km.py MODEL.gguf --types Q8_0 --out /tmp/copies --force

The default model (SmolLM2-135M-Instruct) ships as Q4_1 only, so "full precision" is its Q4_1 dequantized;
every copy is made from that F32 file (llama.cpp's quantizer then needs no requantization allowance). Prints
each file with its tensor types (llama.cpp's own per-tensor choice: see engine/bench/quantize.py). The cache
folder: $NINFER_MODEL_COPIES, else `models` in the user cache folder ($NINFER_CACHE_DIR overrides that).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in a checkout

from engine.bench.quantize import FTYPES, cache_dir, ensure_copies, tensor_types
from engine.errors import NinferError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="source GGUF (default: the configured/embedded model)")
    ap.add_argument("--types", default="Q4_K_M", help=f"comma-separated, of {', '.join(FTYPES)} (default Q4_K_M)")
    ap.add_argument("--out", type=Path, help=f"folder of the copies (default {cache_dir()})")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true", help="make them again even where they exist")
    a = ap.parse_args(argv)
    try:
        from engine.paths import resolve_model
        src = resolve_model(a.model)
        types = [t.strip().upper() for t in a.types.split(",") if t.strip()]
        bad = [t for t in types if t not in FTYPES]
        if bad or not types:
            raise NinferError(f"--types {a.types!r}: give types of {', '.join(FTYPES)}")
        made = ensure_copies(src, types, folder=a.out, force=a.force, threads=a.threads,
                             log=lambda s: print(s, file=sys.stderr, flush=True))
    except NinferError as e:
        print(f"make_q4km: {e}", file=sys.stderr)
        return 2
    for t, p in made.items():
        mix = ", ".join(f"{k} x{v}" for k, v in tensor_types(p).items())
        print(f"{t}\t{p}\t{p.stat().st_size / 2**20:.1f} MiB\t{mix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
