"""UViTDPMSolverScheduler against an independent NumPy transcription of U-ViT's DPM-Solver++ ("fast", order 3)."""

import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler

from uvic.schedulers.scheduling_dpmsolver_uvit import UViTDPMSolverScheduler


N = 1000


def _official_log_alpha_knots() -> tuple[np.ndarray, np.ndarray]:
    betas = np.linspace(0.00085**0.5, 0.012**0.5, N, dtype=np.float64) ** 2
    return np.arange(1, N + 1) / N, 0.5 * np.cumsum(np.log(1.0 - betas))


class _RefSchedule:
    """NoiseScheduleVP('discrete') with np.interp (all times used lie inside the knots)."""

    def __init__(self):
        self.t, self.la = _official_log_alpha_knots()

    def log_alpha(self, t):
        return np.interp(t, self.t, self.la)

    def alpha(self, t):
        return math.exp(self.log_alpha(t))

    def sigma(self, t):
        return math.sqrt(1.0 - math.exp(2 * self.log_alpha(t)))

    def lam(self, t):
        return math.log(self.alpha(t)) - math.log(self.sigma(t))

    def inv_lam(self, lam):
        log_alpha = -0.5 * np.logaddexp(0.0, -2.0 * lam)
        return float(np.interp(log_alpha, self.la[::-1], self.t[::-1]))


def _reference_sample(eps_fn, x, nfe=50, eps=1e-3):
    """Straight transcription of DPM_Solver.sample(method='fast', order=3, skip_type='time_uniform', predict_x0)."""
    ns = _RefSchedule()
    calls = []

    def x0_fn(x, t):
        calls.append(t * N)
        return (x - ns.sigma(t) * eps_fn(x, t * N)) / ns.alpha(t)

    k = nfe // 3 + 1
    orders = [3] * (k - 1) + [2] if nfe % 3 == 2 else None
    assert orders is not None, "this reference covers nfe % 3 == 2 only"
    grid = np.linspace(1.0, eps, nfe + 1)
    i = 0
    for order in orders:
        s, t = grid[i], grid[i + order]
        h = ns.lam(t) - ns.lam(s)
        r1 = (ns.lam(grid[i + 1]) - ns.lam(s)) / h
        s1 = ns.inv_lam(ns.lam(s) + r1 * h)
        x0_s = x0_fn(x, s)
        x_s1 = ns.sigma(s1) / ns.sigma(s) * x - ns.alpha(s1) * math.expm1(-r1 * h) * x0_s
        x0_s1 = x0_fn(x_s1, s1)
        phi_1 = math.expm1(-h)
        if order == 2:
            x = (ns.sigma(t) / ns.sigma(s) * x - ns.alpha(t) * phi_1 * x0_s
                 - 0.5 / r1 * ns.alpha(t) * phi_1 * (x0_s1 - x0_s))
        else:
            r2 = (ns.lam(grid[i + 2]) - ns.lam(s)) / h
            s2 = ns.inv_lam(ns.lam(s) + r2 * h)
            phi_12 = math.expm1(-r2 * h)
            phi_22 = phi_12 / (r2 * h) + 1.0
            x_s2 = (ns.sigma(s2) / ns.sigma(s) * x - ns.alpha(s2) * phi_12 * x0_s
                    + r2 / r1 * ns.alpha(s2) * phi_22 * (x0_s1 - x0_s))
            x0_s2 = x0_fn(x_s2, s2)
            x = (ns.sigma(t) / ns.sigma(s) * x - ns.alpha(t) * phi_1 * x0_s
                 + 1.0 / r2 * ns.alpha(t) * (phi_1 / h + 1.0) * (x0_s2 - x0_s))
        i += order
    return x, calls


class _GaussianEps:
    """Exact epsilon predictor for data x0 ~ N(mu, diag(var)) under the official continuous schedule."""

    def __init__(self, mu, var):
        self.mu, self.var, self.ns = mu, var, _RefSchedule()

    def __call__(self, x, n):
        t = float(n) / N
        a, s = self.ns.alpha(t), self.ns.sigma(t)
        return s * (x - a * self.mu) / (a * a * self.var + s * s)

    def exact_flow(self, x_T, t_from, t_to):
        """Probability-flow ODE solution for Gaussian data: an affine map."""
        a0, s0, a1, s1 = self.ns.alpha(t_from), self.ns.sigma(t_from), self.ns.alpha(t_to), self.ns.sigma(t_to)
        scale = np.sqrt(a1 * a1 * self.var + s1 * s1) / np.sqrt(a0 * a0 * self.var + s0 * s0)
        return a1 * self.mu + scale * (x_T - a0 * self.mu)


def _run_scheduler(sched, eps_fn, x, dtype=torch.float64):
    sample = torch.tensor(x, dtype=dtype)
    for t in sched.timesteps:
        eps = torch.tensor(eps_fn(sample.numpy().astype(np.float64), float(t) + 1.0), dtype=dtype)
        sample = sched.step(eps, t, sample).prev_sample
    return sample.numpy()


def test_official_timesteps_and_orders():
    sched = UViTDPMSolverScheduler()
    sched.set_timesteps(50)
    assert sched.solver_orders == [3] * 16 + [2]
    assert len(sched.timesteps) == 50
    net_t = (sched.timesteps.double() + 1.0).numpy()  # what the U-ViT network sees
    grid = np.linspace(1.0, 1e-3, 51)[:50] * N  # official: grid points 0..49 (the last one, t=1e-3, is not evaluated)
    np.testing.assert_allclose(net_t, grid, atol=2e-3)
    np.testing.assert_allclose(net_t[:3], [1000.0, 980.02, 960.04], atol=2e-3)
    np.testing.assert_allclose(net_t[-1], 20.98, atol=2e-3)


@pytest.mark.parametrize("nfe,expected", [(50, [3] * 16 + [2]), (3, [2, 1]), (10, [3, 3, 3, 1]), (20, [3] * 6 + [2])])
def test_fast_order_pattern(nfe, expected):
    assert UViTDPMSolverScheduler.fast_orders(nfe) == expected
    assert sum(expected) == nfe


def test_beta_schedule_matches_diffusers_scaled_linear():
    ours = UViTDPMSolverScheduler()
    ref = DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
    torch.testing.assert_close(ours.alphas_cumprod, ref.alphas_cumprod, atol=1e-6, rtol=0)
    assert abs(ours.alphas_cumprod[-1].item() - 0.0046600985) < 1e-8


def test_matches_reference_transcription_on_gaussian_toy():
    rng = np.random.default_rng(0)
    mu, var = rng.normal(size=(2, 3, 4, 4)) * 0.5, rng.uniform(0.05, 1.5, size=(2, 3, 4, 4))
    model = _GaussianEps(mu, var)
    x_T = rng.normal(size=(2, 3, 4, 4))

    ref, calls = _reference_sample(model, x_T)
    sched = UViTDPMSolverScheduler()
    sched.set_timesteps(50)
    ours = _run_scheduler(sched, model, x_T)

    np.testing.assert_allclose((sched.timesteps.double() + 1).numpy(), calls, atol=1e-3)
    np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=1e-6)
    # And both solve the probability-flow ODE: the exact solution from t=1 to t=1e-3 for Gaussian data.
    exact = model.exact_flow(x_T, 1.0, 1e-3)
    assert np.abs(ours - exact).max() < 1e-2 * np.abs(exact).max()


def test_step_index_resets_and_fp32_runs():
    sched = UViTDPMSolverScheduler()
    sched.set_timesteps(5)
    assert sched.solver_orders == [3, 2]
    x = torch.randn(1, 4, 2, 2)
    for t in sched.timesteps:
        x = sched.step(torch.zeros_like(x), t, x).prev_sample
    assert x.dtype == torch.float32 and torch.isfinite(x).all()
    with pytest.raises(ValueError, match="more than"):
        sched.step(torch.zeros_like(x), sched.timesteps[-1], x)
    sched.set_timesteps(5)
    assert sched.step_index is None


def test_bad_config_is_clear():
    with pytest.raises(ValueError, match="beta_schedule"):
        UViTDPMSolverScheduler(beta_schedule="cosine")
    with pytest.raises(ValueError, match="set_timesteps"):
        UViTDPMSolverScheduler().step(torch.zeros(1), 0, torch.zeros(1))
