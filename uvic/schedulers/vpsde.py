"""The continuous-time VP-SDE of U-ViT's CIFAR-10 model.

Song et al. 2021, Eq. 11 with a linear beta(t) (U-ViT `sde.py::VPSDE`, docs/conventions.md, "Schedules"):

    beta(t)       = beta_min + t (beta_max - beta_min),                 t in [0, 1]
    alpha_bar(t)  = exp(-(beta_min t + (beta_max - beta_min) t^2 / 2))  (= cum_alpha(t) in U-ViT)
    sigma(t)^2    = 1 - alpha_bar(t)
    x_t           = sqrt(alpha_bar(t)) x_0 + sigma(t) eps

Every function takes a float, a numpy array or a tensor of times and returns the same kind. The network input for
time t (999 t) is `uvic.schedulers.timesteps.network_timestep`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


Time = float | np.ndarray | torch.Tensor


def _exp(x: Time) -> Time:
    return torch.exp(x) if isinstance(x, torch.Tensor) else np.exp(x)


def _log(x: Time) -> Time:
    return torch.log(x) if isinstance(x, torch.Tensor) else np.log(x)


def _sqrt(x: Time) -> Time:
    return torch.sqrt(x) if isinstance(x, torch.Tensor) else np.sqrt(x)


def _expm1(x: Time) -> Time:
    return torch.expm1(x) if isinstance(x, torch.Tensor) else np.expm1(x)


@dataclass(frozen=True)
class VPSDE:
    """Linear-beta VP-SDE on t in [0, 1]. Defaults are U-ViT's (beta 0.1 -> 20)."""

    beta_min: float = 0.1
    beta_max: float = 20.0

    def beta(self, t: Time) -> Time:
        return self.beta_min + t * (self.beta_max - self.beta_min)

    def log_alpha_bar(self, t: Time) -> Time:
        """log alpha_bar(t) = -(beta_min t + (beta_max - beta_min) t^2 / 2)."""
        return -(self.beta_min * t + 0.5 * (self.beta_max - self.beta_min) * t * t)

    def alpha_bar(self, t: Time) -> Time:
        return _exp(self.log_alpha_bar(t))

    def sigma(self, t: Time) -> Time:
        """sqrt(1 - alpha_bar(t)), computed with expm1 so it stays accurate near t = 0."""
        return _sqrt(-_expm1(self.log_alpha_bar(t)))

    def lambda_(self, t: Time) -> Time:
        """Half log-SNR, log(alpha_t / sigma_t) with alpha_t = sqrt(alpha_bar(t)) (DPM-Solver's lambda)."""
        return 0.5 * self.log_alpha_bar(t) - _log(self.sigma(t))

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
