"""UViCText2ImagePipeline: official guidance and timestep convention, round trip, seeds, schedulers, errors."""

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, DPMSolverMultistepScheduler
from tiny_models import VAE_TINY, vae_state_to_ldm

from uvic.models import build_preset
from uvic.models.autoencoder import build_vae
from uvic.models.text_encoder import CLIPTextEncoder
from uvic.pipelines.pipeline_uvic_t2i import UViCText2ImagePipeline, guided_epsilon, official_to_guidance_scale
from uvic.schedulers.scheduling_dpmsolver_uvit import UViTDPMSolverScheduler


PROMPTS = ["a red bus on a street", "two cats on a sofa"]


def _pipe(text_encoder=True):
    torch.manual_seed(0)
    transformer = build_preset("uvic-tiny-t2i", clip_dim=32, num_clip_token=77, attention_backend="torch").eval()
    te = CLIPTextEncoder(width=32, heads=4, layers=1).eval() if text_encoder else None
    pipe = UViCText2ImagePipeline(transformer=transformer, vae=build_vae(**VAE_TINY).eval(),
                                  scheduler=UViTDPMSolverScheduler(), text_encoder=te)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_guidance_formula_and_scale_mapping():
    g = torch.Generator().manual_seed(0)
    e_c, e_u = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    for s in (0.0, 1.0, 3.5):
        official = e_c + s * (e_c - e_u)  # U-ViT eval_t2i_discrete.cfg_nnet
        torch.testing.assert_close(guided_epsilon(e_c, e_u, official_to_guidance_scale(s)), official)
    assert official_to_guidance_scale(1.0) == 2.0


@pytest.fixture(scope="module")
def pipe():
    return _pipe()


def test_matches_official_guided_sampling_loop(pipe):
    """U-ViT eval_t2i_discrete.py: cfg_nnet(x, n) = eps_c + s (eps_c - eps_u) with s = 1, n = t + 1, then decode."""
    cond, empty = pipe.text_encoder.encode_text(PROMPTS), pipe.text_encoder.encode_text([""])
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    sched = UViTDPMSolverScheduler()
    sched.set_timesteps(5)
    z = x.clone()
    with torch.no_grad():
        for t in sched.timesteps:
            n = (t + 1).expand(2)
            e_c = pipe.transformer(z, n, encoder_hidden_states=cond).sample
            e_u = pipe.transformer(z, n, encoder_hidden_states=empty.expand(2, -1, -1)).sample
            z = sched.step(e_c + 1.0 * (e_c - e_u), t, z).prev_sample
        ref_img = (pipe.vae.decode(z / 0.2301).sample / 2 + 0.5).clamp(0, 1)

    lat = pipe(PROMPTS, guidance_scale=2.0, num_inference_steps=5, latents=x, output_type="latent").images
    torch.testing.assert_close(lat, z, atol=1e-5, rtol=1e-4)
    img = pipe(PROMPTS, guidance_scale=2.0, num_inference_steps=5, latents=x, output_type="pt").images
    assert img.shape == (2, 3, 16, 16)
    torch.testing.assert_close(img, ref_img, atol=1e-5, rtol=1e-4)

    # guidance_scale 1 is the conditional model alone, and differs from guided sampling.
    unguided = pipe(prompt_embeds=cond, guidance_scale=1.0, num_inference_steps=5, latents=x, output_type="latent")
    assert not torch.allclose(unguided.images, lat, atol=1e-4)


def test_deterministic_per_seed_and_per_image_generators(pipe):
    def run(seeds, prompts):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        return pipe(prompts, num_inference_steps=3, generator=gens, output_type="np").images

    a, b = run([0, 1], PROMPTS), run([0, 1], PROMPTS)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (2, 16, 16, 3) and a.dtype == np.float32 and 0 <= a.min() and a.max() <= 1
    np.testing.assert_allclose(run([1], PROMPTS[1:])[0], a[1], atol=1e-5)  # image depends on its own seed only
    assert np.abs(run([2, 1], PROMPTS)[0] - a[0]).max() > 1e-3
    pil = pipe(PROMPTS[0], num_inference_steps=3, num_images_per_prompt=2, output_type="pil").images
    assert len(pil) == 2 and pil[0].size == (16, 16)


def test_save_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "pipe")
    back = UViCText2ImagePipeline.from_pretrained(tmp_path / "pipe")
    back.set_progress_bar_config(disable=True)
    assert isinstance(back.scheduler, UViTDPMSolverScheduler)
    assert back.vae.config.scaling_factor == pytest.approx(0.2301)
    assert back.transformer.config.attention == "cog"
    kw = {"num_inference_steps": 3, "output_type": "np"}
    np.testing.assert_allclose(back(PROMPTS, generator=torch.Generator().manual_seed(0), **kw).images,
                               pipe(PROMPTS, generator=torch.Generator().manual_seed(0), **kw).images, atol=1e-6)

    # diffusers' generic loader finds the class through the saved [module, class] name.
    generic = DiffusionPipeline.from_pretrained(tmp_path / "pipe", trust_remote_code=True)
    assert type(generic) is UViCText2ImagePipeline and generic.text_encoder is not None

    # Without a text encoder the pipeline runs on stored features (the FID path) and round-trips too.
    bare = _pipe(text_encoder=False)
    bare.save_pretrained(tmp_path / "bare")
    bare = UViCText2ImagePipeline.from_pretrained(tmp_path / "bare")
    assert bare.text_encoder is None


def test_stock_dpmsolver_multistep_works(pipe):
    stock = DPMSolverMultistepScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                                        beta_schedule="scaled_linear")
    p2 = UViCText2ImagePipeline(transformer=pipe.transformer, vae=pipe.vae, scheduler=stock, text_encoder=None)
    p2.set_progress_bar_config(disable=True)
    cond, empty = pipe.text_encoder.encode_text(PROMPTS), pipe.text_encoder.encode_text([""])
    seen = []
    hook = p2.transformer.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
    try:
        out = p2(prompt_embeds=cond, negative_prompt_embeds=empty, num_inference_steps=4, output_type="np",
                 generator=torch.Generator().manual_seed(0)).images
    finally:
        hook.remove()
    assert out.shape == (2, 16, 16, 3) and np.isfinite(out).all()
    # The network sees diffusers timestep + 1 (U-ViT MS-COCO convention) with either scheduler.
    torch.testing.assert_close(torch.stack([s[0] for s in seen]).float(), stock.timesteps.float() + 1)


def test_clear_errors():
    bare = _pipe(text_encoder=False)
    cond = torch.zeros(1, 77, 32)
    with pytest.raises(ValueError, match="no text_encoder"):
        bare("a dog", num_inference_steps=1)
    with pytest.raises(ValueError, match="negative_prompt_embeds"):
        bare(prompt_embeds=cond, num_inference_steps=1)
    with pytest.raises(ValueError, match="exactly one"):
        bare(num_inference_steps=1)
    with pytest.raises(ValueError, match="output_type"):
        bare(prompt_embeds=cond, guidance_scale=1.0, output_type="jpg")


def test_from_official_checkpoints(pipe, tmp_path):
    """Official-format files (bare nnet state dict, LDM autoencoder) give the same sampler output."""
    from uvic.models.autoencoder import sd_v1_vae_config

    torch.save(pipe.transformer.state_dict(), tmp_path / "nnet_ema.pth")
    ldm = vae_state_to_ldm(pipe.vae.state_dict(), n_levels=len(pipe.vae.config.block_out_channels))
    torch.save(ldm, tmp_path / "autoencoder_kl.pth")
    c = pipe.transformer.config
    nnet = {"name": "uvit_t2i_np", "img_size": c.img_size, "in_chans": c.in_chans, "patch_size": c.patch_size,
            "embed_dim": c.embed_dim, "depth": c.depth, "num_heads": c.num_heads, "clip_dim": c.clip_dim,
            "num_clip_token": c.num_clip_token}
    off = UViCText2ImagePipeline.from_official(tmp_path / "nnet_ema.pth", tmp_path / "autoencoder_kl.pth",
                                               attention="cog", text_encoder=pipe.text_encoder, nnet_config=nnet,
                                               vae_config={**sd_v1_vae_config(), **VAE_TINY},
                                               attention_backend="torch")
    off.set_progress_bar_config(disable=True)
    assert off.transformer.config.attention == "cog" and off.vae.config.scaling_factor == pytest.approx(0.2301)
    kw = {"num_inference_steps": 3, "output_type": "np"}
    np.testing.assert_allclose(off(PROMPTS, generator=torch.Generator().manual_seed(0), **kw).images,
                               pipe(PROMPTS, generator=torch.Generator().manual_seed(0), **kw).images, atol=1e-5)
