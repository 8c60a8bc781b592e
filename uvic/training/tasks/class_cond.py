"""Class-conditional ImageNet training as U-ViT does it (task "class_cond").

Two recipes (U-ViT `train.py` with `configs/imagenet64_uvit_*.py`; `train_ldm_discrete.py` with
`configs/imagenet{256,512}_uvit_*.py`; docs in docs/training.md, "ImageNet class-conditional (U-ViT / U-ViC)"):
- ImageNet 64, pixels: `data.source="pixels"`, the continuous VP-SDE, 1000 classes and no null class, a random
  horizontal flip drawn from the run's generator, no guidance.
- ImageNet 256 / 512, latents: `data.source="features"`, the discrete SD schedule (network time t + 1), 1001 classes
  whose last id is the null class; each step draws a latent from the stored moments (scale 0.18215) and replaces a
  label by the null class with probability `data.p_uncond` (U-ViT's `CFGDataset`), so the model learns the
  unconditional branch of classifier-free guidance.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKL
from torch import nn
from torch.utils.data import Dataset

from uvic.data.imagenet import ImageNet, ImageNetFeatures
from uvic.models.autoencoder import load_vae, sample_latents
from uvic.pipelines import UViCPipeline
from uvic.schedulers import build_scheduler
from uvic.training.losses import eps_prediction_loss
from uvic.training.rng import ShardedRNG
from uvic.training.tasks.diffusion import DiffusionTask


logger = logging.getLogger(__name__)

__all__ = ["ClassConditionalTask", "drop_labels"]


def drop_labels(labels: torch.Tensor, null_class: int, drop: torch.Tensor) -> torch.Tensor:
    """Replace the labels where `drop` is True by `null_class` (U-ViT's `CFGDataset` with `empty_token = K`).

    Args:
        labels: (B,) int64 class ids.
        null_class: the null label (the model's last class id).
        drop: (B,) bool.
    Returns:
        (B,) int64.
    """
    return torch.where(drop.to(labels.device), torch.full_like(labels, null_class), labels)


class ClassConditionalTask(DiffusionTask):
    """Class-conditional diffusion on ImageNet pixels or VAE features (`uvic.training.tasks` API).

    The model, the noise process and the parameter groups are `DiffusionTask`'s. Reads `cfg.model` (a
    class-conditional UViTConfig), `cfg.diffusion`, `cfg.data` (an `ImageNetDataConfig`) and `cfg.sample`
    (`guidance_scale` applies when the model has a null class).
    """

    def __init__(self, cfg: Any) -> None:
        d, m = cfg.data, cfg.model
        if m.num_classes not in (d.num_classes, d.num_classes + 1):
            raise ValueError(f"model.num_classes={m.num_classes} must be data.num_classes ({d.num_classes}, no null "
                             f"class) or data.num_classes + 1 ({d.num_classes + 1}, the last id is the null class)")
        self.null_class = m.num_classes == d.num_classes + 1
        if d.p_uncond > 0 and not self.null_class:
            raise ValueError(f"data.p_uncond={d.p_uncond} drops labels to the null class, but the model has none: set "
                             f"model.num_classes={d.num_classes + 1}")
        if cfg.sample.guidance_scale > 1 and not self.null_class:
            raise ValueError(f"sample.guidance_scale={cfg.sample.guidance_scale} needs a null class, and the model has "
                             "none: set sample.guidance_scale=1, or data.p_uncond > 0 to train one")
        if d.source == "features" and d.random_flip:
            raise ValueError("data.random_flip: the features already hold every image as is and flipped; set "
                             "data.random_flip=false")
        super().__init__(cfg)
        self._class_counts: list[int] | None = None

    @property
    def latent(self) -> bool:
        return self.cfg.data.source == "features"

    @property
    def num_labels(self) -> int:
        return self.cfg.model.num_classes - int(self.null_class)

    @property
    def grid_scale(self) -> int:
        """1: ImageNet images are drawn as they are."""
        return 1

    def _test_split(self) -> None:
        """None: U-ViT's ImageNet reader has no test split (validation holds out `data.val_fraction`)."""
        return None

    def _holdout_groups(self) -> np.ndarray | None:
        """Features: item j is image j % N (as is and flipped), held out together."""
        return np.arange(len(self._data())) % len(self._data().labels) if self.latent else None

    def _validation_inputs(self, batch: dict[str, torch.Tensor],
                           generators: list[torch.Generator]) -> tuple[torch.Tensor, dict[str, Any]]:
        """The pixels as stored, or a latent drawn from the stored moments; the labels (never the null class)."""
        x = self._latents(batch["x"], generators) if self.latent else batch["x"]
        return x, {"class_labels": batch["label"]}

    def _read_data(self) -> Dataset:
        """ImageNet features or pixels, checked against the model (and the VAE, when set)."""
        d, m = self.cfg.data, self.cfg.model
        if self.latent:
            dataset = ImageNetFeatures(d.root)
            if dataset.num_classes != d.num_classes:
                raise ValueError(f"features in {d.root} have {dataset.num_classes} classes, data.num_classes is "
                                 f"{d.num_classes}")
            want = (2 * m.in_chans, m.img_size, m.img_size)
            if tuple(dataset[0]["x"].shape) != want:
                raise ValueError(f"features in {d.root} have moments {tuple(dataset[0]['x'].shape)}, but the model "
                                 f"expects (2 * in_chans, img_size, img_size) = {want}")
            if d.vae:
                self.load_vae()  # a VAE that does not fit the model is an error before training, not at a grid
            return dataset
        dataset = ImageNet(d.root, resolution=d.image_size, num_classes=d.num_classes)
        if (m.in_chans, m.img_size) != (3, d.image_size):
            raise ValueError(f"ImageNet pixels are (3, {d.image_size}, {d.image_size}), but the model expects "
                             f"(model.in_chans, model.img_size) = {(m.in_chans, m.img_size)}")
        self._class_counts = dataset.class_counts().tolist()
        return dataset

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], rng: ShardedRNG) -> torch.Tensor:
        """Epsilon loss with labels; draws (in order): flip or latent, label dropout, time, noise."""
        x, labels = batch["x"], batch["label"]
        B = x.shape[0]
        if self.latent:
            c = x.shape[1] // 2
            x0 = sample_latents(x.float(), self.cfg.data.latent_scale, eps=rng.randn(B, c, *x.shape[2:]).to(x.device))
        else:
            x0 = x
            if self.cfg.data.random_flip:  # U-ViT ImageDataset random_flip, drawn from the run's generator
                flip = rng.rand(B).to(x.device) < 0.5
                x0 = torch.where(flip.view(-1, 1, 1, 1), x0.flip(-1), x0)
        if self.cfg.data.p_uncond > 0:
            drop = rng.rand(B) < self.cfg.data.p_uncond
            labels = drop_labels(labels, self.cfg.model.num_classes - 1, drop)
        return eps_prediction_loss(model, x0, self.noise, rng, class_labels=labels)

    def load_vae(self) -> AutoencoderKL | None:
        """The autoencoder named by `data.vae` (scale `data.latent_scale`), checked against the model; None for a
        pixel model. Raises ValueError for a latent model without `data.vae`."""
        if not self.latent:
            return None
        if not self.cfg.data.vae:
            raise ValueError("data.vae is not set: a latent model's pipeline needs the autoencoder")
        vae = load_vae(self.cfg.data.vae, self.cfg.data.latent_scale)
        if vae.config.latent_channels != self.cfg.model.in_chans:
            raise ValueError(f"data.vae has {vae.config.latent_channels} latent channels, model.in_chans is "
                             f"{self.cfg.model.in_chans}: they must match")
        return vae

    def class_counts(self) -> list[int] | None:
        """Training images per class (pixels: for FID labels in training proportions); None for features."""
        if self._class_counts is None and not self.latent and (Path(self.cfg.data.root) / "train").is_dir():
            d = self.cfg.data
            self._class_counts = ImageNet(d.root, d.image_size, d.num_classes).class_counts().tolist()
        return self._class_counts

    def pipeline(self, model: nn.Module, *, sampler: str | None = None,
                 vae: AutoencoderKL | None = None) -> UViCPipeline:
        """A `UViCPipeline` around `model` with `sampler` and (features) `vae`; defaults: the configured ones."""
        if self.latent:
            vae = vae if vae is not None else self.load_vae()
        elif vae is not None:
            raise ValueError("an ImageNet pixel model's pipeline takes no vae")
        scheduler = build_scheduler(sampler or self.cfg.sample.sampler, self.cfg.diffusion)
        guidance = self.cfg.sample.guidance_scale if self.null_class else 1.0
        return UViCPipeline(transformer=model, scheduler=scheduler, vae=vae, null_class=self.null_class,
                            label_dropout=self.cfg.data.p_uncond, class_counts=self.class_counts(),
                            default_guidance_scale=guidance)

    def export(self, model: nn.Module, out_dir: Path) -> None:
        """The model as a `UViCPipeline` (a latent model needs `data.vae`; otherwise only `out_dir/transformer`)."""
        model = copy.deepcopy(model).float().cpu()
        if self.latent and not self.cfg.data.vae:
            model.save_pretrained(Path(out_dir) / "transformer")
            # `out_dir` is the temporary name the export is renamed from: not a name to show.
            logger.warning("data.vae is not set: exported only the transformer (pipeline/transformer)")
            return
        self.pipeline(model).save_pretrained(str(out_dir))
