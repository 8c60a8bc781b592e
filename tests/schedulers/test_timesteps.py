"""The one scheduler-time -> network-time conversion (docs/conventions.md, "Timesteps")."""

import pytest
import torch
from diffusers import DDIMScheduler, DPMSolverMultistepScheduler

from uvic.schedulers import VPSDEEulerMaruyamaScheduler, network_timestep, network_timestep_for, schedule_of


def test_network_timestep_is_999t_for_vpsde_and_t_plus_1_for_discrete():
    # docs/conventions.md, "Timesteps": U-ViT's `ScoreModel.predict` feeds nnet(x, t * 999); n = diffusers t + 1.
    t = torch.tensor([1.0, 0.5, 1e-3])
    torch.testing.assert_close(network_timestep(t, "vpsde"), torch.tensor([999.0, 499.5, 0.999]))
    assert torch.equal(network_timestep(t, "vpsde"), t * 999)  # in t's dtype, as the official float32 product
    assert network_timestep(torch.tensor(0.5), "vpsde", time_scale=1000.0) == 500.0
    n = network_timestep(torch.tensor([0, 499, 999]), "discrete")
    assert n.dtype == torch.int64 and n.tolist() == [1, 500, 1000]
    assert network_timestep(torch.tensor(979.02), "discrete") == torch.tensor(980.02)  # fractional DPM-Solver stages
    with pytest.raises(ValueError, match="unknown diffusion schedule"):
        network_timestep(t, "edm")
    # Which conversion a scheduler gets, and its own time scale.
    em = VPSDEEulerMaruyamaScheduler(time_scale=1000.0)
    assert schedule_of(em) == "vpsde" and schedule_of(DDIMScheduler()) == "discrete"
    assert network_timestep_for(em, torch.tensor(0.25)) == 250.0
    assert network_timestep_for(DPMSolverMultistepScheduler(), torch.tensor(0)) == 1
