"""numba_env: stale flag-keyed cache dirs are pruned, the one in use and recent ones are kept."""
import os
import time

from engine import numba_env


def _dir(root, name, age_days):
    d = root / name
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "f.nbi").write_bytes(b"x")
    t = time.time() - age_days * 86400
    os.utime(d, (t, t))
    return d


def test_prune_removes_only_stale_siblings(tmp_path):
    current = _dir(tmp_path, "numba-current", 400)  # old mtime, but in use: kept and refreshed
    old = _dir(tmp_path, "numba-old", 31)
    recent = _dir(tmp_path, "numba-recent", 2)
    other = _dir(tmp_path, "tokenizer-old", 400)  # not a numba dir: none of our business
    removed = numba_env.prune_stale(tmp_path, current)
    assert removed == [old]
    assert not old.exists()
    assert current.exists() and recent.exists() and other.exists()
    assert time.time() - current.stat().st_mtime < 60


def test_prune_survives_a_missing_root(tmp_path):
    assert numba_env.prune_stale(tmp_path / "absent", tmp_path / "absent" / "numba-x") == []


_LAZY_PROBE = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
import engine.numba_env as ne
import numba.core.base as base
calls = []
orig = base.BaseContext.refresh
base.BaseContext.refresh = lambda self: (calls.append(1), orig(self))[1]
print("lazy", ne.lazy_cache_refresh())
elf, elf_sets = ne._elf_defined_symbols, []
ne._elf_defined_symbols = lambda obj: (elf_sets.append(elf(obj)), elf_sets[-1])[1]
import probe_mod
print("sum", probe_mod.total(3))
n = len(calls)
print("hash", probe_mod.text_hash("abc") == hash("abc"))
print("refreshed", n > 0, len(calls) > n)
from numba import njit
print("fresh", njit(lambda x: x + 1)(41))
import llvmlite.binding as ll
lib = probe_mod.total.overloads[probe_mod.total.signatures[0]].library
pending = lib.__dict__.get("_lazy_bitcode")
print("pending", pending is not None)
if pending is not None:
    mod = ll.parse_bitcode(pending)
    want = {g.name for gs in (mod.functions, mod.global_variables) for g in gs if not g.is_declaration}
    print("symbols", want in elf_sets, len(want) > 0)
print("linked", njit(lambda n: probe_mod.total(n) * 2)(3), "_lazy_bitcode" not in lib.__dict__)
"""


def test_lazy_cache_refresh_loads_without_refresh_and_still_refreshes_when_needed(tmp_path):
    """A cached function loads without numba's context refresh; one that hashes strings (needs the hash
    secret symbols) gets the refresh; a new function still compiles (its compiler refreshes); the loaded
    library's bitcode is parsed only when a new function links against it (_lazy_linking_module)."""
    import subprocess
    import sys
    from pathlib import Path
    (tmp_path / "probe_mod.py").write_text(
        "from numba import njit\n"
        "@njit(cache=True)\ndef total(n):\n    s = 0\n    for i in range(n + 1):\n        s += i\n    return s\n"
        "@njit(cache=True)\ndef text_hash(s):\n    return hash(s)\n")
    (tmp_path / "probe.py").write_text(_LAZY_PROBE)
    env = dict(__import__("os").environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path),
               PYTHONHASHSEED="7")
    root = str(Path(__file__).resolve().parents[2])
    run = lambda: subprocess.run([sys.executable, str(tmp_path / "probe.py"), root], env=env, cwd=tmp_path,
                                 capture_output=True, text=True, check=True).stdout.split("\n")
    cold = run()  # compiles and caches both (compiling refreshes)
    assert cold[:4] == ["lazy True", "sum 6", "hash True", "refreshed True True"]
    assert cold[5:7] == ["pending False", "linked 12 True"]
    warm = run()  # loads both: `total` without a refresh, `text_hash` with one
    assert warm[:5] == ["lazy True", "sum 6", "hash True", "refreshed False True", "fresh 42"]
    # loaded from the cache: its module for linking not parsed, its symbols from the ELF object the same as
    # the module's; a new function that calls it links it (parsed then) and runs
    assert warm[5:8] == ["pending True", "symbols True True", "linked 12 True"]


def test_elf_symbols_only_from_whole_elf_objects():
    """Not ELF (another platform's object code) or cut short: None, and numba's own way is taken."""
    assert numba_env._elf_defined_symbols(b"\xcf\xfa\xed\xfe not an ELF object") is None
    assert numba_env._elf_defined_symbols(b"\x7fELF\x02\x01\x01" + bytes(20)) is None
