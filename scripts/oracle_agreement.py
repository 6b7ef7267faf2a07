#!/usr/bin/env python3
"""Agreement of our engine with llama.cpp (llama-cpp-python), the oracle of issue 2. Prints the figures.

Three measurements on one GGUF model (default: the embedded SmolLM2-135M-Instruct Q4_1):
  tokenize   identical token ids on a varied corpus (English, code, CJK, emoji, whitespace runs, specials)
  greedy     the first N greedy tokens of 10 varied chat prompts, token for token
  teacher    teacher-forced top-1 agreement: both models read the same fixed text (scripts/oracle_text.txt);
             at every position the argmax of our logits is compared with llama.cpp's
A mismatch is a *near tie* when llama.cpp's own logit gap between its choice and ours is < 0.1: both
implementations are right to within rounding there (llama.cpp quantizes activations to 8 bits for Q4/Q8 dot
products, we do not).

Usage: scripts/oracle_agreement.py [MODEL] [--only tokenize|greedy|teacher] [--backend cpu] [--json FILE]
llama-cpp-python is a test tool only: `pip install llama-cpp-python` (builds llama.cpp, ~8 min on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TEXT_FILE = Path(__file__).resolve().parent / "oracle_text.txt"
NEAR_TIE = 0.1
THREADS = 2

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they've said it's John's, we'll see; you'd think THEY'RE right.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }  // dot product\n",
    '{"name": "ninfer", "version": "0.1.0", "tags": ["llm", "gguf"], "ok": true}',
    "Numbers: 0 7 42 123 4567 89012 3.14159 -2.5e-3 1,000,000 and ½ ² Ⅻ",
    "日本語のテキストです。東京は日本の首都です。",
    "中文：你好，世界！我们今天学习机器学习。",
    "한국어 문장도 테스트합니다.",
    "Emoji: 😀😃😄 👍🏽 🇫🇷 👨‍👩‍👧‍👦 ❤️ ✨🚀",
    "Whitespace   runs\t\ttabs\n\n\nblank lines   \n   trailing   ",
    "    indented\n        more\n\t\tmixed \t \n",
    "Accents: café naïve résumé Zürich São Paulo Ελληνικά русский עברית العربية हिन्दी",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Special text inside prose: <|endoftext|> and <|im_end|>, plus <think>tags</think>.",
    "URLs https://example.com/a?b=c&d=e#f and emails someone@example.org, paths C:\\dir\\file.txt",
    "MIXED case WoRdS, ALLCAPS, snake_case_name, camelCaseName, kebab-case-name.",
    "\n",
    " ",
    "a",
]

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
    [{"role": "user", "content": "Explain photosynthesis in simple terms."}],
    [{"role": "user", "content": "Give me three tips for better sleep."}],
    [{"role": "user", "content": "Translate 'Good morning, how are you?' into Spanish."}],
    [{"role": "user", "content": "What is 17 multiplied by 23?"}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [{"role": "system", "content": "You are a pirate. Answer like one."},
     {"role": "user", "content": "Tell me about your ship."}],
    [{"role": "user", "content": "你好！请用一句话介绍你自己。"}],
    [{"role": "user", "content": "List the planets of the solar system in order."},
     {"role": "assistant", "content": "Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus, Neptune."},
     {"role": "user", "content": "Which one is the largest, and why?"}],
]


def llama_cpp_model(path, **kw):
    """A llama.cpp model on THREADS threads (vocab_only=True for tokenization)."""
    from llama_cpp import Llama
    return Llama(model_path=str(path), verbose=False, n_threads=THREADS, n_threads_batch=THREADS, **kw)


def load_ours(path, backend: str = "cpu"):
    """(tokenizer, model) of our engine."""
    from engine.backend import get_backend
    from engine.gguf import load_gguf
    from engine.model import Model
    from engine.tokenizer import Tokenizer
    mf = load_gguf(path)
    return Tokenizer.from_gguf(mf), Model(mf.args, mf.tensors, get_backend(backend))


def tokenization(path, tok=None, corpus=CORPUS) -> dict:
    """Compare ids on every corpus text, with special-token parsing on and off."""
    if tok is None:
        from engine.tokenizer import Tokenizer
        tok = Tokenizer.from_gguf(path)
    ref = llama_cpp_model(path, vocab_only=True)
    mismatches, n_tokens = [], 0
    for text in corpus:
        for special in (True, False):
            theirs = ref.tokenize(text.encode("utf-8"), add_bos=False, special=special)
            ours = tok.encode(text, parse_special=special)
            n_tokens += len(theirs)
            if ours != theirs:
                mismatches.append({"text": text, "special": special, "ours": ours, "llama_cpp": theirs})
    return {"texts": len(corpus) * 2, "tokens": n_tokens, "mismatches": mismatches}


def _gap(logits: np.ndarray, a: int, b: int) -> float:
    return float(logits[a] - logits[b])


def greedy(path, tok=None, model=None, prompts=PROMPTS, n_new: int = 32) -> dict:
    """First n_new greedy tokens of each chat prompt, ours vs llama.cpp, from the same prompt ids.

    A reply ends early at a stop token (as generation would); it then has to end at the same position.
    """
    if model is None:
        tok, model = load_ours(path)
    ref = llama_cpp_model(path, n_ctx=1024, n_batch=512)
    rows = []
    for msgs in prompts:
        ids = tok.encode_chat(msgs)
        ours, theirs, ref_logits = [], [], []
        cache = model.new_cache(len(ids) + n_new + 1)
        logits = model.forward(ids, 0, cache)[-1]
        for step in range(n_new):
            t = int(np.argmax(logits))
            ours.append(t)
            if t in tok.stop_ids:
                break
            logits = model.forward([t], len(ids) + step, cache)[-1]
        ref.reset()
        ref.eval(ids)
        for _ in range(n_new):
            row = np.array(ref.scores[ref.n_tokens - 1], dtype=np.float32)
            ref_logits.append(row)
            t = int(np.argmax(row))
            theirs.append(t)
            if t in tok.stop_ids:
                break
            ref.eval([t])
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is None and len(ours) != len(theirs):  # cannot happen: equal tokens stop equally
            first = min(len(ours), len(theirs))
        row = {"prompt": msgs[-1]["content"][:40], "match": first is None, "first_diff": first,
               "n": len(theirs),
               "ours": tok.decode(ours), "llama_cpp": tok.decode(theirs)}
        if first is not None:
            row["ref_gap"] = _gap(ref_logits[first], theirs[first], ours[first])
            row["near_tie"] = row["ref_gap"] < NEAR_TIE
        rows.append(row)
    return {"prompts": len(rows), "identical": sum(r["match"] for r in rows), "n_new": n_new, "rows": rows}


def teacher_forced(path, tok=None, model=None, text: str | None = None, chunk: int = 256) -> dict:
    """Top-1 agreement at every position of a fixed text read by both models (logits for all positions)."""
    if model is None:
        tok, model = load_ours(path)
    text = text if text is not None else TEXT_FILE.read_text(encoding="utf-8")
    ids = tok.encode(text)
    n = len(ids)
    cache = model.new_cache(n)
    ours = np.empty((n, model.args.vocab_size), np.float32)  # (n, vocab)
    for s in range(0, n, chunk):
        ours[s:s + chunk] = model.forward(ids[s:s + chunk], s, cache, all_logits=True)
    ref = llama_cpp_model(path, n_ctx=max(512, n + 16), n_batch=512, logits_all=True)
    ref.reset()
    ref.eval(ids)
    theirs = np.array(ref.scores[:n], dtype=np.float32)  # (n, vocab)
    # The last position predicts past the text; positions 0..n-2 each predict a token of the text.
    a, b = ours[:-1].argmax(-1), theirs[:-1].argmax(-1)
    bad = np.nonzero(a != b)[0]
    gaps = theirs[bad, b[bad]] - theirs[bad, a[bad]]  # how much llama.cpp prefers its token over ours
    diff = np.abs(ours - theirs)
    return {"positions": n - 1, "agree": int((a == b).sum()), "rate": float((a == b).mean()),
            "mismatches": int(bad.size), "near_ties": int((gaps < NEAR_TIE).sum()),
            "mismatch_gaps": [round(float(g), 4) for g in gaps],
            "max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
            "text_matches_truth": float((a == np.array(ids[1:])).mean())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="agreement with llama.cpp (tokenization, greedy, teacher-forced)")
    ap.add_argument("model", nargs="?", help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--only", choices=("tokenize", "greedy", "teacher"), action="append")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--n-new", type=int, default=32)
    ap.add_argument("--json", type=Path, help="write all figures here")
    args = ap.parse_args(argv)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from engine.paths import resolve_model
    path = resolve_model(args.model)
    which = args.only or ["tokenize", "greedy", "teacher"]
    out: dict = {"model": str(path)}
    tok, model = load_ours(path, args.backend) if set(which) - {"tokenize"} else (None, None)
    if "tokenize" in which:
        t0 = time.time()
        r = out["tokenize"] = tokenization(path, tok)
        print(f"tokenization: {r['texts'] - len(r['mismatches'])}/{r['texts']} texts identical "
              f"({r['tokens']} tokens) [{time.time() - t0:.0f}s]")
        for m in r["mismatches"]:
            print(f"  MISMATCH special={m['special']} {m['text']!r}: ours {m['ours']} llama.cpp {m['llama_cpp']}")
    if "greedy" in which:
        t0 = time.time()
        r = out["greedy"] = greedy(path, tok, model, n_new=args.n_new)
        print(f"greedy: {r['identical']}/{r['prompts']} prompts identical for {r['n_new']} tokens "
              f"[{time.time() - t0:.0f}s]")
        for row in r["rows"]:
            if not row["match"]:
                print(f"  differs at token {row['first_diff']} (llama.cpp gap {row['ref_gap']:.3f}, "
                      f"near tie: {row['near_tie']}) on {row['prompt']!r}")
    if "teacher" in which:
        t0 = time.time()
        r = out["teacher"] = teacher_forced(path, tok, model)
        print(f"teacher-forced top-1: {r['agree']}/{r['positions']} = {100 * r['rate']:.2f}% "
              f"({r['mismatches']} mismatches, {r['near_ties']} near ties < {NEAR_TIE}); "
              f"max |logit diff| {r['max_abs_logit_diff']:.3f}, mean {r['mean_abs_logit_diff']:.4f} "
              f"[{time.time() - t0:.0f}s]")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
