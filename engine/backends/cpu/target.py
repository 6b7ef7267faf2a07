"""What the CPU numba compiles for can do: the kernels pick their instructions by it."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def _host_cpu_features() -> dict:
    import llvmlite.binding as ll
    try:
        return dict(ll.get_host_cpu_features())
    except (RuntimeError, AttributeError):
        return {}


def target_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with this feature (host CPU unless NUMBA_CPU_NAME says otherwise)."""
    from numba.core import config
    if config.CPU_NAME and config.CPU_NAME != "host":
        return f"+{feature}" in (config.CPU_FEATURES or "")
    return bool(_host_cpu_features().get(feature))


def isa() -> str:
    """The instruction-set class the kernels compile for, as far as it changes their float results:
    'avx512-vnni' (attention's scores in 16 lanes, the int8 cache's scores in integer dot products),
    'avx512' (16 lanes only), 'avx2' or 'generic'. Recorded outputs (tests/engine/golden,
    bench/gpu_expected.json) are kept per class."""
    if target_has("avx512f"):
        return "avx512-vnni" if target_has("avx512vnni") and target_has("avx512bw") else "avx512"
    return "avx2" if target_has("avx2") else "generic"
