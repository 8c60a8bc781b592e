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


__all__ = ["SAMPLES_TAG", "TRACKERS", "log_samples", "start_trackers", "tracker_names"]

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
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"config key train.log_with: {unknown} not in {['none', *TRACKERS]} (or a list of "
                          f"{list(TRACKERS)})")
    if "wandb" in names:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError('train.log_with names wandb, which is not installed: pip install -e ".[wandb]"')
    return list(dict.fromkeys(names))


def start_trackers(accelerator: Any, names: list[str], run_dir: str | os.PathLike, config: dict[str, Any]) -> None:
    """`accelerator.init_trackers` for `names` (the accelerator was built with `log_with=names`); main process."""
    if names:
        accelerator.init_trackers("train", config=config, init_kwargs={"wandb": {"dir": str(run_dir)}})


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
