"""An exclusive lock on a run dir for the life of a training run.

Two launches on one `train.run_dir` would interleave their checkpoints, `metrics.jsonl` and `pipeline/`. The main
process of a launch therefore holds `fcntl.flock(LOCK_EX)` on `run_dir/.lock` (which records its PID) until the run
ends; the other processes of the same launch share the run, and every process of a second launch stops with
`RunLockedError` naming the holder's PID. The kernel drops a flock when its holder dies (kill -9 included), so a
crashed run never leaves a stale lock behind: the PID in the file is informative only. A run that ends (or fails
to start) removes the file while it still holds the lock; a launch that locked a file removed meanwhile retries
on the new one, so two runs never hold locks on two different files.
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
        while not self._try_acquire():  # the file was removed by a run that ended while we opened it
            pass

    def _try_acquire(self) -> bool:
        self._refuse_symlink()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink put there since the check
                self._refuse_symlink()
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
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            current = None
        if current is None or not os.path.samestat(current, os.fstat(fd)):
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return True

    def _refuse_symlink(self) -> None:
        """Raise `StorageError` if the lock file is a symlink: the PID would be written over the file it names,
        wherever that is."""
        if self.path.is_symlink():
            raise StorageError(f"{self.path} is a symlink (to {os.readlink(self.path)}): a lock must be the folder's "
                               f"own file; remove it")

    def release(self) -> None:
        """Remove the lock file, then drop the lock (removed first, so that no run ever locks a file that stays)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                self.path.unlink(missing_ok=True)
            except OSError:  # e.g. the file system went read-only: the file stays, harmless (its lock is dropped)
                pass
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
