"""Golden outputs of the default model (SmolLM2-135M Q4_1): token ids of whole replies and sha256 of logits.

The redesign of the forward pass and the backends (one layer walk, backends as packages) must change no bit
of what the engine computes. This script records, through the public API only (Engine / Session / the model's
forward), what one tree computes; tests/engine/test_golden.py checks the current tree against the recorded
file. Recorded from the tree before the redesign:

    cd OLD_TREE && PYTHONPATH=. .venv/bin/python NEW_TREE/tests/engine/golden_outputs.py --write FILE

with FILE NEW_TREE/tests/engine/golden/smollm2.json on an AVX2-only host, smollm2-avx512.json on an AVX-512 +
AVX512-VNNI one (test_golden.py picks by the host: the bits depend on the instruction set).

Cases: greedy and seeded sampling (with penalties), speculation off and on (n-gram), a second turn over the
first (prefix reuse), an int8 KV cache, the numpy reference backend, and TP2 over two CPU "devices"; the
logits of a one-token step and of an 8-row pass (all rows) for each forward runner.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("NUMBA_NUM_THREADS", "2")

PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string.",
           "Count from 1 to 30, separated by commas.", "Tell me a short story about a robot who learns to paint."]
SAMPLED = dict(greedy=False, temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, presence_penalty=0.5,
               frequency_penalty=0.2)
LOGIT_TOKENS = [1, 4093, 314, 253, 2030, 1842, 28, 506]  # 8 ids of the vocabulary, a pass of 8 rows

# name -> (EngineArgs fields, [(prompt index, sampling fields, spec, draft tokens)])
CASES = {
    "cpu": ({}, [(i, {}, "off", 3) for i in range(4)]
            + [(i, dict(SAMPLED, seed=11 + i), "off", 3) for i in range(2)]
            + [(i, {}, "ngram", 3) for i in (1, 2)]
            + [(2, dict(SAMPLED, seed=5), "ngram", 5)]),
    "cpu-int8": (dict(kv_dtype="int8"), [(0, {}, "off", 3), (2, dict(SAMPLED, seed=3), "off", 3)]),
    "ref": (dict(backend="ref"), [(0, {}, "off", 3)]),
    "cpu-tp2": (dict(tp=2, devices=(0, 1)), [(0, {}, "off", 3), (2, {}, "ngram", 3)]),
}
MAX_NEW = 40


def _sha(a) -> str:
    import numpy as np
    return hashlib.sha256(np.ascontiguousarray(a, dtype=np.float32).tobytes()).hexdigest()[:24]


def run_case(name: str, max_context: int = 1024) -> dict:
    """{"replies": [...token ids...], "turn2": ids, "logits": {...}} for one engine configuration."""
    import numpy as np

    from engine.api import Engine
    from engine.config import EngineArgs, GenerateRequest, SamplingParams

    eargs, replies = CASES[name]
    eng = Engine.load(EngineArgs(max_context=max_context, **eargs))
    out = {"replies": []}
    for idx, samp, spec, k in replies:
        sp = SamplingParams(**{"greedy": True, "max_new": MAX_NEW, **samp})
        msgs = [{"role": "user", "content": PROMPTS[idx]}]
        final = list(eng.session().generate(msgs, GenerateRequest(sp, spec=spec, draft_tokens=k)))[-1]
        out["replies"].append(list(final.token_ids))
    if name == "cpu":  # a second turn on the same session: prefix reuse prefills only the new suffix
        s = eng.session()
        sp = SamplingParams(greedy=True, max_new=24)
        msgs = [{"role": "user", "content": PROMPTS[0]}]
        first = list(s.generate(msgs, GenerateRequest(sp)))
        text = "".join(getattr(e, "text", "") for e in first[:-1])
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "And of Italy?"}]
        final = list(s.generate(msgs, GenerateRequest(sp)))[-1]
        out["turn2"] = [final.cached_prompt_tokens, list(final.token_ids)]
    m = eng.model
    cache = m.new_cache(64, eng.args.kv_dtype)
    toks = np.array(LOGIT_TOKENS, np.int32)
    logits = {"pass8": _sha(m.forward(toks, 0, cache, all_logits=True))}
    logits["step"] = _sha(m.forward(toks[:1], 8, cache))
    cache.truncate(4)
    logits["pass4_after_truncate"] = _sha(m.forward(toks[4:], 4, cache, all_logits=True))
    out["logits"] = logits
    return out


def record() -> dict:
    return {name: run_case(name) for name in CASES}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", metavar="FILE", help="write the outputs of this tree as JSON")
    p.add_argument("--case", choices=sorted(CASES), help="only this case (printed)")
    a = p.parse_args(argv)
    data = {a.case: run_case(a.case)} if a.case else record()
    text = json.dumps(data, indent=1)
    if a.write:
        with open(a.write, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
