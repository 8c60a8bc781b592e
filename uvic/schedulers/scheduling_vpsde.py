"""Samplers for the continuous VP-SDE, as diffusers schedulers (no stock diffusers scheduler is continuous-time).

All share `_VPSDESchedulerBase` (the `VPSDE` of their config, the grid, the step index, `add_noise`) and follow
diffusers' contract: `set_timesteps(n)` fills `timesteps` with the continuous times t in (0, 1] at
which the network is evaluated (the pipeline feeds it `uvic.schedulers.timesteps.network_timestep`, i.e. 999 t,
like diffusers' continuous `ScoreSdeVeScheduler`), and `step(model_output, timestep, sample)` takes one step down
the grid. Samples are (B, C, H, W); the model output is the noise prediction eps_hat of the same shape.

- `VPSDEEulerMaruyamaScheduler`: U-ViT's `sde.euler_maruyama`, the sampler behind the official CIFAR-10 FID 3.11
  (docs/conventions.md, "Samplers"): time grid `[0] + linspace(t_eps, 1, n)` walked from 1 down to 0, the drift
  evaluated at the upper time of each interval, no noise on the last step. The grid, and so every network time
  input, is the official float32 one bit for bit; the step coefficients are computed in float64 from those grid
  values (the official code uses float32 arithmetic), so samples agree to float32 rounding, not bit for bit.
- `VPSDEDPMSolverScheduler`: DPM-Solver++(2M) (Lu et al. 2022, Alg. 2) in data-prediction form on a
  logSNR-uniform grid from t = 1 to t = t_eps; one network evaluation per step, so 50 steps = 50 NFE. U-ViT's
  training-time monitor used the single-step "fast" DPM-Solver variant instead; both are 50-NFE solvers of the
  same ODE, so sample quality is comparable but the samples are not bit-identical.

The monitor's sampler, `VPSDEDPMSolverFastScheduler`, is the third of the family; it lives with the discrete
MS-COCO sampler whose solver it shares (`uvic.schedulers.scheduling_dpmsolver_uvit`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin, SchedulerOutput
from diffusers.utils.torch_utils import randn_tensor

from uvic.schedulers.noise_schedule import SCHEDULE_PRESETS, VPSDE


_VP = SCHEDULE_PRESETS["vpsde"]  # U-ViT's VP-SDE, the defaults of both schedulers


class _VPSDESchedulerBase(SchedulerMixin, ConfigMixin):
    """Shared bookkeeping: the VP-SDE, the continuous grid `times` (n + 1,), `timesteps` (n,) and the step index.

    A subclass registers `beta_min`, `beta_max`, `time_scale` and `num_train_timesteps` in its config and defines
    `_grid` and `_update`.
    """

    _compatibles = ["VPSDEEulerMaruyamaScheduler", "VPSDEDPMSolverScheduler", "VPSDEDPMSolverFastScheduler"]
    order = 1
    init_noise_sigma = 1.0

    def _reset(self) -> None:
        # No grid until `set_timesteps`.
        self.times = None
        self.timesteps = None
        self.num_inference_steps = None
        self._step_index = 0

    @property
    def sde(self) -> VPSDE:
        """The noise schedule, from this scheduler's config."""
        return VPSDE(self.config.beta_min, self.config.beta_max)

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None) -> None:
        """Fill `timesteps` with the n continuous times at which the network is evaluated (see `_grid`)."""
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        times = self._grid(num_inference_steps)
        # `times` is decreasing; steps go from times[i] to times[i + 1], and the network is evaluated at times[i].
        self.times = times
        self.timesteps = times[:-1].to(device=device, dtype=torch.float32)
        self.num_inference_steps = len(times) - 1
        self._step_index = 0

    def _grid(self, num_inference_steps: int) -> torch.Tensor:
        """The (n + 1,) decreasing time grid of the solver."""
        raise NotImplementedError

    def step(
        self,
        model_output: torch.Tensor,
        timestep: torch.Tensor | float,
        sample: torch.Tensor,
        generator: torch.Generator | list[torch.Generator] | None = None,
        return_dict: bool = True,
    ) -> SchedulerOutput | tuple:
        """One step from times[i] to times[i + 1] (i counts the calls since `set_timesteps`).

        Args:
            model_output: (B, C, H, W) eps_hat at time t = times[i].
            timestep: t, as in `timesteps` (the scheduler keeps its own index; accepted for diffusers pipelines).
            sample: (B, C, H, W) x_t.
            generator: one generator, or one per sample (so each sample's noise is its own); deterministic
                solvers ignore it.
            return_dict: return a `SchedulerOutput` instead of a tuple.
        Returns:
            `SchedulerOutput` with `prev_sample`, x at times[i + 1], or `(prev_sample,)`.
        """
        i = self._next_index()
        prev = self._update(i, model_output.to(sample.dtype), sample, generator)
        return SchedulerOutput(prev_sample=prev) if return_dict else (prev,)

    def _update(self, i: int, eps: torch.Tensor, sample: torch.Tensor, generator) -> torch.Tensor:
        """The solver's update x_{times[i]} -> x_{times[i + 1]} given eps_hat at times[i]."""
        raise NotImplementedError

    def scale_model_input(self, sample: torch.Tensor, timestep: torch.Tensor | float | None = None) -> torch.Tensor:
        """Identity (the VP-SDE network takes x_t as is); kept for diffusers pipeline compatibility."""
        return sample

    def add_noise(self, original_samples: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """Forward process alpha_t x_0 + sigma_t noise at (B,) continuous times t (computed in float64).

        Args:
            original_samples: (B, C, H, W) x_0.
            noise: (B, C, H, W) eps.
            timesteps: (B,) continuous t in [0, 1].
        Returns:
            (B, C, H, W) x_t in the samples' dtype.
        """
        log_alpha_bar = self.sde.log_alpha_bar(timesteps.detach().to("cpu", torch.float64))
        shape = (-1, *([1] * (original_samples.dim() - 1)))
        alpha = (0.5 * log_alpha_bar).exp().to(original_samples.device, original_samples.dtype).view(shape)
        sigma = self.sde.sigma(timesteps.detach().to("cpu", torch.float64))
        sigma = sigma.to(original_samples.device, original_samples.dtype).view(shape)
        return alpha * original_samples + sigma * noise

    def _next_index(self) -> int:
        if getattr(self, "times", None) is None:
            raise ValueError("call set_timesteps(num_inference_steps) before step()")
        if self._step_index >= self.num_inference_steps:
            raise ValueError(f"step() called more than num_inference_steps={self.num_inference_steps} times")
        i = self._step_index
        self._step_index += 1
        return i

    def __len__(self) -> int:
        return self.config.num_train_timesteps


class VPSDEEulerMaruyamaScheduler(_VPSDESchedulerBase):
    """Euler–Maruyama for the reverse VP-SDE, U-ViT's CIFAR-10 evaluation sampler (`sde.euler_maruyama`).

    Args:
        beta_min, beta_max: the VP-SDE (`uvic.schedulers.noise_schedule.VPSDE`).
        time_scale: network time per unit of t (U-ViT: 999), read by `uvic.schedulers.timesteps`.
        t_eps: the smallest non-zero grid time.
        num_train_timesteps: only reported by `len()`, for diffusers compatibility.
    """

    @register_to_config
    def __init__(
        self,
        beta_min: float = _VP["beta_min"],
        beta_max: float = _VP["beta_max"],
        time_scale: float = _VP["time_scale"],
        t_eps: float = 1e-3,
        num_train_timesteps: int = 1000,
    ):
        self._reset()

    def _grid(self, num_inference_steps: int) -> torch.Tensor:
        """Grid `append(0, linspace(t_eps, 1, n))`, reversed: n steps, the last one from t_eps to 0."""
        # The official grid: numpy's float64 linspace (torch.linspace rounds some points differently), then cast
        # to float32 (`torch.tensor(timesteps).to(x_init)` in U-ViT's sde.py), so t and 999 t match its values.
        grid = np.append(0.0, np.linspace(self.config.t_eps, 1.0, num_inference_steps))
        return torch.tensor(grid[::-1].copy()).to(torch.float32)

    def _update(self, i: int, eps: torch.Tensor, sample: torch.Tensor, generator) -> torch.Tensor:
        """x_s = x_t + (f - g^2 score)(s - t) + g sqrt(t - s) z with score = -eps_hat / sigma(t); z = 0 when s = 0."""
        t, s = float(self.times[i]), float(self.times[i + 1])  # the float32 grid values, coefficients in float64
        sde = self.sde
        beta = sde.beta(t)
        # Reverse drift f(x, t) - g(t)^2 score(x, t), with f = -beta x / 2, g^2 = beta, score = -eps_hat / sigma.
        drift = -0.5 * beta * sample + (beta / sde.sigma(t)) * eps
        prev = sample + drift * (s - t)
        if s > 0:  # U-ViT adds no noise on the final step to t = 0.
            z = randn_tensor(sample.shape, generator=generator, device=sample.device, dtype=sample.dtype)
            prev = prev + math.sqrt(beta * (t - s)) * z
        return prev


class VPSDEDPMSolverScheduler(_VPSDESchedulerBase):
    """DPM-Solver++(2M) for the VP-SDE probability-flow ODE, deterministic, one network evaluation per step.

    Args:
        beta_min, beta_max: the VP-SDE.
        time_scale: network time per unit of t (U-ViT: 999), read by `uvic.schedulers.timesteps`.
        t_eps: the final time (DPM-Solver's eps; U-ViT's monitor uses 1e-4).
        num_train_timesteps: only reported by `len()`.
    """

    order = 1  # multistep: one model call per `step`

    @register_to_config
    def __init__(
        self,
        beta_min: float = _VP["beta_min"],
        beta_max: float = _VP["beta_max"],
        time_scale: float = _VP["time_scale"],
        t_eps: float = 1e-4,
        num_train_timesteps: int = 1000,
    ):
        self._reset()
        self._prev_x0 = None

    def _grid(self, num_inference_steps: int) -> torch.Tensor:
        """A grid uniform in lambda (half log-SNR) from t = 1 to t = t_eps, n steps."""
        self._prev_x0 = None  # a new grid starts a new multistep history
        sde = self.sde
        lam = torch.linspace(sde.lambda_(1.0), sde.lambda_(self.config.t_eps), num_inference_steps + 1,
                             dtype=torch.float64)
        times = sde.t_from_lambda(lam)
        times[0], times[-1] = 1.0, self.config.t_eps  # exact ends despite round-off in the inverse
        return times

    def _update(self, i: int, eps: torch.Tensor, sample: torch.Tensor, generator) -> torch.Tensor:
        """One DPM-Solver++ step from times[i] to times[i + 1]: first order on the first step, then 2M."""
        sde = self.sde
        t, s = float(self.times[i]), float(self.times[i + 1])
        alpha_t, sigma_t = math.sqrt(sde.alpha_bar(t)), sde.sigma(t)
        alpha_s, sigma_s = math.sqrt(sde.alpha_bar(s)), sde.sigma(s)
        h = sde.lambda_(s) - sde.lambda_(t)
        x0 = (sample - sigma_t * eps) / alpha_t  # data prediction
        if self._prev_x0 is None:
            d = x0
        else:
            # Second-order multistep correction (Lu et al. 2022, DPM-Solver++(2M), Eq. 18-ish with r = h_prev/h).
            h_prev = sde.lambda_(t) - sde.lambda_(float(self.times[i - 1]))
            r = h_prev / h
            d = (1.0 + 0.5 / r) * x0 - (0.5 / r) * self._prev_x0
        prev = (sigma_s / sigma_t) * sample - alpha_s * math.expm1(-h) * d
        self._prev_x0 = x0
        return prev
