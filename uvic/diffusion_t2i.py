"""Discrete-time text-to-image diffusion as U-ViT trains and guides on MS-COCO (reference doc Sec. 2.2).

* Network time: the official model was trained on n in {1, ..., 1000} with `cum_alphas[n] == diffusers
  alphas_cumprod[n - 1]`, so it is fed `n = t + 1` for a diffusers timestep t (0-based). The conversion lives in
  `uvic.schedulers.timesteps` (shared with the class/unconditional models); the loss below and
  `UViCText2ImagePipeline` both go through it.
* Loss (`t2i_diffusion_loss`, U-ViT `LSimple` + `CFGDataset`): z0 is re-drawn from the stored VAE moments at
  every step, the whole (77, 768) context is replaced by the empty-caption features with probability p_uncond
  (0.1), t ~ U{0..999}, x_t = sqrt(abar_t) z0 + sqrt(1 - abar_t) eps, loss = mean((eps - eps_hat)^2).
* `Text2ImageTask`: the training task (`uvic.training.tasks` interface) for `cfg.task == "t2i"`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from uvic.models.autoencoder import sample_latents
from uvic.schedulers.timesteps import network_timestep


logger = logging.getLogger(__name__)

__all__ = [
    "drop_context",
    "t2i_diffusion_loss",
    "Text2ImageTask",
]

class RNG(Protocol):
    """What the loss draws from: `uvic.training.rng.ShardedRNG` (per-process slices of one seeded stream)."""

    def rand(self, *shape: int) -> torch.Tensor: ...

    def randn(self, *shape: int) -> torch.Tensor: ...

    def randint(self, high: int, *shape: int) -> torch.Tensor: ...


def drop_context(context: torch.Tensor, empty_context: torch.Tensor, drop: torch.Tensor) -> torch.Tensor:
    """Replace the whole context of the samples where `drop` is True by the empty-caption features.

    Args:
        context: (B, L, D) caption features.
        empty_context: (L, D) or (1, L, D) features of "" (not zeros, not a learned token).
        drop: (B,) bool.
    Returns:
        (B, L, D).
    """
    empty = empty_context.to(device=context.device, dtype=context.dtype).reshape(1, *context.shape[1:])
    return torch.where(drop.to(context.device)[:, None, None], empty, context)


def t2i_diffusion_loss(
    model: nn.Module,
    moments: torch.Tensor,
    context: torch.Tensor,
    empty_context: torch.Tensor,
    alphas_cumprod: torch.Tensor,
    scaling_factor: float,
    rng: RNG,
    p_uncond: float = 0.1,
) -> torch.Tensor:
    """Epsilon-MSE of a text-conditional U-ViT on one batch of stored features.

    Args:
        model: called as `model(x_t, n, encoder_hidden_states=context)` returning `.sample` (B, C, h, w).
        moments: (B, 2C, h, w) stored VAE moments [mean, logvar]; a latent is drawn from them here.
        context: (B, L, D) caption features.
        empty_context: (L, D) features of the empty caption (CFG null condition).
        alphas_cumprod: (T,) discrete schedule, diffusers indexing (e.g. `DDPMScheduler(beta_schedule=
            "scaled_linear", beta_start=0.00085, beta_end=0.012).alphas_cumprod`).
        scaling_factor: `vae.config.scaling_factor` (0.23010 for U-ViT MS-COCO).
        rng: source of every random draw (latent, dropout, time, noise), e.g. the run's `ShardedRNG`.
        p_uncond: probability of training on the empty context.
    Returns:
        Scalar float32 loss: mean over (C, h, w) per sample, then over the batch.
    """
    if not 0.0 <= p_uncond <= 1.0:
        raise ValueError(f"p_uncond must be in [0, 1], got {p_uncond}")
    B, two_c, h, w = moments.shape
    device = moments.device
    z0 = sample_latents(moments.float(), scaling_factor, eps=rng.randn(B, two_c // 2, h, w).to(device))
    ctx = drop_context(context, empty_context, rng.rand(B).to(device) < p_uncond)
    t = rng.randint(alphas_cumprod.numel(), B).to(device)
    eps = rng.randn(B, two_c // 2, h, w).to(device)
    ab = alphas_cumprod.to(device=device, dtype=torch.float32)[t].view(B, 1, 1, 1)
    x_t = ab.sqrt() * z0 + (1.0 - ab).sqrt() * eps
    eps_hat = model(x_t, network_timestep(t, "discrete"), encoder_hidden_states=ctx).sample
    return (eps - eps_hat.float()).pow(2).flatten(1).mean(1).mean()


class Text2ImageTask:
    """MS-COCO text-to-image training on extracted features (`cfg.task == "t2i"`; `uvic.training.tasks` API).

    Reads: `cfg.model` (a text-conditional UViTConfig), `cfg.diffusion` (discrete, scaled_linear), `cfg.data.root`
    (the output of `python -m uvic.data.mscoco`, split "train"), `cfg.data.p_uncond`, `cfg.data.latent_scale`,
    `cfg.data.vae` (autoencoder for sample grids and the exported pipeline; "" skips both), `cfg.sample.sampler`
    ("uvit_dpm_solver" is the official sampler), `cfg.sample.guidance_scale` and `cfg.sample.num_inference_steps`.
    """

    def __init__(self, cfg: Any) -> None:
        from diffusers import DDPMScheduler

        if cfg.diffusion.schedule != "discrete":
            raise ValueError("the t2i task trains the discrete schedule: set diffusion.schedule=discrete")
        if cfg.model.clip_dim is None:
            raise ValueError("the t2i task needs a text-conditional model: set model.clip_dim (768 for CLIP ViT-L/14)")
        self.cfg = cfg
        d = cfg.diffusion
        sched = DDPMScheduler(num_train_timesteps=d.num_train_timesteps, beta_schedule=d.beta_schedule,
                              beta_start=d.beta_start, beta_end=d.beta_end)
        self.alphas_cumprod = sched.alphas_cumprod
        self._empty_context: torch.Tensor | None = None

    def build_model(self) -> nn.Module:
        from uvic.models import UViTModel

        return UViTModel(**dataclasses.asdict(self.cfg.model))

    def build_dataset(self):
        from uvic.data.mscoco import MSCOCOFeatures

        dataset = MSCOCOFeatures(self.cfg.data.root, "train")
        m = self.cfg.model
        item = dataset[0]
        if tuple(item["x"].shape) != (2 * m.in_chans, m.img_size, m.img_size):
            raise ValueError(f"features in {self.cfg.data.root} have moments {tuple(item['x'].shape)}, but the "
                             f"model expects (2 * in_chans, img_size, img_size) = {(2 * m.in_chans, m.img_size, m.img_size)}")
        if tuple(item["context"].shape) != (m.num_clip_token, m.clip_dim):
            raise ValueError(f"features in {self.cfg.data.root} have contexts {tuple(item['context'].shape)}, but the "
                             f"model expects (num_clip_token, clip_dim) = {(m.num_clip_token, m.clip_dim)}")
        return dataset

    @property
    def empty_context(self) -> torch.Tensor:
        if self._empty_context is None:
            from uvic.data.mscoco import load_empty_context

            self._empty_context = load_empty_context(self.cfg.data.root)
        return self._empty_context

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor], rng: RNG) -> torch.Tensor:
        return t2i_diffusion_loss(model, batch["x"], batch["context"], self.empty_context, self.alphas_cumprod,
                                  self.cfg.data.latent_scale, rng, p_uncond=self.cfg.data.p_uncond)

    def load_vae(self):
        """The autoencoder named by `cfg.data.vae` with `scaling_factor = cfg.data.latent_scale`, or None if unset."""
        from diffusers import AutoencoderKL

        from uvic.models.autoencoder import load_ldm_autoencoder

        spec = self.cfg.data.vae
        if not spec:
            return None
        if Path(spec).is_dir():
            return AutoencoderKL.from_pretrained(spec, scaling_factor=self.cfg.data.latent_scale)
        return load_ldm_autoencoder(spec, scaling_factor=self.cfg.data.latent_scale)

    def pipeline(self, model: nn.Module, vae=None, sampler: str | None = None):
        """A `UViCText2ImagePipeline` around `model` with the configured (or given) sampler."""
        from uvic.pipelines.pipeline_uvic_t2i import UViCText2ImagePipeline
        from uvic.schedulers import build_scheduler

        vae = vae if vae is not None else self.load_vae()
        if vae is None:
            raise ValueError("data.vae is not set: a text-to-image pipeline needs the autoencoder")
        scheduler = build_scheduler(sampler or self.cfg.sample.sampler, self.cfg.diffusion)
        return UViCText2ImagePipeline(transformer=model, vae=vae, scheduler=scheduler)

    def on_sample(self, ema_model: nn.Module, step: int, run_dir: Path) -> None:
        """A grid for the first `num_images` captions of the val split (train if there is none)."""
        import numpy as np

        from uvic.data.mscoco import MSCOCOFeatures
        from uvic.pipelines.sampling import generate, save_grid

        vae = self.load_vae()
        if vae is None:
            logger.warning("data.vae is not set: no sample grid at step %d", step)
            return
        s, root = self.cfg.sample, Path(self.cfg.data.root)
        split = "val" if (root / "val" / "meta.json").is_file() else "train"
        features = MSCOCOFeatures(root, split)
        rows = np.arange(min(s.num_images, len(features)))
        device = next(ema_model.parameters()).device
        pipe = self.pipeline(ema_model, vae=vae.to(device))
        pipe.set_progress_bar_config(disable=True)
        images = generate(pipe, [s.seed + int(r) for r in rows], batch_size=s.batch_size,
                          num_inference_steps=s.num_inference_steps, prompt_embeds=features.context(rows),
                          negative_prompt_embeds=self.empty_context, guidance_scale=s.guidance_scale)
        path = Path(run_dir) / "samples" / f"step_{step:07d}.png"
        save_grid(images, path)
        logger.info("wrote %s", path)

    def export(self, ema_model: nn.Module, out_dir: Path) -> None:
        """The EMA model as a `UViCText2ImagePipeline` (needs `data.vae`; otherwise only `out_dir/transformer`)."""
        model = copy.deepcopy(ema_model).float().cpu()
        vae = self.load_vae()
        if vae is None:
            model.save_pretrained(Path(out_dir) / "transformer")
            logger.warning("data.vae is not set: exported only %s/transformer", out_dir)
            return
        self.pipeline(model, vae=vae).save_pretrained(str(out_dir))
        logger.info("exported the EMA model as a UViCText2ImagePipeline to %s", out_dir)
