"""Fixtures for the FID tests: a random-init FID-Inception weights file per session and a network guard."""

import pytest


@pytest.fixture(autouse=True)
def _offline(no_network):
    """Every FID test runs offline (tests/conftest.py's `no_network`): weights or datasets are never downloaded."""


@pytest.fixture(scope="session")
def weights_file(tmp_path_factory):
    """Random He-init weights in the FID-Inception layout (`python -m uvic.fid make-test-weights`, ~96 MB)."""
    from uvic.fid.inception import make_test_weights

    return make_test_weights(tmp_path_factory.mktemp("weights") / "pt_inception-random.pth")


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
