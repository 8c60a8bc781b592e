"""The diffusion task: U-ViT's random flip from the run's generator, the registry, and its parameter groups."""

from types import SimpleNamespace

import pytest
import torch

from uvic.config import load_config
from uvic.errors import ConfigError
from uvic.training.rng import ShardedRNG
from uvic.training.tasks import build_task, task_class
from uvic.training.tasks.diffusion import DiffusionTask


class _Spy(torch.nn.Module):
    """Records the noisy input it is given and predicts zero noise."""

    def __init__(self):
        super().__init__()
        self.x_t = None

    def forward(self, x, t, **kwargs):
        self.x_t = x
        return SimpleNamespace(sample=torch.zeros_like(x))


@pytest.mark.parametrize("random_flip", [True, False])
def test_random_flip_mirrors_exactly_the_rows_it_draws(random_flip):
    """U-ViT's RandomHorizontalFlip, drawn from the run's generator: each picked image is mirrored left-right.

    The task's loss draws (flip, t, eps) in that order from the run's generator; replaying the same draws gives
    the x_t the model must see: sqrt(abar(t)) x0' + sqrt(1 - abar(t)) eps, with x0' the flipped batch.
    """
    task = DiffusionTask(load_config(None, [f"data.random_flip={str(random_flip).lower()}"]))
    x = torch.randn(32, 3, 4, 5, generator=torch.Generator().manual_seed(0))  # W = 5: no row is its own mirror
    spy = _Spy()
    task.loss(spy, {"x": x}, ShardedRNG(11, 0, 1, "cpu"))

    replay = ShardedRNG(11, 0, 1, "cpu")
    picked = replay.rand(32) < 0.5 if random_flip else torch.zeros(32, dtype=torch.bool)
    t, eps = replay.rand(32), replay.randn(32, 3, 4, 5)
    if random_flip:
        assert 0 < picked.sum() < 32  # both cases occur with this seed
    ab = torch.exp(-(0.1 * t + 9.95 * t**2)).view(-1, 1, 1, 1)  # U-ViT cum_alpha(t), beta in [0.1, 20]
    for i in range(32):
        want = x[i, :, :, torch.arange(4, -1, -1)] if picked[i] else x[i]  # column w <- column W - 1 - w
        expected = ab[i].sqrt() * want + (1 - ab[i]).sqrt() * eps[i]
        torch.testing.assert_close(spy.x_t[i], expected, rtol=1e-5, atol=1e-6)


def test_registry_and_weight_decay_on_every_parameter():
    cfg = load_config(None, ["model.depth=2", "model.embed_dim=16", "model.num_heads=2"])
    assert task_class("diffusion") is DiffusionTask and isinstance(build_task(cfg), DiffusionTask)
    with pytest.raises(ConfigError, match="config key task: 'nope' is not one of \\['diffusion', 't2i'"):
        build_task(SimpleNamespace(task="nope"))
    task = build_task(cfg)
    model = task.build_model()
    # U-ViT's recipe: one group, decay on everything (pos_embed, norms and biases included).
    (group,) = task.param_groups(model, 0.03)
    assert group["weight_decay"] == 0.03 and len(group["params"]) == len(list(model.parameters()))
