"""Fixtures for the FID tests: a random-init FID-Inception weights file per session and a network guard."""

import math

import pytest
import torch
import torchvision


@pytest.fixture(autouse=True)
def _offline(no_network):
    """Every FID test runs offline (tests/conftest.py's `no_network`): weights or datasets are never downloaded."""


@pytest.fixture(scope="session")
def weights_file(tmp_path_factory):
    """Random He-init weights in the FID-Inception layout (torchvision Inception3(1008), 566 keys, ~96 MB)."""
    g = torch.Generator().manual_seed(0)
    model = torchvision.models.inception.Inception3(num_classes=1008, aux_logits=False, init_weights=False)

    def init(key, v):
        if key.endswith("conv.weight"):
            return torch.randn(v.shape, generator=g) * math.sqrt(2 / v[0].numel())
        if key.endswith(("bn.weight", "running_var")):
            return torch.ones_like(v)
        if key == "fc.weight":
            return torch.randn(v.shape, generator=g) / math.sqrt(v.shape[1])
        return torch.zeros_like(v) if v.is_floating_point() else v.clone()

    path = tmp_path_factory.mktemp("weights") / "pt_inception-random.pth"
    torch.save({k: init(k, v) for k, v in model.state_dict().items()}, path)
    return path


@pytest.fixture(scope="session")
def extractors(weights_file):
    """Cache of loaded extractors keyed by (mode, dims, with_logits); loading takes a second each."""
    from uvic.fid import load_extractor

    cache = {}

    def get(mode="pytorch-fid", dims=2048, with_logits=False):
        key = (mode, dims, with_logits)
        if key not in cache:
            cache[key] = load_extractor(mode=mode, dims=dims, with_logits=with_logits, weights=weights_file,
                                        sha256=None, device="cpu")
        return cache[key]

    return get
