"""The fused CPU step compiled once, at the session's start, beside the tests (tests/background.py's lane
"precompile").

The fused step (engine/backends/cpu/step.py) is the longest compile of a cold run: ~170 s for the f16 cache
and ~100 s more for the int8 one on a 2-core CI machine. Its argument types are those of the default model
(SmolLM2: Q4_1 matrices, a Q8_0 embedding), which the tiny Q4 models of the tests share (Q4_0 and Q4_1 take
one layout), so one compile serves every test and every compile helper of the run: without this job a
test compiled it in the pytest process while an engine's helper (engine/backends/cpu/compile_bg.py) compiled
the same one beside it. The job loads the default model with each cache type and no helper
(NINFER_COMPILE_BG=0), holding the helpers' "fused" lock, so a helper started meanwhile waits and then loads
it from numba's cache. Modules that would compile it in the pytest process first set
`AFTER_PRECOMPILE = True`: conftest.py runs them last, each test after this job has finished."""
from __future__ import annotations

import background

SCRIPT = r"""
from engine import numba_env  # noqa: F401  (flags and the cache dir before numba)
from numba.core import config
from engine.backends.cpu import compile_bg
from engine.api import Engine
from engine.config import EngineArgs
from engine.paths import default_model_path
path = default_model_path()
if path is not None:
    compile_bg.install_cache_lock()
    with compile_bg._holding(compile_bg.phase_locks(config.CACHE_DIR).get("fused")):
        for kv in ("f16", "int8"):
            Engine.load(EngineArgs(model=str(path), max_context=256, kv_dtype=kv))
print("precompiled" if path is not None else "no default model")
"""


def job() -> background.Job:
    return background.python_job("precompile:fused-step", SCRIPT, {"NINFER_COMPILE_BG": "0"}, timeout=1200,
                                 lane="precompile")


def wait() -> None:
    """Until the job has run (at once, in this thread, where it was never queued)."""
    p = background.result(job())
    assert p.returncode == 0, p.stderr[-3000:]
