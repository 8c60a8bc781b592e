import pytest
import torch

import uvic.training.losses as losses
from uvic.config import load_config
from uvic.training.rng import ShardedRNG
from uvic.training.tasks import DiffusionTask


@pytest.mark.parametrize("random_flip", [True, False])
def test_random_flip_mirrors_exactly_the_rows_it_draws(monkeypatch, random_flip):
    """U-ViT's RandomHorizontalFlip, drawn from the run's generator: each picked image is mirrored left-right."""
    seen = {}

    def record_x0(model, x0, noise, rng, **kwargs):
        seen["x0"] = x0
        return x0.sum()

    monkeypatch.setattr(losses, "eps_prediction_loss", record_x0)
    task = DiffusionTask(load_config(None, [f"data.random_flip={str(random_flip).lower()}"]))
    x = torch.randn(32, 3, 4, 5, generator=torch.Generator().manual_seed(0))  # W = 5: no row is its own mirror
    task.loss(None, {"x": x}, ShardedRNG(11, 0, 1, "cpu"))

    picked = ShardedRNG(11, 0, 1, "cpu").rand(32) < 0.5 if random_flip else torch.zeros(32, dtype=torch.bool)
    if random_flip:
        assert 0 < picked.sum() < 32  # both cases occur with this seed
    for i in range(32):
        want = x[i, :, :, torch.arange(4, -1, -1)] if picked[i] else x[i]  # column w <- column W - 1 - w
        assert torch.equal(seen["x0"][i], want), i
