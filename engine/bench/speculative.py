"""Speculative decoding benchmark: plain vs speculative modes, A-B-A-B in one process, plus verify-pass cost.

    ninfer-bench speculative                      # default model, greedy, 128 tokens
    ninfer-bench speculative --variants off ngram:3 ngram:3:fixed ngram:7 --repeats 2 --max-new 128 --json out.json
    ninfer-bench speculative --variants off ngram:3 mtp:3 mtp:3:hot mtp:3:hot:lookup --heldout train/heldout.json
    ninfer-bench speculative --variants off ngram:3 mtp:3:hot dflash:7:hot --heldout train/heldout.json
    python -m engine.bench.speculative ...        # the same from a checkout without an install
    (MODE:K = adaptive draft length up to K, what users get; :fixed = always up to K drafts; :hot = the MTP or
    DFlash drafter's hot-vocabulary head (--lm-head-draft); :lookup = n-gram drafts first where the last 3+
    tokens occurred before (engine.spec.lookup, what users get by default: --spec-lookup 3);
    :noconf = the adaptive length without the drafter's per-round confidence, as before 2026-12-05)

Part 1, verify cost: one forward over T = 1, 2, 4, 8 tokens at a realistic context position (the cost a round
pays for k = 0, 1, 3, 7 drafts), interleaved and repeated; median ms and the ratio to T=1 and to a decode step
timed as plain decode runs them, back to back (decode_step_cost: the fair baseline; goal: T=8 <= 1.5x).
Part 1b, draft cost: for each trained-drafter variant (mtp, dflash), the drafter's own time per round (propose
for K drafts + observe of the kept tokens) at the same context position, against that decode step.
Part 2, rounds: every workload (message files from /work/shared/workloads + a couple of chat prompts) under
every variant, interleaved A-B-A-B (--repeats rounds of all variants) to cancel drift; prefix reuse off.
Reports decode tok/s (mean [min-max]), tokens/round, acceptance, ms/round split into draft + verify,
per-position acceptance, speedup vs plain decode, and whether each variant's output is byte-identical to
plain decode (it must be: speculation is lossless).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from ..api import Engine
from ..config import EngineArgs, GenerateRequest, SamplingParams
from .variants import WORKLOAD_DIR

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WORKLOADS = ("count300_plain_en.json", "count300_en.json")
CHAT_PROMPTS = ("Write a short story about a robot who learns to paint.",
                "Explain how a bicycle works, step by step.")


# lookup: lookupN for a match of N+ tokens (lookup = 3); ldN: its rounds draft up to N or the variant's k (default
# spec.lookup.LOOKUP_DRAFTS)
VARIANT_FLAGS = ("fixed", "hot", "lookup", "ldN", "noconf", "notrig", "onelen")


def _flag(f: str) -> str:
    """A variant flag's name (lookupN -> lookup, ldN -> ldN; a bare ld is no flag)."""
    if f.startswith("lookup") and f[6:].isdigit():
        return "lookup"
    return "ldN" if f.startswith("ld") and f[2:].isdigit() else f


def _lookup_drafts(flags: frozenset) -> int | None:
    """The ldN flag's N, None without one."""
    return next((int(f[2:]) for f in flags if _flag(f) == "ldN"), None)


def _lookup(flags: frozenset) -> int:
    """The lookup flag's match length (lookup: 3, lookupN: N), 0 without one."""
    return next((int(f[6:] or 3) for f in flags if _flag(f) == "lookup"), 0)


def parse_variant(text: str) -> tuple[str, int, frozenset]:
    """'off' | 'ngram:3' (adaptive length, the default) | 'mtp:3:fixed:hot' -> (mode, draft tokens, flags)."""
    mode, k, *flags = text.split(":") + [""]
    flags = frozenset(f for f in flags if f)
    bad = {f for f in flags if _flag(f) not in VARIANT_FLAGS}
    if bad:
        raise SystemExit(f"ninfer-bench speculative: variant {text!r}: unknown option {sorted(bad)[0]!r} "
                         f"(options: {', '.join(VARIANT_FLAGS)}; lookupN)")
    return mode, int(k or 3), flags


def variant_name(mode: str, k: int, flags: frozenset) -> str:
    ordered = sorted(flags, key=lambda f: VARIANT_FLAGS.index(_flag(f)))
    return mode if mode == "off" else ":".join([mode, str(k), *ordered])


def variant_round(engine: Engine, mode: str, k: int, flags: frozenset):
    """The round function of a variant: the SpecRound users get, with the variant's drafter options (fixed:
    always up to k drafts, no adaptive length; hot: the MTP hot-vocabulary head; lookup: n-gram drafts first
    where they match; noconf: the adaptive length without the confidence cut; notrig: lookup first's decode blocks
    without triggers, engine.triggers; onelen: one lookup length for the rounds that start a copy and those that
    go on with one)."""
    from ..spec import SpecRound, make_drafter
    drafter = make_drafter(mode, engine.model, engine.model_path, adaptive="fixed" not in flags,
                           lm_head_draft="hot" in flags, lookup=_lookup(flags),
                           lookup_drafts=_lookup_drafts(flags), capacity=engine.capacity)
    if "noconf" in flags and hasattr(drafter, "gate"):
        drafter.gate = False
    if "notrig" in flags and hasattr(drafter, "triggers"):  # lookup first's decode blocks run to their end
        drafter.triggers = False
    if "onelen" in flags and hasattr(drafter, "fresh"):  # one lookup length for fresh and going-on rounds
        drafter.fresh = drafter.lookup
    return SpecRound(drafter, k, engine.capacity)


def _primed(model, forward, kv_dtype: str, ctx_len: int, room: int, seed: int):
    """(forward, cache, ids): forward (default model.forward), a cache of ctx_len + room positions holding ctx_len
    random tokens' keys and values, and ids(n) -> n more random token ids (below 1000 and the vocabulary)."""
    forward = forward or model.forward
    rng = np.random.default_rng(seed)
    top = min(1000, model.args.vocab_size)

    def ids(n):
        return rng.integers(10, top, n).astype(np.int32)
    cache = model.new_cache(ctx_len + room, kv_dtype)
    forward(ids(ctx_len), 0, cache)
    return forward, cache, ids


def verify_cost(model, kv_dtype: str = "f16", sizes=(1, 2, 4, 8), ctx_len: int = 200, repeats: int = 20,
                forward=None, clock=time.perf_counter) -> dict[int, float]:
    """Median ms of one forward over T tokens at position ctx_len (cache rolled back after each pass).
    forward: a callable like model.forward (e.g. the fused CPU step); default model.forward. clock:
    time.process_time counts the CPU time of all the process's threads, steadier than the wall clock on a
    machine other jobs load (with one thread it is the pass's own work)."""
    forward, cache, ids = _primed(model, forward, kv_dtype, ctx_len, max(sizes) + 1, seed=0)
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for t in sizes:  # warm-up: compile each batch shape once
        forward(ids(t), ctx_len, cache, all_logits=True)
        cache.truncate(ctx_len)
    for _ in range(repeats):
        for t in sizes:  # interleaved so drift hits every size alike
            toks = ids(t)
            t0 = clock()
            forward(toks, ctx_len, cache, all_logits=True)
            times[t].append((clock() - t0) * 1e3)
            cache.truncate(ctx_len)
    return {t: statistics.median(v) for t, v in times.items()}


def decode_step_cost(model, kv_dtype: str = "f16", ctx_len: int = 200, steps: int = 24, repeats: int = 3,
                     forward=None, clock=time.perf_counter) -> float:
    """Median ms of a decode step as plain decode runs them: one-token passes back to back at positions
    ctx_len, ctx_len + 1, ... (the cache rolled back after each run of `steps`). verify_cost interleaves its
    sizes, so its T=1 follows a larger pass every time; on the 2-core Xeon VM a step after any other work
    (another pass, 8 ms of sleep) measured 25-35% slower than one right after a step (the weights' cache
    lines, the idle core), which made verify passes look cheaper against decode than they are."""
    forward, cache, ids = _primed(model, forward, kv_dtype, ctx_len, steps + 1, seed=1)
    times = []
    for _ in range(repeats):
        for i in range(steps):
            t0 = clock()
            forward(ids(1), ctx_len + i, cache)
            if i >= 2:  # the run's first steps follow other work
                times.append((clock() - t0) * 1e3)
        cache.truncate(ctx_len)
    return statistics.median(times)


def draft_cost(engine: Engine, mode: str, k: int, flags: frozenset, ctx_len: int = 200,
               repeats: int = 30) -> float:
    """Median ms a drafter spends per round at context ~ctx_len: propose(k) then observe of 2 kept tokens
    (their features from a real target pass, timed apart), the round's own bookkeeping. The trained drafter's
    own: a lookup flag is dropped (a lookup round's drafting is an index lookup, ~0.05 ms)."""
    from ..spec import SpecRound
    rnd = variant_round(engine, mode, k, frozenset(f for f in flags if _flag(f) != "lookup") | {"fixed"})
    drafter, m = rnd.drafter, engine.model
    rng = np.random.default_rng(0)
    toks = rng.integers(10, min(1000, m.args.vocab_size), ctx_len + 2 * repeats + 2).astype(np.int32).tolist()
    cache = m.new_cache(ctx_len + 2 * repeats + 4, engine.args.kv_dtype)
    rnd = SpecRound(drafter, k)
    rnd.begin()
    layers = rnd.capture
    m.forward(np.asarray(toks[:ctx_len], np.int32), 0, cache, capture=layers)
    rnd.observe_prefill(toks[:ctx_len], {i: m.captured[i] for i in layers} if layers else None)
    times = []
    for r in range(repeats):
        pos = ctx_len + 2 * r
        if hasattr(drafter, "bind_target"):
            drafter.bind_target(m, cache)
        t0 = time.perf_counter()
        drafter.propose(toks[:pos + 1], k, None)
        t1 = time.perf_counter()
        m.forward(np.asarray(toks[pos:pos + 2], np.int32), pos, cache, all_logits=True, capture=layers)
        feats = {i: m.captured[i] for i in layers} if layers else None
        t2 = time.perf_counter()
        drafter.observe(toks[pos:pos + 2], feats)
        times.append((t1 - t0 + time.perf_counter() - t2) * 1e3)
    return statistics.median(times[3:])


def random_verify_cost(a) -> int:
    """--random-smollm2: the verify-pass cost only (e.g. on a GPU machine the model file cannot reach)."""
    from ..backends.kernels import get_kernels
    from ..model import Model
    from .gpu import smollm2_like
    if a.threads:
        import numba
        numba.set_num_threads(a.threads)
    margs, tensors = smollm2_like()
    forward, label = None, a.backend
    if a.backend == "cpu_fast":  # the cpu backend's weights and its fused one-call forward
        from types import SimpleNamespace

        from ..backends.cpu import build_model
        from ..backends.cpu.step import build
        model = build_model(SimpleNamespace(args=margs, tensors=tensors), max_batch=16)
        forward = build(model)
        label += " (fused)" if forward is not None else " (per-kernel)"
    else:
        model = Model(margs, tensors, get_kernels(a.backend), max_batch=16)
    cost = verify_cost(model, forward=forward)
    print(f"## verify pass cost, random SmolLM2-135M-shaped model, backend {label}, threads {a.threads}")
    for t, ms in cost.items():
        print(f"  T={t}: {ms:7.3f} ms  = {ms / cost[1]:4.2f}x T=1")
    if a.json:
        Path(a.json).write_text(json.dumps({"backend": a.backend, "verify_cost_ms": cost}, indent=1))
    return 0


def lossless_tiny(a) -> int:
    """--lossless-tiny: speculation == plain decode on tiny models with this backend (e.g. cuda on a GPU)."""
    import tempfile
    sys.path.insert(0, str(REPO_ROOT / "tests" / "fixtures"))  # a checkout's test fixture: not installed
    from make_tiny_models import ARCHS, make_tiny_model
    prompts = ("Hello there, how are you today?", "def main(args):\n    for item in items:",
               "The capital of France is Paris. The capital of")
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        for arch in ARCHS:
            path = make_tiny_model(Path(d) / f"tiny-{arch}.gguf", arch, seed=0)
            eng = Engine.load(EngineArgs(model=str(path), backend=a.backend, max_context=512, prefix_reuse=False))
            diffs = row_step_diff(eng.model)
            same, acc = 0, 0
            for p in prompts:
                msgs = [{"role": "user", "content": p}]
                want = run_one(eng, msgs, "off", 1, frozenset(), 48)
                for k in (1, 3, 5):
                    got = run_one(eng, msgs, "ngram", k, frozenset({"fixed"}), 48)
                    same += got.token_ids == want.token_ids
                    acc += got.accepted
            bad += same != 3 * len(prompts)
            print(f"{arch}: {same}/{3 * len(prompts)} identical, {acc} drafts accepted; "
                  f"max |verify row - step| by T: {diffs}", flush=True)
    return 1 if bad else 0


def row_step_diff(model, n_ctx: int = 40, sizes=(2, 4, 8)) -> dict[int, float]:
    """Largest |logit| difference between a batched verify pass over T tokens and T single decode steps."""
    rng = np.random.default_rng(0)
    toks = rng.integers(3, min(1000, model.args.vocab_size), n_ctx + max(sizes)).astype(np.int32)
    cache = model.new_cache(n_ctx + max(sizes))
    model.forward(toks[:n_ctx], 0, cache)
    steps = np.stack([model.forward(toks[i:i + 1], i, cache)[0].copy() for i in range(n_ctx, n_ctx + max(sizes))])
    out = {}
    for t in sizes:
        cache.truncate(n_ctx)
        rows = model.forward(toks[n_ctx:n_ctx + t], n_ctx, cache, all_logits=True)
        out[t] = float(np.abs(rows - steps[:t]).max())
    return out


def load_workloads(names, chats, heldout: str | None = None, n_heldout: int = 0) -> list[tuple[str, list[dict]]]:
    out = []
    for name in names:
        p = Path(name) if Path(name).exists() else WORKLOAD_DIR / name
        out.append((p.stem, json.loads(p.read_text())))
    for i, c in enumerate(chats):
        out.append((f"chat{i + 1}", [{"role": "user", "content": c}]))
    if heldout:  # prompts no drafter was trained on (train/heldout.json: a list of message lists)
        items = json.loads(Path(heldout).read_text())
        items = items.get("prompts", items) if isinstance(items, dict) else items
        for i, msgs in enumerate(items[:n_heldout or None]):
            msgs = msgs.get("messages", msgs) if isinstance(msgs, dict) else msgs
            out.append((f"heldout{i:02d}", msgs))
    return out


# the users' sampled preset (as ninfer-bench --sampled): acceptance under sampling, not only greedy
SAMPLED = dict(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=42)


def run_one(engine: Engine, msgs, mode: str, k: int, flags: frozenset, max_new: int, sampled: bool = False):
    sp = SamplingParams(max_new=max_new, **SAMPLED) if sampled else SamplingParams(greedy=True, max_new=max_new)
    req = GenerateRequest(sp, spec=mode, draft_tokens=k)
    round_fn = variant_round(engine, mode, k, flags) if mode != "off" else None
    return list(engine.session().generate(msgs, req, round_fn=round_fn))[-1]


def summarise(runs) -> dict:
    """Aggregate FinalStats of repeated runs of one (workload, variant)."""
    tps = [r.decode_tok_s for r in runs]
    st = runs[-1]  # greedy: every repeat has the same tokens; take counts from the last
    return dict(tok_s=statistics.mean(tps), tok_s_min=min(tps), tok_s_max=max(tps), out_tokens=st.output_tokens,
                tokens_per_round=st.tokens_per_round, acceptance=st.acceptance, block_tokens=st.block_tokens,
                draft_ms=statistics.mean(r.draft_ms / max(r.rounds - r.block_rounds, 1) for r in runs),
                verify_ms=statistics.mean((r.verify_ms - r.block_ms) / max(r.rounds - r.block_rounds, 1) for r in runs),
                per_position=[round(x, 3) for x in st.per_position_accept], sha=st.output_sha256,
                same_tokens=len({r.token_ids for r in runs}) == 1)


def modelled_speedup(st, k: int, cost: dict[int, float]) -> float | None:
    """Plain decode time / speculative time for the same tokens, if every drafting round drafted k tokens
    (true for the fixed-length n-gram drafter, which drafts k or nothing) and c(T) is interpolated in `cost`."""
    known = sorted(cost)
    if k + 1 not in cost:
        lo = max((t for t in known if t < k + 1), default=None)
        hi = min((t for t in known if t > k + 1), default=None)
        if lo is None or hi is None:
            return None
        cost = dict(cost, **{k + 1: cost[lo] + (cost[hi] - cost[lo]) * (k + 1 - lo) / (hi - lo)})
    drafting = st.drafted / k
    spec = (st.rounds - drafting) * cost[1] + drafting * cost[k + 1]
    return st.output_tokens * cost[1] / spec if spec > 0 else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ninfer-bench speculative", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the embedded SmolLM2)")
    ap.add_argument("--variants", nargs="+", default=["off", "ngram:3", "ngram:3:fixed", "ngram:7"])
    ap.add_argument("--workloads", nargs="*", default=list(DEFAULT_WORKLOADS))
    ap.add_argument("--chats", type=int, default=len(CHAT_PROMPTS), help="how many built-in chat prompts")
    ap.add_argument("--heldout", default=None, metavar="FILE",
                    help="also every prompt of a held-out set (train/heldout.json), with a summary row per variant")
    ap.add_argument("--heldout-n", type=int, default=0, help="only the first N held-out prompts")
    ap.add_argument("--sampled", action="store_true",
                    help="the users' sampled preset (T=0.7 top-p 0.8 top-k 20 presence 1.5 seed 42) instead of greedy")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="A-B-A-B: rounds over all variants")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-verify-cost", action="store_true")
    ap.add_argument("--verify-only", action="store_true", help="only the verify-pass (and draft) cost")
    ap.add_argument("--verify-sizes", type=int, nargs="+", default=[1, 2, 4, 8], metavar="T",
                    help="verify pass sizes to time (default 1 2 4 8; 16: a 16-row DFlash block)")
    ap.add_argument("--no-draft-cost", action="store_true", help="skip the trained drafters' cost per round")
    ap.add_argument("--cpu-clock", action="store_true",
                    help="time the verify passes by process CPU time (a loaded machine; use with --threads 1)")
    ap.add_argument("--lossless-tiny", action="store_true",
                    help="greedy off vs ngram k=1,3,5 on the tiny models (tests/fixtures/make_tiny_models.py) on --backend, "
                         "and the largest |verify row - decode step| difference")
    ap.add_argument("--random-smollm2", action="store_true",
                    help="verify cost on a random model with SmolLM2-135M's shapes and quant types (no file needed; "
                         "same bytes moved, so the same speed)")
    ap.add_argument("--json", default=None, help="write all figures here")
    ap.add_argument("--cost-json", nargs="*", default=[],
                    help="verify-cost tables (--verify-only/--random-smollm2 --json output, e.g. from a quiet "
                         "machine or a GPU): also print the speedup each fixed-length variant would have there")
    a = ap.parse_args(argv)

    if a.random_smollm2:
        return random_verify_cost(a)
    if a.lossless_tiny:
        return lossless_tiny(a)
    variants = [parse_variant(v) for v in a.variants]
    if variants[0][0] != "off":
        variants.insert(0, ("off", 0, frozenset()))
    k_max = max(v[1] for v in variants)
    t0 = time.perf_counter()
    engine = Engine.load(EngineArgs(model=a.model, prefix_reuse=False, max_context=2048, backend=a.backend,
                                    threads=a.threads, draft_tokens=min(max(k_max, 1), 15)))
    print(f"# model {engine.name} ({engine.description}); loaded in {time.perf_counter() - t0:.1f} s; "
          f"backend {a.backend}; greedy; prefix reuse off", flush=True)
    result: dict = {"model": engine.name, "max_new": a.max_new, "repeats": a.repeats}

    if not a.no_verify_cost:
        cost = verify_cost(engine.model, engine.args.kv_dtype, sizes=tuple(sorted({1, *a.verify_sizes})),
                           clock=time.process_time if a.cpu_clock else time.perf_counter)
        result["verify_cost_ms"] = cost
        step = decode_step_cost(engine.model, engine.args.kv_dtype,
                                clock=time.process_time if a.cpu_clock else time.perf_counter)
        result["decode_step_ms"] = step
        base = cost[1]
        print("\n## verify pass cost (forward over T tokens at position 200, median of 20, sizes interleaved; "
              f"a decode step back to back: {step:.2f} ms)")
        for t, ms in cost.items():
            print(f"  T={t}: {ms:7.2f} ms  = {ms / base:4.2f}x T=1 interleaved = {ms / step:4.2f}x a decode step")
    drafted = [v for v in variants if v[0] in ("mtp", "dflash")]
    if drafted and not a.no_draft_cost:
        base = result["decode_step_ms"] if "decode_step_ms" in result else \
            decode_step_cost(engine.model, engine.args.kv_dtype)
        print(f"\n## draft cost per round (propose + observe, context 200, median; a decode step back to back = "
              f"{base:.2f} ms)", flush=True)
        result["draft_cost_ms"] = {"decode_step": base}
        for mode, k, flags in drafted:
            ms = draft_cost(engine, mode, k, flags)
            result["draft_cost_ms"][variant_name(mode, k, flags)] = ms
            print(f"  {variant_name(mode, k, flags):18s} {ms:6.2f} ms = {ms / base:5.1%} of a decode step", flush=True)
    if a.verify_only:
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1))
        return 0

    work = load_workloads(a.workloads, CHAT_PROMPTS[:a.chats], a.heldout, a.heldout_n)
    runs: dict[tuple[str, str], list] = {}
    for rep in range(a.repeats):  # A-B-A-B: every variant once per repeat, per workload
        for wname, msgs in work:
            for mode, k, flags in variants:
                name = variant_name(mode, k, flags)
                st = run_one(engine, msgs, mode, max(k, 1), flags, a.max_new, a.sampled)
                runs.setdefault((wname, name), []).append(st)
                print(f"  [{rep + 1}/{a.repeats}] {wname:18s} {name:13s} {st.output_tokens:4d} tok "
                      f"{st.decode_tok_s:7.1f} tok/s", file=sys.stderr, flush=True)

    print(f"\n## rounds ({'sampled' if a.sampled else 'greedy'}, A-B-A-B; tok/s mean [min-max])")
    print(f"{'workload':18s} {'variant':13s} {'out':>4s} {'tok/s':>22s} {'tok/rnd':>7s} {'accept':>6s} "
          f"{'ms/rnd':>6s} {'draft':>5s} {'verify':>6s} {'speedup':>7s} {'same':>4s}  per-position")
    table = []
    for wname, _ in work:
        plain = summarise(runs[(wname, "off")])
        for mode, k, flags in variants:
            name = variant_name(mode, k, flags)
            s = summarise(runs[(wname, name)])
            s.update(workload=wname, variant=name, speedup=s["tok_s"] / plain["tok_s"] if plain["tok_s"] else 0.0,
                     identical_to_plain=s["sha"] == plain["sha"])
            table.append(s)
            print(f"{wname:18s} {name:13s} {s['out_tokens']:4d} {s['tok_s']:7.1f} [{s['tok_s_min']:6.1f}-"
                  f"{s['tok_s_max']:6.1f}] {s['tokens_per_round']:7.2f} {s['acceptance']:6.2f} "
                  f"{s['draft_ms'] + s['verify_ms']:6.2f} {s['draft_ms']:5.2f} {s['verify_ms']:6.2f} "
                  f"{s['speedup']:6.2f}x {'yes' if s['identical_to_plain'] else 'NO':>4s}  {s['per_position']}")
    result["rounds"] = table
    held = [t for t in table if t["workload"].startswith("heldout")]
    if held:  # one row per variant over the held-out prompts: tokens over rounds, time over time
        print(f"\n## held-out prompts ({len({t['workload'] for t in held})}): pooled over prompts")
        result["heldout"] = {}
        for mode, k, flags in variants:
            name = variant_name(mode, k, flags)
            rs = [st for (w, v), sts in runs.items() if w.startswith("heldout") and v == name for st in sts]
            plain = [st for (w, v), sts in runs.items() if w.startswith("heldout") and v == "off" for st in sts]
            # tokens over speculative rounds (a reply's decode blocks where nothing was drafted left out)
            tpr = sum(r.output_tokens - r.block_tokens for r in rs) / max(sum(r.rounds - r.block_rounds for r in rs), 1)
            acc = sum(r.accepted for r in rs) / max(sum(r.drafted for r in rs), 1)
            speed = (sum(r.output_tokens for r in rs) / sum(r.output_tokens / max(r.decode_tok_s, 1e-9) for r in rs)) / \
                (sum(r.output_tokens for r in plain) / sum(r.output_tokens / max(r.decode_tok_s, 1e-9) for r in plain))
            same = all(t["identical_to_plain"] for t in held if t["variant"] == name)
            result["heldout"][name] = dict(tokens_per_round=tpr, acceptance=acc, speedup=speed, identical=same)
            print(f"  {name:18s} tok/rnd {tpr:5.2f}  accept {acc:5.2f}  speedup {speed:5.2f}x  "
                  f"same {'yes' if same else 'NO'}")
    for cj in a.cost_json:
        cost = {int(t): ms for t, ms in json.loads(Path(cj).read_text())["verify_cost_ms"].items()}
        print(f"\n## modelled speedup with the verify costs of {cj} "
              f"(T: x T=1 = {', '.join(f'{t}: {ms / cost[1]:.2f}' for t, ms in sorted(cost.items()))})")
        for wname, _ in work:
            for mode, k, flags in variants:
                if "fixed" not in flags or mode == "off":
                    continue  # adaptive lengths depend on the costs of the machine they ran on
                st = runs[(wname, variant_name(mode, k, flags))][-1]
                m = modelled_speedup(st, k, cost)
                if m is not None:
                    print(f"  {wname:18s} {variant_name(mode, k, flags):13s} {m:5.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    bad = [t for t in table if not t["identical_to_plain"]]
    if bad:
        print(f"\nWARNING: {len(bad)} variant(s) differ from plain decode (lossless broken or a near-tie flip)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
