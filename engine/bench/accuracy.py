"""`ninfer-bench accuracy`: a quantized model's accuracy measured as the field does (llama.cpp's perplexity /
KL-divergence tools), for our engine and for llama.cpp on the same files and the same text.

    ninfer-bench accuracy                           # the default model: its Q4_1 + Q8_0 and Q4_K_M copies
    ninfer-bench accuracy --types Q4_1,Q6_K --json out.json --markdown out.md
    ninfer-bench accuracy MODEL.gguf --files other.Q4_K_M.gguf --truth MODEL.F16.gguf
    ninfer-bench accuracy --no-llama                # ours only (no llama-cpp-python here)

The truth: OUR engine's forward of an F32 GGUF of the same weights (--truth, else the source's own weights
dequantized into F32 by engine.quant: engine/bench/quantize.py; the default model ships as Q4_1 only, so its
Q4_1 dequantized IS full precision). Every file reads the same fixed text (--text; default the project's own
prose in probes/oracle_text.txt, 2059 tokens of SmolLM2's tokenizer) in one sequence from position 0, in
prefill chunks, with logits at every position; at each position i < n-1 (predicting token i+1):

    KL      sum_v p_truth(v) * (log p_truth(v) - log p_file(v)), mean / 99th percentile / max over positions
    top-1   argmax of the file's logits == argmax of the truth's
    ppl     exp(mean over positions of -log p_file(token i+1))

llama.cpp (llama-cpp-python, logits_all=True, f16 KV cache, batch 512) reads the same token ids from the
same files; its figures are given against OUR F32 truth (the issue's measure: one truth for both engines) and
against llama.cpp's own forward of the F32 file (what `llama-perplexity --kl-divergence` does), with the
distance between the two truths. The bars (issue 45): ours no worse than llama.cpp within 5% relative on
mean KL and on the top-1 disagreement rate (1 - top-1), perplexity within 1% of llama.cpp's; on the F32
file identical greedy output on >= 9 of 10 chat prompts (--greedy-tokens each, ours through the product's
reply loop, llama.cpp token by token).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import NinferError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TEXT = REPO_ROOT / "probes" / "oracle_text.txt"
DEFAULT_TYPES = ("Q8_0", "Q4_K_M")  # copies made besides the source (the default model: Q4_1)
CHUNK_ROWS = 256  # rows of logits turned into log-probabilities at once (float64: 100 MB at 49k vocab)
KL_REL, PPL_REL, GREEDY_MIN = 0.05, 0.01, 9  # the bars

PROMPTS = (  # the greedy check: varied chat prompts (short answers, code, lists, a system prompt, a CJK one)
    "What is the capital of France?",
    "Write a Python function that returns the factorial of n.",
    "Explain in two sentences why the sky is blue.",
    "List four fruits that are red.",
    "Translate 'Where is the train station?' into German.",
    "What is 12 times 12?",
    "Write a short poem about autumn leaves.",
    "Give me one tip for learning a new language.",
    "用一句话介绍一下长城。",
    "Summarize the plot of Cinderella in three sentences.",
)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Rows of logits -> log-probabilities, in float64."""
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class Truth:
    """The truth's log-probabilities (n, vocab) float32 (float64 while computing), its top-1 and targets."""

    def __init__(self, n: int, vocab: int, ids: list[int]):
        self.logp = np.empty((n, vocab), np.float32)
        self.ids = np.asarray(ids, np.int64)

    def fill(self, start: int, logits: np.ndarray) -> None:
        for s in range(0, logits.shape[0], CHUNK_ROWS):
            rows = logits[s:s + CHUNK_ROWS]
            self.logp[start + s:start + s + rows.shape[0]] = log_softmax(rows)

    @property
    def top1(self) -> np.ndarray:
        return self.logp.argmax(axis=-1)


class Scores:
    """Per-position KL against a truth, top-1 agreement and the negative log-likelihood of the text, filled
    chunk by chunk from a file's logits (positions 0..n-2: the last one predicts past the text)."""

    def __init__(self, truth: Truth):
        self.truth = truth
        n = truth.logp.shape[0] - 1
        self.kl = np.full(n, np.nan)
        self.agree = np.zeros(n, bool)
        self.nll = np.full(n, np.nan)

    def add(self, start: int, logits: np.ndarray) -> None:
        n = self.kl.shape[0]
        for s in range(0, logits.shape[0], CHUNK_ROWS):
            lo = start + s
            hi = min(lo + CHUNK_ROWS, start + logits.shape[0], n)
            if hi <= lo:
                return
            q = log_softmax(logits[s:s + hi - lo])
            t = self.truth.logp[lo:hi].astype(np.float64)
            self.kl[lo:hi] = np.maximum((np.exp(t) * (t - q)).sum(axis=-1), 0.0)
            self.agree[lo:hi] = q.argmax(axis=-1) == t.argmax(axis=-1)
            self.nll[lo:hi] = -q[np.arange(hi - lo), self.truth.ids[lo + 1:hi + 1]]

    def result(self) -> dict:
        if np.isnan(self.kl).any():
            raise AssertionError("not every position was scored")
        return {"positions": int(self.kl.size), "kl_mean": float(self.kl.mean()),
                "kl_p99": float(np.percentile(self.kl, 99)), "kl_max": float(self.kl.max()),
                "top1": float(self.agree.mean()), "ppl": float(np.exp(self.nll.mean()))}


def perplexity(truth: Truth) -> float:
    """The truth's own perplexity on the text."""
    n = truth.logp.shape[0] - 1
    return float(np.exp(-truth.logp[np.arange(n), truth.ids[1:]].astype(np.float64).mean()))


# ------------------------------------------------------------------------------------------ the two engines
def ours_logits(path, ids: list[int], threads: int):
    """Yield (start, logits (rows, vocab)) of our engine reading ids from position 0: Engine.load's runner
    (the cpu backend: the fused step where the file's types take it), in the product's prefill chunks."""
    from ..api import Engine
    from ..config import EngineArgs
    eng = Engine.load(EngineArgs(model=str(path), threads=threads, max_context=len(ids), prefix_reuse=False))
    runner, chunk = eng.model, eng.args.prefill_chunk
    cache = runner.new_cache(len(ids))
    for s in range(0, len(ids), chunk):
        yield s, runner.forward(np.asarray(ids[s:s + chunk], np.int32), s, cache, all_logits=True)


def llama_model(path, n_ctx: int, threads: int, logits_all: bool = True):
    from llama_cpp import Llama
    return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, logits_all=logits_all,
                 n_threads=threads, n_threads_batch=threads, verbose=False)


def llama_logits(path, ids: list[int], threads: int):
    """Yield (0, logits (n, vocab)) of llama.cpp reading ids in one eval (its batches of 512)."""
    ref = llama_model(path, max(len(ids), 64), threads)
    ref.eval(ids)
    yield 0, np.asarray(ref.scores[:len(ids)], np.float32)
    del ref


def score(chunks, truth: Truth) -> dict:
    sc = Scores(truth)
    t = time.perf_counter()
    for start, logits in chunks:
        sc.add(start, logits)
    return {**sc.result(), "seconds": round(time.perf_counter() - t, 1)}


def truth_of(chunks, n: int, ids: list[int]) -> Truth:
    tr = None
    for start, logits in chunks:
        if tr is None:
            tr = Truth(n, logits.shape[-1], ids)
        tr.fill(start, logits)
    return tr


# ------------------------------------------------------------------------------------------------ greedy
def greedy_agreement(path, threads: int, n_new: int = 32, prompts=PROMPTS) -> dict:
    """Greedy replies to each chat prompt: ours through Session.generate (the product's reply loop), llama.cpp
    token by token from the same prompt ids (argmax, until a stop token or n_new). Identical = the same
    tokens up to the end of the shorter reply when that one stopped, else all n_new."""
    from ..api import Engine
    from ..config import EngineArgs, GenerateRequest, SamplingParams
    from ..events import FinalStats
    eng = Engine.load(EngineArgs(model=str(path), threads=threads, prefix_reuse=False))
    tok = eng.tokenizer
    ref = llama_model(path, eng.max_context, threads, logits_all=False)
    req = GenerateRequest(SamplingParams(greedy=True, max_new=n_new))
    rows = []
    for prompt in prompts:
        msgs = [{"role": "user", "content": prompt}]
        session = eng.session()
        ids = session.prompt_tokens(msgs, req)
        final = [ev for ev in session.generate(msgs, req) if isinstance(ev, FinalStats)][-1]
        ours = [t for t in final.token_ids if t not in tok.stop_ids]
        ref.reset()
        ref.eval(ids)
        theirs = []
        for _ in range(n_new):
            t = int(np.argmax(np.ctypeslib.as_array(ref._ctx.get_logits(), shape=(ref.n_vocab(),))))
            if t in tok.stop_ids:
                break
            theirs.append(t)
            ref.eval([t])
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if first is None and len(ours) != len(theirs):
            first = min(len(ours), len(theirs))
        rows.append({"prompt": prompt, "identical": first is None, "first_diff": first,
                     "ours": tok.decode(ours), "llama_cpp": tok.decode(theirs)})
    return {"prompts": len(rows), "identical": sum(r["identical"] for r in rows), "n_new": n_new, "rows": rows}


# ---------------------------------------------------------------------------------------------- the bars
def bars(ours: dict, llama: dict) -> dict:
    """The issue's comparisons of our figures with llama.cpp's (both against the same truth)."""
    kl_ratio = ours["kl_mean"] / llama["kl_mean"] if llama["kl_mean"] > 0 else float("inf" if ours["kl_mean"] else 1)
    dis_o, dis_l = 1 - ours["top1"], 1 - llama["top1"]
    dis_ratio = dis_o / dis_l if dis_l > 0 else (1.0 if dis_o == 0 else float("inf"))
    ppl_rel = ours["ppl"] / llama["ppl"] - 1
    return {"kl_ratio": kl_ratio, "kl_ok": kl_ratio <= 1 + KL_REL,
            "top1_disagreement_ratio": dis_ratio, "top1_ok": dis_ratio <= 1 + KL_REL,
            "ppl_rel": ppl_rel, "ppl_ok": abs(ppl_rel) <= PPL_REL}


# ------------------------------------------------------------------------------------------------- driver
@dataclass
class Plan:
    source: Path
    truth: Path
    files: dict[str, Path]  # label -> quantized file
    ids: list[int]
    text: str
    notes: list[str] = field(default_factory=list)


def file_type_name(path) -> str | None:
    """The GGUF's general.file_type as a FTYPES name (None when absent or unknown)."""
    from ..gguf_reader import GGUFFile
    from .quantize import FTYPES
    ft = GGUFFile(path).value("general.file_type")
    return next((k for k, v in FTYPES.items() if v == ft), None)


def make_plan(a, log) -> Plan:
    from .. import paths
    from ..tokenizer import Tokenizer
    from .quantize import FTYPES, copy_path, ensure_copies, f32_copy
    source = paths.resolve_model(a.model)
    types = [t.strip().upper() for t in a.types.split(",") if t.strip()] if a.types is not None else list(DEFAULT_TYPES)
    bad = [t for t in types if t not in FTYPES]
    if bad:
        raise NinferError(f"--types: {', '.join(bad)} not one of {', '.join(FTYPES)}")
    src_type = file_type_name(source)
    notes = []
    need = [t for t in types if t != src_type]
    copies = {}
    if need and not a.no_llama and _llama_available():
        copies = ensure_copies(source, need, force=a.rebuild, threads=a.threads, log=log)
    elif need:
        notes.append(f"types {', '.join(need)} skipped: llama.cpp's quantizer (llama-cpp-python) is not used here")
    files = {src_type or source.name: source, **copies}
    for f in a.files or []:
        p = Path(f)
        if not p.is_file():
            raise NinferError(f"--files {f}: no such file")
        files[p.name] = p
    if a.truth:
        truth = Path(a.truth)
        if not truth.is_file():
            raise NinferError(f"--truth {a.truth}: no such file")
        notes.append(f"truth: {truth.name} as given")
    else:
        truth = copy_path(source, "F32")
        if a.rebuild or not truth.exists():
            f32_copy(source, truth)
        notes.append(f"truth: {source.name}'s weights dequantized to F32 by engine.quant ({truth})")
    text_path = Path(a.text) if a.text else DEFAULT_TEXT
    try:
        text = text_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise NinferError(f"--text {text_path}: cannot read it as UTF-8 ({e})") from None
    ids = Tokenizer.from_gguf(truth).encode(text)
    if a.max_tokens:
        ids = ids[:a.max_tokens]
    if len(ids) < 16:
        raise NinferError(f"--text {text_path}: {len(ids)} tokens; give a text of at least 16 (the issue: >= 2000)")
    return Plan(source, truth, files, ids, text_path.name, notes)


def _llama_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("llama_cpp") is not None


def run(plan: Plan, threads: int, use_llama: bool, greedy_tokens: int, log) -> dict:
    """Every figure of the plan (see the module docstring) as one dict."""
    ids, n = plan.ids, len(plan.ids)
    out: dict = {"source": str(plan.source), "truth": str(plan.truth), "text": plan.text, "tokens": n,
                 "positions": n - 1, "threads": threads, "notes": plan.notes, "files": {}}
    t = time.perf_counter()
    truth = truth_of(ours_logits(plan.truth, ids, threads), n, ids)
    out["truth_ppl"] = perplexity(truth)
    log(f"[truth] ours F32 {plan.truth.name}: {n} tokens, ppl {out['truth_ppl']:.4f} "
        f"[{time.perf_counter() - t:.0f} s]")
    llama_truth = None
    if use_llama:
        t = time.perf_counter()
        llama_truth = truth_of(llama_logits(plan.truth, ids, threads), n, ids)
        out["llama_f32_vs_truth"] = {**score(((0, llama_truth.logp),), truth), "ppl_own": perplexity(llama_truth)}
        r = out["llama_f32_vs_truth"]
        log(f"[truth] llama.cpp F32 vs ours F32: KL {r['kl_mean']:.2e}, top-1 {100 * r['top1']:.2f}% "
            f"[{time.perf_counter() - t:.0f} s]")
    for label, path in plan.files.items():
        row: dict = {"path": str(path), "mix": _mix(path)}
        try:
            row["ours"] = score(ours_logits(path, ids, threads), truth)
            log(f"[{label}] ours: {_line(row['ours'])}")
        except NinferError as e:
            row["ours_error"] = str(e)
            log(f"[{label}] ours: cannot run it: {e}")
        if use_llama:
            logits = list(llama_logits(path, ids, threads))
            row["llama_cpp"] = score(logits, truth)
            row["llama_cpp_vs_own_f32"] = score(logits, llama_truth)
            del logits
            log(f"[{label}] llama.cpp: {_line(row['llama_cpp'])}")
            if "ours" in row:
                row["bars"] = bars(row["ours"], row["llama_cpp"])
        out["files"][label] = row
    if use_llama and greedy_tokens > 0:
        t = time.perf_counter()
        out["greedy_f32"] = g = greedy_agreement(plan.truth, threads, greedy_tokens)
        log(f"[greedy] F32: {g['identical']}/{g['prompts']} prompts identical for {g['n_new']} tokens "
            f"[{time.perf_counter() - t:.0f} s]")
    return out


def _mix(path) -> str:
    from .quantize import tensor_types
    return ", ".join(f"{k} x{v}" for k, v in tensor_types(path).items())


def _line(r: dict) -> str:
    return (f"KL mean {r['kl_mean']:.5f} p99 {r['kl_p99']:.4f} max {r['kl_max']:.3f}, top-1 {100 * r['top1']:.2f}%, "
            f"ppl {r['ppl']:.4f} [{r['seconds']:.0f} s]")


def markdown(res: dict) -> str:
    """The figures as a Markdown table (what bench/results-models.md quotes)."""
    lines = [(f"Text: {res['text']}, {res['tokens']} tokens ({res['positions']} scored positions). Truth: our "
             f"F32 forward of {Path(res['truth']).name}, perplexity {res['truth_ppl']:.4f}.")]
    if "llama_f32_vs_truth" in res:
        r = res["llama_f32_vs_truth"]
        lines.append(f"llama.cpp's F32 forward vs ours: mean KL {r['kl_mean']:.2e}, top-1 {100 * r['top1']:.2f}%, "
                     f"its perplexity {r['ppl_own']:.4f}.")
    lines += ["", "| file | tensor types | engine | mean KL | KL p99 | top-1 | perplexity | bars (KL, top-1, ppl) |",
              "|---|---|---|---|---|---|---|---|"]
    for label, row in res["files"].items():
        for eng, key in (("ours", "ours"), ("llama.cpp", "llama_cpp"), ("llama.cpp vs its F32", "llama_cpp_vs_own_f32")):
            r = row.get(key)
            if r is None:
                if key == "ours" and "ours_error" in row:
                    lines.append(f"| {label} | {row['mix']} | ours | cannot run: {row['ours_error']} | | | | |")
                continue
            b = row.get("bars") if key == "ours" else None
            verdict = ""
            if b:
                verdict = (f"{b['kl_ratio']:.3f}x {'ok' if b['kl_ok'] else 'MISSED'}, "
                           f"{b['top1_disagreement_ratio']:.3f}x {'ok' if b['top1_ok'] else 'MISSED'}, "
                           f"{100 * b['ppl_rel']:+.2f}% {'ok' if b['ppl_ok'] else 'MISSED'}")
            lines.append(f"| {label} | {row['mix']} | {eng} | {r['kl_mean']:.5f} | {r['kl_p99']:.4f} | "
                         f"{100 * r['top1']:.2f}% | {r['ppl']:.4f} | {verdict} |")
    if "greedy_f32" in res:
        g = res["greedy_f32"]
        lines += ["", (f"Greedy on the F32 file: {g['identical']}/{g['prompts']} prompts identical to llama.cpp for "
                      f"{g['n_new']} tokens (bar: >= {GREEDY_MIN}).")]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ninfer-bench accuracy", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("model", nargs="?", help="the source GGUF (default: the configured/embedded model)")
    p.add_argument("--types", help=f"copies of the source to measure besides it, made by llama.cpp's quantizer "
                                   f"from its F32 copy (default {','.join(DEFAULT_TYPES)}; '' for none)")
    p.add_argument("--files", nargs="*", metavar="GGUF", help="more quantized files of the same weights")
    p.add_argument("--truth", metavar="GGUF", help="the full-precision file (default: the source dequantized to F32)")
    p.add_argument("--text", metavar="FILE", help=f"the fixed text (default {DEFAULT_TEXT.relative_to(REPO_ROOT)})")
    p.add_argument("--max-tokens", type=int, metavar="N", help="read only the text's first N tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-llama", action="store_true", help="our engine only (no llama-cpp-python)")
    p.add_argument("--greedy-tokens", type=int, default=32, metavar="N",
                   help="greedy check on the F32 file: N tokens per prompt (0: skip it)")
    p.add_argument("--rebuild", action="store_true", help="make the F32 and quantized copies again")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--markdown", metavar="FILE")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    try:
        if a.max_tokens is not None and a.max_tokens < 16:
            raise NinferError("--max-tokens must be >= 16")
        if a.threads < 1:
            raise NinferError("--threads must be >= 1")
        use_llama = not a.no_llama
        if use_llama and not _llama_available():
            raise NinferError("llama-cpp-python is not installed: pip install llama-cpp-python (a test/bench tool), "
                              "or pass --no-llama for our figures alone")
        plan = make_plan(a, log)
        for note in plan.notes:
            log(f"[plan] {note}")
        res = run(plan, a.threads, use_llama, a.greedy_tokens, log)
    except NinferError as e:
        print(f"ninfer-bench accuracy: {e}", file=sys.stderr)
        return 2
    md = markdown(res)
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, ensure_ascii=False), encoding="utf-8")
    if a.markdown:
        Path(a.markdown).write_text(md + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
