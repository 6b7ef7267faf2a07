"""GPU telemetry through nvidia-ml-py (pynvml), read about once a second for the live panel.

Every metric is read on its own and a failing one (NVMLError: not supported on this board, permission) is
reported as None instead of hiding the others. Without a driver/GPU, `GpuTelemetry.available` is False and
`reason` says why, so the panel can show a clear "no GPU" state.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# Throttle-reason bits (nvmlClocksThrottleReason*/nvmlClocksEventReason*) -> short names for the panel.
_THROTTLE_BITS = {
    0x1: "idle", 0x2: "app-clock", 0x4: "sw-power", 0x8: "hw-slowdown", 0x10: "sync-boost",
    0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display-clock",
}


@dataclass
class GpuSample:
    index: int
    name: str = "?"
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temp_c: int | None = None
    mem_used_gib: float | None = None
    mem_total_gib: float | None = None
    util_pct: int | None = None
    throttle: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        def f(v, fmt="{}"):
            return "n/a" if v is None else fmt.format(v)
        thr = ", ".join(self.throttle) if self.throttle else "none"
        return [
            f"GPU{self.index} {self.name}",
            f"  SM clock {f(self.sm_clock_mhz)}/{f(self.sm_clock_max_mhz)} MHz  util {f(self.util_pct)}%",
            f"  power {f(self.power_w, '{:.0f}')}/{f(self.power_limit_w, '{:.0f}')} W  temp {f(self.temp_c)} C",
            f"  memory {f(self.mem_used_gib, '{:.1f}')}/{f(self.mem_total_gib, '{:.1f}')} GiB",
            f"  throttle: {thr}",
        ]


class GpuTelemetry:
    """Lazy NVML session. `sample()` never raises."""

    def __init__(self):
        self.available = False
        self.reason = ""
        self._nv = None
        self._handles: list = []
        try:
            import pynvml
        except ImportError:
            self.reason = "nvidia-ml-py is not installed"
            return
        try:
            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
        except pynvml.NVMLError as e:
            self.reason = f"no NVIDIA driver/GPU ({e})"
            return
        if not self._handles:
            self.reason = "NVML reports no GPU"
            return
        self._nv = pynvml
        self.available = True

    def _read(self, fn, *args):
        try:
            return fn(*args)
        except self._nv.NVMLError:
            return None

    def sample(self) -> list[GpuSample]:
        if not self.available:
            return []
        nv, out = self._nv, []
        for i, h in enumerate(self._handles):
            s = GpuSample(i)
            name = self._read(nv.nvmlDeviceGetName, h)
            s.name = name.decode() if isinstance(name, bytes) else (name or "?")
            s.sm_clock_mhz = self._read(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
            s.sm_clock_max_mhz = self._read(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)
            p = self._read(nv.nvmlDeviceGetPowerUsage, h)
            s.power_w = None if p is None else p / 1000.0
            lim = self._read(nv.nvmlDeviceGetEnforcedPowerLimit, h)
            s.power_limit_w = None if lim is None else lim / 1000.0
            s.temp_c = self._read(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            mem = self._read(nv.nvmlDeviceGetMemoryInfo, h)
            if mem is not None:
                s.mem_used_gib, s.mem_total_gib = mem.used / 2**30, mem.total / 2**30
            util = self._read(nv.nvmlDeviceGetUtilizationRates, h)
            s.util_pct = None if util is None else util.gpu
            get_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                getattr(nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
            bits = self._read(get_reasons, h) if get_reasons else None
            if bits:
                s.throttle = [name for bit, name in _THROTTLE_BITS.items() if bits & bit]
            out.append(s)
        return out

    def close(self) -> None:
        if self.available:
            try:
                self._nv.nvmlShutdown()
            except self._nv.NVMLError:
                pass
            self.available = False
