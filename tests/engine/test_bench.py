"""ninfer-bench: variant parsing, aggregation/ratios/roofline, and one real worker run on a tiny model."""
from __future__ import annotations

import json
import os
import time

import pytest

from engine.bench import report, runner
from engine.bench.main import main as bench_main
from engine.bench.main import synthetic_prompt_ids
from engine.bench.variants import Run, Variant, Workload, load_variants_toml, parse_variant
from engine.errors import ConfigError


# ------------------------------------------------------------------------------------------- variants
def test_parse_variant_engine_and_run_keys():
    v = parse_variant("fast:kv_dtype=int8,threads=1,busy=1,draft-tokens=4,spec=ngram")
    assert v.name == "fast" and v.kind == "ours"
    assert v.threads == 1 and v.busy is True and v.cold is False
    assert v.engine == {"kv_dtype": "int8", "draft_tokens": 4, "spec": "ngram"}


def test_parse_variant_keeps_text_fields_as_written():
    """spec=off is the mode "off" (a text field), not the boolean False that `off` means for busy / cold."""
    v = parse_variant("plain:spec=off,busy=off,draft_tokens=3")
    assert v.engine == {"spec": "off", "draft_tokens": 3} and v.busy is False


def test_parse_variant_env_keys():
    v = parse_variant("wq:env.NINFER_THREADING_LAYER=workqueue,env.GOMP_SPINCOUNT=1000,kv_dtype=int8")
    assert v.env == {"NINFER_THREADING_LAYER": "workqueue", "GOMP_SPINCOUNT": "1000"}
    assert v.engine == {"kv_dtype": "int8"}
    assert runner.worker_env(v, None)["GOMP_SPINCOUNT"] == "1000"


def test_parse_variant_peer_and_plain_name():
    assert parse_variant("llama.cpp").kind == "llama.cpp"
    assert parse_variant("peer:kind=llama,threads=2").kind == "llama.cpp"
    assert parse_variant("base:") == Variant("base")


@pytest.mark.parametrize("text, fragment", [
    ("x:nonsense=1", "unknown key"),
    ("x:kv_dtype=fp8", "--kv-dtype"),
    ("x:threads", "not key=value"),
    (":kv_dtype=int8", "give a name"),
    ("p:kind=llama.cpp,kv_dtype=int8", "llama.cpp takes only"),
    ("old:tree=/nonexistent/ninfer", "not a ninfer-chat checkout"),
    (f"p:kind=llama.cpp,tree={runner.REPO_ROOT}", "llama.cpp takes none"),
    ("x:threads=abc", "threads must be an integer"),  # a TypeError traceback before
    ("x:busy=maybe", "busy must be true or false"),  # taken as busy=1 before
    ("x:prefill_chunk=abc", "wrong type"),
])
def test_parse_variant_errors_name_the_problem(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_variant(text)


def test_variants_toml(tmp_path):
    f = tmp_path / "v.toml"
    f.write_text('[variant.a]\nkv_dtype = "int8"\n[variant.peer]\nkind = "llama.cpp"\nthreads = 1\n')
    vs = load_variants_toml(f)
    assert [v.name for v in vs] == ["a", "peer"]
    assert vs[0].engine == {"kv_dtype": "int8"} and vs[1].kind == "llama.cpp" and vs[1].threads == 1
    (tmp_path / "bad.toml").write_text("[other]\n")
    with pytest.raises(ConfigError, match=r"\[variant.NAME\]"):
        load_variants_toml(tmp_path / "bad.toml")


def test_run_json_roundtrip():
    run = Run(parse_variant("a:kv_dtype=int8"), Workload("w", prompt_ids=[1, 2, 3], decode_tokens=5), "m.gguf", 1)
    back = Run.from_json(run.to_json())
    assert back == run


def test_variant_tree_runs_its_worker_from_that_checkout(tmp_path, monkeypatch):
    """tree=PATH: the worker runs from another checkout (its cwd and first import path); the run sent
    to it leaves the key out (an older checkout's worker does not know it)."""
    (tmp_path / "engine" / "bench").mkdir(parents=True)
    (tmp_path / "engine" / "bench" / "worker.py").write_text("")
    v = parse_variant(f"old:tree={tmp_path},kv_dtype=int8")
    assert v.tree == str(tmp_path) and v.engine == {"kv_dtype": "int8"}
    run = Run(v, Workload("w", prompt_ids=[1, 2], decode_tokens=3), "m.gguf")
    assert "tree" not in json.loads(run.to_json())["variant"]
    assert Run.from_json(run.to_json()).variant.tree == ""
    seen = {}

    def fake_run(cmd, **kw):
        seen.update(cwd=kw["cwd"], path=kw["env"]["PYTHONPATH"].split(os.pathsep)[0], run=json.loads(kw["input"]))
        raise runner.subprocess.TimeoutExpired(cmd, 1)
    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    assert not runner.run_one(run)["ok"]
    assert seen["cwd"] == seen["path"] == str(tmp_path.resolve()) and seen["run"]["variant"]["name"] == "old"
    runner.run_one(Run(Variant("new"), run.workload, "m.gguf"))
    assert seen["cwd"] == seen["path"] == str(runner.REPO_ROOT)


# ---------------------------------------------------------------------------------------- aggregation
def _run(name, rep, dec, pre, sha="aa", ok=True):
    return {"ok": ok, "variant": name, "repeat": rep, "decode_tok_s": dec, "prefill_tok_s": pre, "ttft_s": 1.0,
            "peak_rss": 100 * 2**20, "output_sha256": sha, "tokens_per_round": 1.0}


def test_aggregate_mean_range_ratio_and_hashes():
    runs = [_run("ours", 0, 200, 400), _run("peer", 0, 100, 300), _run("ours", 1, 220, 420),
            _run("peer", 1, 110, 330, sha="bb"), {"ok": False, "variant": "ours", "repeat": 2, "error": "boom"}]
    agg = report.aggregate(runs, ["ours", "peer"])
    assert agg["ours"]["decode_tok_s"] == {"mean": 210, "min": 200, "max": 220, "n": 2}
    assert agg["ours"]["errors"] == ["boom"] and agg["ours"]["ok"] == 2 and agg["ours"]["runs"] == 3
    assert agg["peer"]["sha256"] == ["aa", "bb"]
    rat = report.ratios(agg, "peer")
    assert rat["ours"]["decode_tok_s"] == pytest.approx(210 / 105)
    assert rat["peer"]["decode_tok_s"] == pytest.approx(1.0)
    text = report.table(agg, rat, "peer")
    assert "210.0 [200.0-220.0]" in text and "2.00x" in text and "FAILED boom" in text
    md = report.markdown_table(agg, rat, "peer")
    assert md.startswith("| variant") and "| ours |" in md


def test_table_notes_replies_of_different_lengths():
    """One variant stopped at end-of-sequence, the other ran to the limit: the table says their tok/s are not
    like for like; equal lengths say nothing."""
    runs = [dict(_run("ours", 0, 200, 400), output_tokens=122), dict(_run("peer", 0, 100, 300), output_tokens=1024)]
    agg = report.aggregate(runs, ["ours", "peer"])
    text = report.table(agg, report.ratios(agg, "peer"), "peer")
    assert "replies differ in length (ours 122, peer 1024 tokens)" in text
    same = report.aggregate([dict(r, output_tokens=64) for r in runs], ["ours", "peer"])
    assert "differ in length" not in report.table(same, report.ratios(same, "peer"), "peer")


def test_roofline_share_uses_each_runs_own_bandwidth():
    runs = [{"variant": "ours", "ok": True, "decode_tok_s": 150.0, "read_bandwidth": 30e9},
            {"variant": "ours", "ok": True, "decode_tok_s": 100.0, "read_bandwidth": 20e9},
            {"variant": "peer", "ok": True, "decode_tok_s": 60.0, "read_bandwidth": 30e9},
            {"variant": "peer", "ok": False, "error": "x"}]
    roof = report.roofline(runs, ["ours", "peer"], weight_bytes=100e6)
    assert roof["share_of_roofline"]["ours"] == {"mean": pytest.approx(0.5), "min": pytest.approx(0.5),
                                                 "max": pytest.approx(0.5), "n": 2, "pooled": pytest.approx(0.5)}
    assert roof["share_of_roofline"]["peer"]["mean"] == pytest.approx(0.2)
    assert roof["read_bandwidth_gb_s"]["min"] == pytest.approx(20.0) and roof["roofline_tok_s"] > 0
    text = report.table(report.aggregate(runs, ["ours", "peer"]), {}, "peer", roof)
    assert "ours 50%" in text and "peer 20%" in text and "20.0-30.0] GB/s" in text
    assert report.roofline(runs, ["ours"], None) == {}
    assert report.roofline([{"variant": "ours", "ok": True, "decode_tok_s": 1.0}], ["ours"], 100) == {}


def test_pooled_share_is_the_runs_mean_rate_over_their_mean_bandwidth():
    """A fast run in a slow-bandwidth round and a slow one in a fast round: the runs' shares 100% and 25%
    average 62.5%; the runs read 30 GB/s on average against 60 GB/s measured on average: 50% pooled."""
    runs = [{"variant": "ours", "ok": True, "decode_tok_s": 400.0, "read_bandwidth": 40e9},
            {"variant": "ours", "ok": True, "decode_tok_s": 200.0, "read_bandwidth": 80e9}]
    s = report.roofline(runs, ["ours"], weight_bytes=100e6)["share_of_roofline"]["ours"]
    assert s["mean"] == pytest.approx((1.0 + 0.25) / 2)
    assert s["pooled"] == pytest.approx((40e9 + 20e9) / 2 / ((40e9 + 80e9) / 2))
    text = report.table(report.aggregate(runs, ["ours"]), {}, "ours", report.roofline(runs, ["ours"], 100e6))
    assert "ours 62 [25-100]% (pooled 50%)" in text


def test_roofline_with_kv_counts_the_cache_read_at_the_mean_context():
    runs = [{"variant": "ours", "ok": True, "decode_tok_s": 100.0, "read_bandwidth": 20e9,
             "prompt_tokens": 500, "output_tokens": 200},
            {"variant": "peer", "ok": True, "decode_tok_s": 50.0, "read_bandwidth": 20e9}]  # no token counts
    roof = report.roofline(runs, ["ours", "peer"], weight_bytes=100e6, kv_bytes={"ours": 1000, "peer": 1000})
    # 100 MB of weights + 1000 B x 600 positions (500 prompt + 200 / 2) = 100.6 MB a token, at 100 tok/s
    assert roof["share_with_kv"]["ours"]["mean"] == pytest.approx(100 * 100.6e6 / 20e9)
    assert roof["share_of_roofline"]["ours"]["mean"] == pytest.approx(0.5)
    assert "peer" not in roof["share_with_kv"]  # a run without token counts has no such share
    text = report.table(report.aggregate(runs, ["ours", "peer"]), {}, "peer", roof)
    assert "counting the KV cache" in text and "ours 50%" in text
    assert "share_with_kv" not in report.roofline(runs, ["ours"], 100e6)


def test_kv_bytes_per_position_of_the_default_model():
    from engine import paths
    from engine.bench.bandwidth import kv_bytes_per_position
    model = str(paths.resolve_model(None))
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 values, K and V; int8 adds a float32 scale per 32 values
    assert kv_bytes_per_position(model) == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_position(model, "int8") == 2 * 30 * 3 * 64 * (1 + 4 / 32)


def test_warm_up_writes_our_bytecode_even_where_imports_do_not(tmp_path, monkeypatch):
    import os
    import stat
    import sys
    from engine.bench import runner
    pkg = tmp_path / "bc_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # as PYTHONDONTWRITEBYTECODE=1
    said = []
    runner._byte_compile(said.append, ("bc_pkg",))
    assert any(p.name.startswith("mod.") for p in (pkg / "__pycache__").iterdir()) and not said
    if os.geteuid() != 0:  # root writes into read-only folders anyway
        ro = tmp_path / "ro_pkg"
        ro.mkdir()
        (ro / "__init__.py").write_text("")
        ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
        try:
            runner._byte_compile(said.append, ("ro_pkg",))
        finally:
            ro.chmod(stat.S_IRWXU)
        assert said and "read-only" in said[0]


def test_warm_up_compiles_in_its_own_process_and_measured_runs_keep_their_env(monkeypatch):
    """A warm-up on an empty cache must not leave a compile helper running beside the measured runs."""
    seen = []
    monkeypatch.setattr(runner, "_byte_compile", lambda log, **kw: None)
    monkeypatch.setattr(runner, "run_one", lambda run: seen.append((run.repeat, run.variant.name,
                                                                    dict(run.variant.env))) or
                        {"ok": True, "variant": run.variant.name, "repeat": run.repeat, "decode_tok_s": 1.0})
    wl = Workload(name="w", decode_tokens=4)
    variants = [Variant("a"), Variant("b", env={"NINFER_DECODE_BLOCK": "1"}), Variant("c", kind="llama.cpp")]
    runner.run_bench(variants, wl, "m", repeats=1, idle_gap_s=0, log=lambda s: None)
    warm = [(n, e) for r, n, e in seen if r == -1]
    assert warm == [("a", {"NINFER_COMPILE_BG": "0"}), ("b", {"NINFER_DECODE_BLOCK": "1", "NINFER_COMPILE_BG": "0"})]
    assert [(n, e) for r, n, e in seen if r == 0] == [("a", {}), ("b", {"NINFER_DECODE_BLOCK": "1"}),
                                                      ("c", {})]


def test_run_bench_brackets_each_round_with_bandwidth_and_turns_the_order(monkeypatch):
    order = []
    monkeypatch.setattr(runner, "run_one", lambda run: order.append(run.variant.name) or
                        {"ok": True, "variant": run.variant.name, "repeat": run.repeat, "decode_tok_s": 1.0})
    probes = iter([10.0, 20.0, 40.0, 80.0])

    def bandwidth():
        order.append("bw")
        return next(probes)
    wl = Workload(name="w", decode_tokens=4)
    res = runner.run_bench([Variant("a"), Variant("b")], wl, "m", repeats=3, idle_gap_s=0, warmup=False,
                           log=lambda s: None, bandwidth=bandwidth)
    assert order == ["bw", "a", "b", "bw", "b", "a", "bw", "a", "b", "bw"]  # no variant always first
    assert [(r["variant"], r["read_bandwidth"]) for r in res] == [("a", 15.0), ("b", 15.0), ("b", 30.0),
                                                                  ("a", 30.0), ("a", 60.0), ("b", 60.0)]
    order.clear()
    runner.run_bench([Variant("a"), Variant("b"), Variant("c")], wl, "m", repeats=3, idle_gap_s=0, warmup=False,
                     log=lambda s: None)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


# ------------------------------------------------------------------------------------------- workloads
def test_synthetic_prompt_has_exact_length(tiny_models):
    for n in (1, 37, 300):
        ids = synthetic_prompt_ids(str(tiny_models["llama"]), n)
        assert len(ids) == n
    assert synthetic_prompt_ids(str(tiny_models["llama"]), 50) == synthetic_prompt_ids(str(tiny_models["llama"]), 50)


def test_busy_process_is_started_and_stopped():
    p = runner.start_busy_process(0)
    try:
        time.sleep(0.2)
        assert p.poll() is None
    finally:
        runner.stop_process(p)
    assert p.poll() is not None


def test_worker_env_threads_and_cold_cache(tmp_path):
    env = runner.worker_env(Variant("a", threads=1), str(tmp_path))
    assert env["NUMBA_NUM_THREADS"] == "1" and env["NINFER_CACHE_DIR"] == str(tmp_path)
    assert "NUMBA_CACHE_DIR" not in env


def test_worker_env_of_another_checkout_keys_its_own_numba_cache(tmp_path, monkeypatch):
    """This process's NUMBA_CACHE_DIR is keyed on this checkout's kernels: a tree= variant must not share it
    (numba would serve it functions compiled from another version of their callees)."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "numba-this-tree"))
    assert runner.worker_env(Variant("a"), None)["NUMBA_CACHE_DIR"] == str(tmp_path / "numba-this-tree")
    (tmp_path / "engine" / "bench").mkdir(parents=True)
    (tmp_path / "engine" / "bench" / "worker.py").write_text("")  # what a checkout is taken to be
    other = runner.worker_env(Variant("b", tree=str(tmp_path)), None)
    assert "NUMBA_CACHE_DIR" not in other and other["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)


# ------------------------------------------------------------------------------------ real worker runs
def test_steady_rate_leaves_out_the_replys_first_tokens():
    from engine.bench.worker import RAMP_TOKENS, steady_rate
    cut = 1 + RAMP_TOKENS
    # blocks of 8 after the first token: slow while the memory ramps (10 ms a token), then 2 ms a token
    marks, t = [(1, 0.0)], 0.0
    for n in range(9, 66, 8):
        t += 8 * (0.010 if n <= cut else 0.002)
        marks.append((n, t))
    first_past = next(m for m in marks if m[0] >= cut)
    assert steady_rate(marks) == pytest.approx((marks[-1][0] - first_past[0]) / (marks[-1][1] - first_past[1]))
    assert steady_rate(marks) == pytest.approx(500.0)
    assert steady_rate(marks[:4]) == pytest.approx(500.0) and steady_rate(marks[:3]) is None  # 8 tokens, 0
    assert steady_rate([(1, 0.0), (cut, 1.0), (cut + 10, 1.0)]) is None  # no time passed


def test_roofline_steady_share_uses_the_steady_rate():
    runs = [{"variant": "ours", "ok": True, "decode_tok_s": 100.0, "decode_steady_tok_s": 150.0,
             "read_bandwidth": 20e9, "prompt_tokens": 500, "output_tokens": 200},
            {"variant": "peer", "ok": True, "decode_tok_s": 50.0, "read_bandwidth": 20e9}]  # no steady rate
    roof = report.roofline(runs, ["ours", "peer"], weight_bytes=100e6, kv_bytes={"ours": 1000})
    assert roof["share_of_roofline"]["ours"]["mean"] == pytest.approx(0.5)
    assert roof["steady"]["share_of_roofline"]["ours"]["mean"] == pytest.approx(0.75)
    assert roof["steady"]["share_with_kv"]["ours"]["mean"] == pytest.approx(150 * 100.6e6 / 20e9)
    assert "peer" not in roof["steady"]["share_of_roofline"]
    agg = report.aggregate(runs, ["ours", "peer"])
    text = report.table(agg, report.ratios(agg, "peer"), "peer", roof)
    assert "steady tok/s" in text and "steady (the rate after" in text and "ours 75%" in text
    assert "steady" not in report.roofline(runs[1:], ["peer"], 100e6)


def test_worker_run_ref_backend_synthetic(tiny_models):
    """One real subprocess run (numpy ref backend: no JIT) - figures are present and positive."""
    model = str(tiny_models["llama"])
    ids = synthetic_prompt_ids(model, 24)
    run = Run(parse_variant("r:backend=ref,prefill_chunk=16,threads=1"),
              Workload("syn", prompt_ids=ids, prompt_tokens=24, decode_tokens=30), model, max_context=128)
    res = runner.run_one(run, timeout_s=300)
    assert res["ok"], res.get("error")
    assert res["prompt_tokens"] == 24 and res["output_tokens"] == 30 and res["rounds"] == 30  # the reply loop
    assert res["decode_steady_tok_s"] > 0  # 13 tokens after the ramp's 17
    assert res["decode_tok_s"] > 0 and res["prefill_tok_s"] > 0 and res["ttft_s"] > 0
    assert res["peak_rss"] > 10 * 2**20 and len(res["output_sha256"]) == 64
    again = runner.run_one(run, timeout_s=300)
    assert again["output_sha256"] == res["output_sha256"]  # greedy: same ids, same text


def test_bench_cli_messages_workload_json(tiny_models, tmp_path, capsys):
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    rc = bench_main([str(tiny_models["llama"]), "--variant", "a:backend=ref,threads=1", "--prompt", "Hello there",
                     "--decode-tokens", "4", "--repeats", "1", "--idle-gap", "0", "--no-warmup", "--no-roofline",
                     "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["prefix_reuse"] is False and doc["baseline"] == "a"
    assert doc["runs"][0]["ok"] and doc["runs"][0]["output_tokens"] >= 1
    assert "decode tok/s" in capsys.readouterr().out
    assert md.read_text().startswith("| variant")


def test_bench_cli_bad_variant_is_one_line_error(capsys):
    assert bench_main(["--variant", "x:bogus=1", "--no-roofline"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ninfer-bench: ") and "unknown key" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--json", "--markdown"])
def test_bench_cli_unwritable_output_fails_before_the_runs(tmp_path, capsys, monkeypatch, flag):
    """An output path in a folder that does not exist, or a folder: one line before anything runs."""
    import engine.bench.runner as runner
    monkeypatch.setattr(runner, "run_bench", lambda *a, **k: pytest.fail("ran before checking the output path"))
    for out, want in ((tmp_path / "no" / "r.out", "does not exist; create it"), (tmp_path, "is a directory")):
        assert bench_main(["--variant", "a:backend=ref", "--no-roofline", flag, str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"ninfer-bench: {flag} ") and want in err, err


def test_bench_cli_presence_penalty_greedy_or_sampled(tiny_models, tmp_path, capsys):
    """--presence-penalty: greedy runs with that penalty (without --sampled), or the preset with it instead of
    1.5; the run's output differs from plain greedy once the penalty moves a token. Bad values and synthetic
    workloads are one-line errors."""
    from engine.bench.main import _workload, build_parser

    def wl(*argv):
        return _workload(build_parser().parse_args(["--prompt", "Hi", *argv]), str(tiny_models["llama"]))
    assert wl().greedy_presence_penalty == 0.0 and wl("--presence-penalty", "1.5").greedy_presence_penalty == 1.5
    w = wl("--sampled", "--presence-penalty", "0.5")
    assert not w.greedy and w.presence_penalty == 0.5 and w.greedy_presence_penalty == 0.0
    shas = {}
    for pen in ("0", "8"):
        out = tmp_path / f"r{pen}.json"
        assert bench_main([str(tiny_models["llama"]), "--variant", "a:backend=ref,threads=1", "--prompt", "Hello",
                           "--decode-tokens", "12", "--repeats", "1", "--idle-gap", "0", "--no-warmup",
                           "--no-roofline", "--presence-penalty", pen, "--json", str(out)]) == 0
        shas[pen] = json.loads(out.read_text())["runs"][0]["output_sha256"]
    assert shas["0"] != shas["8"]
    capsys.readouterr()
    for bad in (["--prompt", "Hi", "--presence-penalty", "-1"], ["--presence-penalty", "1"]):
        assert bench_main([str(tiny_models["llama"]), *bad, "--no-roofline"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ninfer-bench: --presence-penalty") and "Traceback" not in err


def test_bench_cli_top_k(tiny_models, capsys):
    """--top-k K replaces the sampled preset's top-k 20 (0: off); without --sampled, negative, or on the
    synthetic prompt it is a one-line error."""
    from engine.bench.main import _workload, build_parser

    def wl(*argv):
        return _workload(build_parser().parse_args(["--prompt", "Hi", *argv]), str(tiny_models["llama"]))
    assert wl("--sampled").top_k == 20 and wl("--sampled", "--top-k", "0").top_k == 0
    assert wl("--sampled", "--top-k", "200").top_k == 200
    for bad, what in ((["--prompt", "Hi", "--top-k", "5"], "applies with --sampled"),
                      (["--prompt", "Hi", "--sampled", "--top-k", "-1"], "give a value >= 0"),
                      (["--sampled", "--top-k", "0"], "applies to message workloads")):
        assert bench_main([str(tiny_models["llama"]), *bad, "--no-roofline"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ninfer-bench: --top-k") and what in err and "Traceback" not in err


def test_bench_cli_thinking_budget(tiny_models, tmp_path, capsys):
    """--thinking-budget N: our runs reason first (prompted markers on a model without its own) and the budget
    forces the close; llama.cpp variants, synthetic workloads and negative budgets are one-line errors."""
    out = tmp_path / "r.json"
    assert bench_main([str(tiny_models["llama"]), "--variant", "a:backend=ref,threads=1", "--prompt", "Hello",
                       "--decode-tokens", "100", "--repeats", "1", "--idle-gap", "0", "--no-warmup",
                       "--no-roofline", "--thinking-budget", "3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    run = doc["runs"][0]
    assert doc["workload"]["thinking_budget"] == 3
    assert run["ok"] and run["reasoning_tokens"] == 3 and run["thinking_forced"]
    capsys.readouterr()
    for bad, what in ((["--prompt", "Hi", "--thinking-budget", "-1"], "give a value >= 0"),
                      (["--thinking-budget", "8"], "message workloads"),
                      (["--prompt", "Hi", "--thinking-budget", "8", "--variant", "l:kind=llama.cpp"], "llama.cpp")):
        assert bench_main([str(tiny_models["llama"]), *bad, "--no-roofline"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("ninfer-bench: ") and what in err and "Traceback" not in err


@pytest.mark.skipif(os.environ.get("NINFER_BENCH_LLAMA") != "1", reason="set NINFER_BENCH_LLAMA=1 (slow peer run)")
@pytest.mark.slow
def test_llama_cpp_peer_run(smollm2_path):
    pytest.importorskip("llama_cpp")
    ids = synthetic_prompt_ids(str(smollm2_path), 32)
    run = Run(parse_variant("llama.cpp"), Workload("syn", prompt_ids=ids, prompt_tokens=32, decode_tokens=8),
              str(smollm2_path))
    res = runner.run_one(run)
    assert res["ok"], res.get("error")
    assert res["decode_tok_s"] > 0


def test_read_probe_sums_every_value_and_reports_both_readers():
    """The roofline's bandwidth probe: the prefetching reader sums the whole buffer (no line skipped), and both
    readers (numpy's, and the one that reads as the decode kernels do) give a finite rate; the probe's figure
    is the better of the two."""
    import numpy as np
    from engine.bench import bandwidth as bw
    from engine.bench.stream_read import stream_sum
    a = np.arange(1 << 16, dtype=np.float64)
    assert stream_sum(a, 2048) == a.sum()
    rates = bw.read_rates(threads=2, nbytes=8 << 20, repeats=1)
    assert set(rates) == {"numpy", "prefetched"} and all(0 < r < 1e13 for r in rates.values())


def test_probe_reads_what_a_step_reads_at_the_mean_context(tiny_models):
    from engine.bench import bandwidth as bw
    from engine.bench import main as bench
    model = str(tiny_models["llama"])
    syn = Workload("syn", prompt_ids=[1] * 40, prompt_tokens=40, decode_tokens=30)
    msg = Workload("m", mode="messages", messages=[{"role": "user", "content": "hi"}], decode_tokens=30)
    assert bench.probe_context(syn) == 40 + 15 and bench.probe_context(msg) == 15  # a chat prompt: not counted
    w = bw.weight_bytes_per_token(model)["bytes"]
    f16, i8 = bw.kv_bytes_per_position(model, "f16"), bw.kv_bytes_per_position(model, "int8")
    assert i8 < f16
    ours, int8, peer = parse_variant("a:"), parse_variant("b:kv_dtype=int8"), parse_variant("llama.cpp")
    kv = {"a": f16, "b": i8, "llama.cpp": f16}
    assert bench.step_bytes(w, kv, [ours, peer], syn) == w + 55 * f16
    assert bench.step_bytes(w, kv, [ours, int8], syn) == w + 55 * i8  # the smaller cache: the smaller probe


def test_exit_reason_names_the_signal_and_what_to_do_for_a_crashed_peer():
    assert runner.exit_reason(3, "ours") == "worker exited 3"
    assert runner.exit_reason(-9, "ours") == "worker killed by SIGKILL"
    peer = runner.exit_reason(-11, "llama.cpp")
    assert peer.startswith("worker killed by SIGSEGV (llama-cpp-python crashed") and "GGML_NATIVE=OFF" in peer
    assert runner.exit_reason(-11, "ours") == "worker killed by SIGSEGV"


def test_probe_reads_as_many_bytes_as_the_weights_in_whole_mib_per_reader():
    from engine.bench import bandwidth as bw
    w = 96_400_000  # SmolLM2's matrices per token
    assert bw.probe_bytes(w, 2) == 2 * 46 * (1 << 20) and bw.probe_bytes(w, 2) >= w
    assert bw.probe_bytes(w, 1) == 92 * (1 << 20)
    assert bw.probe_bytes(1000, 2) == bw.PROBE_MIN  # a tiny model: still past the L2 caches
    assert bw.probe_bytes(w, 3) % (3 << 20) == 0


def test_variant_devices_as_one_id_and_its_own_max_context():
    """devices=0 is one id (as --devices 0; it was a TypeError in the worker); max_context is a variant key the
    worker lets win over --max-context (it was "got multiple values")."""
    v = parse_variant("a:max_context=64,devices=0")
    assert v.engine == {"max_context": 64, "devices": (0,)}


def test_bench_synthetic_run_that_cannot_fit_the_context_is_refused(tiny_models, capsys):
    """--prompt-tokens + --decode-tokens past --max-context: refused up front (the runs stopped short and the
    table reported them as the asked-for workload)."""
    from engine.bench.main import main as bench_main
    code = bench_main([str(tiny_models["llama"]), "--variant", "a:backend=ref", "--prompt-tokens", "32",
                       "--decode-tokens", "100", "--max-context", "64", "--repeats", "1"])
    err = capsys.readouterr().err
    assert code != 0 and "do not fit --max-context 64" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("name", ["speculative", "gpu"])
def test_other_benchmarks_are_subcommands(name, capsys):
    """`ninfer-bench speculative|gpu ...` hands its arguments to that module's own parser."""
    with pytest.raises(SystemExit) as e:
        bench_main([name, "--help"])
    assert e.value.code == 0 and f"usage: ninfer-bench {name}" in capsys.readouterr().out


def test_speculative_variants_and_heldout_workloads(tmp_path):
    """ninfer-bench speculative: MODE:K[:fixed][:hot][:lookup] variants, and a held-out prompt file as
    workloads (one per prompt, named heldoutNN)."""
    import json

    from engine.bench import speculative as sb
    assert sb.parse_variant("off") == ("off", 3, frozenset())
    mode, k, flags = sb.parse_variant("mtp:5:hot:fixed")
    assert (mode, k, flags) == ("mtp", 5, frozenset({"hot", "fixed"}))
    assert sb.variant_name(mode, k, flags) == "mtp:5:fixed:hot"
    with pytest.raises(SystemExit, match="unknown option 'fast'"):
        sb.parse_variant("mtp:3:fast")
    mode, k, flags = sb.parse_variant("mtp:3:ld3:lookup4:hot")  # lookup from 4 matched tokens, 3 drafts a round
    assert sb.variant_name(mode, k, flags) == "mtp:3:hot:lookup4:ld3"
    assert (sb._lookup(flags), sb._lookup_drafts(flags)) == (4, 3)
    assert sb._lookup_drafts(sb.parse_variant("mtp:3:lookup")[2]) is None  # spec.lookup.LOOKUP_DRAFTS
    with pytest.raises(SystemExit, match="unknown option 'ld'"):
        sb.parse_variant("mtp:3:lookup:ld")
    held = tmp_path / "heldout.json"
    held.write_text(json.dumps([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]))
    work = sb.load_workloads([], [], str(held), 1)
    assert work == [("heldout00", [{"role": "user", "content": "a"}])]
