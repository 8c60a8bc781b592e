"""Training tasks: what `train(cfg)` trains. The loop, checkpoints, EMA, logging and LR schedule are shared.

A task builds the model and dataset, computes the loss of one batch, and writes task-specific artefacts
(sample grids, the exported pipeline). Add a task by writing a class with these methods and registering it in
`TASKS` under the name used by `cfg.task`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import Dataset

from uvic.config import Config
from uvic.training.rng import ShardedRNG


logger = logging.getLogger(__name__)


class Task(Protocol):
    """The task interface used by `uvic.training.loop.train`."""

    def build_model(self) -> nn.Module:
        """A freshly initialised model (float32, on CPU)."""

    def build_dataset(self) -> Dataset:
        """The training set; items are dicts of tensors."""

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], rng: ShardedRNG) -> torch.Tensor:
        """Scalar loss of a (per-process) batch; all randomness comes from `rng`."""

    def on_sample(self, ema_model: nn.Module, step: int, run_dir: Path) -> None:
        """Periodic qualitative output (main process only), e.g. a sample grid."""

    def export(self, ema_model: nn.Module, out_dir: Path) -> None:
        """Write the final artefact (main process only), e.g. a diffusers pipeline directory."""


class DiffusionTask:
    """Epsilon-prediction diffusion of images with a `UViTModel` (U-ViT / U-ViC).

    Batches are `{"x": (B, C, H, W) in [-1, 1], ...}`; the noise process and the samplers come from
    `cfg.diffusion` and `cfg.sample`.
    """

    def __init__(self, cfg: Config) -> None:
        from uvic.training.losses import build_noise_process

        self.cfg = cfg
        self.noise = build_noise_process(cfg.diffusion)

    def build_model(self) -> nn.Module:
        from uvic.models import UViTModel

        return UViTModel(**dataclasses.asdict(self.cfg.model))

    def build_dataset(self) -> Dataset:
        from uvic.data import build_image_dataset

        dataset = build_image_dataset(self.cfg.data)
        x = dataset[0]["x"]
        m = self.cfg.model
        if tuple(x.shape) != (m.in_chans, m.img_size, m.img_size):
            raise ValueError(
                f"dataset {self.cfg.data.name!r} gives images of shape {tuple(x.shape)}, but the model expects "
                f"(model.in_chans, model.img_size, model.img_size) = {(m.in_chans, m.img_size, m.img_size)}"
            )
        return dataset

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], rng: ShardedRNG) -> torch.Tensor:
        from uvic.training.losses import eps_prediction_loss

        x0 = batch["x"]
        if self.cfg.data.random_flip:
            # Random horizontal flip (U-ViT `random_flip=True`), drawn from the run's generator.
            flip = rng.rand(x0.shape[0]) < 0.5
            x0 = torch.where(flip.view(-1, 1, 1, 1), x0.flip(-1), x0)
        kwargs = {}
        if self.cfg.model.num_classes > 0:
            kwargs["class_labels"] = batch["label"]
        return eps_prediction_loss(model, x0, self.noise, rng, **kwargs)

    def pipeline(self, ema_model: nn.Module, sampler: str | None = None):
        """A `UViCPipeline` around (a copy of) `ema_model` with the configured sampler."""
        from uvic.pipelines import UViCPipeline
        from uvic.schedulers import build_scheduler

        scheduler = build_scheduler(sampler or self.cfg.sample.sampler, self.cfg.diffusion)
        return UViCPipeline(transformer=ema_model, scheduler=scheduler)

    def on_sample(self, ema_model: nn.Module, step: int, run_dir: Path) -> None:
        from uvic.pipelines.sampling import generate, save_grid

        s = self.cfg.sample
        pipe = self.pipeline(ema_model)
        pipe.set_progress_bar_config(disable=True)
        seeds = list(range(s.seed, s.seed + s.num_images))
        labels = self._grid_labels(len(seeds))
        images = generate(pipe, seeds, batch_size=s.batch_size, num_inference_steps=s.num_inference_steps,
                          class_labels=labels)
        path = Path(run_dir) / "samples" / f"step_{step:07d}.png"
        save_grid(images, path, scale=max(1, 32 // self.cfg.model.img_size))  # tiny images: enlarged to >= 32 px
        logger.info("wrote %s", path)

    def _grid_labels(self, n: int) -> list[int] | None:
        k = self.cfg.model.num_classes
        return [i % k for i in range(n)] if k > 0 else None

    def export(self, ema_model: nn.Module, out_dir: Path) -> None:
        model = copy.deepcopy(ema_model).float().cpu()
        self.pipeline(model).save_pretrained(str(out_dir))
        logger.info("exported the EMA model as a UViCPipeline to %s", out_dir)


TASKS: dict[str, Any] = {"diffusion": DiffusionTask}


def _register_builtin_tasks() -> None:
    # Imported here: uvic.diffusion_t2i builds on this module.
    from uvic.diffusion_t2i import Text2ImageTask
    from uvic.lm.task import LMTask

    TASKS["t2i"] = Text2ImageTask
    TASKS["lm"] = lambda cfg: LMTask(cfg.model, cfg.data)


_register_builtin_tasks()


def build_task(cfg: Config) -> Task:
    """The task named by `cfg.task`."""
    if cfg.task not in TASKS:
        raise ValueError(f"unknown task {cfg.task!r}; expected one of {sorted(TASKS)}")
    return TASKS[cfg.task](cfg)
