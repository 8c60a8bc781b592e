"""SD v1 VAE with U-ViT's scale, latent sampling from moments, and the LDM-checkpoint converter."""

import pytest
import torch
from tiny_models import VAE_TINY, vae_state_to_ldm

from uvic.models.autoencoder import (
    UVIT_VAE_SCALE,
    build_vae,
    encode_moments,
    load_ldm_autoencoder,
    sample_latents,
    sd_v1_vae_config,
)


def test_sd_v1_architecture_and_scale_in_config():
    vae = build_vae()
    assert vae.config.scaling_factor == pytest.approx(0.23010)
    # CompVis/stable-diffusion-v1-4 "vae" (the SD v1 KL-f8 first stage) has 83,653,863 parameters.
    assert sum(p.numel() for p in vae.parameters()) == 83_653_863


def test_ldm_checkpoint_converts_to_identical_model(tmp_path):
    torch.manual_seed(0)
    ref = build_vae(**VAE_TINY).eval()
    ldm = vae_state_to_ldm(ref.state_dict(), n_levels=2)
    assert "encoder.mid.attn_1.q.weight" in ldm and ldm["encoder.mid.attn_1.q.weight"].dim() == 4
    torch.save({f"first_stage_model.{k}": v for k, v in ldm.items()}, tmp_path / "prefixed.ckpt")
    torch.save(ldm, tmp_path / "autoencoder_kl.pth")

    x = torch.rand(2, 3, 16, 16) * 2 - 1
    for name in ["autoencoder_kl.pth", "prefixed.ckpt"]:
        vae = load_ldm_autoencoder(tmp_path / name, config={**sd_v1_vae_config(), **VAE_TINY})
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
        load_ldm_autoencoder(tmp_path / "bad.pth", config={**sd_v1_vae_config(), **VAE_TINY})


def test_moments_shape_and_latent_sampling_formula():
    torch.manual_seed(0)
    vae = build_vae(**VAE_TINY).eval()
    moments = encode_moments(vae, torch.rand(3, 3, 16, 16) * 2 - 1)
    assert moments.shape == (3, 8, 8, 8) and moments.dtype == torch.float32

    moments[:, 4:, 0, 0] = 50.0  # logvar beyond the clamp
    scale = vae.config.scaling_factor
    z = sample_latents(moments, scale, generator=torch.Generator().manual_seed(1))
    eps = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    mean, logvar = moments[:, :4], moments[:, 4:].clamp(-30, 20)
    torch.testing.assert_close(z, scale * (mean + torch.exp(0.5 * logvar) * eps))
    assert not torch.allclose(z, scale * mean)  # a draw, not the posterior mean
