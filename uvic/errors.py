"""The library's own error types, and how the command-line scripts report them.

Library code raises these (or ValueError / FileNotFoundError with a message that names the problem) for bad input
and for faults of the environment (a full disk, a run dir held by another run). The scripts (`train.py`,
`sample.py`, `python -m uvic.fid`) wrap their work in `cli_errors()`, which turns exactly these into one line on
stderr and a non-zero exit; any other exception is a bug and keeps its traceback. The checks the scripts share
live here too: argument types (`int_at_least`, `finite_float`), an output that must be writable before any work
starts (`check_writable`), failed writes during the work (`storage_errors`), and their log format
(`configure_logging`).
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


class UvicError(Exception):
    """Base class of uvic's own errors: the message is complete and meant for the user."""


class ConfigError(UvicError, ValueError):
    """A config file or override that cannot be used: YAML syntax, unknown key, wrong type, value out of range."""


class CheckpointError(UvicError, ValueError):
    """A checkpoint that is incomplete, corrupted (SHA-256 mismatch) or does not match the run."""


class DataError(UvicError, ValueError):
    """Input data that cannot be used, e.g. an unreadable image file; the message names the file."""


class RunRecordError(UvicError, ValueError):
    """A record a run keeps about itself (`eval.jsonl`, `best.json`, `metrics.jsonl`) that is damaged or holds a
    value uvic never writes there; the message names the file, the line and what is wrong."""


class StorageError(UvicError, OSError):
    """Writing failed (disk full, read-only file system, a file where a directory should be); nothing half-written
    is left behind, and the message says what failed and what is still intact."""


class MissingPackageError(UvicError, ImportError):
    """An optional package that a requested feature needs is not installed; the message says which to install."""


class RunLockedError(UvicError, RuntimeError):
    """The run dir is held by another live training run (its PID is in the message)."""


# What the scripts report as one line: uvic's errors, and the standard types the library raises with full messages.
USER_ERRORS: tuple[type[BaseException], ...] = (UvicError, ValueError, FileNotFoundError, FloatingPointError)

_OS_REASONS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOTDIR: "not a directory (a file is in the way)",
    errno.EEXIST: "a file is in the way",
    errno.EISDIR: "is a directory",
    errno.ENOENT: "no such file or directory",
}


def describe_os_error(e: OSError) -> str:
    """A short phrase for what went wrong, e.g. "disk full (No space left on device: '/runs/x/ckpt/model.bin')"."""
    reason = _OS_REASONS.get(e.errno or -1, "I/O error")
    detail = e.strerror or str(e)
    if e.filename is not None:
        detail += f": {str(e.filename)!r}"
    return f"{reason} ({detail})"


def one_line(message: str) -> str:
    """`message` with its line breaks folded, so that a report stays one line."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


@contextmanager
def cli_errors(status: int = 1) -> Iterator[None]:
    """For the scripts only: on a `USER_ERRORS` exception, write `error: <message>` as one line to stderr and exit
    with `status` (no traceback). Any other exception propagates with its traceback: it is a bug, not bad input.
    """
    try:
        yield
    except USER_ERRORS as e:
        sys.stderr.write(f"error: {one_line(str(e)) or type(e).__name__}\n")
        raise SystemExit(status) from None


@contextmanager
def storage_errors(what: str, hint: str = "") -> Iterator[None]:
    """An OSError of a write inside the block (disk full, read-only file system) becomes one `StorageError`,
    `"{what}: {reason}{hint}"`; uvic's own errors and OSErrors without an errno (complete messages) pass as they are.
    """
    try:
        yield
    except OSError as e:
        if isinstance(e, UvicError) or e.errno is None:
            raise
        raise StorageError(f"{what}: {describe_os_error(e)}{hint}") from None


def check_writable(folder: str | os.PathLike, what: str) -> None:
    """Create `folder` if needed and write (then remove) an empty file in it, before any work that would write there.

    Raises:
        StorageError: `"cannot write {what}: {reason}"` (read-only, a file in the way, no permission).
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise StorageError(f"cannot write {what}: {describe_os_error(e)}") from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: an int >= `minimum` (counts and sizes; 0 steps, samples or splits would give nothing or NaN)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def finite_float(text: str) -> float:
    """argparse type: a finite float (e.g. a NaN guidance scale would turn every image into NaN)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def configure_logging() -> None:
    """For the scripts: INFO log lines with time and source on stderr, without torch's CUDA_HOME warning
    (`hide_cuda_home_warning`)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    hide_cuda_home_warning()


def _not_cuda_home(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("No CUDA runtime is found")


def hide_cuda_home_warning() -> None:
    """Drop torch's "No CUDA runtime is found, using CUDA_HOME=..." warning, which `torch.utils.cpp_extension` logs
    on a machine with a CUDA toolkit and no GPU when it is first imported (by torch.compile's Inductor): nothing of
    uvic depends on it, and CPU users take it for an error. Called by the scripts and before uvic's own
    torch.compile; only that one record of that one logger is dropped."""
    log = logging.getLogger("torch.utils.cpp_extension")
    if _not_cuda_home not in log.filters:
        log.addFilter(_not_cuda_home)
