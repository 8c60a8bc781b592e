"""Train the runs of a plan on this machine, `jobs` at a time, each an ordinary `train.py` subprocess.

    failures = run_plan(plan, jobs=2, train_script="train.py")

Resumable: a finished run is skipped, any other is launched with `--resume` (a fresh one starts, an interrupted
one continues from its last checkpoint: train.py's exact resume), so the same call after a kill finishes the job
with the numbers an uninterrupted one gives. Each run's output goes to `DIR/<arm>/seed_<seed>.log` (appended per
attempt), its exit status to `DIR/attempts.json`; a run that fails is reported and the others go on.

Threads: with `jobs` > 1, a run whose `train.cpu_threads` is 0 (torch's default: every core) gets
`train.cpu_threads = cores // jobs`, so that the jobs do not oversubscribe the CPU. The setting changes no
config that identifies the comparison (`uvic.compare.plan.NEUTRAL_KEYS`); on a CPU it may change the last bits
of a run's floats, so keep `--jobs` fixed within one comparison when bit-identical runs matter.

On Linux the children are killed with the parent (a kill -9 of `compare.py run` leaves no training behind that
would hold its run dir's lock when the command is run again).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tqdm.contrib.logging import logging_redirect_tqdm

from uvic.compare.plan import Plan, Run, shell_command
from uvic.compare.progress import Progress
from uvic.compare.rundirs import read_attempts, record_attempt, run_state
from uvic.errors import ConfigError, RunLockedError, StorageError, describe_os_error
from uvic.training.lock import RunDirLock


logger = logging.getLogger(__name__)

# Seconds a terminated child gets to exit before it is killed (when compare.py itself is stopped).
_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _die_with_parent_fn() -> Callable[[], None] | None:
    """A preexec function that has the child receive SIGTERM when this process dies (Linux), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child runs as little as possible
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


@dataclass
class _Job:
    run: Run
    process: subprocess.Popen
    log: IO[bytes]
    started: float


def run_plan(plan: Plan, *, jobs: int = 1, train_script: str = "train.py",
             launcher: Sequence[str] | None = None, progress: bool = True) -> list[Run]:
    """Train every run of `plan` that has not finished; returns the runs that failed.

    Args:
        jobs: runs trained at once (>= 1).
        train_script: the path of train.py.
        launcher: the argv prefix that starts train.py (e.g. ["accelerate", "launch"]); None: this Python
            (`Plan.command`).
        progress: show one aggregate progress bar on stderr (`uvic.compare.progress`); False: the log lines only.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    todo = pending_runs(plan)
    threads = max(1, _cores() // jobs)
    preexec = _die_with_parent_fn()
    running: list[_Job] = []
    failed: list[Run] = []
    done = 0
    total = len(todo)
    bar = Progress(plan, todo, enabled=progress)
    ended: list[Run] = []
    try:
        with logging_redirect_tqdm():  # log lines go above the progress bar, never onto it
            while todo or running:
                while todo and len(running) < jobs:
                    run = todo.pop(0)
                    extra = [f"train.cpu_threads={threads}"] if jobs > 1 and _threads(plan, run) == 0 else []
                    bar.started(run)
                    running.append(_start(run, plan.command(run, launcher, train_script, extra), preexec))
                    logger.info(f"[{done + len(running)}/{total}] {run.label}: training (log: {run.log_path})")
                    bar.update([j.run for j in running], ended, force=True)
                time.sleep(0.2)
                for job in [j for j in running if j.process.poll() is not None]:
                    running.remove(job)
                    done += 1
                    ended.append(job.run)
                    if not _finish(plan, job):
                        failed.append(job.run)
                bar.update([j.run for j in running], ended)
    finally:
        bar.close()
        _stop(running)
    return failed


def pending_runs(plan: Plan) -> list[Run]:
    """The runs of `plan` that have not finished, in plan order (finished ones are logged as skipped).

    Raises:
        ConfigError: a run dir holds a run of another config (trained by another command): it is never touched.
    """
    attempts = read_attempts(plan.out)
    todo = []
    for run in plan.runs:
        state = run_state(plan, run, attempts)
        if state.state == "finished":
            logger.info(f"{run.label}: finished, skipped")
        elif state.state == "mismatch":
            raise ConfigError(f"{run.run_dir}: {state.detail}; it is not overwritten: move it away, or choose "
                              f"another --out")
        else:
            _check_log_path(run)
            todo.append(run)
    return todo


def _check_log_path(run: Run) -> None:
    """Refuse a run whose log (`Run.log_path`, appended to by `compare.py run`) is a symlink: the output would be
    written wherever it points, outside the comparison directory.

    Raises:
        ConfigError: naming the log and where it points.
    """
    path = run.log_path
    if path.is_symlink():
        raise ConfigError(f"{path} is a symlink (to {os.readlink(path)}): the comparison writes its logs only inside "
                          f"--out; remove it")


def lock_comparison(out: Path) -> RunDirLock:
    """Take the lock of comparison directory `out` (`out/.lock`, flock'd, with this process's PID) for the life of
    a `compare.py run`: two of them on one `--out` would train the same runs into the same logs. Release it with
    `.release()`; a process that dies drops it.

    Raises:
        ConfigError: another process holds it (its PID is named); nothing is written.
        StorageError: `out` cannot be created or written.
    """
    lock = RunDirLock(out)
    try:
        lock.acquire()
    except RunLockedError:
        try:
            holder = lock.path.read_text().strip() or "unknown"
        except OSError:
            holder = "unknown"
        raise ConfigError(f"--out {out} is in use by another `compare.py run` (PID {holder}); wait for it to "
                          f"finish, or stop it (the same command continues it)") from None
    except StorageError as e:
        cause = e.__cause__
        why = describe_os_error(cause) if isinstance(cause, OSError) else str(e)
        raise StorageError(f"cannot write --out {out}: {why}") from None
    return lock


def _threads(plan: Plan, run: Run) -> int:
    return plan.configs[run.arm]["train"].get("cpu_threads", 0)


def _start(run: Run, argv: list[str], preexec: Callable[[], None] | None) -> _Job:
    path = run.log_path
    path.parent.mkdir(parents=True, exist_ok=True)
    # A killed attempt's output may end mid-line (a progress bar): the header of the next one starts a line.
    gap = b"\n" if path.is_file() and path.stat().st_size else b""
    log = open(path, "ab")
    log.write(gap + f"=== {time.strftime('%Y-%m-%d %H:%M:%S')}: {shell_command(argv)}\n".encode())
    log.flush()
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                               preexec_fn=preexec)
    return _Job(run, process, log, time.time())


def _finish(plan: Plan, job: _Job) -> bool:
    """Record the outcome of an ended job; returns whether its run finished."""
    job.log.close()
    code = job.process.returncode
    finished = run_state(plan, job.run, {}).state == "finished"
    error = "" if finished else _error_line(job.run.log_path)
    if code == 0 and not finished:
        error = f"train.py exited with status 0 but the run is not complete ({error})"
    exit_code = 0 if finished else (code or 1)
    record_attempt(plan.out, job.run, exit_code, error, str(job.run.log_path.relative_to(plan.out)))
    minutes = (time.time() - job.started) / 60
    if finished:
        logger.info(f"{job.run.label}: finished in {minutes:.1f} min")
    else:
        logger.error(f"{job.run.label}: failed (exit status {code}) after {minutes:.1f} min: {error}")
    return finished


def _error_line(log: Path, tail_bytes: int = 20_000) -> str:
    """The last `error:` line of the last attempt in a run's log (train.py's one-line errors), else its last line
    (a traceback's)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = [_past_progress(line.strip()) for line in f.read().decode(errors="replace").splitlines()
                     if line.strip()]
    except OSError:
        return ""
    headers = [i for i, line in enumerate(lines) if line.startswith("=== ")]
    lines = lines[headers[-1] + 1:] if headers else lines
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [""])[-1][:500]


# A progress bar (tqdm's "\r 50%|#####     | 3/6 [00:01<00:01, 2.9it/s]") that a line was written after, without
# a line break between them.
_PROGRESS = re.compile(r"^.*\]\s*(?=error:)")


def _past_progress(line: str) -> str:
    """`line` less a progress bar's last state before an `error:` written right after it."""
    return line if line.startswith("error:") else _PROGRESS.sub("", line, count=1)


def _stop(running: list[_Job]) -> None:
    """Terminate the jobs still running (compare.py is stopping), then kill those that outlast the grace time."""
    if running:
        logger.warning(f"stopping {', '.join(job.run.label for job in running)}: the same command continues them "
                       f"from their last checkpoints")
    for job in running:
        job.process.terminate()
    deadline = time.time() + _GRACE_S
    for job in running:
        try:
            job.process.wait(max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            job.process.kill()
            job.process.wait()
        job.log.close()
