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
