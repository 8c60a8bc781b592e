"""Training tasks: what `train(cfg)` trains. The loop, checkpoints, EMA, logging and LR schedule are shared.

A task builds the model and dataset, computes the loss of one batch, names its optimizer parameter groups, turns
a model into the pipeline that samples it, and writes task-specific artefacts (sample grids, the export). Add a task by writing a class with the
`Task` methods and registering it with `register_task(name, factory)`; `cfg.task` picks it.

    diffusion   `DiffusionTask`   images with a `UViTModel` (unconditional / class-conditional)
    t2i         `Text2ImageTask`  MS-COCO text-to-image on extracted VAE / CLIP features
    lm          `LMTask`          Cogformer language modelling
    class_cond  `ClassConditionalTask`  ImageNet class-conditional, pixels (64) or VAE features (256 / 512)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from diffusers import AutoencoderKL, DiffusionPipeline
from torch import nn
from torch.utils.data import Dataset

from uvic.training.rng import ShardedRNG
from uvic.training.tasks.class_cond import ClassConditionalTask
from uvic.training.tasks.diffusion import DiffusionTask
from uvic.training.tasks.lm import LMTask
from uvic.training.tasks.text2image import Text2ImageTask


__all__ = ["TASKS", "ClassConditionalTask", "DiffusionTask", "LMTask", "Task", "Text2ImageTask", "build_task", "register_task"]


class Task(Protocol):
    """The task interface used by `uvic.training.loop.train`."""

    def build_model(self) -> nn.Module:
        """A freshly initialised model (float32, on CPU)."""

    def build_dataset(self) -> Dataset:
        """The training set; items are dicts of tensors."""

    def param_groups(self, model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
        """AdamW parameter groups (`{"params": [...], "weight_decay": w}`); every trainable parameter once."""

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], rng: ShardedRNG) -> torch.Tensor:
        """Scalar loss of a (per-process) batch; all randomness comes from `rng`."""

    def pipeline(self, model: nn.Module, *, sampler: str | None = None,
                 vae: AutoencoderKL | None = None) -> DiffusionPipeline:
        """The pipeline that samples `model` (not copied). `sampler`: a `uvic.schedulers.SAMPLER_TABLE` name, None
        for the config's `sample.sampler`; `vae`: the autoencoder of a latent model, None for the configured one.
        Raises ValueError for a task whose model has no image pipeline (the LM)."""

    def on_sample(self, model: nn.Module, step: int, run_dir: Path) -> Path | None:
        """Periodic qualitative output from the sampling weights (main process only), e.g. a sample grid. Returns
        the file written (the loop shows it in the trackers under `samples`), or None when nothing was written."""

    def export(self, model: nn.Module, out_dir: Path) -> None:
        """Write the final artefact from the sampling weights (main process only), e.g. a pipeline directory."""


# cfg.task -> a factory `(cfg) -> Task`.
TASKS: dict[str, Callable[[Any], Task]] = {
    "diffusion": DiffusionTask,
    "t2i": Text2ImageTask,
    "lm": LMTask,
    "class_cond": ClassConditionalTask,
}


def register_task(name: str, factory: Callable[[Any], Task]) -> None:
    """Make `cfg.task == name` train `factory(cfg)`."""
    TASKS[name] = factory


def build_task(cfg: Any) -> Task:
    """The task named by `cfg.task`."""
    if cfg.task not in TASKS:
        raise ValueError(f"unknown task {cfg.task!r}; expected one of {sorted(TASKS)}")
    return TASKS[cfg.task](cfg)
