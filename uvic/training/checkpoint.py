"""Checkpoints: atomic save, rotation, discovery and resume. Task-agnostic (diffusion and LM runs share it).

Layout of one checkpoint, `run_dir/checkpoints/step_000001000/`:
    model.safetensors, optimizer.bin, random_states_{rank}.pkl, custom_checkpoint_{i}.pkl
                        `accelerator.save_state`: model, optimizer, RNG states, registered objects (LR schedule,
                        the run's sharded generator)
    {name}.safetensors  extra models such as the EMA weights
    config.yaml         the resolved config of the run
    meta.json           {"step": ...}; written last

A checkpoint is written into `.tmp-step_.../` and renamed into place when complete, so a crash during a save
leaves the previous checkpoints untouched and the partial directory is never picked up.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import yaml
from accelerate import Accelerator
from safetensors.torch import load_file, save_file
from torch import nn


logger = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d+)$")


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, path), oldest first. Temporary and partial dirs are ignored."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and (p / "meta.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir from a checkpoint path or a run dir (its latest checkpoint). Raises FileNotFoundError."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(f"no checkpoint at {path} (expected a step_* dir with meta.json, or a run dir with "
                                f"checkpoints/step_*/)")
    return latest


def save_checkpoint(
    accelerator: Accelerator,
    run_dir: str | Path,
    step: int,
    config: dict[str, Any],
    extra_models: dict[str, nn.Module] | None = None,
    keep: int = 3,
) -> Path:
    """Save the accelerator state plus `extra_models` atomically as `checkpoints/step_{step:09d}`; keep the last `keep`.

    Call on every process (accelerate writes per-rank RNG states). Returns the checkpoint path.
    """
    root = checkpoints_dir(run_dir)
    final = root / f"step_{step:09d}"
    tmp = root / f".tmp-step_{step:09d}"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover from a crashed save
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    if accelerator.is_main_process:
        for name, model in (extra_models or {}).items():
            state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
            save_file(state, str(tmp / f"{name}.safetensors"))
        (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (tmp / "meta.json").write_text(json.dumps({"step": step}))
        if final.exists():  # re-saving the same step (e.g. the final save after a periodic one)
            shutil.rmtree(final)
        os.replace(tmp, final)
        for _, old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(
    accelerator: Accelerator, path: str | Path, extra_models: dict[str, nn.Module] | None = None
) -> int:
    """Restore what `save_checkpoint` wrote into the prepared objects; returns the step.

    Raises:
        FileNotFoundError: `path` is not a complete checkpoint.
        ValueError: a file in it cannot be read (truncated, corrupted, or from a different model).
    """
    path = Path(path)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no meta.json)")
    try:
        step = int(json.loads((path / "meta.json").read_text())["step"])
        accelerator.load_state(str(path))
        for name, model in (extra_models or {}).items():
            model.load_state_dict(load_file(str(path / f"{name}.safetensors")))
    except Exception as e:  # noqa: BLE001 - any failure here means "this checkpoint cannot be resumed"
        raise ValueError(f"checkpoint {path} is unreadable or does not match this run: {type(e).__name__}: {e}") from e
    logger.info("resumed from %s at step %d", path, step)
    return step


def read_checkpoint_config(path: str | Path) -> dict[str, Any]:
    """The resolved config dict stored in a checkpoint."""
    path = Path(path)
    try:
        return yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read the config of checkpoint {path}: {e}") from e


def load_model_weights(model: nn.Module, path: str | Path, name: str) -> nn.Module:
    """Load `{name}.safetensors` of a checkpoint into `model` (strict). Raises ValueError when unreadable."""
    file = Path(path) / f"{name}.safetensors"
    try:
        model.load_state_dict(load_file(str(file)))
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"cannot load {file}: {type(e).__name__}: {e}") from e
    return model
