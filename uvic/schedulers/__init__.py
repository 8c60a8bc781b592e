"""Noise schedules and samplers, and the ONE table that maps a sampler name to a scheduler class.

Every solver reads its forward process from one noise-schedule object (`noise_schedule`: `VPSDE` for the
continuous models, `DiscreteSchedule` for the discrete ones), and each algorithm is one scheduler class:
- continuous VP-SDE models (U-ViT CIFAR-10; timesteps: continuous t): `scheduling_vpsde` (Euler-Maruyama,
  DPM-Solver++(2M)) and U-ViT's training-monitor DPM-Solver-fast (`scheduling_dpmsolver_uvit`);
- discrete DDPM models (timesteps: 0-based DDPM steps): diffusers' stock schedulers unchanged, and U-ViT's MS-COCO
  DPM-Solver++ (`scheduling_dpmsolver_uvit`).
Either way the network input for a scheduler timestep (999 t, or t + 1) comes from `timesteps.network_timestep`,
the one place that conversion lives; the training losses use the same function (docs/conventions.md, "Timesteps").

Every sampler choice in the project (training configs, `sample.py --sampler`, the pipelines' sampler switch) goes
through `build_scheduler` / `convert_scheduler` below.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from diffusers.schedulers.scheduling_utils import SchedulerMixin


# The sampler table: for each forward process ("vpsde" continuous, "discrete" DDPM), sampler name -> scheduler class,
# written "module:Class" and imported on first use (`sampler_class`), as transformers' auto mappings name their
# classes: reading the names (config validation, `sample.py --help`) then imports no diffusers. A class object is a
# valid entry too.
SAMPLER_TABLE: dict[str, dict[str, str | type[SchedulerMixin]]] = {
    "vpsde": {
        # U-ViT's CIFAR-10 FID sampler
        "euler_maruyama": "uvic.schedulers.scheduling_vpsde:VPSDEEulerMaruyamaScheduler",
        "dpm_solver": "uvic.schedulers.scheduling_vpsde:VPSDEDPMSolverScheduler",  # DPM-Solver++(2M), logSNR grid
        # U-ViT's CIFAR-10 training monitor
        "uvit_dpm_solver": "uvic.schedulers.scheduling_dpmsolver_uvit:VPSDEDPMSolverFastScheduler",
    },
    "discrete": {
        "ddpm": "diffusers:DDPMScheduler",
        "ddim": "diffusers:DDIMScheduler",
        "dpm_solver": "diffusers:DPMSolverMultistepScheduler",
        # The official MS-COCO sampler (single-step DPM-Solver++).
        "uvit_dpm_solver": "uvic.schedulers.scheduling_dpmsolver_uvit:UViTDPMSolverScheduler",
    },
}

# The classes and functions of the submodules, re-exported here and imported on first access (PEP 562), so that
# `import uvic.schedulers` stays free of diffusers.
_EXPORTS = {
    "VPSDE": "noise_schedule", "DiscreteSchedule": "noise_schedule", "NoiseSchedule": "noise_schedule",
    "UViTDPMSolverScheduler": "scheduling_dpmsolver_uvit", "VPSDEDPMSolverFastScheduler": "scheduling_dpmsolver_uvit",
    "VPSDEDPMSolverScheduler": "scheduling_vpsde", "VPSDEEulerMaruyamaScheduler": "scheduling_vpsde",
    "network_timestep": "timesteps", "network_timestep_for": "timesteps", "schedule_of": "timesteps",
}


def __getattr__(name: str) -> Any:
    """The re-exported name `name` of a submodule, imported now (PEP 562: called only for names not yet defined)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def sampler_names() -> tuple[str, ...]:
    """Every sampler name of `SAMPLER_TABLE`, in table order: the choices of `sample.sampler` and
    `sample.py --sampler`, read from the table at each call so that a new entry is a choice everywhere."""
    return tuple(dict.fromkeys(name for table in SAMPLER_TABLE.values() for name in table))


# Config keys a scheduler of one class must not hand to another: each VP-SDE solver keeps its own final time.
_PER_CLASS_KEYS = ("t_eps",)


def sampler_class(sampler: str, schedule: str) -> type[SchedulerMixin]:
    """The scheduler class of `sampler` for a forward process `schedule` ("vpsde" | "discrete"), imported now.

    Raises:
        ValueError: an unknown schedule, or a sampler that does not apply to it (the message lists those that do).
    """
    if schedule not in SAMPLER_TABLE:
        raise ValueError(f"unknown diffusion schedule {schedule!r}; expected one of {sorted(SAMPLER_TABLE)}")
    table = SAMPLER_TABLE[schedule]
    if sampler not in table:
        kind = "continuous VP-SDE" if schedule == "vpsde" else schedule
        raise ValueError(f"sampler {sampler!r} does not apply to a {kind} model; use one of {sorted(table)}")
    entry = table[sampler]
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        entry = getattr(importlib.import_module(module), name)
    return entry


def _accepted(cls: type, config: dict[str, Any]) -> dict[str, Any]:
    """The entries of `config` that `cls.__init__` takes (private `_` keys kept for diffusers' `from_config`)."""
    params = inspect.signature(cls.__init__).parameters
    return {k: v for k, v in config.items() if k in params or k.startswith("_")}


def build_scheduler(sampler: str, diffusion: Any) -> SchedulerMixin:
    """A sampler for the forward process in `diffusion` (a `uvic.config.DiffusionConfig`).

    vpsde: "euler_maruyama" | "dpm_solver" | "uvit_dpm_solver" (U-ViT's monitor sampler, noise-prediction
    DPM-Solver-fast); discrete: "ddpm" | "ddim" | "dpm_solver" (diffusers' multistep) | "uvit_dpm_solver" (the
    official single-step DPM-Solver++).
    """
    cls = sampler_class(sampler, diffusion.schedule)
    if diffusion.schedule == "vpsde":
        fields = {"beta_min": diffusion.beta_min, "beta_max": diffusion.beta_max, "time_scale": diffusion.time_scale}
    else:
        fields = {"num_train_timesteps": diffusion.num_train_timesteps, "beta_schedule": diffusion.beta_schedule,
                  "beta_start": diffusion.beta_start, "beta_end": diffusion.beta_end}
    return cls(**_accepted(cls, fields))


def convert_scheduler(scheduler: SchedulerMixin, sampler: str) -> SchedulerMixin:
    """Switch a pipeline's scheduler to another `sampler` for the same forward process (diffusers `from_config`)."""
    from uvic.schedulers.timesteps import schedule_of

    schedule = schedule_of(scheduler)
    cls = sampler_class(sampler, schedule)
    config = {k: v for k, v in scheduler.config.items() if k not in _PER_CLASS_KEYS}
    return cls.from_config(_accepted(cls, config))


def is_continuous(scheduler: SchedulerMixin) -> bool:
    """True for the VP-SDE schedulers (continuous t, network time 999 t), False for discrete ones."""
    from uvic.schedulers.timesteps import schedule_of

    return schedule_of(scheduler) == "vpsde"


__all__ = [
    "SAMPLER_TABLE",
    "DiscreteSchedule",
    "NoiseSchedule",
    "UViTDPMSolverScheduler",
    "VPSDE",
    "VPSDEDPMSolverFastScheduler",
    "VPSDEDPMSolverScheduler",
    "VPSDEEulerMaruyamaScheduler",
    "build_scheduler",
    "convert_scheduler",
    "is_continuous",
    "network_timestep",
    "network_timestep_for",
    "sampler_class",
    "sampler_names",
    "schedule_of",
]
