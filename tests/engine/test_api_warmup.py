"""Engine.load's warm start: the fused step is already loaded from numba's cache, so no scratch steps run
(engine.backends.cpu.warm_up), and numba's cache loads skip the context refresh (numba_env.lazy_cache_refresh);
replies are token-for-token those of a load that ran the scratch steps / the full refresh."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as QT

from engine.config import EngineArgs, GenerateRequest, SamplingParams

ALL_Q4 = dict(attn_q=QT.Q4_1, attn_k=QT.Q4_1, attn_v=QT.Q4_0, attn_output=QT.Q4_1, ffn_gate=QT.Q4_0,
              ffn_up=QT.Q4_1, ffn_down=[QT.Q4_1])
MSGS = [{"role": "user", "content": "Count from 1 to 30."}]


@pytest.fixture(scope="module")
def q4_path(tmp_path_factory, make_tiny):
    return make_tiny(tmp_path_factory.mktemp("q4warm") / "tiny-q4.gguf", "llama", seed=3, qtypes=ALL_Q4)


def _load_counting(path, monkeypatch, **env):
    """Engine.load with the cpu runner's forward counted; env: variables set for the load only."""
    from engine.api import Engine
    from engine.backends.cpu.runner import CpuRunner
    calls = []
    orig = CpuRunner.forward

    def counted(self, *a, **k):
        calls.append(a[0].shape[0])
        return orig(self, *a, **k)

    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        m.setattr(CpuRunner, "forward", counted)
        eng = Engine.load(EngineArgs(model=str(path), max_context=256))
    return eng, calls


def _tokens(eng):
    from engine.events import FinalStats
    evs = list(eng.session().generate(MSGS, GenerateRequest(SamplingParams(greedy=True, max_new=12))))
    return [e for e in evs if isinstance(e, FinalStats)][0].token_ids


def test_warm_start_runs_no_scratch_steps_and_replies_the_same(q4_path, monkeypatch):
    from engine.backends.cpu.step import FusedForward
    # the old way: the fused step compiled (or loaded) here, then the two scratch steps
    old, old_calls = _load_counting(q4_path, monkeypatch, NINFER_COMPILE_BG="0")
    assert old_calls == [2, 1]
    eng, calls = _load_counting(q4_path, monkeypatch)  # now loaded in this process: a warm start
    assert calls == [] and type(eng.model.step) is FusedForward
    assert _tokens(eng) == _tokens(old)


def test_scratch_steps_run_while_the_fused_step_is_not_loaded(q4_path, monkeypatch):
    import engine.backends.cpu
    monkeypatch.setattr(engine.backends.cpu, "fused_loaded", lambda ff, kv_dtype: False)
    _, calls = _load_counting(q4_path, monkeypatch)
    assert calls == [2, 1]


_LOAD_AND_REPLY = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numba.core.base as base
calls = []
orig = base.BaseContext.refresh
base.BaseContext.refresh = lambda self: (calls.append(1), orig(self))[1]
from engine.api import Engine
from engine.config import EngineArgs, GenerateRequest, SamplingParams
from engine.events import FinalStats
eng = Engine.load(EngineArgs(model=sys.argv[2], max_context=256))
n_load = len(calls)
req = GenerateRequest(SamplingParams(greedy=True, max_new=12))
fs = [e for e in eng.session().generate([{"role": "user", "content": "Count from 1 to 30."}], req)
      if isinstance(e, FinalStats)][0]
print(json.dumps({"tokens": list(fs.token_ids), "refreshes_in_load": n_load}))
"""


def test_lazy_numba_refresh_replies_the_same(q4_path, monkeypatch):
    """Fresh processes (the refresh happens once per process): lazy and full refresh, same tokens; the lazy
    warm load refreshes nothing."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = str(Path(__file__).resolve().parents[2])
    _load_counting(q4_path, monkeypatch, NINFER_COMPILE_BG="0")  # the fused step in the numba cache

    def run(full):
        env = dict(os.environ, NINFER_NUMBA_FULL_REFRESH="1" if full else "0")
        out = subprocess.run([sys.executable, "-c", _LOAD_AND_REPLY, root, str(q4_path)], env=env,
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    lazy, full = run(False), run(True)
    assert lazy["tokens"] == full["tokens"]
    assert lazy["refreshes_in_load"] == 0 and full["refreshes_in_load"] > 0
