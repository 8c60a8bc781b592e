"""The Stable Diffusion v1 KL-f8 autoencoder as U-ViT uses it for MS-COCO (docs/conventions.md, "VAE scale").

* `sd_v1_vae_config()` / `build_vae()`: diffusers `AutoencoderKL` with the SD v1 first-stage architecture and
  U-ViT's latent scale `scaling_factor=0.23010` stored in the model config (not SD's 0.18215). Everything
  downstream reads `vae.config.scaling_factor`.
* `encode_moments(vae, images)`: (B, 3, 256, 256) in [-1, 1] -> moments (B, 8, 32, 32) = [mean(4), logvar(4)],
  i.e. `quant_conv(encoder(x))`, what U-ViT stores per image.
* `sample_latents(moments, scaling_factor)`: the training latent
  `scale * (mean + exp(0.5 * clamp(logvar, -30, 20)) * eps)`, re-drawn at every step (not the posterior mean).
* `load_ldm_autoencoder(path)`: the LDM-format `autoencoder_kl.pth` that U-ViT distributes
  (`encoder.down.{i}.block.{j}...`, 1x1-conv attention), converted to diffusers keys with diffusers' own
  single-file converter; `load_vae(spec)`: that file or a diffusers folder, the one loader every `--vae` and
  `data.vae` goes through.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from diffusers import AutoencoderKL
from diffusers.utils.torch_utils import randn_tensor

from uvic.io import load_torch_data
from uvic.presets import UVIT_VAE_SCALE


logger = logging.getLogger(__name__)

__all__ = ["UVIT_VAE_SCALE", "sd_v1_vae_config", "build_vae", "load_ldm_autoencoder", "load_vae", "encode_moments",
           "sample_latents"]


def sd_v1_vae_config(scaling_factor: float = UVIT_VAE_SCALE) -> dict:
    """AutoencoderKL kwargs of the SD v1 KL-f8 first stage (ch 128, ch_mult 1,2,4,4, 2 res blocks, z 4)."""
    return {
        "in_channels": 3,
        "out_channels": 3,
        "down_block_types": ("DownEncoderBlock2D",) * 4,
        "up_block_types": ("UpDecoderBlock2D",) * 4,
        "block_out_channels": (128, 256, 512, 512),
        "layers_per_block": 2,
        "act_fn": "silu",
        "latent_channels": 4,
        "norm_num_groups": 32,
        "sample_size": 256,
        "scaling_factor": scaling_factor,
    }


def build_vae(scaling_factor: float = UVIT_VAE_SCALE, **overrides) -> AutoencoderKL:
    """A randomly initialised SD v1 AutoencoderKL; `overrides` change config entries (tests build tiny ones)."""
    return AutoencoderKL(**{**sd_v1_vae_config(scaling_factor), **overrides})


def load_ldm_autoencoder(
    path: str | os.PathLike, scaling_factor: float = UVIT_VAE_SCALE, config: dict | None = None
) -> AutoencoderKL:
    """Load an LDM-format KL autoencoder state dict (U-ViT's `assets/stable-diffusion/autoencoder_kl.pth`).

    Args:
        path: the `.pth` / `.ckpt` / `.safetensors` file; keys may carry a `first_stage_model.` prefix.
        scaling_factor: stored as `vae.config.scaling_factor` (U-ViT MS-COCO: 0.23010).
        config: AutoencoderKL kwargs (default: `sd_v1_vae_config(scaling_factor)`).
    Raises:
        FileNotFoundError: no such file. ValueError: the keys do not fit the architecture.
    """
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"autoencoder weights not found at {path}. U-ViT distributes them as "
            "assets/stable-diffusion/autoencoder_kl.pth (see its README); put the file there or pass its path."
        )
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = load_torch_data(path, what="autoencoder weights")  # tensors and plain data only
        state = state.get("state_dict", state)
    config = dict(config) if config is not None else sd_v1_vae_config(scaling_factor)
    config["scaling_factor"] = scaling_factor
    converted = convert_ldm_vae_checkpoint(state, config)
    vae = AutoencoderKL(**config)
    missing, unexpected = vae.load_state_dict(converted, strict=False)
    if missing or unexpected or len(converted) == 0:
        raise ValueError(
            f"{path} does not look like an LDM KL autoencoder for this config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]} (converted {len(converted)} of {len(state)} keys)"
        )
    logger.info("loaded LDM autoencoder %s (scaling_factor=%s)", path, scaling_factor)
    return vae.eval().requires_grad_(False)


# What `load_vae` takes, in words (its error and the extraction CLIs' --vae help).
VAE_SPEC = "U-ViT's assets/stable-diffusion/autoencoder_kl.pth (LDM format) or a diffusers AutoencoderKL folder"


def load_vae(spec: str | os.PathLike, scaling_factor: float) -> AutoencoderKL:
    """The autoencoder `spec` names: an LDM-format file (`load_ldm_autoencoder`) or a diffusers `AutoencoderKL`
    folder, with `scaling_factor` in its config.

    Raises:
        FileNotFoundError: `spec` is neither.
    """
    path = Path(spec)
    if path.is_file():
        return load_ldm_autoencoder(path, scaling_factor=scaling_factor)
    if path.is_dir():
        return AutoencoderKL.from_pretrained(path, scaling_factor=scaling_factor)
    raise FileNotFoundError(f"autoencoder {str(spec)!r} not found: pass {VAE_SPEC}")


@torch.no_grad()
def encode_moments(vae: AutoencoderKL, images: torch.Tensor) -> torch.Tensor:
    """
    Args:
        images: (B, 3, H, W) in [-1, 1].
    Returns:
        (B, 2 * latent_channels, H / 8, W / 8) moments [mean, logvar] (U-ViT `encode_moments`), float32.
    """
    return vae.encode(images.to(device=vae.device, dtype=vae.dtype)).latent_dist.parameters.float()


def sample_latents(
    moments: torch.Tensor,
    scaling_factor: float,
    generator: torch.Generator | None = None,
    eps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw a scaled latent from stored moments, as U-ViT's `FrozenAutoencoderKL.sample`.

    Args:
        moments: (B, 2C, h, w) [mean, logvar].
        scaling_factor: `vae.config.scaling_factor`.
        generator: for the standard-normal draw; eps: (B, C, h, w) the draw itself (then `generator` is unused).
    Returns:
        (B, C, h, w) `scaling_factor * (mean + exp(0.5 * clamp(logvar, -30, 20)) * eps)`.
    """
    mean, logvar = moments.chunk(2, dim=1)
    std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
    if eps is None:
        eps = randn_tensor(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
    elif eps.shape != mean.shape:
        raise ValueError(f"eps has shape {tuple(eps.shape)}, expected {tuple(mean.shape)}")
    return scaling_factor * (mean + std * eps)
