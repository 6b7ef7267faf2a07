"""A non-editable install works: the wheel carries config.toml (engine/defaults.toml) and the themes
(ninfer_tui/builtin_themes), so `ninfer-chat` and `ninfer` start from a directory outside the checkout.

The package is installed into a fresh venv in a temp dir, without build isolation and without its
dependencies, which the new venv reads from this one's site-packages through a .pth file (no network)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "config.toml", "themes", "engine", "ninfer_tui")


def _run(cmd, cwd, env, timeout=120) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd} -> {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


def test_wheel_install_starts_outside_the_checkout(tmp_path, tiny_models):
    # A copy of what the package is built from (pip builds in the source tree: build/ and egg-info go there);
    # the links stay links, so the wheel must resolve them.
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(p, src / name)
    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                   check=True, timeout=60)
    py = venv / "bin" / "python"
    purelib = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path,
                        None).stdout.strip())
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (purelib / "ninfer_deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", NUMBA_NUM_THREADS="2",
               NINFER_CONFIG_DIR=str(tmp_path / "config"), NINFER_DATA_DIR=str(tmp_path / "data"))
    _run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
          "--ignore-installed", str(src)], tmp_path, env, timeout=300)

    away = tmp_path / "elsewhere"
    away.mkdir()
    r = _run([str(py), "-c", "import engine.paths as p, ninfer_tui.themes as t; print(p.__file__); "
              "print(p.DEFAULTS_FILE.is_symlink(), t.BUILTIN_THEMES.is_symlink()); "
              "print(sorted(x.name for x in t.load_themes()[0]))"], away, env)
    where, links, themes = r.stdout.splitlines()
    assert where.startswith(str(purelib)), where  # the installed copy, not the checkout
    assert links == "False False"  # files, not links back into a source tree
    assert {"ninfer-dark", "ninfer-light", "ninfer-high-contrast"} <= set(eval(themes))

    r = _run([str(venv / "bin" / "ninfer-chat"), "--help"], away, env)
    assert "usage: ninfer-chat" in r.stdout
    r = _run([str(venv / "bin" / "ninfer"), str(tiny_models["llama"]), "--prompt", "hi", "--backend", "ref",
              "--greedy", "--max-new", "3", "--max-context", "64"], away, env)
    assert "finish " in r.stderr and "output 3 tok" in r.stderr, r.stderr
