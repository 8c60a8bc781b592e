"""The Fashion-MNIST classifier feature space of the FID harness ("FD (Fashion-MNIST classifier)"): training the
network, statistics and scores through `python -m uvic.fid --features`, and the refusals across feature spaces.
Tiny made-up images stand in for Fashion-MNIST (CI has no real files)."""

import hashlib
import json

import numpy as np
import pytest
import torch

from uvic.fid import classifier as clf
from uvic.fid.__main__ import main
from uvic.fid.metric import frechet_distance
from uvic.fid.stats import load_stats


def _cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return e.value.code, capsys.readouterr().err


def _toy_split(n, seed):
    """Two classes a tiny CNN tells apart: a bright left half or a bright right half, plus noise; [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 2
    x = torch.rand(n, 1, 28, 28, generator=g) * 0.4 - 1
    x[y == 0, :, :, :14] += 1.2
    x[y == 1, :, :, 14:] += 1.2
    return x.clamp(-1, 1), y


@pytest.fixture
def toy_dataset(monkeypatch):
    monkeypatch.setitem(clf.DATASETS, "fashion_mnist",
                        ("fashion_mnist-classifier", lambda root: (_toy_split(256, 0), _toy_split(64, 1))))


@pytest.fixture
def weights(tmp_path, toy_dataset):
    torch.set_num_threads(1)
    path = tmp_path / "w.safetensors"
    clf.train_features("fashion_mnist", path, seed=0, epochs=1)
    return path


def _images(tmp_path, n=300, seed=0, shift=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 200, (n, 28, 28, 1), dtype=np.uint8)
    x[:, :, : 14 + shift] += 50
    path = tmp_path / f"imgs_{seed}_{shift}.npz"
    np.savez(path, x)
    return path, x


def test_train_features_is_deterministic_and_prints_accuracy_and_sha(tmp_path, toy_dataset, capsys):
    outs = []
    for name in ("a", "b"):
        main(["train-features", "fashion_mnist", "--out", str(tmp_path / f"{name}.safetensors"), "--epochs", "1"])
        outs.append(capsys.readouterr().out.strip())
    sha = hashlib.sha256((tmp_path / "a.safetensors").read_bytes()).hexdigest()
    assert outs[0].endswith(f"sha256 {sha}") and outs[1].endswith(f"sha256 {sha}")  # same seed, same bytes
    acc = float(outs[0].split("test accuracy ")[1].split(",")[0])
    assert acc >= 0.9  # the halves are easy to tell apart
    meta = clf.read_classifier_meta(tmp_path / "a.safetensors")
    assert meta["uvic_features"] == "fashion_mnist-classifier" and float(meta["test_accuracy"]) == acc


def test_features_take_gray_rgb_and_a_padded_32x32_image_alike(weights):
    ext = clf.ClassifierExtractor(weights)
    gray = torch.randint(0, 256, (4, 1, 28, 28), dtype=torch.uint8)
    expected = ext.net.features(gray.float() / 127.5 - 1)  # the training range, by hand
    padded = torch.nn.functional.pad(gray, (2, 2, 2, 2)).repeat(1, 3, 1, 1)
    torch.testing.assert_close(ext(gray)["features"], expected)
    torch.testing.assert_close(ext(padded)["features"], expected)
    assert expected.shape == (4, 128)


def test_stats_and_score_record_the_sha_and_match_a_numpy_frechet_distance(tmp_path, weights, capsys):
    ref_imgs, a = _images(tmp_path, seed=0)
    smp_imgs, b = _images(tmp_path, seed=1, shift=4)
    ref = tmp_path / "ref.npz"
    main(["stats", str(ref_imgs), "--features", str(weights), "--out", str(ref), "--no-progress", "--num-workers", "0"])
    capsys.readouterr()
    stats = load_stats(ref)
    sha = hashlib.sha256(weights.read_bytes()).hexdigest()
    assert stats.mode == "classifier" and stats.dims == 128
    assert stats.meta["weights_sha256"] == sha and stats.meta["features"] == "fashion_mnist-classifier"

    out = tmp_path / "score.json"
    main(["score", str(smp_imgs), str(ref), "--features", str(weights), "--json", str(out), "--no-progress", "--num-workers", "0"])
    line = capsys.readouterr().out.strip()
    result = json.loads(out.read_text())
    # independent reference: features by the network itself, mean and covariance by numpy
    net = clf.ClassifierExtractor(weights).net

    def gauss(x):
        f = net.features(torch.from_numpy(x).permute(0, 3, 1, 2).float() / 127.5 - 1).double().numpy()
        return f.mean(0), np.cov(f, rowvar=False)

    expected = frechet_distance(*gauss(b), *gauss(a))
    assert result["fid"] == pytest.approx(expected, rel=1e-6) and expected > 0
    assert result["title"] == "FD (Fashion-MNIST classifier)" and result["meta"]["weights_sha256"] == sha
    assert line.startswith("FD (Fashion-MNIST classifier): fd300=") and "FID" not in line and "fid" not in line


def test_a_reference_of_other_features_is_refused(tmp_path, weights, toy_dataset, capsys):
    imgs, _ = _images(tmp_path)
    other = tmp_path / "other.safetensors"
    clf.train_features("fashion_mnist", other, seed=1, epochs=1)  # another seed: other weights
    ref = tmp_path / "ref_other.npz"
    main(["stats", str(imgs), "--features", str(other), "--out", str(ref), "--no-progress", "--num-workers", "0"])
    capsys.readouterr()
    code, err = _cli(capsys, "score", imgs, ref, "--features", weights, "--no-progress", "--num-workers", "0")
    assert code == 2 and "SHA-256" in err and "refused" in err and len(err.strip().splitlines()) == 1

    # an Inception reference (U-ViT's files have no 'features': Inception) against classifier features
    inception = tmp_path / "inception.npz"
    np.savez(inception, mu=np.zeros(128), sigma=np.eye(128), mode=np.str_("pytorch-fid"), n=np.int64(500),
             meta=np.str_(json.dumps({"weights_sha256": "6726825d" + "0" * 56})))
    code, err = _cli(capsys, "score", imgs, inception, "--features", weights, "--no-progress", "--num-workers", "0")
    assert code == 2 and "feature space" in err and len(err.strip().splitlines()) == 1

    # a classifier reference scored without --features (Inception) is refused before any network loads
    code, err = _cli(capsys, "score", imgs, ref, "--weights", tmp_path / "missing.pth")
    assert code == 2 and "pass --features" in err


def test_the_evaluator_refuses_a_reference_of_other_weights(tmp_path, weights, toy_dataset):
    from types import SimpleNamespace

    from uvic.training.evaluation import check_fid_config

    imgs, _ = _images(tmp_path)
    other = tmp_path / "other.safetensors"
    clf.train_features("fashion_mnist", other, seed=1, epochs=1)
    ref = tmp_path / "ref.npz"
    main(["stats", str(imgs), "--features", str(other), "--out", str(ref), "--no-progress", "--num-workers", "0"])
    train = SimpleNamespace(eval_reference=str(ref), eval_fid_weights=str(weights), eval_fid_dims=2048,
                            eval_fid_mode="pytorch-fid")
    cfg = SimpleNamespace(train=train, task="diffusion")
    task = SimpleNamespace(makes_images=True)
    with pytest.raises(ValueError, match="SHA-256"):
        check_fid_config(cfg, task)
    train.eval_fid_weights = str(other)
    assert check_fid_config(cfg, task).meta["weights_sha256"] == hashlib.sha256(other.read_bytes()).hexdigest()


def test_the_protocol_records_the_title_and_sha_of_classifier_weights(weights):
    from types import SimpleNamespace

    from uvic.compare.protocol_fid import settings

    train = SimpleNamespace(eval_num_images=500, eval_reference="ref.npz", eval_fid_dims=2048,
                            eval_fid_weights=str(weights), eval_sampler="", eval_steps=None, max_steps=10)
    cfg = SimpleNamespace(train=train, sample=SimpleNamespace(sampler="dpm_solver", num_inference_steps=5, seed=0))
    got = settings(cfg)
    assert got["title"] == "FD (Fashion-MNIST classifier)"
    assert got["weights_sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    train.eval_fid_weights = ""  # Inception: the record keeps its old keys, so older records stay valid
    assert "title" not in settings(cfg) and "weights_sha256" not in settings(cfg)
