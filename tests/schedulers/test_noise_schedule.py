"""The two noise schedules against their definitions and diffusers' discrete betas."""

import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler

from uvic.schedulers.noise_schedule import VPSDE, DiscreteSchedule


def test_discrete_betas_match_diffusers_and_u_vit():
    ours = DiscreteSchedule()  # SD / U-ViT MS-COCO: scaled_linear 0.00085 -> 0.012, 1000 steps
    ref = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    assert ours.betas.dtype == ours.alphas_cumprod.dtype == torch.float64
    torch.testing.assert_close(ours.alphas_cumprod.float(), ref.alphas_cumprod, atol=1e-6, rtol=0)
    # U-ViT's `stable_diffusion_beta_schedule`: numpy float64 linspace of square roots, squared.
    official = np.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=np.float64) ** 2
    np.testing.assert_allclose(ours.betas.numpy(), official, rtol=1e-15, atol=0)
    linear = DiscreteSchedule(beta_schedule="linear", beta_start=1e-4, beta_end=0.02)
    np.testing.assert_allclose(linear.betas.numpy(), np.linspace(1e-4, 0.02, 1000), rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="beta_schedule"):
        DiscreteSchedule(beta_schedule="squaredcos_cap_v2")


def test_discrete_continuous_extension_hits_the_knots_and_interpolates_log_alpha():
    s = DiscreteSchedule(num_train_timesteps=10, beta_schedule="linear", beta_start=0.01, beta_end=0.2)
    knots = torch.arange(1, 11, dtype=torch.float64) / 10
    # At t_n = n / N, alpha_bar is the DDPM cumulative product at 0-based step n - 1.
    torch.testing.assert_close(s.alpha_bar(knots), s.alphas_cumprod, rtol=1e-13, atol=0)
    # Between knots, log alpha_bar is linear in t; past the first knot it extends the first segment.
    log_ab = torch.log(s.alphas_cumprod)
    mid = torch.tensor([0.25, 0.05], dtype=torch.float64)
    expected = torch.stack([(log_ab[1] + log_ab[2]) / 2, log_ab[0] - (log_ab[1] - log_ab[0]) / 2])
    torch.testing.assert_close(s.log_alpha_bar(mid), expected, rtol=1e-13, atol=0)


@pytest.mark.parametrize("schedule", [VPSDE(), DiscreteSchedule()], ids=["vpsde", "discrete"])
def test_derived_quantities_and_lambda_inverse(schedule):
    t = torch.tensor([1e-3, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)
    ab = schedule.alpha_bar(t)
    torch.testing.assert_close(schedule.sigma(t) ** 2 + ab, torch.ones_like(t), rtol=1e-14, atol=0)
    torch.testing.assert_close(schedule.lambda_(t), 0.5 * torch.log(ab / (1 - ab)), rtol=1e-12, atol=0)
    torch.testing.assert_close(schedule.t_from_lambda(schedule.lambda_(t)), t, rtol=1e-9, atol=0)


def test_vpsde_takes_floats_arrays_and_tensors_alike():
    sde = VPSDE()
    assert sde.alpha_bar(0.5) == pytest.approx(math.exp(-(0.05 + 9.95 * 0.25)), rel=1e-14)
    np.testing.assert_allclose(sde.lambda_(np.array([0.5])), sde.lambda_(torch.tensor([0.5], dtype=torch.float64)).numpy(),
                               rtol=1e-15)


def test_vpsde_closed_forms():
    sde = VPSDE()
    t = np.array([0.0, 0.25, 0.5, 1.0])
    # U-ViT sde.py: cum_alpha(t) = exp(-(0.1 t + 9.95 t^2)), beta(t) = 0.1 + 19.9 t
    np.testing.assert_allclose(sde.alpha_bar(t), np.exp(-(0.1 * t + 9.95 * t**2)), rtol=1e-12)
    np.testing.assert_allclose(sde.beta(t), 0.1 + 19.9 * t, rtol=1e-12)
    np.testing.assert_allclose(sde.sigma(t) ** 2 + sde.alpha_bar(t), 1.0, rtol=1e-12)
    assert sde.alpha_bar(1.0) == pytest.approx(4.3186e-5, rel=1e-4)  # docs/conventions.md, "Schedules": 4.32e-5
    # lambda = log(alpha / sigma) and the inverses
    lam = sde.lambda_(t[1:])
    np.testing.assert_allclose(lam, 0.5 * np.log(sde.alpha_bar(t[1:]) / (1 - sde.alpha_bar(t[1:]))), rtol=1e-12)
    np.testing.assert_allclose(sde.t_from_lambda(lam), t[1:], rtol=1e-10)
    np.testing.assert_allclose(sde.t_from_log_alpha_bar(sde.log_alpha_bar(t)), t, atol=1e-12)
    # docs/conventions.md, "Timesteps": t = (-0.1 + sqrt(0.01 - 39.8 ln ab)) / 19.9
    ab = 0.3
    assert sde.t_from_log_alpha_bar(math.log(ab)) == pytest.approx((-0.1 + math.sqrt(0.01 - 39.8 * math.log(ab))) / 19.9)
