"""First start (empty numba cache): compile the fast CPU step with a helper process, serve meanwhile.

    python -m engine.backends.cpu.compile_bg          # the helper; reads its job from stdin (see `Helper`)

Why a process: numba compiles with the GIL held and on one core; this machine class has two. The engine
compiles half of the step's kernels while the helper compiles the other half, then runs the step as those
kernels called one by one (backends/cpu/tier.py, bit-identical). The helper goes on to compile the
one-call fused step, whose kernels are now all in the cache, and the engine switches to it between two
steps.

Protocol (one line each on the helper's stdout): "leaves" when its kernels are in the cache, then it waits
for "go" on stdin, compiles the fused step and prints "fused". Any other end is a failure: the engine
keeps the kernel-by-kernel step and says so once. An engine that exits during its own load ends the helper
(atexit; a helper whose engine died reads end of file at "go" and exits); after "go" the helper finishes
the fused step alone and exits (a one-shot `ninfer --prompt` run leaves a warm cache for the next start).
numba writes a cache entry's data file and index each by atomic rename, so a killed helper leaves no half
entry; `install_cache_lock` also serializes the index read-modify-write across processes (two writers
could otherwise give two signatures one data file).

One helper at a time per cache dir and phase (`phase_locks`): a helper started while another one compiles
(a second start within the minutes a cold first start's helper needs) waits for it, then loads what it
cached instead of compiling the same functions beside it on the same two cores.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger("ninfer.compile")
_lock_installed = False


def install_cache_lock() -> None:
    """Serialize numba's cache writes (index + data file) with an flock on the cache directory."""
    global _lock_installed
    if _lock_installed:
        return
    import fcntl

    from numba.core import caching

    orig = caching.IndexDataCacheFile.save

    def save(self, key, data):
        path = os.path.join(self._cache_path, ".ninfer-write.lock")
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError:  # unwritable cache dir: numba reports that itself
            return orig(self, key, data)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            return orig(self, key, data)
        finally:
            os.close(fd)

    caching.IndexDataCacheFile.save = save
    _lock_installed = True


def load_cached(disp, sig):
    """The entry point of `disp` for `sig` if it is compiled or in numba's on-disk cache, else None
    (never compiles). Mirrors the cache branch of numba's Dispatcher.compile."""
    from numba.core.compiler_lock import global_compiler_lock
    with global_compiler_lock:
        existing = disp.overloads.get(tuple(sig))
        if existing is not None:
            return existing.entry_point
        cres = disp._cache.load_overload(sig, disp.targetctx)
        if cres is None:
            return None
        if not cres.objectmode:
            disp.targetctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
        disp.add_overload(cres)
        return cres.entry_point


def _ref(disp) -> tuple[str, str]:
    return disp.py_func.__module__, disp.py_func.__name__


def _resolve(ref):
    import importlib
    return getattr(importlib.import_module(ref[0]), ref[1])


class Helper:
    """The engine's handle on one helper process. `leaves_done`/`fused_done` are threading.Events set as
    its lines arrive; `failure` is set (a short reason) when it ended any other way."""

    def __init__(self, leaves: list, fused: list, argv: list[str] | None = None):
        """leaves, fused: [(dispatcher, signature)] to compile, in that order."""
        self.leaves_done = threading.Event()
        self.fused_done = threading.Event()
        self.ended = threading.Event()
        self.failure: str | None = None
        self._err = tempfile.TemporaryFile()
        job = pickle.dumps({"leaves": [(_ref(d), s) for d, s in leaves], "fused": [(_ref(d), s) for d, s in fused]})
        argv = argv or [sys.executable, "-m", "engine.backends.cpu.compile_bg"]
        env = dict(os.environ, NINFER_COMPILE_HELPER="1")
        root = str(Path(__file__).resolve().parents[3])  # the directory holding the engine package
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err,
                                         env=env, cwd=root, start_new_session=True)
            self.proc.stdin.write(job)
            self.proc.stdin.flush()
        except OSError as e:
            self.proc = None
            self._fail(f"could not start it ({e})")
            return
        threading.Thread(target=self._read, name="ninfer-compile-helper", daemon=True).start()
        self._go_sent = False
        atexit.register(self._at_exit)

    def _fail(self, why: str) -> None:
        if self.failure is None and not self.fused_done.is_set():
            self.failure = why
        self.ended.set()
        self.leaves_done.set()  # nobody waits for a helper that is gone

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line == "leaves":
                self.leaves_done.set()
            elif line == "fused":
                self.fused_done.set()
        rc = self.proc.wait()
        tail = ""
        with contextlib.suppress(OSError):
            self._err.seek(0)
            lines = self._err.read().decode(errors="replace").strip().splitlines()
            tail = lines[-1] if lines else ""
        self._fail(f"it exited with status {rc}" + (f": {tail}" if tail else ""))

    def go(self) -> None:
        """Let the helper compile the fused step (its kernels are all in the cache by now)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write(b"go\n")
                self.proc.stdin.flush()
                self._go_sent = True

    def _at_exit(self) -> None:
        if not self._go_sent:  # still compiling kernels for an engine that is gone
            self.stop()

    def stop(self) -> None:
        """End the helper now."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


PHASES = ("leaves", "fused")


def phase_lock_path(cache_dir: str, phase: str) -> str:
    return os.path.join(cache_dir, f".ninfer-helper-{phase}.lock")


def phase_locks(cache_dir: str) -> dict[str, int]:
    """Open (creating) the lock file of each phase in the numba cache dir: {phase: fd}; {} if it cannot be
    written (then helpers do not wait for each other). Opened at once: a later open could recreate a cache
    dir that a benchmark's cold run removed meanwhile."""
    fds: dict[str, int] = {}
    try:
        os.makedirs(cache_dir, exist_ok=True)
        for phase in PHASES:
            fds[phase] = os.open(phase_lock_path(cache_dir, phase), os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        for fd in fds.values():
            os.close(fd)
        return {}
    return fds


@contextlib.contextmanager
def _holding(fd: int | None):
    """An exclusive flock on fd while the block runs (released when the process dies, too)."""
    if fd is None:
        yield
        return
    import fcntl
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def main() -> int:
    """The helper process: compile the job's kernels, report, wait, compile the fused step, report."""
    from ... import numba_env  # noqa: F401  (flags and cache dir before numba)
    from numba.core import config
    job = pickle.load(sys.stdin.buffer)
    install_cache_lock()
    _keep_removed_cache_removed()
    locks = phase_locks(config.CACHE_DIR)
    with _holding(locks.get("leaves")):  # compile() loads what another helper cached meanwhile
        for ref, sig in job["leaves"]:
            _resolve(ref).compile(sig)
    _say("leaves")
    if not sys.stdin.buffer.readline():  # end of file: the engine is gone
        return 0
    with _holding(locks.get("fused")):
        for ref, sig in job["fused"]:
            _resolve(ref).compile(sig)
    _say("fused")
    return 0


def _keep_removed_cache_removed() -> None:
    """A helper finishing after its engine exited must not recreate a cache dir someone removed meanwhile
    (a benchmark's cold run deletes its NINFER_CACHE_DIR; numba would make it again at save). Nor go on
    compiling for it: a watchdog ends the process once the dir is gone (a cold run's helper otherwise
    compiled the fused step for minutes into the next runs' measurements)."""
    root = os.environ.get("NINFER_CACHE_DIR")
    if not root:
        return

    def watch():
        while os.path.isdir(root):
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, name="ninfer-cache-watch", daemon=True).start()
    from numba.core import caching
    orig = caching.Cache.save_overload

    def save_overload(self, sig, data):
        if os.path.isdir(root):
            orig(self, sig, data)

    caching.Cache.save_overload = save_overload


def _say(line: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # the engine may be gone: the cache is what matters
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
