"""`UViCText2ImagePipeline`: text-to-image latent diffusion with a U-ViT / U-ViC transformer (MS-COCO recipe).

Reproducing U-ViT's MS-COCO numbers (docs/conventions.md, "MS-COCO text-to-image") takes: `UViTDPMSolverScheduler`
with 50 steps, `guidance_scale=2.0` (the official `scale=1.0`), CLIP ViT-L/14 `last_hidden_state` contexts with
the empty caption as the unconditional context, and the VAE decode with `vae.config.scaling_factor` (0.23010).

Guidance (`guided_epsilon`) is diffusers' convention eps_u + g (eps_c - eps_u). U-ViT's `eps_c + s (eps_c - eps_u)`
is the same with g = 1 + s (`official_to_guidance_scale`), so the official `scale=1.0` is `guidance_scale=2.0`
(docs/conventions.md, "Guidance").
"""

from __future__ import annotations

import os

import torch
from diffusers import AutoencoderKL, DiffusionPipeline, ImagePipelineOutput
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils.torch_utils import randn_tensor

from uvic.guidance import DEFAULT_GUIDANCE_SCALE, official_to_guidance_scale
from uvic.models import UViTModel
from uvic.models.text_encoder import CLIPTextEncoder
from uvic.pipelines.export import ExportedPipelineMixin
from uvic.pipelines.pipeline_uvic import denoise, guided_epsilon, postprocess_images


__all__ = ["UViCText2ImagePipeline", "guided_epsilon", "official_to_guidance_scale"]


class UViCText2ImagePipeline(ExportedPipelineMixin, DiffusionPipeline):
    """Text-to-image sampling: CLIP text features -> U-ViT epsilon with classifier-free guidance -> VAE decode.

    The network is fed `network_timestep_for(scheduler, t) = t + 1` for every scheduler timestep t (the U-ViT
    MS-COCO index convention; `uvic.schedulers.timesteps`, shared with the training loss), so
    `UViTDPMSolverScheduler` (the official sampler, fractional t) and diffusers' discrete schedulers
    (`DPMSolverMultistepScheduler`, `DDIMScheduler`, ... with the same scaled_linear betas) both work.

    A saved pipeline loads with `UViCText2ImagePipeline.from_pretrained(dir)`, or with diffusers' generic
    `DiffusionPipeline.from_pretrained(dir, trust_remote_code=True)` (see `uvic.pipelines.export`).

    Args:
        transformer: a text-conditional `UViTModel` (`clip_dim` set), epsilon prediction.
        vae: `AutoencoderKL` whose `config.scaling_factor` is the latent scale the transformer was trained with.
        scheduler: a diffusers-compatible scheduler on the training schedule.
        text_encoder: optional `CLIPTextEncoder`; without it, pass `prompt_embeds` (and `negative_prompt_embeds`).
    """

    model_cpu_offload_seq = "text_encoder->transformer->vae"
    _optional_components = ["text_encoder"]
    _module_file = "pipeline_uvic_t2i"

    def __init__(
        self,
        transformer: UViTModel,
        vae: AutoencoderKL,
        scheduler: SchedulerMixin,
        text_encoder: CLIPTextEncoder | None = None,
    ) -> None:
        super().__init__()
        self.register_modules(transformer=transformer, vae=vae, scheduler=scheduler, text_encoder=text_encoder)

    @classmethod
    def from_official(
        cls,
        nnet_path: str | os.PathLike,
        autoencoder_path: str | os.PathLike,
        attention: str = "cog",
        text_encoder: CLIPTextEncoder | None = None,
        nnet_config: dict | None = None,
        vae_config: dict | None = None,
        attention_backend: str = "auto",
    ) -> UViCText2ImagePipeline:
        """The released MS-COCO models: a U-ViT / U-ViC `nnet_ema.pth`, U-ViT's `autoencoder_kl.pth`, the
        official DPM-Solver++.

        Args:
            nnet_path: official `nnet_ema.pth` (U-ViT README, or CogAttn readme `cog_nnet_ema.pth`).
            autoencoder_path: `assets/stable-diffusion/autoencoder_kl.pth` (LDM format, scale 0.23010).
            attention: "cog" for U-ViC (`uvit_t2i_np`, np=True), "softmax" for U-ViT; the weights cannot tell.
            text_encoder: e.g. `CLIPTextEncoder.from_open_clip()`; None for stored-feature sampling.
            nnet_config: official `config.nnet` (default: U-ViT `configs/mscoco_uvit_small.py`'s, S/2, the preset
                "uvit-s2-mscoco").
            vae_config: AutoencoderKL kwargs (default: SD v1 KL-f8).
        """
        from uvic.attention import check_attention_kind
        from uvic.models.autoencoder import UVIT_VAE_SCALE, load_ldm_autoencoder
        from uvic.models.uvit import uvit_from_official
        from uvic.presets import official_nnet
        from uvic.schedulers.scheduling_dpmsolver_uvit import UViTDPMSolverScheduler

        check_attention_kind(attention)
        nnet = dict(nnet_config) if nnet_config is not None else official_nnet("uvit-s2-mscoco")
        nnet["np"] = attention == "cog"
        transformer = uvit_from_official(nnet, nnet_path, attention_backend=attention_backend).eval()
        vae = load_ldm_autoencoder(autoencoder_path, scaling_factor=UVIT_VAE_SCALE, config=vae_config)
        return cls(transformer=transformer, vae=vae, scheduler=UViTDPMSolverScheduler(), text_encoder=text_encoder)

    def encode_prompt(self, prompt: str | list[str]) -> torch.Tensor:
        """Text -> (B, L, D) context with the pipeline's text encoder (official 77-token EOT padding)."""
        if self.text_encoder is None:
            raise ValueError("this pipeline has no text_encoder: pass prompt_embeds (and negative_prompt_embeds)")
        return self.text_encoder.encode_text(prompt)

    def _contexts(self, prompt, prompt_embeds, negative_prompt, negative_prompt_embeds, guided: bool):
        if (prompt is None) == (prompt_embeds is None):
            raise ValueError("pass exactly one of `prompt` and `prompt_embeds`")
        cond = self.encode_prompt(prompt) if prompt is not None else prompt_embeds
        if cond.dim() != 3:
            raise ValueError(f"prompt_embeds must have shape (B, L, D), got {tuple(cond.shape)}")
        if not guided:
            return cond, None
        if negative_prompt_embeds is None:
            if self.text_encoder is None:
                raise ValueError(
                    "guidance_scale > 1 needs the unconditional context: pass negative_prompt_embeds (the empty-caption "
                    "features, e.g. empty_context.npy of the extracted MS-COCO features) or give the pipeline a text_encoder"
                )
            negative = "" if negative_prompt is None else negative_prompt
            negative_prompt_embeds = self.encode_prompt(negative)
        uncond = negative_prompt_embeds
        if uncond.dim() == 2:
            uncond = uncond[None]
        if uncond.shape[0] == 1:
            uncond = uncond.expand(cond.shape[0], -1, -1)
        if uncond.shape != cond.shape:
            raise ValueError(f"negative_prompt_embeds {tuple(uncond.shape)} does not match prompt_embeds {tuple(cond.shape)}")
        return cond, uncond

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str] | None = None,
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt: str | list[str] | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        guidance_scale: float = DEFAULT_GUIDANCE_SCALE,
        num_inference_steps: int = 50,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "pil",
        return_dict: bool = True,
    ) -> ImagePipelineOutput | tuple:
        """
        Args:
            prompt: one caption or a list of B captions (needs `text_encoder`).
            prompt_embeds: (B, L, D) caption features instead of `prompt` (e.g. stored CLIP features).
            negative_prompt: unconditional caption(s); the empty string when None (U-ViT's null condition).
            negative_prompt_embeds: (L, D), (1, L, D) or (B, L, D) unconditional features (the empty caption's).
            guidance_scale: g in eps_u + g (eps_c - eps_u); U-ViT's `scale=s` is g = 1 + s (official s = 1 -> 2.0);
                g <= 1 runs the conditional model only.
            num_inference_steps: network evaluations per image and context (x2 forwards with guidance).
            num_images_per_prompt: images per caption.
            generator: one generator, or one per image so each image depends on its own seed only.
            latents: (B, C, h, w) starting noise; drawn with `randn_tensor` when None.
            output_type: "pil", "np" ((B, H, W, 3) float32 in [0, 1]), "pt" ((B, 3, H, W) float32 in [0, 1]) or
                "latent" (the final (B, C, h, w) scaled latents, before the VAE).
            return_dict: return an `ImagePipelineOutput` instead of a tuple.
        Returns:
            `ImagePipelineOutput` with `images`, or `(images,)`.
        """
        if output_type not in ("pil", "np", "pt", "latent"):
            raise ValueError(f"output_type must be 'pil', 'np', 'pt' or 'latent', got {output_type!r}")
        cfg = self.transformer.config
        if cfg.clip_dim is None:
            raise ValueError("the transformer is not text-conditional (clip_dim is None)")
        device, dtype = self._execution_device, self.transformer.dtype
        guided = guidance_scale > 1.0

        # 1. Contexts: (B, L, D) conditional and, with guidance, unconditional.
        cond, uncond = self._contexts(prompt, prompt_embeds, negative_prompt, negative_prompt_embeds, guided)
        cond = cond.to(device=device, dtype=dtype).repeat_interleave(num_images_per_prompt, dim=0)
        if uncond is not None:
            uncond = uncond.to(device=device, dtype=dtype).repeat_interleave(num_images_per_prompt, dim=0)
        batch_size = cond.shape[0]

        # 2. Starting noise x_T.
        shape = (batch_size, cfg.in_chans, cfg.img_size, cfg.img_size)
        if latents is None:
            if isinstance(generator, list) and len(generator) != batch_size:
                raise ValueError(f"got {len(generator)} generators for {batch_size} images")
            latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
        elif tuple(latents.shape) != shape:
            raise ValueError(f"latents must have shape {shape}, got {tuple(latents.shape)}")
        else:
            latents = latents.to(device=device, dtype=dtype)
        latents = latents * self.scheduler.init_noise_sigma

        # 3. Denoising loop; guidance on epsilon, before the solver turns it into a data prediction.
        context = torch.cat([cond, uncond]) if guided else cond
        latents = denoise(self, latents, num_inference_steps, guidance_scale, generator, device,
                          encoder_hidden_states=context)

        # 4. Decode z / scaling_factor with the VAE; [-1, 1] -> [0, 1] in float32.
        if output_type == "latent":
            images = latents
        else:
            z = latents.to(self.vae.dtype) / self.vae.config.scaling_factor
            images = postprocess_images(self.vae.decode(z).sample, output_type)
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images) if return_dict else (images,)
