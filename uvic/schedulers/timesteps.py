"""The one place a diffusion time becomes the timestep value the U-ViT network embeds.

U-ViT trains its two kinds of model on different time inputs (docs/conventions.md, "Timesteps"):

    schedule    time t (training sample, scheduler timestep)            network input
    "vpsde"     continuous t in [0, 1] (VP-SDE, CIFAR-10)                time_scale * t = 999 t  (`ScoreModel.predict`)
    "discrete"  diffusers' 0-based DDPM step t in {0, ..., N - 1}        t + 1 in {1, ..., N}

The discrete offset exists because U-ViT's `Schedule` prepends beta_0 = 0: its `cum_alphas[n]` equals diffusers'
`alphas_cumprod[n - 1]`, and training feeds the network n. Fractional t (DPM-Solver stages) shifts the same way.

The training losses (`uvic.training.losses`) call `network_timestep` on the time they
sampled; the pipelines call `network_timestep_for(scheduler, t)` on each entry of `scheduler.timesteps`, which
holds the time t above (the VP-SDE schedulers hold continuous t; diffusers' discrete schedulers their 0-based step).
"""

from __future__ import annotations

from typing import Literal

import torch
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from uvic.schedulers.noise_schedule import SCHEDULE_PRESETS
from uvic.schedulers.scheduling_vpsde import _VPSDESchedulerBase


__all__ = ["DISCRETE_TIMESTEP_OFFSET", "network_timestep", "network_timestep_for", "schedule_of"]

Schedule = Literal["vpsde", "discrete"]

# U-ViT's discrete index convention: network time n = diffusers timestep + 1.
DISCRETE_TIMESTEP_OFFSET = 1


def network_timestep(
    t: torch.Tensor, schedule: Schedule, time_scale: float = SCHEDULE_PRESETS["vpsde"]["time_scale"]
) -> torch.Tensor:
    """Time t -> the value the network embeds: `time_scale * t` ("vpsde") or `t + 1` ("discrete").

    Args:
        t: (B,) or scalar times; float in [0, 1] for "vpsde", int or fractional diffusers steps for "discrete".
        schedule: the forward process the model was trained on (`DiffusionConfig.schedule`).
        time_scale: the VP-SDE network time scale (U-ViT: 999); unused for "discrete".
    Returns:
        A tensor of t's shape (dtype kept, so integer steps stay integers).
    """
    if schedule == "vpsde":
        return t * time_scale
    if schedule == "discrete":
        return t + DISCRETE_TIMESTEP_OFFSET
    raise ValueError(f"unknown diffusion schedule {schedule!r}; expected 'vpsde' or 'discrete'")


def schedule_of(scheduler: SchedulerMixin) -> Schedule:
    """The forward process a scheduler samples: "vpsde" for the VP-SDE schedulers of `uvic.schedulers`,
    "discrete" for every other scheduler (`UViTDPMSolverScheduler` and diffusers' stock ones)."""
    return "vpsde" if isinstance(scheduler, _VPSDESchedulerBase) else "discrete"


def network_timestep_for(scheduler: SchedulerMixin, t: torch.Tensor) -> torch.Tensor:
    """`network_timestep` for an entry `t` of `scheduler.timesteps` (the schedule and time scale come from it)."""
    if schedule_of(scheduler) == "vpsde":
        return network_timestep(t, "vpsde", scheduler.config.time_scale)
    return network_timestep(t, "discrete")
