"""Every registered task implements the `Task` protocol with the protocol's own signatures."""

import inspect

import pytest
import torch

from uvic.config import load_config
from uvic.schedulers import build_scheduler
from uvic.training.tasks import TASKS, Task


PROTOCOL_METHODS = ["build_model", "build_dataset", "param_groups", "loss", "pipeline", "on_sample", "export"]


def _params(fn):
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_task_has_the_protocol_methods_and_signatures(name):
    cls = TASKS[name]
    assert PROTOCOL_METHODS == [m for m in vars(Task) if not m.startswith("_")]
    for method in PROTOCOL_METHODS:
        assert _params(getattr(cls, method)) == _params(getattr(Task, method)), (name, method)


def test_diffusion_pipeline_takes_the_sampler_by_keyword_and_refuses_a_vae():
    task = TASKS["diffusion"](load_config(None, ["model.depth=2", "model.embed_dim=16", "model.num_heads=2",
                                                 "model.img_size=8"]))
    model = task.build_model()
    configured = type(build_scheduler(task.cfg.sample.sampler, task.cfg.diffusion))
    assert type(task.pipeline(model).scheduler) is configured
    pipe = task.pipeline(model, sampler="euler_maruyama")
    euler = type(build_scheduler("euler_maruyama", task.cfg.diffusion))
    assert pipe.transformer is model and type(pipe.scheduler) is euler is not configured
    with pytest.raises(ValueError, match="pixel space: its pipeline takes no vae"):
        task.pipeline(model, vae=torch.nn.Identity())


def test_the_language_model_task_has_no_image_pipeline():
    task = TASKS["lm"](load_config(None, ["task=lm"]))
    with pytest.raises(ValueError, match="an 'lm' run has no image pipeline.*AutoModelForCausalLM"):
        task.pipeline(torch.nn.Identity(), sampler="ddim")
