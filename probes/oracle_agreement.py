#!/usr/bin/env python3
"""Agreement of our engine with llama.cpp (llama-cpp-python), the oracle of issue 2. Prints the figures.

Three measurements on one GGUF model (default: the embedded SmolLM2-135M-Instruct Q4_1):
  tokenize   identical token ids on a varied corpus (English, code, CJK, emoji, whitespace runs, specials)
  greedy     the first N greedy tokens of 10 varied chat prompts, token for token
  teacher    teacher-forced top-1 agreement: both models read the same fixed text (probes/oracle_text.txt);
             at every position the argmax of our logits is compared with llama.cpp's
A mismatch is a *near tie* when llama.cpp's own logit gap between its choice and ours is < 0.1.

Two more figures explain the teacher-forced one (--explain):
  floor      llama.cpp against itself: the same text read in one batch vs one token at a time (both with
             llama-cpp-python's defaults: flash_attn=False, n_batch = n_ubatch = 512, f16 KV cache).
             llama.cpp rounds activations to 8 bits per 32 values (Q8_1) before every Q4_1 matmul; its
             batched and one-token attention kernels (f16 K.q, softmax.V) sum in different orders, and the
             last-bit differences flip 8-bit roundings in the next matmul, which cascade through the layers.
             Result: llama.cpp agrees with itself on 96.65% of positions (mean |logit diff| 0.160), the same
             distance as ours; probes/llama_bitexact.py shows the first differing op, probes/llama_numerics.py
             shows the same cascade in a numpy emulation (f64 vs f32 sums).
  f32        both engines on an F32 copy of the same (dequantized) weights, where llama.cpp does not round
             activations: this isolates our forward pass from llama.cpp's activation quantization.

Usage: probes/oracle_agreement.py [MODEL] [--explain] [--only tokenize|greedy|teacher|floor|f32] [--json FILE]
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
    from engine.backends.kernels import get_kernels
    from engine.gguf import load_gguf
    from engine.model import Model
    from engine.tokenizer import Tokenizer
    mf = load_gguf(path)
    return Tokenizer.from_gguf(mf), Model(mf.args, mf.tensors, get_kernels(backend))


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


def _llama_greedy(ref, ids, n_new, stops, prompt_one_by_one=False):
    """llama.cpp greedy tokens (and the logits each was chosen from) after the prompt `ids`."""
    ref.reset()
    for part in ([[t] for t in ids] if prompt_one_by_one else [ids]):
        ref.eval(part)
    out, rows = [], []
    for _ in range(n_new):
        rows.append(np.array(ref.scores[ref.n_tokens - 1], dtype=np.float32))  # (vocab,)
        out.append(int(np.argmax(rows[-1])))
        if out[-1] in stops:
            break
        ref.eval([out[-1]])
    return out, rows


def _first_diff(a: list[int], b: list[int]) -> int | None:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return min(len(a), len(b)) if first is None and len(a) != len(b) else first


def greedy(path, tok=None, model=None, prompts=PROMPTS, n_new: int = 32) -> dict:
    """First n_new greedy tokens of each chat prompt, ours vs llama.cpp, from the same prompt ids.

    A reply ends early at a stop token (as generation would); it then has to end at the same position.
    """
    if model is None:
        tok, model = load_ours(path)
    # llama-cpp-python keeps logits (scores) only with logits_all=True
    ref = llama_cpp_model(path, n_ctx=1024, n_batch=512, logits_all=True)
    rows = []
    for msgs in prompts:
        ids = tok.encode_chat(msgs)
        ours = []
        cache = model.new_cache(len(ids) + n_new + 1)
        logits = model.forward(ids, 0, cache)[-1]
        for step in range(n_new):
            t = int(np.argmax(logits))
            ours.append(t)
            if t in tok.stop_ids:
                break
            logits = model.forward([t], len(ids) + step, cache)[-1]
        theirs, ref_logits = _llama_greedy(ref, ids, n_new, tok.stop_ids)
        first = _first_diff(ours, theirs)
        row = {"prompt": msgs[-1]["content"][:40], "match": first is None, "first_diff": first,
               "n": len(theirs),
               "ours": tok.decode(ours), "llama_cpp": tok.decode(theirs)}
        if first is not None:
            row["ref_gap"] = _gap(ref_logits[first], theirs[first], ours[first])
            row["near_tie"] = row["ref_gap"] < NEAR_TIE
        rows.append(row)
    return {"prompts": len(rows), "identical": sum(r["match"] for r in rows), "n_new": n_new, "rows": rows}


def teacher_forced(path, tok=None, model=None, text: str | None = None, chunk: int = 256,
                   kv_dtype: str = "f16") -> dict:
    """Top-1 agreement at every position of a fixed text read by both models (logits for all positions).
    Ours reads it `chunk` tokens per pass (1: every position through the decode step's attention) into a
    kv_dtype cache; llama.cpp with its default f16 cache."""
    if model is None:
        tok, model = load_ours(path)
    text = text if text is not None else TEXT_FILE.read_text(encoding="utf-8")
    ids = tok.encode(text)
    n = len(ids)
    cache = model.new_cache(n, kv_dtype)
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


def llama_self_agreement(path, tok=None, text: str | None = None) -> dict:
    """llama.cpp's own top-1 agreement between batched and one-token-at-a-time evaluation (its noise floor)."""
    if tok is None:
        from engine.tokenizer import Tokenizer
        tok = Tokenizer.from_gguf(path)
    ids = tok.encode(text if text is not None else TEXT_FILE.read_text(encoding="utf-8"))
    n = len(ids)
    ref = llama_cpp_model(path, n_ctx=max(512, n + 16), n_batch=512, logits_all=True)
    ref.eval(ids)
    batch = np.array(ref.scores[:n], dtype=np.float32)  # (n, vocab)
    ref.reset()
    for t in ids:
        ref.eval([t])
    seq = np.array(ref.scores[:n], dtype=np.float32)  # (n, vocab)
    a, b = batch[:-1].argmax(-1), seq[:-1].argmax(-1)
    return {"positions": n - 1, "agree": int((a == b).sum()), "rate": float((a == b).mean()),
            "mean_abs_logit_diff": float(np.abs(batch - seq).mean())}


def llama_greedy_self_agreement(path, tok=None, prompts=PROMPTS, n_new: int = 32) -> dict:
    """llama.cpp greedy against itself: prompt read in one batch vs one token at a time."""
    if tok is None:
        from engine.tokenizer import Tokenizer
        tok = Tokenizer.from_gguf(path)
    ref = llama_cpp_model(path, n_ctx=1024, n_batch=512, logits_all=True)
    same = 0
    for msgs in prompts:
        ids = tok.encode_chat(msgs)
        a, _ = _llama_greedy(ref, ids, n_new, tok.stop_ids)
        b, _ = _llama_greedy(ref, ids, n_new, tok.stop_ids, prompt_one_by_one=True)
        same += _first_diff(a, b) is None
    return {"prompts": len(prompts), "identical": same, "n_new": n_new}


def write_f32_copy(path, dst) -> Path:
    """An F32 GGUF with the same metadata and the dequantized weights of `path` (for the f32 figure)."""
    from gguf import GGMLQuantizationType as QT
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize
    r = GGUFReader(path)
    w = GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        x = np.asarray(t.data) if t.tensor_type == QT.F32 else dequantize(np.asarray(t.data), t.tensor_type)
        w.add_tensor(t.name, np.ascontiguousarray(x.reshape(tuple(reversed(t.shape.tolist()))), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="agreement with llama.cpp (tokenization, greedy, teacher-forced)")
    ap.add_argument("model", nargs="?", help="GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--only", choices=("tokenize", "greedy", "teacher", "floor", "f32"), action="append",
                    help="default: tokenize, greedy, teacher (+ floor, f32 with --explain)")
    ap.add_argument("--explain", action="store_true", help="also measure llama.cpp's noise floor and the F32 copy")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--n-new", type=int, default=32)
    ap.add_argument("--json", type=Path, help="write all figures here")
    ap.add_argument("--kv-dtype", default="f16", help="our KV cache for the teacher-forced run (f16, int8)")
    ap.add_argument("--chunk", type=int, default=256,
                    help="tokens per pass of the teacher-forced run (1: each through the decode step)")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # figures appear as they are measured, also into a file
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from engine.paths import resolve_model
    path = resolve_model(args.model)
    which = args.only or ["tokenize", "greedy", "teacher"] + (["floor", "f32"] if args.explain else [])
    out: dict = {"model": str(path)}
    tok, model = load_ours(path, args.backend) if set(which) & {"greedy", "teacher"} else (None, None)
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
        r = out["teacher"] = teacher_forced(path, tok, model, chunk=args.chunk, kv_dtype=args.kv_dtype)
        print(f"teacher-forced top-1: {r['agree']}/{r['positions']} = {100 * r['rate']:.2f}% "
              f"({r['mismatches']} mismatches, {r['near_ties']} near ties < {NEAR_TIE}); "
              f"max |logit diff| {r['max_abs_logit_diff']:.3f}, mean {r['mean_abs_logit_diff']:.4f} "
              f"[{time.time() - t0:.0f}s]")
    if "floor" in which:
        t0 = time.time()
        r = out["floor"] = llama_self_agreement(path, tok)
        print(f"llama.cpp vs itself (batch vs token by token) top-1: {r['agree']}/{r['positions']} = "
              f"{100 * r['rate']:.2f}%, mean |logit diff| {r['mean_abs_logit_diff']:.4f} [{time.time() - t0:.0f}s]")
        r = out["floor_greedy"] = llama_greedy_self_agreement(path, tok, n_new=args.n_new)
        print(f"llama.cpp vs itself, greedy (prompt batched vs token by token): {r['identical']}/{r['prompts']} "
              f"prompts identical for {r['n_new']} tokens")
    if "f32" in which:
        import tempfile
        t0 = time.time()
        with tempfile.TemporaryDirectory() as d:
            f32 = write_f32_copy(path, Path(d) / "f32.gguf")
            t32, m32 = load_ours(f32, args.backend)
            r = out["f32"] = teacher_forced(f32, t32, m32)
            print(f"F32 copy, teacher-forced top-1: {r['agree']}/{r['positions']} = {100 * r['rate']:.2f}% "
                  f"({r['mismatches']} mismatches, {r['near_ties']} near ties); max |logit diff| "
                  f"{r['max_abs_logit_diff']:.4f}, mean {r['mean_abs_logit_diff']:.5f} [{time.time() - t0:.0f}s]")
            r = out["f32_greedy"] = greedy(f32, t32, m32, n_new=args.n_new)
            print(f"F32 copy, greedy: {r['identical']}/{r['prompts']} prompts identical for {r['n_new']} tokens")
            for row in r["rows"]:
                if not row["match"]:
                    print(f"  differs at token {row['first_diff']} (llama.cpp gap {row['ref_gap']:.3f}) "
                          f"on {row['prompt']!r}")
            del m32
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
