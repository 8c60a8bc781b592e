"""What a training run checks before it touches its run dir: every check of the config that needs no data.

`check_run_config(cfg)` runs, in order, the config's own checks (`uvic.config.validate_ranges`: keys, types,
ranges, named choices), the memory the run needs at least against this machine's (`uvic.training.memory`,
counted from the config), the trackers (`train.log_with`: known names, and an account or offline mode for wandb),
the task's checks of its sections (`Task.__init__`: a class-conditional model's classes against the data, the
null class against label dropout and guidance), the model's (its constructor, run on the meta device, so that no
memory is allocated: heads that do not divide the width, a patch size that does not divide the image), and FID
while training's (`uvic.training.evaluation.check_fid_config`: a task that makes images, a reference, its
feature layer and mode). `train(cfg)` calls it first, so a config error leaves no run dir, no `config.yaml`
and no lock behind; `train.py` reports a `ConfigError` from it with exit status 2. `check_resume_config(cfg)`
does the same for a resume: the keys a resumed run may change are `RESUME_MAY_CHANGE`, every other key must equal
the run's.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import torch

from uvic.config import validate_ranges
from uvic.errors import ConfigError, one_line


logger = logging.getLogger(__name__)


__all__ = ["RESUME_MAY_CHANGE", "check_resume_config", "check_run_config", "may_change_on_resume"]


def check_run_config(cfg: Any) -> None:
    """Check `cfg` as far as it can be checked without its data, its run dir or a device.

    Raises:
        ConfigError: a value that no run can use (the message names the key).
        FileNotFoundError / ValueError: a statistics `.npz` named by `train.eval_reference` that does not exist or
            does not fit (`check_fid_config`).
    """
    from uvic.training.evaluation import check_fid_config
    from uvic.training.memory import check_memory
    from uvic.training.tasks import build_task
    from uvic.training.trackers import check_tracker_accounts, tracker_names

    validate_ranges(cfg)
    check_memory(cfg)  # sizes from the config alone, before anything is built (even on the meta device)
    check_tracker_accounts(tracker_names(cfg.train.log_with), cfg.train.run_dir)
    try:
        task = build_task(cfg)
    except ConfigError:
        raise
    except ValueError as e:  # the task's checks of its config sections
        raise ConfigError(one_line(str(e))) from None
    try:
        with torch.device("meta"):  # the constructor's checks, without allocating the weights
            task.build_model()
    except ValueError as e:
        raise ConfigError(f"config section model: {one_line(str(e))}") from None
    if cfg.train.eval_every > 0:
        check_fid_config(cfg, task)
    warn_short_ema(cfg.train.ema_decay, cfg.train.max_steps)


# The share of the initial weights left in the EMA at the last step above which a run is warned.
EMA_INIT_SHARE = 0.01


def warn_short_ema(decay: float, max_steps: int) -> float:
    """Warn when the EMA (the sampling weights) still holds more than `EMA_INIT_SHARE` of the initial weights at
    the last step: the EMA starts as a copy of the model and keeps `decay ** max_steps` of it. U-ViT's 0.9999 over
    its 250k-1M steps keeps nothing; over 2,000 steps 0.999 keeps 13.5% of a random init, enough to turn the
    samples into noise. Returns that share (0 without an EMA)."""
    share = decay**max_steps if 0 < decay < 1 else float(decay >= 1)
    if share > EMA_INIT_SHARE:
        fit = math.floor(EMA_INIT_SHARE ** (1 / max_steps) * 1e4) / 1e4
        logger.warning(f"train.ema_decay={decay} over train.max_steps={max_steps} leaves {share:.1%} of the initial "
                       f"weights (random unless the run starts from trained ones) in the EMA, the sampling weights; "
                       f"for a run this short use train.ema_decay <= {fit} (under {EMA_INIT_SHARE:.0%}), or 0 "
                       f"(no EMA)")
    return share


# ---------------------------------------------------------------------------------------------------------
# A resumed run is the same run
# ---------------------------------------------------------------------------------------------------------

# The keys a resumed run may change (`train.py CONFIG --resume` with other values): those that only extend or watch
# the run, never what its weights, its data order, its losses or its recorded numbers mean. A `section.*` entry
# takes every key of the section. Every other key (the model, the data, the task, the noise schedule, the
# optimisation, and what FID and the validation loss are measured with) must equal the run's: a resume that
# changes one is refused (`check_resume_config`). docs/training.md lists them.
RESUME_MAY_CHANGE: tuple[str, ...] = (
    "train.run_dir", "train.resume",  # where the run lies now, and which of its checkpoints continues it
    "train.max_steps",  # extend (or end earlier); with lr_schedule=cosine the decay stretches to the new end
    "train.log_every", "train.log_with", "train.sample_every", "train.save_every", "train.keep_checkpoints",
    "train.eval_every", "train.val_every",  # how often it is watched, not how
    "train.cpu_threads", "train.gradient_checkpointing", "train.val_batch_size",  # speed and memory, same numbers
    "data.num_workers", "data.download",
    "sample.num_images", "sample.batch_size",  # the grid's size; images do not depend on the batch
)


def may_change_on_resume(key: str) -> bool:
    """Whether the dotted config `key` is one a resumed run may change (`RESUME_MAY_CHANGE`)."""
    return any(key == k or (k.endswith(".*") and key.startswith(k[:-1])) for k in RESUME_MAY_CHANGE)


def _flat_items(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat_items(v, f"{prefix}{k}."))
    return out


def resume_difference(cfg: Any, saved: dict[str, Any], where: str) -> str | None:
    """The first key that `cfg` (the resuming run's config) sets otherwise than the resolved config dict `saved`
    (a run's `config.yaml` or a checkpoint's), among those a resume may not change, as one phrase; None if none.

    `saved` is resolved as the run would resolve it today (`config_from_dict`: keys it lacks, as a config saved by
    an older uvic does, take their defaults), so an old config that equals `cfg` is accepted.

    Raises:
        ConfigError: `saved` is no config (`where` names the file).
    """
    from uvic.config import config_from_dict

    try:
        old = config_from_dict(saved).to_dict()
    except ValueError as e:
        raise ConfigError(f"cannot check the resumed config against {where}: {one_line(str(e))}") from None
    new = _flat_items(cfg.to_dict())
    old = _flat_items(old)
    for key in ("task", *[k for k in new if k != "task"], *[k for k in old if k not in new]):
        if may_change_on_resume(key) or new.get(key, "<none>") == old.get(key, "<none>"):
            continue
        return f"{key} is {new.get(key, '(not a key of this task)')!r} here but {old.get(key, '(not a key)')!r} in {where}"
    return None


def check_resume_config(cfg: Any) -> None:
    """Refuse a resume (`train.resume` set) whose config differs from the run's in a key that `RESUME_MAY_CHANGE`
    does not list, before the run dir is touched: the run's `config.yaml` and the config of the checkpoint it would
    continue (its weights were trained under it) are compared, those that exist.

    Raises:
        ConfigError: one line naming the first differing key, both values and the file.
    """
    import yaml

    from uvic.training.checkpoint import latest_checkpoint, resolve_checkpoint

    tc = cfg.train
    if not tc.resume:
        return
    run_dir = Path(tc.run_dir)
    sources = [run_dir / "config.yaml"]
    try:
        ckpt = latest_checkpoint(run_dir) if tc.resume == "latest" else resolve_checkpoint(tc.resume, verify=False)
    except (OSError, ValueError):  # reported by the run itself, in its words
        ckpt = None
    if ckpt is not None:
        sources.append(ckpt / "config.yaml")
    for path in sources:
        if not path.is_file():
            continue
        try:
            saved = yaml.safe_load(path.read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot check the resumed config against {path}: {type(e).__name__}: "
                              f"{one_line(str(e))}") from None
        if not isinstance(saved, dict):
            raise ConfigError(f"cannot check the resumed config against {path}: it is not a mapping of sections")
        why = resume_difference(cfg, saved, str(path))
        if why is not None:
            raise ConfigError(
                f"config key {why}: a resumed run continues the same model, data, task and noise schedule (only "
                f"{', '.join(RESUME_MAY_CHANGE[2:])} may change); resume with the run's value, or start another "
                f"train.run_dir")
