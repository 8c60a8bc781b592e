"""Epsilon-prediction diffusion of images with a `UViTModel` (U-ViT / U-ViC), `cfg.task == "diffusion"`."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from uvic.data import build_image_dataset
from uvic.models import UViTModel
from uvic.pipelines import UViCPipeline
from uvic.pipelines.sampling import balanced_class_labels, generate, save_grid
from uvic.schedulers import build_scheduler
from uvic.training.losses import build_noise_process, eps_prediction_loss
from uvic.training.optim import decay_all
from uvic.training.rng import ShardedRNG


logger = logging.getLogger(__name__)


class DiffusionTask:
    """Epsilon-prediction diffusion of images with a `UViTModel` (U-ViT / U-ViC).

    Batches are `{"x": (B, C, H, W) in [-1, 1], ...}`; the noise process and the samplers come from
    `cfg.diffusion` and `cfg.sample`.
    """

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.noise = build_noise_process(cfg.diffusion)

    def build_model(self) -> nn.Module:
        return UViTModel(**dataclasses.asdict(self.cfg.model))

    def build_dataset(self) -> Dataset:
        dataset = build_image_dataset(self.cfg.data)
        x = dataset[0]["x"]
        m = self.cfg.model
        if tuple(x.shape) != (m.in_chans, m.img_size, m.img_size):
            raise ValueError(
                f"dataset {self.cfg.data.name!r} gives images of shape {tuple(x.shape)}, but the model expects "
                f"(model.in_chans, model.img_size, model.img_size) = {(m.in_chans, m.img_size, m.img_size)}"
            )
        return dataset

    def param_groups(self, model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
        """U-ViT decays every parameter."""
        return decay_all(model, weight_decay)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], rng: ShardedRNG) -> torch.Tensor:
        x0 = batch["x"]
        if self.cfg.data.random_flip:
            # Random horizontal flip (U-ViT `random_flip=True`), drawn from the run's generator.
            flip = rng.rand(x0.shape[0]) < 0.5
            x0 = torch.where(flip.view(-1, 1, 1, 1), x0.flip(-1), x0)
        kwargs = {}
        if self.cfg.model.num_classes > 0:
            kwargs["class_labels"] = batch["label"]
        return eps_prediction_loss(model, x0, self.noise, rng, **kwargs)

    def pipeline(self, model: nn.Module, *, sampler: str | None = None, vae: None = None) -> UViCPipeline:
        """A `UViCPipeline` around `model` with `sampler` (default: the configured one); pixel space, no `vae`."""
        if vae is not None:
            raise ValueError(f"the {self.cfg.task!r} task trains in pixel space: its pipeline takes no vae")
        scheduler = build_scheduler(sampler or self.cfg.sample.sampler, self.cfg.diffusion)
        return UViCPipeline(transformer=model, scheduler=scheduler)

    def on_sample(self, model: nn.Module, step: int, run_dir: Path) -> Path | None:
        s = self.cfg.sample
        pipe = self.pipeline(model)
        pipe.set_progress_bar_config(disable=True)
        seeds = list(range(s.seed, s.seed + s.num_images))
        images = generate(pipe, seeds, batch_size=s.batch_size, num_inference_steps=s.num_inference_steps,
                          class_labels=balanced_class_labels(pipe.num_labels, range(len(seeds))))
        path = Path(run_dir) / "samples" / f"step_{step:07d}.png"
        save_grid(images, path, scale=max(1, 32 // self.cfg.model.img_size))  # tiny images: enlarged to >= 32 px
        logger.info("wrote %s", path)
        return path

    def export(self, model: nn.Module, out_dir: Path) -> None:
        self.pipeline(copy.deepcopy(model).float().cpu()).save_pretrained(str(out_dir))
