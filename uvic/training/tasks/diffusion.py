"""Epsilon-prediction diffusion of images with a `UViTModel` (U-ViT / U-ViC): task "diffusion", and the base of the
other image tasks (t2i, class_cond), which share its model, noise process, parameter groups and sample grid."""

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
from uvic.pipelines.sampling import ImageConditions, balanced_class_labels, generate, save_grid
from uvic.schedulers import build_scheduler
from uvic.training.losses import build_noise_process, eps_prediction_loss
from uvic.training.optim import decay_all
from uvic.training.rng import ShardedRNG
from uvic.training.tasks import sample_path


logger = logging.getLogger(__name__)


class DiffusionTask:
    """Epsilon-prediction diffusion of images with a `UViTModel` (U-ViT / U-ViC).

    Batches are `{"x": (B, C, H, W) in [-1, 1], ...}`; the noise process and the samplers come from
    `cfg.diffusion` and `cfg.sample`. The image tasks built on it override what differs: `latent` and `load_vae`
    (an autoencoder), `num_labels`, `image_conditions`, `grid_scale`, the data, the loss and the pipeline.
    """

    makes_images = True
    # Whether the model works on VAE latents (then `data.vae` names the autoencoder of the grids and the export).
    latent = False

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.noise = build_noise_process(cfg.diffusion)

    @property
    def num_labels(self) -> int:
        """The classes a sample can ask for (a null class excluded); 0 for an unconditional model."""
        return max(self.cfg.model.num_classes, 0)

    @property
    def grid_scale(self) -> int:
        """Pixel repetition of the sample grid: tiny images (the 8x8 digits) are enlarged to at least 32 px."""
        return max(1, 32 // self.cfg.model.img_size)

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

    def load_vae(self) -> None:
        """None: a pixel-space model has no autoencoder."""
        return None

    def pipeline(self, model: nn.Module, *, sampler: str | None = None, vae: None = None) -> UViCPipeline:
        """A `UViCPipeline` around `model` with `sampler` (default: the configured one); pixel space, no `vae`."""
        if vae is not None:
            raise ValueError(f"the {self.cfg.task!r} task trains in pixel space: its pipeline takes no vae")
        scheduler = build_scheduler(sampler or self.cfg.sample.sampler, self.cfg.diffusion)
        return UViCPipeline(transformer=model, scheduler=scheduler)

    def image_conditions(self, purpose: str, num_images: int) -> ImageConditions:
        """Class i % num_labels for image i (nothing for an unconditional model), grids and FID alike; the
        pipeline's own guidance."""
        return ImageConditions(num_images, class_labels=balanced_class_labels(self.num_labels, range(num_images)))

    def on_sample(self, model: nn.Module, step: int, run_dir: Path) -> Path | None:
        """A grid of the `image_conditions("grid", sample.num_images)` images, image i from seed `sample.seed + i`;
        returns its path, or None (with a warning) for a latent model without its autoencoder (`data.vae`)."""
        if self.latent and not self.cfg.data.vae:
            logger.warning("data.vae is not set: no sample grid at step %d", step)
            return None
        s = self.cfg.sample
        pipe = self.pipeline(model, vae=self.load_vae())
        pipe.to(next(model.parameters()).device)
        pipe.set_progress_bar_config(disable=True)
        conditions = self.image_conditions("grid", s.num_images)
        indices = range(conditions.num_images)
        images = generate(pipe, [s.seed + i for i in indices], batch_size=s.batch_size,
                          num_inference_steps=s.num_inference_steps, **conditions.kwargs(indices))
        path = save_grid(images, sample_path(run_dir, step, ".png"), scale=self.grid_scale)
        logger.info("wrote %s", path)
        return path

    def export(self, model: nn.Module, out_dir: Path) -> None:
        self.pipeline(copy.deepcopy(model).float().cpu()).save_pretrained(str(out_dir))
