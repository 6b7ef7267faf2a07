"""On a machine with an NVIDIA GPU: telemetry reads real values and the live panel shows them (marker gpu)."""
from __future__ import annotations

import pytest

from ninfer_tui.telemetry import GpuTelemetry

from tui_helpers import ready

pytestmark = pytest.mark.gpu


def test_telemetry_reads_real_values():
    tel = GpuTelemetry()
    assert tel.available, tel.reason
    s = tel.sample()[0]
    print("\n".join(s.lines()))
    assert s.name != "?" and s.sm_clock_max_mhz and s.mem_total_gib and s.mem_total_gib > 1
    assert s.power_limit_w and s.temp_c is not None
    tel.close()


@pytest.mark.anyio
async def test_panel_shows_gpu(make_app):
    app = make_app(telemetry=GpuTelemetry())
    async with app.run_test(size=(130, 45)) as pilot:
        await ready(pilot)
        app._poll_gpu()
        await pilot.pause()
        text = str(app.query_one("#gpu").render())
        print(text)
        assert "GPU0" in text and "SM clock" in text and "no GPU" not in text
