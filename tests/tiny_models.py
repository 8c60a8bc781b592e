"""Tiny model configs and state-dict helpers shared by several test folders (importable because tests/conftest.py
puts tests/ on sys.path).

A plain module rather than `conftest`: every test folder has its own conftest.py, so `from conftest import ...`
resolves to whichever one pytest imported first.
"""

import re
from types import SimpleNamespace

import torch


# A tiny SD-style VAE (16x16 images -> 4x8x8 latents) for the autoencoder and text-to-image tests.
VAE_TINY = {"block_out_channels": (8, 16), "down_block_types": ("DownEncoderBlock2D",) * 2,
            "up_block_types": ("UpDecoderBlock2D",) * 2, "layers_per_block": 1, "norm_num_groups": 4, "sample_size": 16}


def vae_state_to_ldm(state: dict, n_levels: int) -> dict:
    """diffusers `AutoencoderKL` state dict -> the original LDM autoencoder's (U-ViT's autoencoder_kl.pth) names.

    The inverse of the converter in `uvic.models.autoencoder`, written independently of it, so that tests can
    build official-format files from a tiny diffusers VAE. `n_levels`: len(block_out_channels).
    """
    out = {}
    for k, v in state.items():
        k = re.sub(r"down_blocks\.(\d+)\.resnets\.(\d+)", r"down.\1.block.\2", k)
        k = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0", r"down.\1.downsample", k)
        k = re.sub(r"up_blocks\.(\d+)\.resnets\.(\d+)", lambda m: f"up.{n_levels - 1 - int(m[1])}.block.{m[2]}", k)
        k = re.sub(r"up_blocks\.(\d+)\.upsamplers\.0", lambda m: f"up.{n_levels - 1 - int(m[1])}.upsample", k)
        k = re.sub(r"mid_block\.resnets\.(\d+)", lambda m: f"mid.block_{int(m[1]) + 1}", k)
        k = k.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
        if "mid_block.attentions.0" in k:
            k = k.replace("mid_block.attentions.0", "mid.attn_1")
            for a, b in [("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")]:
                k = k.replace(f".{a}.", f".{b}.")
            if v.dim() == 2:  # LDM attention projections are 1x1 convolutions
                v = v[:, :, None, None]
        out[k] = v.clone()
    return out


def tiny_t2i_config(root, run_dir, vae_dir, *, model=None, data=None, train=None, sample=None):
    """A seconds-long text-to-image run config on the tiny MS-COCO features of the `make_tiny_coco` fixture (CLIP
    width 16, 5 tokens; the tiny VAE's 8x8x4 latents): a U-ViT of width 16 and depth 2 on the discrete SD schedule,
    one step at batch 2 that saves a checkpoint, samples of 2 images with 2 U-ViT DPM-Solver steps.

    root: the features root; run_dir: the run folder; vae_dir: the saved tiny VAE. model, data, train, sample:
    fields of that config section that replace (or add to) these defaults.
    """
    from uvic.config import (
        DiffusionConfig,
        SampleConfig,
        Text2ImageDataConfig,
        Text2ImageRunConfig,
        TrainConfig,
        UViTConfig,
    )

    model = {"img_size": 8, "patch_size": 2, "in_chans": 4, "embed_dim": 16, "depth": 2, "num_heads": 2,
             "clip_dim": 16, "num_clip_token": 5, **(model or {})}
    data = {"root": str(root), "num_workers": 0, "vae": str(vae_dir), **(data or {})}
    train = {"run_dir": str(run_dir), "max_steps": 1, "batch_size": 2, "warmup_steps": 0, "log_every": 1,
             "sample_every": 0, "save_every": 1, "log_with": "none", **(train or {})}
    sample = {"sampler": "uvit_dpm_solver", "num_inference_steps": 2, "num_images": 2, **(sample or {})}
    return Text2ImageRunConfig(
        model=UViTConfig(**model),
        diffusion=DiffusionConfig(schedule="discrete", beta_schedule="scaled_linear", beta_start=0.00085,
                                  beta_end=0.012),
        data=Text2ImageDataConfig(**data),
        train=TrainConfig(**train),
        sample=SampleConfig(**sample),
    )


class SpyDenoiser(torch.nn.Module):
    """A denoiser for tests of what a loss feeds the network: it predicts zero noise (x * w, w = 0, so the loss is
    the noise's mean square) and records each call as (x, t, condition), the condition being what the call passed
    under `keyword` ("class_labels", "encoder_hidden_states"; None if nothing). Any other keyword is an error."""

    def __init__(self, keyword: str):
        super().__init__()
        self.keyword = keyword
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.calls = []

    def forward(self, x, t, **condition):
        if set(condition) - {self.keyword}:
            raise TypeError(f"the network takes {self.keyword}=, got {sorted(condition)}")
        self.calls.append((x, t, condition.get(self.keyword)))
        return SimpleNamespace(sample=x * self.w)
