"""Epsilon-prediction diffusion of images with a `UViTModel` (U-ViT / U-ViC): task "diffusion", and the base of the
other image tasks (t2i, class_cond), which share its model, noise process, parameter groups, held-out split,
validation loss and sample grid."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from uvic.data import build_image_dataset
from uvic.data.images import TEST_SPLITS
from uvic.models import UViTModel
from uvic.models.autoencoder import sample_latents
from uvic.pipelines import UViCPipeline
from uvic.pipelines.sampling import ImageConditions, balanced_class_labels, generate, save_grid
from uvic.schedulers import build_scheduler
from uvic.training.losses import build_noise_process, eps_prediction_loss, stratified_eps_losses
from uvic.training.optim import decay_all
from uvic.training.rng import ShardedRNG
from uvic.training.tasks.protocol import sample_path
from uvic.training.validation import example_generators, held_out_subsets


logger = logging.getLogger(__name__)


class DiffusionTask:
    """Epsilon-prediction diffusion of images with a `UViTModel` (U-ViT / U-ViC).

    Batches are `{"x": (B, C, H, W) in [-1, 1], ...}`; the noise process and the samplers come from
    `cfg.diffusion` and `cfg.sample`. The image tasks built on it override what differs: `latent` and `load_vae`
    (an autoencoder), `num_labels`, `image_conditions`, `grid_scale`, the data (`_read_data`, `_test_split`,
    `_holdout_groups`), the loss, the validation inputs (`_validation_inputs`) and the pipeline.
    """

    makes_images = True
    # Whether the model works on VAE latents (then `data.vae` names the autoencoder of the grids and the export).
    latent = False

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.noise = build_noise_process(cfg.diffusion)
        self._dataset: Dataset | None = None

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
        """The training data, less the held-out examples when validating (`train.val_every` > 0) on data without
        a test split."""
        if self.cfg.train.val_every > 0 and self._test_split() is None:
            return held_out_subsets(self._data(), self.cfg.data.val_fraction, self._holdout_groups())[0]
        return self._data()

    def validation_set(self) -> Dataset:
        """The data's test split (CIFAR-10's test batch), else `data.val_fraction` of the training data
        (`uvic.training.validation.hold_out`)."""
        load = self._test_split()
        if load is not None:
            return load()
        return held_out_subsets(self._data(), self.cfg.data.val_fraction, self._holdout_groups())[1]

    def validation_split(self) -> str:
        """The data's test split, or the share `data.val_fraction` held out."""
        if self._test_split() is not None:
            return "the data's test split"
        return f"data.val_fraction={self.cfg.data.val_fraction} of the data, held out"

    def _data(self) -> Dataset:
        """All the training data, read once (`_read_data`)."""
        if self._dataset is None:
            self._dataset = self._read_data()
        return self._dataset

    def _read_data(self) -> Dataset:
        """All the training data, checked against the model."""
        dataset = build_image_dataset(self.cfg.data)
        x = dataset[0]["x"]
        m = self.cfg.model
        if tuple(x.shape) != (m.in_chans, m.img_size, m.img_size):
            raise ValueError(
                f"dataset {self.cfg.data.name!r} gives images of shape {tuple(x.shape)}, but the model expects "
                f"(model.in_chans, model.img_size, model.img_size) = {(m.in_chans, m.img_size, m.img_size)}"
            )
        if m.num_classes > 0:
            check_labels(dataset, self.cfg.data.name, m.num_classes)
        return dataset

    def _test_split(self) -> Callable[[], Dataset] | None:
        """The loader of the data's test split (`uvic.data.images.TEST_SPLITS`), None when it has none."""
        load = TEST_SPLITS.get(self.cfg.data.name)
        return None if load is None else lambda: load(self.cfg.data)

    def _holdout_groups(self) -> np.ndarray | None:
        """The group of each item of `_data()` that `hold_out` keeps together; None: every item its own."""
        return None

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

    def validation_losses(self, model: nn.Module, batch: dict[str, torch.Tensor],
                          index: torch.Tensor) -> dict[str, torch.Tensor]:
        """`val_loss`: each example's epsilon loss at `train.val_timesteps` times stratified over the schedule,
        noise and times from the example's own generator (`stratified_eps_losses`)."""
        generators = example_generators(index)
        x0, kwargs = self._validation_inputs(batch, generators)
        return {"val_loss": stratified_eps_losses(model, x0, self.noise, generators, self.cfg.train.val_timesteps,
                                                  **kwargs)}

    def _validation_inputs(self, batch: dict[str, torch.Tensor],
                           generators: list[torch.Generator]) -> tuple[torch.Tensor, dict[str, Any]]:
        """x0 (B, C, H, W) and the model's condition of held-out examples: the images as stored (no flip), with
        their labels for a class-conditional model."""
        kwargs = {"class_labels": batch["label"]} if self.cfg.model.num_classes > 0 else {}
        return batch["x"], kwargs

    def _latents(self, moments: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
        """(B, C, h, w) latents of held-out examples from their stored (B, 2C, h, w) moments, each drawn (first) from
        the example's generator."""
        shape = (moments.shape[1] // 2, *moments.shape[2:])
        eps = torch.stack([torch.randn(shape, generator=g) for g in generators]).to(moments.device)
        return sample_latents(moments.float(), self.cfg.data.latent_scale, eps=eps)

    def validation_metrics(self, means: dict[str, float]) -> dict[str, float]:
        return dict(means)

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


def check_labels(dataset: Dataset, name: str, num_classes: int) -> None:
    """A class-conditional model (`model.num_classes` > 0) needs data whose items carry labels in
    [0, num_classes): the in-memory sets (digits, CIFAR-10, Fashion-MNIST) hold them as `labels` (N,).

    Raises:
        ValueError: data without labels (an image folder), or a label the model's class embedding cannot take.
    """
    labels = getattr(dataset, "labels", None)
    if labels is None:
        raise ValueError(f"model.num_classes={num_classes} asks for class labels, but dataset {name!r} has none; "
                         f"set model.num_classes=-1 (unconditional) or use a labelled dataset")
    top = int(labels.max()) if len(labels) else -1
    if top >= num_classes:
        raise ValueError(f"dataset {name!r} has label {top}, but model.num_classes={num_classes} embeds only "
                         f"0..{num_classes - 1}; set model.num_classes={top + 1}")
