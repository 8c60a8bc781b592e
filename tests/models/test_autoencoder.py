"""SD v1 VAE with U-ViT's scale, latent sampling from moments, and the LDM-checkpoint converter."""

import re

import pytest
import torch

from uvic.models.autoencoder import (
    UVIT_VAE_SCALE,
    build_vae,
    encode_moments,
    load_ldm_autoencoder,
    sample_latents,
    sd_v1_vae_config,
)


TINY = {"block_out_channels": (8, 16), "down_block_types": ("DownEncoderBlock2D",) * 2,
            "up_block_types": ("UpDecoderBlock2D",) * 2, "layers_per_block": 1, "norm_num_groups": 4, "sample_size": 16}


def _to_ldm(state: dict, n_levels: int) -> dict:
    """Inverse key mapping diffusers -> original LDM `AutoencoderKL` (written independently of the converter)."""
    out = {}
    for k, v in state.items():
        k2 = k
        k2 = re.sub(r"down_blocks\.(\d+)\.resnets\.(\d+)", r"down.\1.block.\2", k2)
        k2 = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0", r"down.\1.downsample", k2)
        k2 = re.sub(r"up_blocks\.(\d+)\.resnets\.(\d+)",
                    lambda m: f"up.{n_levels - 1 - int(m[1])}.block.{m[2]}", k2)
        k2 = re.sub(r"up_blocks\.(\d+)\.upsamplers\.0", lambda m: f"up.{n_levels - 1 - int(m[1])}.upsample", k2)
        k2 = re.sub(r"mid_block\.resnets\.(\d+)", lambda m: f"mid.block_{int(m[1]) + 1}", k2)
        k2 = k2.replace("conv_shortcut", "nin_shortcut").replace("conv_norm_out", "norm_out")
        if "mid_block.attentions.0" in k2:
            k2 = k2.replace("mid_block.attentions.0", "mid.attn_1")
            for a, b in [("group_norm", "norm"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")]:
                k2 = k2.replace(f".{a}.", f".{b}.")
            if v.dim() == 2:  # LDM attention projections are 1x1 convolutions
                v = v[:, :, None, None]
        out[k2] = v.clone()
    return out


def test_sd_v1_architecture_and_scale_in_config():
    vae = build_vae()
    assert vae.config.scaling_factor == pytest.approx(0.23010)
    # CompVis/stable-diffusion-v1-4 "vae" (the SD v1 KL-f8 first stage) has 83,653,863 parameters.
    assert sum(p.numel() for p in vae.parameters()) == 83_653_863


def test_ldm_checkpoint_converts_to_identical_model(tmp_path):
    torch.manual_seed(0)
    ref = build_vae(**TINY).eval()
    ldm = _to_ldm(ref.state_dict(), n_levels=2)
    assert "encoder.mid.attn_1.q.weight" in ldm and ldm["encoder.mid.attn_1.q.weight"].dim() == 4
    torch.save({f"first_stage_model.{k}": v for k, v in ldm.items()}, tmp_path / "prefixed.ckpt")
    torch.save(ldm, tmp_path / "autoencoder_kl.pth")

    x = torch.rand(2, 3, 16, 16) * 2 - 1
    for name in ["autoencoder_kl.pth", "prefixed.ckpt"]:
        vae = load_ldm_autoencoder(tmp_path / name, config={**sd_v1_vae_config(), **TINY})
        assert vae.config.scaling_factor == pytest.approx(UVIT_VAE_SCALE)
        with torch.no_grad():
            torch.testing.assert_close(encode_moments(vae, x), encode_moments(ref, x))
            z = torch.randn(2, 4, 8, 8)
            torch.testing.assert_close(vae.decode(z).sample, ref.decode(z).sample)


def test_loader_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="autoencoder_kl.pth"):
        load_ldm_autoencoder(tmp_path / "nope.pth")
    torch.save({"foo.weight": torch.zeros(1)}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="does not look like an LDM KL autoencoder"):
        load_ldm_autoencoder(tmp_path / "bad.pth", config={**sd_v1_vae_config(), **TINY})


def test_moments_shape_and_latent_sampling_formula():
    torch.manual_seed(0)
    vae = build_vae(**TINY).eval()
    moments = encode_moments(vae, torch.rand(3, 3, 16, 16) * 2 - 1)
    assert moments.shape == (3, 8, 8, 8) and moments.dtype == torch.float32

    moments[:, 4:, 0, 0] = 50.0  # logvar beyond the clamp
    scale = vae.config.scaling_factor
    z = sample_latents(moments, scale, generator=torch.Generator().manual_seed(1))
    eps = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    mean, logvar = moments[:, :4], moments[:, 4:].clamp(-30, 20)
    torch.testing.assert_close(z, scale * (mean + torch.exp(0.5 * logvar) * eps))
    assert not torch.allclose(z, scale * mean)  # a draw, not the posterior mean
