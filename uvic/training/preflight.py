"""What a training run checks before it touches its run dir: every check of the config that needs no data.

`check_run_config(cfg)` runs, in order, the config's own checks (`uvic.config.validate_ranges`: keys, types,
ranges, named choices), the trackers (`train.log_with`: known names, and an account or offline mode for wandb),
the task's checks of its sections (`Task.__init__`: a class-conditional model's classes against the data, the
null class against label dropout and guidance), the model's (its constructor, run on the meta device, so that no
memory is allocated: heads that do not divide the width, a patch size that does not divide the image), and FID
while training's (`uvic.training.evaluation.check_fid_config`: a task that makes images, a reference, its
feature layer and mode). `train(cfg)` calls it first, so a config error leaves no run dir, no `config.yaml`
and no lock behind; `train.py` reports a `ConfigError` from it with exit status 2.
"""

from __future__ import annotations

from typing import Any

import torch

from uvic.config import validate_ranges
from uvic.errors import ConfigError, one_line


__all__ = ["check_run_config"]


def check_run_config(cfg: Any) -> None:
    """Check `cfg` as far as it can be checked without its data, its run dir or a device.

    Raises:
        ConfigError: a value that no run can use (the message names the key).
        FileNotFoundError / ValueError: a statistics `.npz` named by `train.eval_reference` that does not exist or
            does not fit (`check_fid_config`).
    """
    from uvic.training.evaluation import check_fid_config
    from uvic.training.tasks import build_task
    from uvic.training.trackers import check_tracker_accounts, tracker_names

    validate_ranges(cfg)
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
