"""UViTDPMSolverScheduler against an independent NumPy transcription of U-ViT's DPM-Solver++ ("fast", order 3)."""

import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler

from uvic.schedulers.scheduling_dpmsolver_uvit import UViTDPMSolverScheduler, VPSDEDPMSolverFastScheduler


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


# ----------------------------------------------------------------------------------------------------------------
# VPSDEDPMSolverFastScheduler: U-ViT's CIFAR-10 training monitor, DPM_Solver(NoiseScheduleVP("linear")) noise prediction,
# .sample(steps=nfe, eps=1e-4, adaptive_step_size=False, fast_version=True), the model fed 999 t.
# ----------------------------------------------------------------------------------------------------------------

B0, B1 = 0.1, 20.0


class _LinearVP:
    """NoiseScheduleVP('linear') from its definition: beta(t) = b0 + t (b1 - b0), float64."""

    @staticmethod
    def log_alpha(t):
        return -0.25 * t * t * (B1 - B0) - 0.5 * t * B0  # integral of -beta / 2

    def sigma(self, t):
        return math.sqrt(1.0 - math.exp(2.0 * self.log_alpha(t)))

    def lam(self, t):
        return self.log_alpha(t) - math.log(self.sigma(t))

    @staticmethod
    def inv_lam(lam):
        # log alpha = -log(1 + e^(-2 lambda)) / 2, then the positive root of (b1-b0)/4 t^2 + b0/2 t + log alpha = 0.
        log_alpha = -0.5 * math.log1p(math.exp(-2.0 * lam))
        return (-B0 + math.sqrt(B0 * B0 - 4.0 * (B1 - B0) * log_alpha)) / (B1 - B0)


def _reference_fast_noise(eps_fn, x, nfe, eps=1e-4):
    """DPM-Solver-fast (Lu et al. 2022) with noise prediction: K = nfe // 3 + 1 steps uniform in lambda from
    t = 1 to t = eps, orders [3]*(K-2)+[2,1] / [3]*(K-1)+[1] / [3]*(K-1)+[2] for nfe % 3 = 0 / 1 / 2, stages at
    lambda fractions (1/3, 2/3) or 1/2. Returns the sample at t = eps and the list of evaluation times."""
    ns, calls = _LinearVP(), []

    def model(x, t):
        t = float(np.float32(t))  # the network sees float32 times (as in the official code)
        calls.append(t)
        return eps_fn(x, t)

    k = nfe // 3 + 1
    orders = {0: [3] * (k - 2) + [2, 1], 1: [3] * (k - 1) + [1], 2: [3] * (k - 1) + [2]}[nfe % 3]
    lams = np.linspace(ns.lam(1.0), ns.lam(eps), k + 1)
    times = [ns.inv_lam(v) for v in lams]
    for i, order in enumerate(orders):
        s, t = times[i], times[i + 1]
        h = ns.lam(t) - ns.lam(s)

        def a(u, s=s):  # alpha_u / alpha_s
            return math.exp(ns.log_alpha(u) - ns.log_alpha(s))

        e_s = model(x, s)
        if order == 1:
            x = a(t) * x - ns.sigma(t) * math.expm1(h) * e_s
        elif order == 2:
            r1 = 0.5
            s1 = ns.inv_lam(ns.lam(s) + r1 * h)
            e_1 = model(a(s1) * x - ns.sigma(s1) * math.expm1(r1 * h) * e_s, s1)
            x = (a(t) * x - ns.sigma(t) * math.expm1(h) * e_s
                 - 0.5 / r1 * ns.sigma(t) * math.expm1(h) * (e_1 - e_s))
        else:
            r1, r2 = 1.0 / 3.0, 2.0 / 3.0
            s1, s2 = ns.inv_lam(ns.lam(s) + r1 * h), ns.inv_lam(ns.lam(s) + r2 * h)
            e_1 = model(a(s1) * x - ns.sigma(s1) * math.expm1(r1 * h) * e_s, s1)
            phi_22 = math.expm1(r2 * h) / (r2 * h) - 1.0
            x_2 = a(s2) * x - ns.sigma(s2) * math.expm1(r2 * h) * e_s - r2 / r1 * ns.sigma(s2) * phi_22 * (e_1 - e_s)
            e_2 = model(x_2, s2)
            phi_2 = math.expm1(h) / h - 1.0
            x = a(t) * x - ns.sigma(t) * math.expm1(h) * e_s - 1.0 / r2 * ns.sigma(t) * phi_2 * (e_2 - e_s)
    assert len(calls) == nfe
    return x, calls


class _GaussianEpsVP:
    """Exact epsilon for data x0 ~ N(mu, diag(var)) under the linear VP-SDE, and the exact probability-flow map."""

    def __init__(self, mu, var):
        self.mu, self.var, self.ns = mu, var, _LinearVP()

    def _a_s(self, t):
        return math.exp(self.ns.log_alpha(t)), self.ns.sigma(t)

    def __call__(self, x, t):
        a, s = self._a_s(t)
        return s * (x - a * self.mu) / (a * a * self.var + s * s)

    def exact_flow(self, x_T, t_from, t_to):
        (a0, s0), (a1, s1) = self._a_s(t_from), self._a_s(t_to)
        scale = np.sqrt(a1 * a1 * self.var + s1 * s1) / np.sqrt(a0 * a0 * self.var + s0 * s0)
        return a1 * self.mu + scale * (x_T - a0 * self.mu)


def _vpsde_scheduler(**kwargs):
    from uvic.config import DiffusionConfig
    from uvic.schedulers import build_scheduler

    if not kwargs:
        return build_scheduler("uvit_dpm_solver", DiffusionConfig())  # how a VP-SDE model selects it
    return VPSDEDPMSolverFastScheduler(**kwargs)


def _run_continuous(sched, eps_fn, x, nfe):
    sched.set_timesteps(nfe)
    sample = torch.tensor(x, dtype=torch.float64)
    for t in sched.timesteps:
        eps = torch.tensor(eps_fn(sample.numpy(), float(t)), dtype=torch.float64)
        sample = sched.step(eps, t, sample).prev_sample
    return sample.numpy()


@pytest.mark.parametrize("nfe", [50, 10, 12, 4])
def test_vpsde_matches_reference_dpm_solver_fast(nfe):
    """Noise-prediction DPM-Solver-fast on the Gaussian toy: our scheduler against the plain-loop reference."""
    rng = np.random.default_rng(1)
    mu, var = rng.normal(size=(2, 3, 4, 4)) * 0.5, rng.uniform(0.05, 1.5, size=(2, 3, 4, 4))
    model = _GaussianEpsVP(mu, var)
    x_T = rng.normal(size=(2, 3, 4, 4))
    ref, calls = _reference_fast_noise(model, x_T, nfe)
    sched = _vpsde_scheduler()
    ours = _run_continuous(sched, model, x_T, nfe)
    assert isinstance(sched, VPSDEDPMSolverFastScheduler) and sched.config.algorithm_type == "dpmsolver"
    assert sum(sched.solver_orders) == nfe and len(sched.timesteps) == nfe
    np.testing.assert_array_equal(sched.timesteps.double().numpy(), calls)
    np.testing.assert_allclose(ours, ref, rtol=1e-10, atol=1e-10)


def test_vpsde_monitor_grid():
    """50 NFE: [3] * 16 + [2] over 17 logSNR-uniform intervals from t = 1 to 1e-4; the last evaluation sits at the
    lambda midpoint of the last interval (t = 1.87e-4, network time 0.187)."""
    ns = _LinearVP()
    sched = _vpsde_scheduler()
    sched.set_timesteps(50)
    assert sched.solver_orders == [3] * 16 + [2]
    lams = np.linspace(ns.lam(1.0), ns.lam(1e-4), 18)
    assert sched.timesteps[0].item() == 1.0
    np.testing.assert_allclose(sched.timesteps[::3][:17].double().numpy(), [ns.inv_lam(v) for v in lams[:17]],
                               rtol=1e-6)
    last = ns.inv_lam(0.5 * (lams[16] + lams[17]))
    assert sched.timesteps[-1].item() == pytest.approx(last, rel=1e-6) and abs(last - 1.87e-4) < 5e-7


@pytest.mark.parametrize(
    "algorithm_type,skip_type",
    [("dpmsolver", None), ("dpmsolver++", None), ("dpmsolver", "time_uniform"), ("dpmsolver++", "time_uniform")],
)
def test_vpsde_converges_to_the_exact_flow(algorithm_type, skip_type):
    """Gaussian data: the probability-flow ODE maps x_T affinely to x_eps; every solver variant converges to it
    as NFE grows, the logSNR-spaced ones at (at least) second order."""
    rng = np.random.default_rng(2)
    mu, var = rng.normal(size=(64,)) * 0.5, rng.uniform(0.05, 1.5, size=(64,))
    model = _GaussianEpsVP(mu, var)
    x_T = rng.normal(size=(256, 64))
    kwargs = {"algorithm_type": algorithm_type, "skip_type": skip_type}
    sched = _vpsde_scheduler(**{k: v for k, v in kwargs.items() if v is not None})
    exact = model.exact_flow(x_T, 1.0, 1e-4)
    errors = [np.abs(_run_continuous(sched, model, x_T, nfe) - exact).max() for nfe in (12, 24, 48, 96)]
    assert all(b < a for a, b in zip(errors, errors[1:])), errors
    if sched.config.skip_type == "logSNR":
        assert errors[-1] < 1e-3 * np.abs(exact).max() and errors[-2] / errors[-1] > 4.0, errors
    else:  # time-uniform steps are too coarse near t = 1e-4 on the VP-SDE: slow, but converging
        assert errors[-1] < 5e-2 * np.abs(exact).max(), errors


def test_vpsde_monitor_sampler_reaches_the_data_marginal():
    """x_T drawn from the exact marginal at t = 1; after 50 NFE the samples have the exact marginal at t = 1e-4,
    N(alpha mu, alpha^2 var + sigma^2), within the sampling error of 20000 draws."""
    rng = np.random.default_rng(3)
    mu, var = np.array([1.5, -0.5, 0.0, 0.8]), np.array([0.04, 0.5, 1.0, 2.0])
    model, ns = _GaussianEpsVP(mu, var), _LinearVP()
    n = 20000

    def marginal(t):
        a, s = math.exp(ns.log_alpha(t)), ns.sigma(t)
        return a * mu, np.sqrt(a * a * var + s * s)

    m_T, sd_T = marginal(1.0)
    out = _run_continuous(_vpsde_scheduler(), model, m_T + sd_T * rng.normal(size=(n, 4)), 50)
    m_eps, sd_eps = marginal(1e-4)
    np.testing.assert_allclose(out.mean(0), m_eps, atol=4 * sd_eps.max() / math.sqrt(n))
    np.testing.assert_allclose(out.std(0), sd_eps, rtol=4 * math.sqrt(0.5 / n))


def test_vpsde_config_and_selection():
    from uvic.config import DiffusionConfig
    from uvic.schedulers import VPSDEDPMSolverScheduler, VPSDEEulerMaruyamaScheduler, convert_scheduler, sampler_names
    from uvic.schedulers.timesteps import network_timestep_for, schedule_of

    assert "uvit_dpm_solver" in sampler_names()
    sched = _vpsde_scheduler()
    cfg = sched.config
    assert (cfg.beta_min, cfg.beta_max, cfg.time_scale, cfg.t_eps) == (0.1, 20.0, 999.0, 1e-4)
    assert (cfg.algorithm_type, cfg.skip_type, cfg.solver_order) == ("dpmsolver", "logSNR", 3)
    assert schedule_of(sched) == "vpsde" and network_timestep_for(sched, torch.tensor(0.5)) == 499.5
    assert schedule_of(UViTDPMSolverScheduler()) == "discrete"
    # from_config from the other VP-SDE schedulers' configs keeps the process, not their final time.
    for other in (VPSDEEulerMaruyamaScheduler(), VPSDEDPMSolverScheduler(beta_max=10.0, time_scale=500.0)):
        mine = convert_scheduler(other, "uvit_dpm_solver")
        assert isinstance(mine, VPSDEDPMSolverFastScheduler)
        assert (mine.config.beta_max, mine.config.time_scale) == (other.config.beta_max, other.config.time_scale)
        assert mine.config.t_eps == 1e-4  # the monitor's eps, not the other solver's t_eps
    mine = convert_scheduler(VPSDEDPMSolverScheduler(beta_max=10.0), "uvit_dpm_solver")
    back = convert_scheduler(mine, "dpm_solver")
    assert isinstance(back, VPSDEDPMSolverScheduler) and back.config.beta_max == 10.0
    # A round trip through its own config keeps every field.
    again = VPSDEDPMSolverFastScheduler.from_config(sched.config)
    assert {k: v for k, v in again.config.items() if not k.startswith("_")} == {
        k: v for k, v in cfg.items() if not k.startswith("_")
    }
    # The discrete scheduler from a stock discrete one keeps the betas and the official solver.
    d = convert_scheduler(
        __import__("diffusers").DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
        "uvit_dpm_solver")
    assert isinstance(d, UViTDPMSolverScheduler) and d.config.algorithm_type == "dpmsolver++"
    assert (d.config.beta_schedule, d.config.beta_start, d.config.beta_end) == ("scaled_linear", 0.00085, 0.012)
    assert DiffusionConfig().schedule == "vpsde"


def test_vpsde_add_noise_and_bad_config():
    sched = _vpsde_scheduler()
    x0, noise, t = torch.randn(3, 2, 2, 2), torch.randn(3, 2, 2, 2), torch.tensor([0.0, 0.5, 1.0])
    a = torch.tensor([math.exp(_LinearVP.log_alpha(float(u))) for u in t]).view(-1, 1, 1, 1)
    torch.testing.assert_close(sched.add_noise(x0, noise, t), a * x0 + (1 - a * a).sqrt() * noise)
    with pytest.raises(ValueError, match="beta_min < beta_max"):
        VPSDEDPMSolverFastScheduler(beta_min=20.0, beta_max=0.1)
    for cls in (UViTDPMSolverScheduler, VPSDEDPMSolverFastScheduler):
        with pytest.raises(ValueError, match="algorithm_type"):
            cls(algorithm_type="sde-dpmsolver++")
        with pytest.raises(ValueError, match="skip_type"):
            cls(skip_type="time_quadratic")
        with pytest.raises(ValueError, match="solver_order"):
            cls(solver_order=4)


@pytest.mark.parametrize("nfe", [50, 10])
def test_uvic_pipeline_reproduces_the_monitor_sampler(nfe):
    """`UViCPipeline` with a tiny random continuous-time U-ViT and `uvit_dpm_solver`, against the plain reference
    loop with the same network as its noise model (official `model_wrapper(time_input_type="0")` around
    `ScoreModel.noise_pred`: the network gets 999 t in float32), from the same x_T: every network input (x, 999 t)
    and the final images agree. (A random network drives x far outside [-1, 1], where the images clamp, so the
    inputs of all evaluations are compared too.)"""
    from uvic.models import UViTModel
    from uvic.pipelines import UViCPipeline

    torch.manual_seed(0)
    net = UViTModel(img_size=8, patch_size=2, in_chans=3, embed_dim=16, depth=2, num_heads=2, attention="cog").eval()
    pipe = UViCPipeline(transformer=net, scheduler=_vpsde_scheduler())
    pipe.set_progress_bar_config(disable=True)
    x_T = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    seen = []
    hook = net.register_forward_pre_hook(lambda m, args: seen.append((args[0].clone(), args[1].clone())))
    try:
        got = pipe(latents=x_T, num_inference_steps=nfe, output_type="pt").images.double().numpy()
    finally:
        hook.remove()

    ref_inputs = []

    @torch.no_grad()
    def noise_pred(x, t):
        time = torch.full((x.shape[0],), t, dtype=torch.float32) * 999
        ref_inputs.append((x.copy(), time))
        return net(torch.from_numpy(x).float(), time).sample.double().numpy()

    ref, _ = _reference_fast_noise(noise_pred, x_T.double().numpy(), nfe)
    assert len(seen) == len(ref_inputs) == nfe
    for (x_pipe, t_pipe), (x_ref, t_ref) in zip(seen, ref_inputs):
        assert torch.equal(t_pipe, t_ref)
        scale = np.abs(x_ref).max()
        np.testing.assert_allclose(x_pipe.double().numpy(), x_ref, rtol=0, atol=2e-6 * scale)  # float32 round-off
    np.testing.assert_allclose(got, np.clip(ref / 2 + 0.5, 0.0, 1.0), rtol=0, atol=1e-5)
