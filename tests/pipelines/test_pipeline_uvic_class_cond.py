"""Class-conditional UViCPipeline: U-ViT's ImageNet CFG sampler (eval_ldm_discrete.py), VAE decode, bad input,
round trip, official checkpoints."""

import logging
import math

import numpy as np
import pytest
import torch
from tiny_models import VAE_TINY, vae_state_to_ldm

from uvic.models import UViTModel
from uvic.models.autoencoder import build_vae
from uvic.pipelines import UViCPipeline
from uvic.schedulers import UViTDPMSolverScheduler, schedule_of


K = 10  # real classes; id K is the null class
TINY = {"img_size": 8, "patch_size": 2, "in_chans": 4, "embed_dim": 32, "depth": 4, "num_heads": 2,
        "num_classes": K + 1, "attention": "softmax", "attention_backend": "torch"}


def _pipe(**kwargs):
    torch.manual_seed(0)
    transformer = UViTModel(**TINY).eval()
    with torch.no_grad():  # a label embedding large enough that the class visibly matters
        transformer.label_emb.weight.mul_(20)
    vae = build_vae(scaling_factor=0.18215, **VAE_TINY).eval()
    args = {"null_class": True, "label_dropout": 0.15, **kwargs}
    pipe = UViCPipeline(transformer=transformer, scheduler=UViTDPMSolverScheduler(), vae=vae, **args)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe():
    return _pipe()


# --- U-ViT's sampler, transcribed from eval_ldm_discrete.py and dpm_solver_pp.py (NoiseScheduleVP('discrete'),
# DPM_Solver(predict_x0=True).sample(method='fast', order=3, skip_type='time_uniform', eps=1/N, T=1)). ---

N = 1000
_BETAS = torch.linspace(0.00085**0.5, 0.012**0.5, N, dtype=torch.float64) ** 2  # stable_diffusion_beta_schedule
_T_KNOTS = np.linspace(1.0 / N, 1.0, N)
_LOG_ALPHA = (0.5 * torch.log(1 - _BETAS).cumsum(0)).numpy()


def _log_alpha(t):
    return float(np.interp(t, _T_KNOTS, _LOG_ALPHA))


def _lam(t):
    la = _log_alpha(t)
    return la - 0.5 * math.log(1 - math.exp(2 * la))


def _inv_lam(lam):
    la = -0.5 * math.log1p(math.exp(-2 * lam))
    return float(np.interp(la, _LOG_ALPHA[::-1], _T_KNOTS[::-1]))


def _official_sample(nnet, z, y, scale, steps=50):
    """`sample_z` of eval_ldm_discrete.py with `cfg_nnet` (two separate network calls, null class K)."""

    def cfg_nnet(x, t):
        cond = nnet(x, t, class_labels=y).sample
        if scale == 0:
            return cond
        uncond = nnet(x, t, class_labels=torch.full_like(y, K)).sample
        return cond + scale * (cond - uncond)

    def a_s(t):  # (alpha_t, sigma_t)
        la = _log_alpha(t)
        return math.exp(la), math.sqrt(1 - math.exp(2 * la))

    def x0_pred(x, t):  # model_fn of DPM_Solver with predict_x0: network time t_continuous * N
        alpha, sigma = a_s(t)
        return (x - sigma * cfg_nnet(x, torch.full((x.shape[0],), t * N))) / alpha

    kk = steps // 3 + 1
    orders = {0: [3] * (kk - 2) + [2, 1], 1: [3] * (kk - 1) + [1], 2: [3] * (kk - 1) + [2]}[steps % 3]
    grid = np.linspace(1.0, 1.0 / N, steps + 1).tolist()
    x, i = z, 0
    for order in orders:
        s, t = grid[i], grid[i + order]
        h = _lam(t) - _lam(s)
        sg_s, (al_t, sg_t) = a_s(s)[1], a_s(t)
        d_s = x0_pred(x, s)
        phi_1 = math.expm1(-h)
        if order == 1:
            x = sg_t / sg_s * x - al_t * phi_1 * d_s
        else:
            r1 = (_lam(grid[i + 1]) - _lam(s)) / h
            s1 = _inv_lam(_lam(s) + r1 * h)
            al_1, sg_1 = a_s(s1)
            d_1 = x0_pred(sg_1 / sg_s * x - al_1 * math.expm1(-r1 * h) * d_s, s1)
            if order == 2:
                x = sg_t / sg_s * x - al_t * phi_1 * d_s - 0.5 / r1 * al_t * phi_1 * (d_1 - d_s)
            else:
                r2 = (_lam(grid[i + 2]) - _lam(s)) / h
                s2 = _inv_lam(_lam(s) + r2 * h)
                al_2, sg_2 = a_s(s2)
                phi_22 = math.expm1(-r2 * h) / (r2 * h) + 1
                x_s2 = (sg_2 / sg_s * x - al_2 * math.expm1(-r2 * h) * d_s + r2 / r1 * al_2 * phi_22 * (d_1 - d_s))
                d_2 = x0_pred(x_s2, s2)
                x = sg_t / sg_s * x - al_t * phi_1 * d_s + 1 / r2 * al_t * (phi_1 / h + 1) * (d_2 - d_s)
        i += order
    return x


@pytest.mark.parametrize("scale", [0.4, 0.7])
def test_matches_official_cfg_sampler(pipe, scale):
    """Official scale s (0.4 at 256, 0.7 at 512) is guidance_scale 1 + s; 50 steps, null class K."""
    z = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 3, 9])
    with torch.no_grad():
        ref = _official_sample(pipe.transformer, z, y, scale)
    lat = pipe(class_labels=y, guidance_scale=1 + scale, latents=z, output_type="latent").images
    torch.testing.assert_close(lat, ref, atol=2e-4, rtol=1e-4)
    # The images are the VAE decode of z / 0.18215 (U-ViT's autoencoder.decode), mapped to [0, 1].
    img = pipe(class_labels=y, guidance_scale=1 + scale, latents=z, num_inference_steps=5, output_type="pt").images
    lat5 = pipe(class_labels=y, guidance_scale=1 + scale, latents=z, num_inference_steps=5, output_type="latent").images
    with torch.no_grad():
        expected = (pipe.vae.decode(lat5 / 0.18215).sample / 2 + 0.5).clamp(0, 1)
    assert img.shape == (3, 3, 16, 16)
    torch.testing.assert_close(img, expected, atol=1e-5, rtol=1e-4)


def test_unguided_is_one_call_per_step_and_the_conditional_model(pipe):
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([1, 5])
    batches = []
    hook = pipe.transformer.register_forward_hook(lambda m, args, out: batches.append(args[0].shape[0]))
    try:
        lat = pipe(class_labels=y, guidance_scale=1.0, num_inference_steps=8, latents=z, output_type="latent").images
        assert batches == [2] * 8
        batches.clear()
        guided = pipe(class_labels=y, guidance_scale=1.4, num_inference_steps=8, latents=z, output_type="latent").images
        assert batches == [4] * 8  # conditional and null-class halves in one call
    finally:
        hook.remove()
    with torch.no_grad():
        torch.testing.assert_close(lat, _official_sample(pipe.transformer, z, y, 0.0, steps=8), atol=2e-4, rtol=1e-4)
    assert not torch.allclose(lat, guided, atol=1e-3)
    # Per-image generators: an image depends on its own seed only.
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    a = pipe(batch_size=2, class_labels=[1, 5], num_inference_steps=3, generator=gens([7, 8]), output_type="np")
    b = pipe(batch_size=1, class_labels=[5], num_inference_steps=3, generator=gens([8]), output_type="np")
    np.testing.assert_allclose(a.images[1], b.images[0], atol=1e-5)


def test_bad_input_is_named(pipe, caplog):
    with pytest.raises(ValueError, match=r"\[0, 10\) \(10 is the null class\)"):
        pipe(class_labels=[K], num_inference_steps=1)
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        pipe(class_labels=[-1], num_inference_steps=1)
    with pytest.raises(ValueError, match="latent channels"):
        UViCPipeline(transformer=pipe.transformer, scheduler=pipe.scheduler,
                     vae=build_vae(**{**VAE_TINY, "latent_channels": 3}))
    no_null = UViCPipeline(transformer=pipe.transformer, scheduler=pipe.scheduler, vae=pipe.vae)
    assert no_null.num_labels == K + 1
    with pytest.raises(ValueError, match="needs a null class"):
        no_null(class_labels=[0], guidance_scale=1.4, num_inference_steps=1)
    undropped = _pipe(label_dropout=0.0)
    with caplog.at_level(logging.WARNING, logger="uvic.pipelines.pipeline_uvic"):
        for _ in range(2):
            undropped(class_labels=[0], guidance_scale=1.4, num_inference_steps=1, output_type="latent")
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "without label dropout" in caplog.records[0].message


def test_save_load_round_trip(pipe, tmp_path):
    pipe.save_pretrained(tmp_path / "p")
    loaded = UViCPipeline.from_pretrained(tmp_path / "p")
    loaded.set_progress_bar_config(disable=True)
    assert loaded.config.null_class and loaded.config.label_dropout == 0.15
    assert loaded.vae.config.scaling_factor == pytest.approx(0.18215)
    kw = {"batch_size": 2, "class_labels": [2, 4], "guidance_scale": 1.7, "num_inference_steps": 3, "output_type": "np"}
    np.testing.assert_allclose(loaded(generator=torch.Generator().manual_seed(0), **kw).images,
                               pipe(generator=torch.Generator().manual_seed(0), **kw).images, atol=1e-6)


def test_from_official_latent_and_pixel(pipe, tmp_path):
    """Official-format files (bare nnet state dict, LDM autoencoder) load into pipelines with the official settings."""
    from uvic.models.autoencoder import sd_v1_vae_config

    torch.save(pipe.transformer.state_dict(), tmp_path / "nnet.pth")
    torch.save(vae_state_to_ldm(pipe.vae.state_dict(), n_levels=2), tmp_path / "autoencoder_kl.pth")
    nnet = {"name": "uvit", **{k: v for k, v in TINY.items() if not k.startswith("attention")}}
    kw = {"nnet_config": nnet, "vae_config": {**sd_v1_vae_config(), **VAE_TINY}, "attention_backend": "torch"}
    off = UViCPipeline.from_official("imagenet256_uvit_huge", tmp_path / "nnet.pth", tmp_path / "autoencoder_kl.pth",
                                     **kw)
    off.set_progress_bar_config(disable=True)
    assert off.config.default_guidance_scale == pytest.approx(1.4) and off.config.null_class
    assert off.config.label_dropout == 0.1 and schedule_of(off.scheduler) == "discrete"
    assert off.vae.config.scaling_factor == pytest.approx(0.18215)
    z = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(4))
    ref = pipe(class_labels=[1, 2], guidance_scale=1.4, latents=z, num_inference_steps=5, output_type="np").images
    got = off(class_labels=[1, 2], latents=z, num_inference_steps=5, output_type="np").images  # default: 1.4
    np.testing.assert_allclose(got, ref, atol=1e-5)
    # The L latent models were trained and evaluated on the continuous VP-SDE (train_ldm.py / eval_ldm.py).
    large = UViCPipeline.from_official("imagenet512_uvit_large", tmp_path / "nnet.pth", tmp_path / "autoencoder_kl.pth",
                                       **kw)
    assert schedule_of(large.scheduler) == "vpsde" and large.vae is not None and large.config.label_dropout == 0.15
    assert large.config.default_guidance_scale == pytest.approx(1.7) and large.num_labels == K

    # ImageNet 64: pixels, 1000 classes without a null class, the VP-SDE DPM-Solver-fast, no guidance.
    torch.manual_seed(0)
    pix = {**TINY, "in_chans": 3, "num_classes": K}
    state = UViTModel(**pix).state_dict()
    torch.save(state, tmp_path / "imagenet64_uvit_mid.pth")
    nnet64 = {"name": "uvit", **{k: v for k, v in pix.items() if not k.startswith("attention")}}
    off64 = UViCPipeline.from_official("imagenet64_uvit_mid", tmp_path / "imagenet64_uvit_mid.pth",
                                       nnet_config=nnet64, class_counts=[1] * K, attention_backend="torch")
    assert off64.vae is None and not off64.config.null_class and off64.config.default_guidance_scale == 1.0
    assert schedule_of(off64.scheduler) == "vpsde" and off64.num_labels == K
    assert off64(class_labels=[K - 1], num_inference_steps=2, output_type="np").images.shape == (1, 8, 8, 3)
    with pytest.raises(ValueError, match="pixel model"):
        UViCPipeline.from_official("imagenet64_uvit_mid", tmp_path / "imagenet64_uvit_mid.pth", tmp_path / "x.pth")
    with pytest.raises(ValueError, match="unknown official"):
        UViCPipeline.from_official("imagenet128", tmp_path / "imagenet64_uvit_mid.pth")
