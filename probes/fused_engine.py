"""What the fused decode step's probes share (step_phases, stream_ceiling, lanes_ab): the engine
as they load it (the default model, SmolLM2; two threads; prefix reuse off) and a cycle counter for stamps
inside jitted code (step_phases' instrumented copies of the step import it too)."""
from __future__ import annotations

import sys

from engine import numba_env  # noqa: F401  (flags before numba)

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def load_fused(q8_head: bool = False, model: str | None = None):
    """(engine, model (the file `model`, default SmolLM2), its FusedForward), or None after a line on stderr when the model has no fused step,
    numba runs fewer than two threads, or (q8_head) the head is not Q8_0."""
    import numba

    from engine.api import Engine
    from engine.config import EngineArgs
    eng = Engine.load(EngineArgs(model=model, threads=2, prefix_reuse=False))
    model, ff = eng.model, eng.model.step
    ff = getattr(ff, "ff", ff)  # a first start's TieredForward: its FusedForward (the probes call it directly)
    if ff is None or numba.get_num_threads() < 2 or (q8_head and ff.head[0] != 1):
        print("needs the fused step, two threads" + (" and a Q8_0 head (SmolLM2)" if q8_head else ""),
              file=sys.stderr)
        return None
    return eng, model, ff


@intrinsic
def cycles(typingctx):
    """The CPU's cycle counter (llvm.readcyclecounter: rdtsc on x86)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])
    return types.int64(), codegen
