"""Fréchet distance: closed forms, torch-fidelity's eigvals route, pytorch-fid's error semantics."""

import logging

import numpy as np
import pytest
import scipy.linalg

from uvic.fid import FIDStats, fid_from_stats, frechet_distance, kernel_inception_distance
from uvic.fid.metric import inception_score


def closed_form_commuting(mu1, a1, mu2, a2):
    """FID of Gaussians whose covariances share eigenvectors: |dmu|^2 + sum (sqrt(a1) - sqrt(a2))^2."""
    return float(np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(a1) - np.sqrt(a2)) ** 2))


def test_diagonal_gaussians_closed_form():
    mu1, mu2 = np.array([0.0, 1, 2, 3]), np.array([1.0, 1, 2, 5])
    a1, a2 = np.array([1.0, 4, 9, 16]), np.array([4.0, 4, 1, 1])
    expected = closed_form_commuting(mu1, a1, mu2, a2)  # 1 + 4 + (1 + 0 + 4 + 9) = 19
    assert expected == pytest.approx(19.0, abs=1e-12)
    assert frechet_distance(mu1, np.diag(a1), mu2, np.diag(a2)) == pytest.approx(expected, rel=1e-12)


def test_commuting_covariances_closed_form():
    rng = np.random.default_rng(0)
    d = 128
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    a1, a2 = rng.uniform(0.1, 3, d), rng.uniform(0.1, 3, d)
    s1, s2 = (q * a1) @ q.T, (q * a2) @ q.T
    s1, s2 = (s1 + s1.T) / 2, (s2 + s2.T) / 2
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    expected = closed_form_commuting(mu1, a1, mu2, a2)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(expected, rel=1e-10)


def test_identical_stats_are_zero():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(600, 192)) @ rng.normal(size=(192, 192)) * 0.1
    mu, sigma = x.mean(0), np.cov(x, rowvar=False)
    assert abs(frechet_distance(mu, sigma, mu, sigma)) < 1e-8


def test_matches_torch_fidelity_on_general_stats():
    from torch_fidelity.metric_fid import fid_statistics_to_metric

    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(400, 64)), rng.normal(size=(300, 64)) * 1.3 + 0.2
    s1 = {"mu": x.mean(0), "sigma": np.cov(x, rowvar=False)}
    s2 = {"mu": y.mean(0), "sigma": np.cov(y, rowvar=False)}
    ref = fid_statistics_to_metric(s1, s2, verbose=False)["frechet_inception_distance"]
    assert frechet_distance(s1["mu"], s1["sigma"], s2["mu"], s2["sigma"]) == pytest.approx(ref, rel=1e-9)


def test_eps_retry_is_logged(monkeypatch, caplog):
    real = scipy.linalg.sqrtm
    calls = []

    def flaky(a, *args, **kwargs):
        calls.append(a.copy())
        out = real(a, *args, **kwargs)
        return np.full_like(out, np.nan) if len(calls) == 1 else out

    monkeypatch.setattr(scipy.linalg, "sqrtm", flaky)
    mu = np.zeros(3)
    a1, a2 = np.array([1.0, 2, 3]), np.array([2.0, 2, 5])
    with caplog.at_level(logging.WARNING, logger="uvic.fid.metric"):
        fid = frechet_distance(mu, np.diag(a1), mu, np.diag(a2), eps=1e-6)
    assert len(calls) == 2 and "retrying" in caplog.text
    np.testing.assert_allclose(calls[1], np.diag((a1 + 1e-6) * (a2 + 1e-6)))
    # pytorch-fid: traces of the original covariances, square root of the offset product.
    assert fid == pytest.approx(float(np.sum(a1 + a2) - 2 * np.sum(np.sqrt((a1 + 1e-6) * (a2 + 1e-6)))), rel=1e-9)


def test_imaginary_component_raises_with_magnitude():
    mu = np.zeros(2)
    # sigma1 @ sigma2 = diag(-1, 1): its square root has an imaginary diagonal entry of magnitude 1.
    with pytest.raises(ValueError, match=r"imaginary component of magnitude 1\b"):
        frechet_distance(mu, np.eye(2), mu, np.diag([-1.0, 1.0]))


@pytest.mark.parametrize(
    "mu2, sigma2, match",
    [
        (np.zeros(3), np.eye(3), "feature dims differ"),
        (np.zeros(2), np.array([[1.0, 0.5], [0.0, 1.0]]), "not symmetric"),
        (np.zeros(2), np.array([[np.nan, 0.0], [0.0, 1.0]]), "NaN or Inf"),
        (np.array([np.inf, 0.0]), np.eye(2), "NaN or Inf"),
        (np.zeros(2), np.eye(3), r"sigma must be \(2, 2\)"),
    ],
)
def test_bad_stats_raise(mu2, sigma2, match):
    with pytest.raises(ValueError, match=match):
        frechet_distance(np.zeros(2), np.eye(2), mu2, sigma2)


def test_mixing_modes_is_an_error():
    a = FIDStats(np.zeros(2), np.eye(2), n=10, mode="pytorch-fid", name="a.npz")
    b = FIDStats(np.zeros(2), np.eye(2), n=10, mode="tf", name="b.npz")
    with pytest.raises(ValueError, match="different pipelines.*a.npz.*pytorch-fid.*b.npz.*'tf'"):
        fid_from_stats(a, b)


def test_result_label():
    rng = np.random.default_rng(3)
    mu, a = rng.normal(size=4), rng.uniform(1, 2, 4)
    s = FIDStats(mu, np.diag(a), n=50000, mode="pytorch-fid", name="samples")
    r = FIDStats(mu + 1, np.diag(a), n=None, mode="pytorch-fid", name="fid_stats_cifar10_train_pytorch.npz")
    res = fid_from_stats(s, r)
    assert res.label == "fid50000" and res.reference == "fid_stats_cifar10_train_pytorch.npz"
    assert res.fid == pytest.approx(4.0, rel=1e-12)
    assert str(res).startswith("fid50000=4.0000 (mode=pytorch-fid, reference=fid_stats_cifar10_train_pytorch.npz")


def test_kid_subset_larger_than_n_is_a_clear_error():
    import torch

    f = torch.randn(20, 8)
    with pytest.raises(ValueError, match="KID subset size 50 is larger than the number of images"):
        kernel_inception_distance(f, f, subset_size=50)


def test_inception_score_needs_logits_and_enough_images():
    import torch

    with pytest.raises(ValueError, match="needs logits"):
        inception_score(None)
    with pytest.raises(ValueError, match="at least 10 images"):
        inception_score(torch.randn(5, 1008))
