"""The VP-SDE schedulers (Euler-Maruyama, DPM-Solver++(2M)) against their formulas and exact denoisers, and
the sampler table's build / convert on both schedules."""

import math

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler

from uvic.config import DiffusionConfig
from uvic.schedulers import (
    VPSDE,
    VPSDEDPMSolverScheduler,
    VPSDEEulerMaruyamaScheduler,
    build_scheduler,
    convert_scheduler,
)


def test_euler_maruyama_time_grid_is_the_official_one():
    s = VPSDEEulerMaruyamaScheduler()
    s.set_timesteps(1000)
    # sde.euler_maruyama: `torch.tensor(np.append(0., np.linspace(eps, T, n))).to(x_init)` (float32), walked 1 -> 0.
    official = torch.tensor(np.append(0.0, np.linspace(1e-3, 1, 1000))).to(torch.randn(1)).flip(0).numpy()
    assert s.times.dtype == torch.float32
    np.testing.assert_array_equal(s.times.numpy(), official)
    assert len(s.timesteps) == 1000
    # timesteps are the continuous times the network is evaluated at (the pipeline feeds it 999 t).
    np.testing.assert_array_equal(s.timesteps.numpy(), official[:-1])
    assert s.timesteps[0] == 1.0 and s.timesteps[-1] == np.float32(1e-3)


def test_euler_maruyama_step_matches_the_formula_and_skips_noise_at_the_end():
    s = VPSDEEulerMaruyamaScheduler()
    s.set_timesteps(4)  # grid 1, 2/3+, 1/3+, 1e-3, 0
    x = torch.randn(2, 1, 3, 3, dtype=torch.float64)
    eps = torch.randn_like(x)
    for i in range(4):
        t, u = float(s.times[i]), float(s.times[i + 1])
        g = torch.Generator().manual_seed(i)
        z = torch.randn(x.shape, generator=torch.Generator().manual_seed(i), dtype=x.dtype)
        beta = 0.1 + 19.9 * t
        drift = -0.5 * beta * x - beta * (-eps / math.sqrt(1 - math.exp(-(0.1 * t + 9.95 * t * t))))
        expected = x + drift * (u - t) + (math.sqrt(beta * (t - u)) * z if i < 3 else 0)
        out = s.step(eps, s.timesteps[i], x, generator=g).prev_sample
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    assert float(s.times[-1]) == 0.0
    with pytest.raises(ValueError, match="more than num_inference_steps"):
        s.step(eps, 0.0, x)


def _gaussian_eps(sde, s2):
    """Exact eps-prediction for data x0 ~ N(0, s2): E[eps | x_t] = sigma x_t / (alpha^2 s2 + sigma^2)."""

    def eps_fn(x, t):
        ab = sde.alpha_bar(t)
        return math.sqrt(1 - ab) * x / (ab * s2 + 1 - ab)

    return eps_fn


def _run(s, eps_fn, x, steps, generator=None):
    s.set_timesteps(steps)
    for t in s.timesteps:
        x = s.step(eps_fn(x, float(t)), t, x, generator=generator).prev_sample
    return x


def test_dpm_solver_solves_the_probability_flow_ode():
    # For Gaussian data the PF-ODE keeps x_t / sqrt(alpha_t^2 s2 + sigma_t^2) constant: a closed-form solution.
    sde, s2 = VPSDE(), 0.25
    x1 = torch.linspace(-3, 3, 7, dtype=torch.float64)

    def rel_error(steps):
        s = VPSDEDPMSolverScheduler()
        out = _run(s, _gaussian_eps(sde, s2), x1, steps)
        te = s.config.t_eps
        exact = x1 * math.sqrt(sde.alpha_bar(te) * s2 + 1 - sde.alpha_bar(te)) / math.sqrt(
            sde.alpha_bar(1.0) * s2 + 1 - sde.alpha_bar(1.0))
        return ((out - exact).abs() / exact.abs().clamp(min=1e-12)).max().item(), s

    e50, s = rel_error(50)
    e100, _ = rel_error(100)
    assert e50 < 5e-3
    assert 3.0 < e50 / e100 < 5.0  # second order: halving the step divides the error by about 4
    assert s.times[0] == 1.0 and s.times[-1] == 1e-4 and len(s.timesteps) == 50  # 50 steps = 50 NFE
    lam = VPSDE().lambda_(s.times)
    np.testing.assert_allclose(np.diff(lam.numpy()), np.diff(lam.numpy())[0], rtol=1e-8)  # logSNR-uniform


def test_euler_maruyama_samples_the_data_distribution():
    sde, s2 = VPSDE(), 0.25
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=g, dtype=torch.float64)
    out = _run(VPSDEEulerMaruyamaScheduler(), _gaussian_eps(sde, s2), x, 1000, generator=g)
    assert out.std().item() == pytest.approx(math.sqrt(s2), rel=0.05)
    assert abs(out.mean().item()) < 0.05


def test_build_and_convert_schedulers():
    vp = DiffusionConfig()
    em = build_scheduler("euler_maruyama", vp)
    assert isinstance(em, VPSDEEulerMaruyamaScheduler) and em.config.beta_max == 20.0
    dpm = convert_scheduler(em, "dpm_solver")
    assert isinstance(dpm, VPSDEDPMSolverScheduler) and dpm.config.t_eps == 1e-4 and dpm.config.time_scale == 999
    disc = DiffusionConfig(schedule="discrete", beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    ddim = build_scheduler("ddim", disc)
    assert isinstance(ddim, DDIMScheduler) and ddim.config.beta_schedule == "scaled_linear"
    assert isinstance(convert_scheduler(ddim, "dpm_solver"), DPMSolverMultistepScheduler)
    with pytest.raises(ValueError, match="does not apply to a continuous"):
        build_scheduler("ddim", vp)
    with pytest.raises(ValueError, match="does not apply to a discrete"):
        convert_scheduler(ddim, "euler_maruyama")


def test_scheduler_config_round_trip(tmp_path):
    s = VPSDEDPMSolverScheduler(beta_max=15.0)
    s.save_pretrained(tmp_path)
    assert VPSDEDPMSolverScheduler.from_pretrained(tmp_path).config.beta_max == 15.0


@pytest.mark.parametrize("sampler, steps", [("euler_maruyama", 1000), ("dpm_solver", 50)])
def test_samplers_with_the_exact_denoiser_reproduce_the_data(sampler, steps):
    # The exact eps-prediction for data = a finite point set (here 20 of scikit-learn's digits) is a softmax
    # posterior over the points; both samplers must then land on the points (the reverse process is exact).
    from sklearn.datasets import load_digits

    sde = VPSDE()
    data = torch.from_numpy(load_digits().images[:20].reshape(20, 64)).double() / 8 - 1  # (N, 64) in [-1, 1]

    def eps_star(x, t):
        ab = sde.alpha_bar(t)
        a, s = math.sqrt(ab), math.sqrt(1 - ab)
        w = torch.softmax(-torch.cdist(x, a * data) ** 2 / (2 * s * s), dim=1)
        return (x - a * w @ data) / s

    s = build_scheduler(sampler, DiffusionConfig())
    g = torch.Generator().manual_seed(0)
    x = _run(s, eps_star, torch.randn(16, 64, generator=g, dtype=torch.float64), steps, generator=g)
    nearest = torch.cdist(x, data).min(dim=1).values
    spacing = torch.cdist(data, data).add(torch.eye(20) * 1e9).min().item()
    assert nearest.max().item() < 0.05 * spacing
