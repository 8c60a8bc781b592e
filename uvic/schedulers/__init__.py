"""Noise schedules and samplers.

Continuous VP-SDE models (U-ViT CIFAR-10) use the two schedulers in `scheduling_vpsde` (timesteps: continuous t);
discrete DDPM models use diffusers' stock schedulers unchanged (timesteps: 0-based DDPM steps). Either way the
network input for a scheduler timestep (999 t, or t + 1) comes from `timesteps.network_timestep`, the one place
that conversion lives; the training losses use the same function.
"""

from __future__ import annotations

from typing import Any

from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from uvic.schedulers.scheduling_dpmsolver_uvit import UViTDPMSolverScheduler
from uvic.schedulers.scheduling_vpsde import VPSDEDPMSolverScheduler, VPSDEEulerMaruyamaScheduler
from uvic.schedulers.timesteps import network_timestep, network_timestep_for, schedule_of
from uvic.schedulers.vpsde import VPSDE


SAMPLERS = ("euler_maruyama", "dpm_solver", "ddpm", "ddim", "uvit_dpm_solver")

_CONTINUOUS = {"euler_maruyama": VPSDEEulerMaruyamaScheduler, "dpm_solver": VPSDEDPMSolverScheduler, "uvit_dpm_solver": UViTDPMSolverScheduler}
_DISCRETE = {
    "ddpm": DDPMScheduler,
    "ddim": DDIMScheduler,
    "dpm_solver": DPMSolverMultistepScheduler,
    "uvit_dpm_solver": UViTDPMSolverScheduler,  # the official MS-COCO sampler (single-step DPM-Solver++)
}


def build_scheduler(sampler: str, diffusion: Any) -> SchedulerMixin:
    """A sampler for the forward process in `diffusion` (a `uvic.config.DiffusionConfig`).

    vpsde: "euler_maruyama" | "dpm_solver"; discrete: "ddpm" | "ddim" | "dpm_solver" (diffusers' multistep).
    """
    if diffusion.schedule == "vpsde":
        if sampler not in _CONTINUOUS:
            raise ValueError(
                f"sampler {sampler!r} does not apply to a continuous VP-SDE model; use one of {sorted(_CONTINUOUS)}"
            )
        return _CONTINUOUS[sampler](
            beta_min=diffusion.beta_min, beta_max=diffusion.beta_max, time_scale=diffusion.time_scale
        )
    if diffusion.schedule == "discrete":
        if sampler not in _DISCRETE:
            raise ValueError(f"sampler {sampler!r} does not apply to a discrete model; use one of {sorted(_DISCRETE)}")
        return _DISCRETE[sampler](
            num_train_timesteps=diffusion.num_train_timesteps,
            beta_schedule=diffusion.beta_schedule,
            beta_start=diffusion.beta_start,
            beta_end=diffusion.beta_end,
        )
    raise ValueError(f"unknown diffusion schedule {diffusion.schedule!r}; expected 'vpsde' or 'discrete'")


def convert_scheduler(scheduler: SchedulerMixin, sampler: str) -> SchedulerMixin:
    """Switch a pipeline's scheduler to another `sampler` for the same forward process (diffusers `from_config`)."""
    table = _CONTINUOUS if is_continuous(scheduler) else _DISCRETE
    if sampler not in table:
        kind = "continuous VP-SDE" if is_continuous(scheduler) else "discrete"
        raise ValueError(f"sampler {sampler!r} does not apply to this {kind} model; use one of {sorted(table)}")
    cls = table[sampler]
    config = {k: v for k, v in scheduler.config.items() if k != "t_eps"}  # each VP-SDE solver keeps its own t_eps
    return cls.from_config(config)


def is_continuous(scheduler: SchedulerMixin) -> bool:
    """True for the VP-SDE schedulers (continuous t, network time 999 t), False for discrete ones."""
    return schedule_of(scheduler) == "vpsde"


__all__ = [
    "SAMPLERS",
    "UViTDPMSolverScheduler",
    "VPSDE",
    "VPSDEDPMSolverScheduler",
    "VPSDEEulerMaruyamaScheduler",
    "build_scheduler",
    "convert_scheduler",
    "is_continuous",
    "network_timestep",
    "network_timestep_for",
    "schedule_of",
]
