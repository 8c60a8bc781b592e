"""The noise schedules of U-ViT's two kinds of model, as one interface every solver and loss reads.

A schedule fixes the forward process x_t = alpha_t x_0 + sigma_t eps on continuous time t in [0, 1], with
alpha_bar(t) = alpha_t^2 and sigma_t^2 = 1 - alpha_bar(t) (docs/conventions.md, "Schedules"):

- `VPSDE`: the continuous linear-beta VP-SDE of U-ViT's CIFAR-10 model (Song et al. 2021, Eq. 11; U-ViT
  `sde.py::VPSDE`): beta(t) = beta_min + t (beta_max - beta_min),
  log alpha_bar(t) = -(beta_min t + (beta_max - beta_min) t^2 / 2).
- `DiscreteSchedule`: a DDPM beta schedule (Stable Diffusion's "scaled_linear" for MS-COCO) extended to continuous
  time as DPM-Solver's `NoiseScheduleVP("discrete")` does: knots t_n = n / N (n = 1..N) with
  log alpha_bar(t_n) = sum_{i<=n} log(1 - beta_i), piecewise linear in t between them.

`SCHEDULE_PRESETS` names the forward processes U-ViT trains on and is the one place their constants are written:
a config's `diffusion: {preset: NAME}`, `uvic.config.DiffusionConfig` and the schedules' and schedulers' defaults
read it.

Both subclass `NoiseSchedule`, which derives alpha_bar, sigma and lambda (half log-SNR, DPM-Solver's lambda_t)
from the subclass's `log_alpha_bar` in one way; a subclass adds only its `log_alpha_bar` and the inverse
`t_from_lambda`. The network input for time t is `uvic.schedulers.timesteps.network_timestep`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


__all__ = ["DiscreteSchedule", "NoiseSchedule", "SCHEDULE_PRESETS", "VPSDE", "schedule_preset"]

# Named forward processes, as `uvic.config.DiffusionConfig` fields (docs/conventions.md, "Schedules").
SCHEDULE_PRESETS: dict[str, dict[str, Any]] = {
    # U-ViT's continuous VP-SDE (CIFAR-10, ImageNet 64, the L latent models; U-ViT `sde.py`): beta 0.1 -> 20,
    # network time 999 t.
    "vpsde": {"schedule": "vpsde", "beta_min": 0.1, "beta_max": 20.0, "time_scale": 999.0},
    # DDPM's discrete linear betas (Ho et al. 2020; diffusers' `DDPMScheduler` defaults).
    "ddpm": {"schedule": "discrete", "num_train_timesteps": 1000, "beta_schedule": "linear", "beta_start": 0.0001,
             "beta_end": 0.02},
    # Stable Diffusion's discrete "scaled_linear" betas, linspace(sqrt(0.00085), sqrt(0.012), 1000)^2 (U-ViT's
    # MS-COCO and ImageNet H models; U-ViT `stable_diffusion_beta_schedule`).
    "stable-diffusion": {"schedule": "discrete", "num_train_timesteps": 1000, "beta_schedule": "scaled_linear",
                         "beta_start": 0.00085, "beta_end": 0.012},
}
_VP, _SD = SCHEDULE_PRESETS["vpsde"], SCHEDULE_PRESETS["stable-diffusion"]


def schedule_preset(name: str) -> dict[str, Any]:
    """The `DiffusionConfig` fields of the named forward process `name` (a copy of `SCHEDULE_PRESETS[name]`)."""
    if name not in SCHEDULE_PRESETS:
        raise ValueError(f"unknown schedule preset {name!r}; available: {sorted(SCHEDULE_PRESETS)}")
    return dict(SCHEDULE_PRESETS[name])

Time = float | np.ndarray | torch.Tensor


def _exp(x: Time) -> Time:
    return torch.exp(x) if isinstance(x, torch.Tensor) else np.exp(x)


def _log(x: Time) -> Time:
    return torch.log(x) if isinstance(x, torch.Tensor) else np.log(x)


def _sqrt(x: Time) -> Time:
    return torch.sqrt(x) if isinstance(x, torch.Tensor) else np.sqrt(x)


def _expm1(x: Time) -> Time:
    return torch.expm1(x) if isinstance(x, torch.Tensor) else np.expm1(x)


class NoiseSchedule:
    """alpha_bar, sigma and lambda of a forward process, all from `log_alpha_bar` (subclasses define it and
    `t_from_lambda`). Each method takes times of any shape and returns that shape."""

    def log_alpha_bar(self, t: Time) -> Time:
        """log alpha_bar(t) = 2 log alpha_t (DPM-Solver's `marginal_log_mean_coeff` is half of it)."""
        raise NotImplementedError

    def t_from_lambda(self, lam: Time) -> Time:
        """The time whose half log-SNR is `lam` (inverse of `lambda_`)."""
        raise NotImplementedError

    def alpha_bar(self, t: Time) -> Time:
        return _exp(self.log_alpha_bar(t))

    def sigma(self, t: Time) -> Time:
        """sqrt(1 - alpha_bar(t)), computed with expm1 so it stays accurate near t = 0."""
        return _sqrt(-_expm1(self.log_alpha_bar(t)))

    def lambda_(self, t: Time) -> Time:
        """Half log-SNR log(alpha_t / sigma_t) = (log alpha_bar - log(1 - alpha_bar)) / 2 (DPM-Solver's lambda)."""
        log_alpha_bar = self.log_alpha_bar(t)
        return 0.5 * log_alpha_bar - 0.5 * _log(-_expm1(log_alpha_bar))


@dataclass(frozen=True)
class VPSDE(NoiseSchedule):
    """Linear-beta VP-SDE on t in [0, 1]. Defaults are U-ViT's (`SCHEDULE_PRESETS["vpsde"]`). Works on floats,
    numpy arrays and tensors alike."""

    beta_min: float = _VP["beta_min"]
    beta_max: float = _VP["beta_max"]

    def beta(self, t: Time) -> Time:
        return self.beta_min + t * (self.beta_max - self.beta_min)

    def log_alpha_bar(self, t: Time) -> Time:
        """log alpha_bar(t) = -(beta_min t + (beta_max - beta_min) t^2 / 2)."""
        return -(self.beta_min * t + 0.5 * (self.beta_max - self.beta_min) * t * t)

    def t_from_log_alpha_bar(self, log_alpha_bar: Time) -> Time:
        """Inverse of `log_alpha_bar`: the positive root of (b1 - b0) t^2 / 2 + b0 t + log_alpha_bar = 0."""
        d = self.beta_max - self.beta_min
        return (-self.beta_min + _sqrt(self.beta_min**2 - 2.0 * d * log_alpha_bar)) / d

    def t_from_lambda(self, lam: Time) -> Time:
        """Inverse of `lambda_`: alpha_bar = sigmoid(2 lambda)."""
        if isinstance(lam, torch.Tensor):
            log_ab = -torch.nn.functional.softplus(-2.0 * lam)
        else:
            log_ab = -np.logaddexp(0.0, -2.0 * lam)
        return self.t_from_log_alpha_bar(log_ab)


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation on increasing knots `xp`, extended linearly past both ends (as the
    official `interpolate_fn`). All tensors 1-D."""
    idx = torch.searchsorted(xp, x).clamp(1, xp.numel() - 1)
    x0, x1, y0, y1 = xp[idx - 1], xp[idx], fp[idx - 1], fp[idx]
    return y0 + (x - x0) * (y1 - y0) / (x1 - x0)


class DiscreteSchedule(NoiseSchedule):
    """A DDPM beta schedule and its continuous-time extension (DPM-Solver's `NoiseScheduleVP("discrete")`).

    Args:
        num_train_timesteps: N, the number of training steps (knots t_n = n / N).
        beta_start, beta_end, beta_schedule: "scaled_linear" or "linear", as diffusers' `DDPMScheduler` names
            them; the defaults are Stable Diffusion's (`SCHEDULE_PRESETS["stable-diffusion"]`, U-ViT's MS-COCO).
        trained_betas: explicit (N,) betas instead of a named schedule.

    Attributes:
        betas, alphas_cumprod: (N,) float64; alphas_cumprod[n] is diffusers' alpha_bar at 0-based step n.
    The continuous-time methods take and return float64 tensors of times.
    """

    def __init__(
        self,
        num_train_timesteps: int = _SD["num_train_timesteps"],
        beta_start: float = _SD["beta_start"],
        beta_end: float = _SD["beta_end"],
        beta_schedule: str = _SD["beta_schedule"],
        trained_betas: list[float] | None = None,
    ) -> None:
        if trained_betas is not None:
            betas = torch.tensor(trained_betas, dtype=torch.float64)
        elif beta_schedule == "scaled_linear":
            # Same float64 construction as U-ViT's `stable_diffusion_beta_schedule`.
            betas = torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=torch.float64) ** 2
        elif beta_schedule == "linear":
            betas = torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float64)
        else:
            raise ValueError(f"unsupported beta_schedule {beta_schedule!r}; expected 'scaled_linear' or 'linear'")
        n = betas.numel()
        self.betas = betas
        self.alphas_cumprod = torch.cumprod(1.0 - betas, 0)
        # Knots of the continuous-time extension: t_n = n / N, log alpha_n = 0.5 * sum_{i<=n} log(1 - beta_i).
        self._t_knots = torch.linspace(1.0 / n, 1.0, n, dtype=torch.float64)
        self._log_alpha_knots = 0.5 * torch.log(1.0 - betas).cumsum(0)

    def log_alpha_bar(self, t: torch.Tensor) -> torch.Tensor:
        return 2.0 * _interp(t, self._t_knots, self._log_alpha_knots)

    def t_from_lambda(self, lam: torch.Tensor) -> torch.Tensor:
        """The official inverse: log alpha_t = -log(1 + e^(-2 lambda)) / 2, then the knots read backwards."""
        log_alpha = -0.5 * torch.logaddexp(torch.zeros_like(lam), -2.0 * lam)
        return _interp(log_alpha, self._log_alpha_knots.flip(0), self._t_knots.flip(0))
