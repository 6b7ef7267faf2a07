"""Which test pays which numba compile: a pytest plugin that maps a run's compiles to the tests they ran in.

    PYTHONPATH=probes NINFER_CACHE_DIR=$(mktemp -d) .venv/bin/python -m pytest -p compile_map [pytest args]
    PYTHONPATH=probes .venv/bin/python probes/compile_map.py /tmp/compile_map.json [--top 40]   # read it again

Every real compile (numba's "numba:compile" event: not a load from the on-disk cache) is timed, nested
compiles apart (a function's own seconds exclude the callees compiled inside it), and charged to the test
running when it happened. At the session's end: the tests by compile seconds, the functions by their own
seconds with the test that paid them, and the functions compiled for more than one signature; the whole map
goes to COMPILE_MAP_OUT (default /tmp/compile_map.json). What CI's time is made of on an empty cache, so that
moving a test behind the slow marker is known to take its compile with it (another test may pay it next).
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict

_test = ["(collection)"]
_stack: list[list] = []  # [start, name, child seconds, signature]
_rows: list[dict] = []


def _name(ev) -> str:
    d = ev.data.get("dispatcher")
    py = getattr(d, "py_func", None)
    return f"{py.__module__}.{py.__qualname__}" if py is not None else str(d)


def _listener():
    from numba.core import event

    class Compiles(event.Listener):
        def on_start(self, ev):
            _stack.append([time.perf_counter(), _name(ev), 0.0, str(ev.data.get("args"))[:160]])

        def on_end(self, ev):
            t0, name, child, sig = _stack.pop()
            total = time.perf_counter() - t0
            if _stack:
                _stack[-1][2] += total
            _rows.append(dict(test=_test[0], name=name, sig=sig, own=total - child, total=total))
    return Compiles()


def pytest_configure(config):
    from numba.core import event
    event.register("numba:compile", _listener())


def pytest_runtest_setup(item):
    _test[0] = item.nodeid


def report(rows: list[dict], top: int = 40, out=sys.stdout) -> None:
    per_test = defaultdict(float)
    for r in rows:
        per_test[r["test"]] += r["own"]
    print(f"\n== compile seconds by test ({sum(per_test.values()):.0f} s in all) ==", file=out)
    for t, s in sorted(per_test.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{s:8.1f}  {t}", file=out)
    print("\n== functions by their own compile seconds (the test that paid) ==", file=out)
    for r in sorted(rows, key=lambda r: -r["own"])[:top]:
        print(f"{r['own']:8.1f}  {r['name']}  [{r['test']}]", file=out)
    sigs = defaultdict(list)
    for r in rows:
        sigs[r["name"]].append(r)
    many = sorted(((n, rs) for n, rs in sigs.items() if len(rs) > 1), key=lambda nr: -sum(r["own"] for r in nr[1]))
    print("\n== compiled for more than one signature ==", file=out)
    for n, rs in many[:top]:
        print(f"{sum(r['own'] for r in rs):8.1f}  {n} x{len(rs)}  tests: "
              f"{', '.join(sorted({r['test'].split('::')[0] for r in rs}))}", file=out)


def pytest_sessionfinish(session):
    path = os.environ.get("COMPILE_MAP_OUT", "/tmp/compile_map.json")
    with open(path, "w") as f:
        json.dump(_rows, f)
    report(_rows)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description="print a saved compile map")
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    with open(a.path) as f:
        report(json.load(f), a.top)
