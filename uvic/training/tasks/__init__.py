"""Training tasks: what `train(cfg)` trains. The loop, checkpoints, EMA, logging, LR schedule, the held-out
validation loss (`uvic.training.validation`) and FID while training (`uvic.training.evaluation`) are shared, and ask
the task for everything that differs; none of them asks which task it is.

A task builds the model and the training and held-out sets, computes the loss of a training batch and the
deterministic per-example loss of held-out examples, names its optimizer parameter groups, turns a model into the
pipeline that samples it (with its autoencoder and the conditions of each image), and writes task-specific
artefacts (sample grids, the export). `cfg.task` picks it from the task table here, `TASK_CLASSES` (name -> task
class), whose names are those of the config's table `uvic.config.TASKS` (name -> run-config class); a new task is
one file with a class that implements `Task` and one `register_task` call (docs/where_to_change.md).

    diffusion   `diffusion.DiffusionTask`            images with a `UViTModel` (unconditional / class-conditional)
    t2i         `text2image.Text2ImageTask`          MS-COCO text-to-image on extracted VAE / CLIP features
    lm          `lm.LMTask`                          Cogformer language modelling
    class_cond  `class_cond.ClassConditionalTask`    ImageNet class-conditional, pixels (64) or VAE features

This package holds the protocol (`protocol.py`, which the task modules import) and the table only; a task class is
imported from its module when a run names it (`task_class`, `build_task`), so importing the protocol imports no
model library.
"""

from __future__ import annotations

import importlib
from typing import Any

from uvic.errors import ConfigError
from uvic.training.tasks.protocol import Task, sample_path


__all__ = ["TASK_CLASSES", "Task", "build_task", "register_task", "sample_path", "task_class"]


# The training task of each task name of `uvic.config.TASKS` (a test keeps the two tables' names equal), written
# "module:Class" and imported on first use (`task_class`), as `uvic.schedulers.SAMPLER_TABLE` names its schedulers: a
# class object is a valid entry too (`register_task`).
TASK_CLASSES: dict[str, str | type] = {
    "diffusion": "uvic.training.tasks.diffusion:DiffusionTask",
    "t2i": "uvic.training.tasks.text2image:Text2ImageTask",
    "class_cond": "uvic.training.tasks.class_cond:ClassConditionalTask",
    "lm": "uvic.training.tasks.lm:LMTask",
}


def task_class(task: str) -> type:
    """The training-task class of `task` (imported now). Raises ConfigError for a name the table does not hold."""
    if not isinstance(task, str) or task not in TASK_CLASSES:
        raise ConfigError(f"config key task: {task!r} is not one of {list(TASK_CLASSES)}")
    entry = TASK_CLASSES[task]
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        entry = getattr(importlib.import_module(module), name)
    return entry


def register_task(name: str, task: type, run_config: type) -> None:
    """Add (or replace) the task `name`: its training-task class `task` (implementing `Task`) here, and its run
    config `run_config` (a frozen dataclass deriving from `uvic.config.BaseRunConfig`, e.g. one of the built-in
    run configs) in `uvic.config.TASKS`, so that `task: <name>` in a config loads and trains it."""
    from uvic import config

    TASK_CLASSES[name] = task
    config.TASKS[name] = run_config


def build_task(cfg: Any) -> Task:
    """The task named by `cfg.task` (a row of `TASK_CLASSES`), built from `cfg`.

    Raises:
        ConfigError: a task name the table does not hold.
    """
    return task_class(cfg.task)(cfg)
