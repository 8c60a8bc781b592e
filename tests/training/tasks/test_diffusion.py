"""The diffusion task: U-ViT's random flip from the run's generator, the registry, and its parameter groups."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_fashion_mnist import write_split

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


def _write_fashion_idx(root, prefix, labels):
    """Tiny Fashion-MNIST idx files of random images with these labels (`tiny_fashion_mnist.write_split`)."""
    images = np.random.default_rng(len(labels)).integers(0, 256, (len(labels), 28, 28), dtype=np.uint8)
    write_split(root, prefix, images, np.array(labels))


TINY_FASHION = ["model.embed_dim=16", "model.depth=2", "model.num_heads=2", "model.patch_size=7"]


def test_fashion_mnist_class_conditional_takes_the_files_labels(tmp_path):
    """model.num_classes=10 on Fashion-MNIST: the loss and the held-out loss give the model each image's label from
    the labels file, and grids ask for class i % 10; a real (tiny) model trains on them."""
    train_labels = [9, 0, 3, 7, 2, 5]
    _write_fashion_idx(tmp_path, "train", train_labels)
    _write_fashion_idx(tmp_path, "t10k", [1, 8])
    cfg = load_config("configs/fashion_mnist_uvic.yaml", [f"data.root={tmp_path}", "model.num_classes=10",
                                                           "data.random_flip=false", *TINY_FASHION])
    task = build_task(cfg)
    data, held_out = task.build_dataset(), task.validation_set()
    batch = {"x": torch.stack([data[i]["x"] for i in range(6)]), "label": torch.stack([data[i]["label"] for i in range(6)])}
    seen = []

    class LabelSpy(_Spy):
        def forward(self, x, t, **kwargs):
            seen.append(kwargs["class_labels"].tolist())
            return super().forward(x, t)

    task.loss(LabelSpy(), batch, ShardedRNG(0, 0, 1, "cpu"))
    val = {"x": torch.stack([held_out[i]["x"] for i in range(2)]), "label": torch.stack([held_out[i]["label"] for i in range(2)])}
    task.validation_losses(LabelSpy(), val, torch.arange(2))
    assert seen[0] == train_labels and all(labels == [1, 8] for labels in seen[1:])
    assert task.image_conditions("grid", 12).class_labels == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    model = task.build_model()
    loss = task.loss(model, batch, ShardedRNG(0, 0, 1, "cpu"))
    loss.backward()
    assert torch.isfinite(loss) and model.label_emb.weight.grad[train_labels].abs().sum(1).gt(0).all()
    assert model.label_emb.weight.grad[[1, 4, 6, 8]].abs().sum() == 0  # classes no image of the batch has


def test_class_conditional_data_without_fitting_labels_is_refused(tmp_path, image_dir):
    _write_fashion_idx(tmp_path, "train", [9, 0])
    few = load_config("configs/fashion_mnist_uvic.yaml", [f"data.root={tmp_path}", "model.num_classes=3",
                                                          "train.val_every=0", *TINY_FASHION])
    with pytest.raises(ValueError, match="dataset 'fashion_mnist' has label 9, but model.num_classes=3 embeds only "
                                         "0..2; set model.num_classes=10"):
        build_task(few).build_dataset()
    folder = load_config(None, ["data.name=image_folder", f"data.root={image_dir}", "data.image_size=8",
                                "model.img_size=8", "model.patch_size=2", "model.num_classes=10",
                                "train.val_every=0", "model.depth=2", "model.embed_dim=16", "model.num_heads=2"])
    with pytest.raises(ValueError, match="model.num_classes=10 asks for class labels, but dataset 'image_folder' has "
                                         "none"):
        build_task(folder).build_dataset()
