"""`UViCPipeline`: unconditional (or class-conditional) image generation with a U-ViT / U-ViC transformer."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import DiffusionPipeline, ImagePipelineOutput
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils.torch_utils import randn_tensor

# Imported so that `from_pretrained` can load the saved scheduler: diffusers only resolves component modules
# that are already imported (it will not import a module named in a config file).
import uvic.schedulers  # noqa: F401
from uvic.models import UViTModel
from uvic.pipelines.export import ExportedPipelineMixin
from uvic.schedulers.timesteps import network_timestep_for


def postprocess_images(images: torch.Tensor, output_type: str) -> torch.Tensor | np.ndarray | list:
    """(B, C, H, W) images in [-1, 1] -> [0, 1] in float32 as "pt" (B, C, H, W), "np" (B, H, W, C) or "pil"."""
    images = (images.float() / 2 + 0.5).clamp(0, 1)
    if output_type == "pt":
        return images
    images = images.cpu().permute(0, 2, 3, 1).numpy()
    return DiffusionPipeline.numpy_to_pil(images) if output_type == "pil" else images


class UViCPipeline(ExportedPipelineMixin, DiffusionPipeline):
    """Pixel-space diffusion sampling with a `UViTModel` noise predictor and any scheduler from `uvic.schedulers`.

    Each entry t of `scheduler.timesteps` reaches the network as `network_timestep_for(scheduler, t)`
    (`uvic.schedulers.timesteps`, shared with the training loss): 999 t for the VP-SDE schedulers (continuous t),
    t + 1 for diffusers' discrete schedulers (U-ViT's 1-based DDPM step).

    A saved pipeline loads with `UViCPipeline.from_pretrained(dir)`, or with diffusers' generic
    `DiffusionPipeline.from_pretrained(dir, trust_remote_code=True)` (see `uvic.pipelines.export`).

    Args:
        transformer: the `UViTModel` (eps-prediction).
        scheduler: e.g. `VPSDEEulerMaruyamaScheduler`, `VPSDEDPMSolverScheduler`, `DDIMScheduler`.
    """

    model_cpu_offload_seq = "transformer"
    _module_file = "pipeline_uvic"

    def __init__(self, transformer: UViTModel, scheduler: SchedulerMixin) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)

    @torch.no_grad()
    def __call__(
        self,
        batch_size: int = 1,
        num_inference_steps: int = 50,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        class_labels: torch.Tensor | list[int] | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
    ) -> ImagePipelineOutput | tuple:
        """
        Args:
            batch_size: number of images B (ignored when `latents` is given).
            num_inference_steps: sampler steps (network evaluations for the schedulers in `uvic.schedulers`).
            generator: one generator, or a list of B generators so each image depends on its own seed only.
            latents: (B, C, H, W) starting noise x_T; drawn with `randn_tensor` when None.
            class_labels: (B,) class ids for a class-conditional transformer (`num_classes > 0`).
            output_type: "pil" (list of PIL images), "np" ((B, H, W, C) float32 in [0, 1]) or "pt"
                ((B, C, H, W) float32 in [0, 1]).
            return_dict: return an `ImagePipelineOutput` instead of a tuple.
        Returns:
            `ImagePipelineOutput` with `images`, or `(images,)`.
        """
        if output_type not in ("pil", "np", "pt"):
            raise ValueError(f"output_type must be 'pil', 'np' or 'pt', got {output_type!r}")
        cfg = self.transformer.config
        device, dtype = self._execution_device, self.transformer.dtype

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

        # 2. Conditioning.
        labels = self._check_labels(class_labels, batch_size, device)

        # 3. Denoising loop.
        self.scheduler.set_timesteps(num_inference_steps, device=device)
        for t in self.progress_bar(self.scheduler.timesteps):
            model_input = self.scheduler.scale_model_input(latents, t)
            timestep = network_timestep_for(self.scheduler, t.to(device)).expand(batch_size)
            eps = self.transformer(model_input, timestep, class_labels=labels).sample
            latents = self.scheduler.step(eps, t, latents, generator=generator).prev_sample

        # 4. [-1, 1] -> [0, 1], in float32 before any numpy conversion.
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
            raise ValueError(f"the transformer is class-conditional ({num_classes} classes): pass class_labels")
        labels = torch.as_tensor(class_labels, device=device, dtype=torch.long).reshape(-1)
        if labels.numel() == 1:
            labels = labels.expand(batch_size)
        if labels.numel() != batch_size:
            raise ValueError(f"got {labels.numel()} class labels for a batch of {batch_size}")
        if labels.min() < 0 or labels.max() >= num_classes:
            raise ValueError(f"class labels must be in [0, {num_classes}), got {labels.tolist()}")
        return labels
