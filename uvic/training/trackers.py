"""Experiment trackers (`train.log_with`): which accelerate trackers a run starts, and the samples they show.

`train.log_with` is "tensorboard", "wandb", "none", or a list of tracker names. Scalars (loss, lr, eval/fid) go
through `accelerator.log`; the periodic samples of a task go to the trackers under the tag `samples`, an image
grid as an image and an LM's text sample as text. TensorBoard writes to `<run_dir>/train/`, wandb to
`<run_dir>/wandb/` (`WANDB_MODE=offline` runs without an account or network).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


__all__ = ["SAMPLES_TAG", "TRACKERS", "check_tracker_accounts", "log_samples", "start_trackers", "tracker_names"]

SAMPLES_TAG = "samples"
TRACKERS = ("tensorboard", "wandb")


def tracker_names(log_with: str | list[str] | tuple[str, ...]) -> list[str]:
    """The tracker names of a `train.log_with` value ([] for "none"), checked.

    Raises:
        ConfigError: an unknown name, or "none" in a list.
    """
    from uvic.errors import ConfigError

    names = [log_with] if isinstance(log_with, str) else list(log_with)
    if names == ["none"]:
        return []
    if "none" in names:
        raise ConfigError(f"config key train.log_with: {names} lists 'none' with other trackers; 'none' alone means "
                          f"no tracker, else list trackers of {list(TRACKERS)}")
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"config key train.log_with: {', '.join(map(repr, unknown))} is not a tracker uvic starts; "
                          f"use one of {list(TRACKERS)}, a list of them, or 'none'")
    if "wandb" in names:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError('train.log_with names wandb, which is not installed: pip install -e ".[wandb]"')
    return list(dict.fromkeys(names))


def _no_wandb_account(run_dir: str | os.PathLike, why: str) -> str:
    return (f"train.log_with names wandb, which has no account to log to ({why}): run `wandb login`, or set "
            f"WANDB_MODE=offline to log to {Path(run_dir) / 'wandb'} without an account")


def check_tracker_accounts(names: list[str], run_dir: str | os.PathLike) -> None:
    """Before a run starts: raise ConfigError when `names` holds wandb and wandb has nowhere to log (not offline or
    disabled by WANDB_MODE, and no credentials: no `wandb login`, no WANDB_API_KEY). Nothing is contacted; a wandb
    whose login cannot be asked without prompting leaves the check to `start_trackers`."""
    from uvic.errors import ConfigError

    if "wandb" not in names or os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return
    import wandb

    try:
        found = wandb.login(verify=False, prompt=False)  # reads the environment and ~/.netrc only
    except TypeError:  # an older wandb without `prompt`: it could block on a prompt here
        return
    except Exception as e:  # noqa: BLE001 - wandb's UsageError / AuthenticationError: no usable credentials
        raise ConfigError(_no_wandb_account(run_dir, f"{type(e).__name__}: {' '.join(str(e).split())}")) from None
    if not found:
        raise ConfigError(_no_wandb_account(run_dir, "no `wandb login`, no WANDB_API_KEY"))


def start_trackers(accelerator: Any, names: list[str], run_dir: str | os.PathLike, config: dict[str, Any]) -> None:
    """`accelerator.init_trackers` for `names` (the accelerator was built with `log_with=names`); main process.

    Raises:
        ConfigError: wandb has no account to log to (no `wandb login`, no WANDB_API_KEY) and is not offline.
        StorageError: the TensorBoard folder `<run_dir>/train` cannot be written (read-only, a file in the way).
    """
    from uvic.errors import ConfigError, check_writable

    if not names:
        return
    if "tensorboard" in names:
        check_writable(Path(run_dir) / "train", f"the TensorBoard logs to {Path(run_dir) / 'train'}")
        _quiet_tensorboard_writer_threads()
    try:
        accelerator.init_trackers("train", config=config, init_kwargs={"wandb": {"dir": str(run_dir)}})
    except Exception as e:
        if "wandb" in names and _is_wandb_login_error(e):
            raise ConfigError(_no_wandb_account(run_dir, f"{type(e).__name__}: {' '.join(str(e).split())}")) from None
        raise


def _is_wandb_login_error(e: Exception) -> bool:
    """Whether `e` is wandb saying it has no (valid) credentials and cannot ask for them."""
    try:
        from wandb.errors import AuthenticationError, UsageError
    except ImportError:
        return False
    return isinstance(e, (UsageError, AuthenticationError))


def _quiet_tensorboard_writer_threads() -> None:
    """TensorBoard writes events in a thread; when a write fails (read-only, disk full) the thread keeps the error
    and the next write or flush of the main thread raises it, where the run reports it in one line. The thread's
    own traceback, which Python prints as it ends, says the same thing first: it is left out (other threads'
    exceptions are reported as before)."""
    import threading

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    previous = threading.excepthook
    if getattr(previous, "uvic_quiet_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not (isinstance(args.thread, _AsyncWriterThread) and args.thread.exception is args.exc_value):
            previous(args)

    hook.uvic_quiet_tensorboard = True
    threading.excepthook = hook


def log_samples(accelerator: Any, written: str | os.PathLike | None, step: int) -> None:
    """Show a task's periodic sample (the file its `on_sample` wrote) in every tracker under `samples`: a `.png`
    grid as a (1, H, W, C) uint8 image, a `.txt` as text. Main process; nothing to do without trackers."""
    if written is None or not accelerator.trackers:
        return
    path = Path(written)
    if path.suffix == ".txt":
        accelerator.log({SAMPLES_TAG: path.read_text(encoding="utf-8")}, step=step)
        return
    from PIL import Image

    with Image.open(path) as im:
        grid = np.asarray(im.convert("RGB"))[None]  # (1, H, W, 3)
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            tracker.log_images({SAMPLES_TAG: grid}, step=step, dataformats="NHWC")
        else:
            tracker.log_images({SAMPLES_TAG: list(grid)}, step=step)
