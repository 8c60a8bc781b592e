"""Tiny model configs and state-dict helpers shared by several test folders (importable because tests/conftest.py
puts tests/ on sys.path).

A plain module rather than `conftest`: every test folder has its own conftest.py, so `from conftest import ...`
resolves to whichever one pytest imported first.
"""

import re


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
