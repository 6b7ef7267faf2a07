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
