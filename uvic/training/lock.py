"""An exclusive lock on a run dir for the life of a training run.

Two launches on one `train.run_dir` would interleave their checkpoints, `metrics.jsonl` and `pipeline/`. The main
process of a launch therefore holds `fcntl.flock(LOCK_EX)` on `run_dir/.lock` (which records its PID) until the run
ends; the other processes of the same launch share the run, and every process of a second launch stops with
`RunLockedError` naming the holder's PID. The kernel drops a flock when its holder dies (kill -9 included), so a
crashed run never leaves a stale lock behind: the PID in the file is informative only.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from uvic.errors import RunLockedError, StorageError, describe_os_error


LOCK_NAME = ".lock"


class RunDirLock:
    """`flock` on `run_dir/.lock`, taken by `acquire()` and dropped by `release()` (or when the process exits)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise `RunLockedError` (held by another run) / `StorageError` (cannot create the dir)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StorageError(f"cannot use {self.path.parent} as the run dir: {describe_os_error(e)}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunLockedError(
                f"{self.path.parent} is in use by another training run (PID {holder}); wait for it to finish, "
                f"or choose another train.run_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock (the file stays, so that a waiting run never races on its creation)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


@contextmanager
def hold_run_dir(run_dir: str | Path, state: Any) -> Iterator[None]:
    """Hold the run-dir lock on the main process of `state` (the run's `Accelerator`) while the block runs.

    Every process learns the outcome (a collective), so that in a second launch all processes stop with the same
    error instead of the others waiting forever for a main process that gave up.
    """
    from accelerate.utils import broadcast_object_list

    lock, failure = RunDirLock(run_dir), [None]
    if state.is_main_process:
        try:
            lock.acquire()
        except (RunLockedError, StorageError) as e:
            failure = [e]
    if state.num_processes > 1:
        failure = broadcast_object_list(failure)
    if failure[0] is not None:
        raise failure[0]
    try:
        yield
    finally:
        lock.release()
