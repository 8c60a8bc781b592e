"""Checkpoints: atomic save, rotation, discovery and resume. Task-agnostic (diffusion and LM runs share it).

Layout of one checkpoint, `run_dir/checkpoints/step_000001000/`:
    model.safetensors, optimizer.bin, random_states_{rank}.pkl, custom_checkpoint_{i}.pkl
                        `accelerator.save_state`: model, optimizer, RNG states, registered objects (LR schedule,
                        the run's sharded generator)
    {name}.safetensors  extra models such as the EMA weights
    config.yaml         the resolved config of the run
    meta.json           {"step": ...}; written last

A checkpoint is written into `.tmp-step_.../` and renamed into place when complete, so a crash during a save
leaves the previous checkpoints untouched and the partial directory is never picked up. Re-saving a step renames
the old copy aside (`.old-step_...`), renames the new one in, and only then deletes the old one.

Resuming from a checkpoint older than the run's newest (`abandon_newer_checkpoints`) moves the newer ones to
`checkpoints/abandoned/after_step_.../`: the resumed run is a new branch, and rotation and `--resume latest` must
only ever see that branch, while the abandoned one stays on disk.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
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
        _move_into_place(tmp, final)
        for _, old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _move_into_place(new: Path, final: Path) -> None:
    """Rename `new` to `final`; an existing `final` (the same step saved again, e.g. the final save after a periodic
    one) is renamed aside first and deleted last, so a crash never leaves the step without a complete copy."""
    old = final.with_name(f".old-{final.name}")
    shutil.rmtree(old, ignore_errors=True)  # a leftover from a crashed replacement
    if final.exists():
        os.replace(final, old)
    os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)


def abandon_newer_checkpoints(run_dir: str | Path, step: int) -> Path | None:
    """Move the checkpoints of `run_dir` newer than `step` to `checkpoints/abandoned/after_step_{step}_{time}/`.

    Call on the main process when a run resumes from `step` while newer checkpoints exist: training continues
    from `step` as a new branch, so the newer ones must not be rotated in step order with it or picked up by a
    later `--resume latest`. Nothing is deleted. Returns the folder they went to, or None when there were none.
    """
    newer = [p for s, p in list_checkpoints(run_dir) if s > step]
    if not newer:
        return None
    base = checkpoints_dir(run_dir) / "abandoned" / f"after_step_{step:09d}_{time.strftime('%Y%m%d-%H%M%S')}"
    dest, i = base, 1
    while dest.exists():
        dest, i = base.with_name(f"{base.name}-{i}"), i + 1
    dest.mkdir(parents=True)
    for p in newer:
        os.replace(p, dest / p.name)
    logger.warning("resuming from step %d of %s: moved the %d newer checkpoint(s) %s to %s", step, run_dir,
                   len(newer), ", ".join(p.name for p in newer), dest)
    return dest


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
