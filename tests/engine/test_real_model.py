"""engine/bench/real_model.py: the default model travels to the device machine in parts and its greedy replies
are checked there against records made here (scripts/device_model.sh)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.bench import real_model as rm


def test_split_join_roundtrip_and_errors(tmp_path):
    src = tmp_path / "m.gguf"
    src.write_bytes(np.random.default_rng(0).integers(0, 256, 10_001, dtype=np.uint8).tobytes())
    man = rm.split(src, tmp_path / "parts", 3)
    assert [p["size"] for p in man["parts"]] == [3334, 3334, 3333]
    assert json.loads((tmp_path / "parts" / "manifest.json").read_text()) == man
    out = rm.join(tmp_path / "parts", man, tmp_path / "joined.gguf")
    assert out.read_bytes() == src.read_bytes()

    (tmp_path / "parts" / "part2").unlink()
    with pytest.raises(SystemExit, match="part2 not in .*carry each part"):
        rm.join(tmp_path / "parts", man, tmp_path / "j2.gguf")
    (tmp_path / "parts" / "part2").write_bytes(b"\0" * 3334)  # a stale part: same size, other bytes
    with pytest.raises(SystemExit, match="sha256 .* split again"):
        rm.join(tmp_path / "parts", man, tmp_path / "j3.gguf")
    assert not (tmp_path / "j3.gguf").exists() and not (tmp_path / "j3.gguf.tmp").exists()


def test_compare_reports_first_difference_and_margin():
    rec = {"name": "p", "ref": [1, 2, 3, 4], "cpu": [1, 2, 9, 9], "ref_margin": [0.5, 0.4, 0.01, 0.3]}
    assert rm.compare([1, 2, 3, 4], rec) == {"name": "p", "same_as_ref": True, "same_as_cpu": False,
                                             "first_diff_cpu": 2}
    assert rm.compare([1, 2, 9, 9], rec) == {"name": "p", "same_as_ref": False, "first_diff_ref": 2,
                                             "same_as_cpu": True, "ref_margin_at_diff": 0.01}
    assert rm.first_diff([1, 2], [1, 2, 3]) == 2 and rm.first_diff([1], [1]) is None


def test_record_and_check_on_a_tiny_model(tiny_models, tmp_path):
    path = tiny_models["llama"]
    items = [("a", [1, 5, 9, 2]), ("b", [3, 3, 7])]
    rec = rm.expected(path, 6, items)
    assert [p["ids"] for p in rec["prompts"]] == [ids for _, ids in items]
    assert all(len(p["ref"]) == 6 and len(p["ref_margin"]) == 6 and min(p["ref_margin"]) >= 0
               for p in rec["prompts"])
    res = rm.check(path, rec, "ref")
    assert res["same_as_ref"] == 2 and res["runner"] == "Model"
    res = rm.check(path, rec, "cpu")
    assert res["same_as_cpu"] == 2
    bad = dict(rec, sha256="0" * 64)
    with pytest.raises(SystemExit, match="not the file the record was made from"):
        rm.check(path, bad, "ref")


def test_committed_record_matches_the_default_model(smollm2_path):
    """bench/gpu_expected.json is the device check's truth: made from this file, and the cpu backend still gives
    its cpu replies (regenerate with `python -m engine.bench.real_model expected` when either changes), on a host
    of the instruction set it was made on (the record from before cpu_isa was kept came from an AVX2 host)."""
    from engine.backends.cpu.target import isa
    rec = json.loads(rm.EXPECTED.read_text())
    assert rec["sha256"] == rm.sha256_file(Path(smollm2_path))
    if rec.get("cpu_isa", "avx2") != isa():
        pytest.skip(f"the record's cpu replies come from an {rec.get('cpu_isa', 'avx2')} host, this one is {isa()}")
    res = rm.check(Path(smollm2_path), rec, "cpu")
    assert res["same_as_cpu"] == res["n_prompts"] == len(rec["prompts"]) >= 6


NCU_CSV = '''==PROF== Connected to process 4242 (/usr/bin/python3.12)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3","127.0.0.1","cudapy::engine::backends::cuda::quant::matmul_q4[abi:v1,cw51cXTLSUwv1sDUaKthqqNgqKmjgOR3W3CwAkMXLaJtQYkOIgxJU0gCqOkEJoHkbttqdVhoqlspQGNFHSgJ5BnXagIA](Array<float, (int)2, C, mutable, aligned>)","1","7","(32, 4, 1)","(144, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","3,000"
"1","4242","python3","127.0.0.1","_ZN6cudapy6engine8backends4cuda3ops7rmsnormB2v1E5ArrayIfLi2E1C7mutable7alignedE","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","1,000"
"2","4242","python3","127.0.0.1","cudapy::engine::backends::cuda::quant::matmul_q4[abi:v1,x](Array<float, (int)2, C, mutable, aligned>)","1","7","(32, 4, 1)","(144, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","5"
==PROF== Disconnected from process 4242
'''


def test_ncu_summary_groups_kernels_by_name():
    res = rm.ncu_summary(NCU_CSV)
    assert res["us_per_step"] == 9.0 and res["launches_per_step"] == 3
    assert res["kernels"]["matmul_q4"] == {"launches": 2, "us": 8.0, "mean_us": 4.0, "share": 0.889}
    assert res["kernels"]["rmsnorm"]["us"] == 1.0
    assert list(res["kernels"]) == ["matmul_q4", "rmsnorm"]
    assert rm.ncu_summary("no kernels were profiled") == {"us_per_step": 0.0, "launches_per_step": 0, "kernels": {}}
