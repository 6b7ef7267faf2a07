"""Long subprocess checks that start with the session, on the core the main pytest process leaves idle.

The main process is mostly single-threaded (numba compiles, TUI pilots, numpy on small shapes), and a few
checks are whole subprocesses that spend a minute or more on one core: the CUDA simulator workers, the
generic-kernel runs with their own cold numba cache. A module lists its jobs in `BACKGROUND` (functions that
return a `Job`); conftest.py queues the jobs of every collected module when collection ends, and one thread
runs them one at a time. A test asks for its job with `result(job)`: it waits for a running one, and a job
that was never queued (a single test file run) or has not started yet runs at once in the asking thread.

    def _worker_job():
        return background.Job("cuda-kernels", [sys.executable, __file__, "--worker"], env=..., timeout=600)
    BACKGROUND = [_worker_job]
    ...
    proc = background.result(_worker_job())   # a subprocess.CompletedProcess
    verdicts = background.result_json(_worker_job(), "cuda worker")   # or its last stdout line's JSON
"""
from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Job:
    key: str
    argv: list[str]
    env: dict | None = None
    timeout: float = 900
    cwd: Path = ROOT
    cleanup: list[Path] = field(default_factory=list)  # folders removed once the job has run
    started: bool = False
    proc: subprocess.CompletedProcess | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    # (the session's timeline, printed at its end: when the job ran, and how long tests waited for it)
    began: float | None = None
    seconds: float = 0.0
    waited: float = 0.0
    in_test: bool = False  # run by the asking test, not the background thread

    def run(self) -> None:
        self.began = time.perf_counter()
        try:
            self.proc = subprocess.run(self.argv, env=self.env, cwd=self.cwd, capture_output=True, text=True,
                                       timeout=self.timeout)
        except BaseException as e:  # a timeout, or the interpreter missing: the test reports it
            self.error = e
        finally:
            for d in self.cleanup:
                shutil.rmtree(d, ignore_errors=True)
            self.seconds = time.perf_counter() - self.began
            self.done.set()


_lock = threading.Lock()
_t0 = time.perf_counter()
_jobs: dict[str, Job] = {}
_queue: list[Job] = []
_thread: threading.Thread | None = None


def _known(job: Job) -> Job:
    """The job registered under job.key (job itself if none was; call with _lock held). Another command under
    the same key is an error: its asker would get that job's results (a slow test once got the default cases'
    verdicts of the same worker script)."""
    have = _jobs.setdefault(job.key, job)
    if have.argv != job.argv:
        raise ValueError(f"background job key {job.key!r} names two commands: {have.argv[2:]} and {job.argv[2:]}")
    return have


def _claim(job: Job) -> bool:
    with _lock:
        if job.started:
            return False
        job.started = True
        return True


def _drain() -> None:
    global _thread
    while True:
        with _lock:
            job = next((j for j in _queue if not j.started), None)
            if job is None:
                _thread = None
                return
            job.started = True
        job.run()


def start(jobs: list[Job]) -> None:
    """Queue `jobs` (a key already known is kept as it is) and start the runner thread if it is idle."""
    global _thread
    with _lock:
        for job in jobs:
            fresh = job.key not in _jobs
            _known(job)
            if fresh:
                _queue.append(job)
        if _thread is None:
            _thread = threading.Thread(target=_drain, name="background-checks", daemon=True)
            _thread.start()


def python_job(key: str, script: str, env: dict, timeout: float = 900, cold_numba: bool = False) -> Job:
    """`python -c script` with `env` over this environment and tests/engine on its path; `cold_numba`: a numba
    cache folder of its own (made by numba, removed after the run), so every kernel compiles afresh."""
    import os
    import sys
    import tempfile
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'engine'}", **env)
    cleanup = []
    if cold_numba:
        cache = Path(tempfile.gettempdir()) / f"ninfer-{key.replace(':', '-')}-{os.getpid()}"
        env["NUMBA_CACHE_DIR"] = str(cache)
        cleanup.append(cache)
    return Job(key, [sys.executable, "-c", script], env=env, timeout=timeout, cleanup=cleanup)


def result(job: Job) -> subprocess.CompletedProcess:
    """The finished process of `job` (or of the queued job with its key)."""
    with _lock:
        job = _known(job)
    if _claim(job):
        job.in_test = True
        job.run()
    t = time.perf_counter()
    job.done.wait()
    job.waited += time.perf_counter() - t
    if job.error is not None:
        raise job.error
    return job.proc


def result_json(job: Job, what: str = "check"):
    """The JSON a check prints as its last line of output, from the finished process of `job` (result());
    a process that failed fails the asking test with its stderr's end, `what` naming the check."""
    return process_json(result(job), what)


def process_json(proc: subprocess.CompletedProcess, what: str = "check"):
    """The JSON on the last line of a finished check's stdout; its return code 0 asserted first."""
    import json
    assert proc.returncode == 0, f"{what} failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def timeline() -> list[str]:
    """One line per job that ran: when it started (seconds into the session), how long it ran, where, and how
    long tests waited for it (conftest.py prints these at the session's end: what the second core did)."""
    rows = sorted((j for j in _jobs.values() if j.began is not None), key=lambda j: j.began)
    return [f"{j.key}: started at {j.began - _t0:.0f} s, ran {j.seconds:.0f} s "
            f"{'in the asking test' if j.in_test else 'in the background'}, tests waited {j.waited:.0f} s"
            for j in rows]
