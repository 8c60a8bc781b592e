"""`UViCPipeline`: unconditional or class-conditional generation with a U-ViT / U-ViC transformer, in pixels or in
the latent space of a VAE.

Class-conditional guidance follows U-ViT's `eval_ldm.py` / `eval_ldm_discrete.py` (ImageNet 256 / 512): the
unconditional branch is
the null class, the model's last class id (`transformer.config.num_classes - 1`, 1000 of 1001), and guidance acts on
epsilon before the solver. `guidance_scale` is diffusers' g in eps_u + g (eps_c - eps_u); U-ViT's
`eps_c + s (eps_c - eps_u)` is g = 1 + s, so its 0.4 (256) is 1.4 and its 0.7 (512) is 1.7; g <= 1 is one model
call per step. `from_official` builds the released ImageNet models with their official sampling settings.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKL, DiffusionPipeline, ImagePipelineOutput
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils.torch_utils import randn_tensor

# Imported so that `from_pretrained` can load the saved scheduler: diffusers only resolves component modules
# that are already imported (it will not import a module named in a config file). This module imports the other
# one that holds uvic's scheduler classes, `scheduling_vpsde`.
import uvic.schedulers.scheduling_dpmsolver_uvit  # noqa: F401
from uvic.guidance import official_to_guidance_scale
from uvic.models import UViTModel
from uvic.pipelines.export import ExportedPipelineMixin
from uvic.presets import official_nnet
from uvic.schedulers.noise_schedule import SCHEDULE_PRESETS
from uvic.schedulers.timesteps import network_timestep_for


logger = logging.getLogger(__name__)


def guided_epsilon(eps_cond: torch.Tensor, eps_uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance, diffusers convention: eps_u + g (eps_c - eps_u). Shapes (B, C, H, W)."""
    return eps_uncond + guidance_scale * (eps_cond - eps_uncond)


def denoise(
    pipeline: DiffusionPipeline,
    latents: torch.Tensor,
    num_inference_steps: int,
    guidance_scale: float,
    generator: torch.Generator | list[torch.Generator] | None,
    device: torch.device,
    **conditioning: torch.Tensor | None,
) -> torch.Tensor:
    """The denoising loop of both pipelines: `pipeline.scheduler` runs `num_inference_steps` steps from the scaled
    starting noise `latents` (B, C, H, W), each on the epsilon of `pipeline.transformer` fed the network timestep.

    With guidance (`guidance_scale` > 1) each step is one transformer call on the doubled batch [conditional,
    unconditional], so every `conditioning` tensor (the transformer's keyword arguments, e.g. `class_labels` (2B,)
    or `encoder_hidden_states` (2B, L, D)) must come batched that way; epsilon is guided (`guided_epsilon`) before
    the solver turns it into a data prediction. Returns the final latents (B, C, H, W).
    """
    guided = guidance_scale > 1.0
    scheduler = pipeline.scheduler
    scheduler.set_timesteps(num_inference_steps, device=device)
    for t in pipeline.progress_bar(scheduler.timesteps):
        model_input = scheduler.scale_model_input(latents, t)
        model_input = torch.cat([model_input] * 2) if guided else model_input
        timestep = network_timestep_for(scheduler, t.to(device)).expand(model_input.shape[0])
        eps = pipeline.transformer(model_input, timestep, **conditioning).sample
        if guided:
            eps_cond, eps_uncond = eps.chunk(2)
            eps = guided_epsilon(eps_cond, eps_uncond, guidance_scale)
        latents = scheduler.step(eps, t, latents, generator=generator).prev_sample
    return latents


def postprocess_images(images: torch.Tensor, output_type: str) -> torch.Tensor | np.ndarray | list:
    """(B, C, H, W) images in [-1, 1] -> [0, 1] in float32 as "pt" (B, C, H, W), "np" (B, H, W, C) or "pil"."""
    images = (images.float() / 2 + 0.5).clamp(0, 1)
    if output_type == "pt":
        return images
    images = images.cpu().permute(0, 2, 3, 1).numpy()
    return DiffusionPipeline.numpy_to_pil(images) if output_type == "pil" else images


# The released class-conditional U-ViT models (baofff/U-ViT configs/imagenet*_uvit_*.py): the model preset of the
# `nnet` section, the forward process (a preset of `SCHEDULE_PRESETS`), the label dropout (`dataset.p_uncond`) and
# the guidance (`sample.scale`) of each config. The README trains and evaluates the L latent models with
# train_ldm.py / eval_ldm.py (the continuous VP-SDE, as ImageNet 64) and the H ones with train_ldm_discrete.py /
# eval_ldm_discrete.py (the discrete SD schedule).
_OFFICIAL_IMAGENET_PRESETS: dict[str, tuple[str, str, float, float]] = {
    # name: (model preset, diffusion preset, p_uncond, scale)
    "imagenet64_uvit_mid": ("uvit-m4-imagenet64", "vpsde", 0.0, 0.0),
    "imagenet64_uvit_large": ("uvit-l4-imagenet64", "vpsde", 0.0, 0.0),
    "imagenet256_uvit_large": ("uvit-l2-imagenet256", "vpsde", 0.15, 0.4),
    "imagenet256_uvit_huge": ("uvit-h2-imagenet256", "stable-diffusion", 0.1, 0.4),
    "imagenet512_uvit_large": ("uvit-l4-imagenet512", "vpsde", 0.15, 0.7),
    "imagenet512_uvit_huge": ("uvit-h4-imagenet512", "stable-diffusion", 0.1, 0.7),
}
# name -> {"nnet": the official nnet config, "preset", "diffusion": the presets, "schedule": "vpsde" | "discrete",
# "p_uncond", "scale"}.
OFFICIAL_IMAGENET: dict[str, dict[str, Any]] = {
    name: {"nnet": official_nnet(preset), "preset": preset, "diffusion": diffusion,
           "schedule": SCHEDULE_PRESETS[diffusion]["schedule"], "p_uncond": p_uncond, "scale": scale}
    for name, (preset, diffusion, p_uncond, scale) in _OFFICIAL_IMAGENET_PRESETS.items()
}


class UViCPipeline(ExportedPipelineMixin, DiffusionPipeline):
    """Diffusion sampling with a `UViTModel` noise predictor and any scheduler from `uvic.schedulers`, in pixels or
    (with a `vae`) in latents.

    Each entry t of `scheduler.timesteps` reaches the network as `network_timestep_for(scheduler, t)`
    (`uvic.schedulers.timesteps`, shared with the training loss): 999 t for the VP-SDE schedulers (continuous t),
    t + 1 for diffusers' discrete schedulers (U-ViT's 1-based DDPM step).

    A saved pipeline loads with `UViCPipeline.from_pretrained(dir)`, or with diffusers' generic
    `DiffusionPipeline.from_pretrained(dir, trust_remote_code=True)` (see `uvic.pipelines.export`).

    Args:
        transformer: the `UViTModel` (eps-prediction).
        scheduler: e.g. `VPSDEEulerMaruyamaScheduler`, `VPSDEDPMSolverScheduler`, `UViTDPMSolverScheduler`.
        vae: for a latent model, the `AutoencoderKL` whose `config.scaling_factor` the latents were trained with
            (U-ViT ImageNet: 0.18215); its latent channels must be the transformer's `in_chans`.
        null_class: the transformer's last class id (`num_classes - 1`) is the null label of classifier-free
            guidance; the labels a caller may ask for are then [0, num_classes - 1).
        label_dropout: the probability with which the labels were replaced by the null class in training
            (U-ViT's `p_uncond`); guidance on a model trained with 0 gets a warning.
        class_counts: (K,) training images per class, for drawing FID labels in training proportions (U-ViT's
            ImageNet 64 `sample_label`); None where labels are drawn uniformly.
        default_guidance_scale: the guidance `__call__` uses when given none (the official one of the model).
    """

    model_cpu_offload_seq = "transformer->vae"
    _optional_components = ["vae"]
    _module_file = "pipeline_uvic"

    def __init__(
        self,
        transformer: UViTModel,
        scheduler: SchedulerMixin,
        vae: AutoencoderKL | None = None,
        null_class: bool = False,
        label_dropout: float = 0.0,
        class_counts: list[int] | None = None,
        default_guidance_scale: float = 1.0,
    ) -> None:
        super().__init__()
        cfg = transformer.config
        if vae is not None and vae.config.latent_channels != cfg.in_chans:
            raise ValueError(f"the VAE has {vae.config.latent_channels} latent channels but the transformer takes "
                             f"in_chans={cfg.in_chans}: they must match")
        if null_class and cfg.num_classes < 2:
            raise ValueError(f"null_class needs a class-conditional transformer with at least 2 classes, "
                             f"got num_classes={cfg.num_classes}")
        if not 0.0 <= label_dropout <= 1.0:
            raise ValueError(f"label_dropout must be in [0, 1], got {label_dropout}")
        if class_counts is not None:
            class_counts = [int(c) for c in class_counts]
            if len(class_counts) != cfg.num_classes - int(null_class) or min(class_counts) < 0 or sum(class_counts) == 0:
                raise ValueError(f"class_counts must hold {cfg.num_classes - int(null_class)} non-negative counts "
                                 f"(one per class), got {len(class_counts)}")
        self.register_modules(transformer=transformer, scheduler=scheduler, vae=vae)
        self.register_to_config(null_class=null_class, label_dropout=float(label_dropout), class_counts=class_counts,
                                default_guidance_scale=float(default_guidance_scale))
        self._warned_no_dropout = False

    @property
    def num_labels(self) -> int:
        """The number of class ids a caller may ask for (the null class excluded); 0 if not class-conditional."""
        k = self.transformer.config.num_classes
        return max(k, 0) - int(self.config.null_class)

    @classmethod
    def from_official(
        cls,
        name: str,
        nnet_path: str | os.PathLike,
        autoencoder_path: str | os.PathLike | None = None,
        *,
        class_counts: list[int] | None = None,
        nnet_config: dict | None = None,
        vae_config: dict | None = None,
        attention_backend: str = "auto",
    ) -> UViCPipeline:
        """A released U-ViT ImageNet model with the official sampler and guidance.

        Sampling settings, as the U-ViT README evaluates each config (sampler "uvit_dpm_solver", 50 steps):
        ImageNet 64 (`eval.py`) and the L latent models (`eval_ldm.py`) on the continuous VP-SDE with
        DPM-Solver-fast, the H latent models (`eval_ldm_discrete.py`) on the discrete SD schedule with
        DPM-Solver++; the latent models with guidance 1 + 0.4 (256) or 1 + 0.7 (512) and the null class 1000,
        decoded with the VAE at scale 0.18215; ImageNet 64 without guidance.

        Args:
            name: the official config, one of `OFFICIAL_IMAGENET` (e.g. "imagenet256_uvit_huge").
            nnet_path: the released `imagenet*_uvit_*.pth` (a bare state dict, loaded strictly).
            autoencoder_path: for 256 / 512, U-ViT's `assets/stable-diffusion/autoencoder_kl.pth` (the Huge
                configs decode with `autoencoder_kl_ema.pth`), LDM format.
            class_counts: ImageNet 64 only: training images per class (`ImageNet(root).class_counts()`), for
                `sample.py --class-labels random`.
            nnet_config: replaces the config's `nnet` section (e.g. a tiny model of the same kind in tests).
            vae_config: AutoencoderKL kwargs (default: SD v1 KL-f8).
            attention_backend: the `uvic.attention` backend.
        """
        from uvic.config import DiffusionConfig
        from uvic.data.imagenet import LATENT_SCALE
        from uvic.models.autoencoder import load_ldm_autoencoder
        from uvic.models.uvit import uvit_from_official
        from uvic.schedulers import build_scheduler

        if name not in OFFICIAL_IMAGENET:
            raise ValueError(f"unknown official ImageNet config {name!r}; expected one of {sorted(OFFICIAL_IMAGENET)}")
        spec = OFFICIAL_IMAGENET[name]
        latent = spec["nnet"]["in_chans"] == 4  # SD-VAE latents (256 / 512), else pixels (64)
        if latent and autoencoder_path is None:
            raise ValueError(f"{name} is a latent model: pass autoencoder_path (U-ViT's autoencoder_kl.pth)")
        if not latent and autoencoder_path is not None:
            raise ValueError(f"{name} is a pixel model: it takes no autoencoder")
        nnet = spec["nnet"] if nnet_config is None else nnet_config
        transformer = uvit_from_official(nnet, nnet_path, attention_backend=attention_backend).eval()
        vae = load_ldm_autoencoder(autoencoder_path, scaling_factor=LATENT_SCALE, config=vae_config) if latent else None
        scheduler = build_scheduler("uvit_dpm_solver", DiffusionConfig.from_preset(spec["diffusion"]))
        return cls(transformer=transformer, scheduler=scheduler, vae=vae, null_class=latent,
                   label_dropout=spec["p_uncond"], class_counts=class_counts,
                   default_guidance_scale=official_to_guidance_scale(spec["scale"]))

    @torch.no_grad()
    def __call__(
        self,
        batch_size: int = 1,
        num_inference_steps: int = 50,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        class_labels: torch.Tensor | list[int] | None = None,
        guidance_scale: float | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
    ) -> ImagePipelineOutput | tuple:
        """
        Args:
            batch_size: number of images B (ignored when `latents` is given).
            num_inference_steps: sampler steps (network evaluations for the schedulers in `uvic.schedulers`).
            generator: one generator, or a list of B generators so each image depends on its own seed only.
            latents: (B, C, h, w) starting noise x_T; drawn with `randn_tensor` when None.
            class_labels: (B,) class ids (or one id for all) for a class-conditional transformer, in
                [0, num_labels).
            guidance_scale: g in eps_u + g (eps_c - eps_u) with the null class as the unconditional branch
                (U-ViT's scale s is g = 1 + s); g <= 1 is the conditional model alone, one call per step.
                None: `config.default_guidance_scale`.
            output_type: "pil" (list of PIL images), "np" ((B, H, W, C) float32 in [0, 1]), "pt"
                ((B, C, H, W) float32 in [0, 1]) or, with a VAE, "latent" (the final (B, C, h, w) latents).
            return_dict: return an `ImagePipelineOutput` instead of a tuple.
        Returns:
            `ImagePipelineOutput` with `images`, or `(images,)`.
        """
        allowed = ("pil", "np", "pt", "latent") if self.vae is not None else ("pil", "np", "pt")
        if output_type not in allowed:
            raise ValueError(f"output_type must be one of {allowed} for this pipeline, got {output_type!r}")
        cfg = self.transformer.config
        device, dtype = self._execution_device, self.transformer.dtype
        g = self.config.default_guidance_scale if guidance_scale is None else float(guidance_scale)
        guided = g > 1.0

        # 1. Starting noise x_T, one slice per generator when a list is given.
        if latents is None:
            if isinstance(generator, list) and len(generator) != batch_size:
                raise ValueError(f"got {len(generator)} generators for batch_size={batch_size}")
            shape = (batch_size, cfg.in_chans, cfg.img_size, cfg.img_size)
            latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
        else:
            latents = latents.to(device=device, dtype=dtype)
        batch_size = latents.shape[0]
        latents = latents * self.scheduler.init_noise_sigma

        # 2. Conditioning; with guidance the batch is [conditional, null class] (two U-ViT calls in one).
        labels = self._check_labels(class_labels, batch_size, device)
        if guided:
            self._check_guidance(g)
            labels = torch.cat([labels, torch.full_like(labels, cfg.num_classes - 1)])

        # 3. Denoising loop; guidance on epsilon, before the solver turns it into a data prediction.
        latents = denoise(self, latents, num_inference_steps, g, generator, device, class_labels=labels)

        # 4. Decode z / scaling_factor with the VAE (latent models); [-1, 1] -> [0, 1] in float32.
        if output_type == "latent":
            images = latents
        elif self.vae is not None:
            z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
            images = postprocess_images(self.vae.decode(z).sample, output_type)
        else:
            images = postprocess_images(latents, output_type)
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)

    def _check_labels(self, class_labels, batch_size: int, device: torch.device) -> torch.Tensor | None:
        num_classes = self.transformer.config.num_classes
        if num_classes is None or num_classes <= 0:
            if class_labels is not None:
                raise ValueError("class_labels given, but the transformer is not class-conditional (num_classes <= 0)")
            return None
        if class_labels is None:
            raise ValueError(f"the transformer is class-conditional ({self.num_labels} classes): pass class_labels")
        labels = torch.as_tensor(class_labels, device=device, dtype=torch.long).reshape(-1)
        if labels.numel() == 1:
            labels = labels.expand(batch_size)
        if labels.numel() != batch_size:
            raise ValueError(f"got {labels.numel()} class labels for a batch of {batch_size}")
        k = self.num_labels
        if labels.min() < 0 or labels.max() >= k:
            null = f" ({num_classes - 1} is the null class)" if self.config.null_class else ""
            raise ValueError(f"class labels must be in [0, {k}){null}, got min {int(labels.min())} "
                             f"max {int(labels.max())}")
        return labels

    def _check_guidance(self, guidance_scale: float) -> None:
        if self.transformer.config.num_classes <= 0:
            raise ValueError(f"guidance_scale={guidance_scale} needs a class-conditional transformer")
        if not self.config.null_class:
            raise ValueError(f"guidance_scale={guidance_scale} > 1 needs a null class, and this pipeline has none "
                             "(null_class=False): use guidance_scale=1")
        if self.config.label_dropout == 0 and not self._warned_no_dropout:
            logger.warning("guidance_scale=%s on a model trained without label dropout (label_dropout=0): its null "
                           "class was never trained, so the unconditional branch is meaningless", guidance_scale)
            self._warned_no_dropout = True
