"""Bit-exact pins of U-ViT's samplers: every timestep and every output value, compared with `==`.

The other scheduler tests check the samplers against independent references within a tolerance; these pin their
exact float bits, so a refactor of the schedules or solvers cannot move the official samplers by even one ulp
unnoticed. The eps "model" is affine in x with python-float coefficients (pure IEEE arithmetic, no library
transcendental functions), so the pins depend only on the schedulers.

`sampler_pins.json` holds the values as `float.hex()` strings. Regenerate it (`python
tests/schedulers/test_sampler_pins.py`) only for an intended numerical change, and say so in the commit.
"""

import json
import sys
from pathlib import Path

import torch

from uvic.config import DiffusionConfig
from uvic.schedulers import build_scheduler


PINS = Path(__file__).with_name("sampler_pins.json")
MSCOCO = DiffusionConfig(schedule="discrete", beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
CIFAR10 = DiffusionConfig()


def _eps(x: torch.Tensor, t: float) -> torch.Tensor:
    """A deterministic stand-in for the network: affine in x, its coefficients plain python floats of t."""
    return x * (0.3 + 0.4 * t) + (0.05 - 0.1 * t)


def _run(sampler: str, diffusion: DiffusionConfig, steps: int, dtype: torch.dtype) -> dict[str, list[str]]:
    sched = build_scheduler(sampler, diffusion)
    sched.set_timesteps(steps)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2, 2, generator=g, dtype=torch.float64).to(dtype)
    for t in sched.timesteps:
        x = sched.step(_eps(x, float(t) / len(sched)), t, x, generator=g).prev_sample
    return {"timesteps": [float(v).hex() for v in sched.timesteps.tolist()],
            "sample": [float(v).hex() for v in x.flatten().tolist()]}


# (name, sampler, schedule, steps, dtype): the official MS-COCO sampler, the official CIFAR-10 FID sampler (fewer
# steps than its 1000 to stay fast; the grid and step rule are the same), and U-ViT's CIFAR-10 training monitor.
CASES = [
    ("mscoco_dpm_solver_pp_50_fp32", "uvit_dpm_solver", MSCOCO, 50, torch.float32),
    ("mscoco_dpm_solver_pp_50_fp64", "uvit_dpm_solver", MSCOCO, 50, torch.float64),
    ("cifar10_euler_maruyama_100_fp32", "euler_maruyama", CIFAR10, 100, torch.float32),
    ("cifar10_monitor_dpm_solver_fast_50_fp32", "uvit_dpm_solver", CIFAR10, 50, torch.float32),
]


def _all() -> dict[str, dict[str, list[str]]]:
    return {name: _run(sampler, diffusion, steps, dtype) for name, sampler, diffusion, steps, dtype in CASES}


def test_official_samplers_are_bit_exact():
    pinned = json.loads(PINS.read_text())
    got = _all()
    assert sorted(got) == sorted(pinned)
    for name in pinned:
        assert got[name]["timesteps"] == pinned[name]["timesteps"], name
        assert got[name]["sample"] == pinned[name]["sample"], name


if __name__ == "__main__":
    PINS.write_text(json.dumps(_all(), indent=1) + "\n")
    sys.exit(0)
