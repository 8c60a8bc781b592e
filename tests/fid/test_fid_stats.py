"""FID statistics: float64 mean/cov, .npz round trip readable by pytorch-fid/U-ViT, legacy files, weights policy."""

import json

import numpy as np
import pytest
import torch

from uvic.config import TrainConfig
from uvic.fid import FIDStats, compute_fid, compute_stats, load_extractor, load_stats, resolve_weights, save_stats
from uvic.fid.inception import DEFAULT_DIMS, WEIGHTS_NAME, WEIGHTS_URL, sha256_file
from uvic.fid.stats import _gather_rows, process_state, stats_from_features


def test_stats_match_numpy_float64():
    x = torch.randn(300, 16, generator=torch.Generator().manual_seed(0)) * 3 + 1
    s = stats_from_features(x, mode="pytorch-fid")
    ref = x.numpy().astype(np.float64)
    assert s.mu.dtype == np.float64 and s.sigma.dtype == np.float64 and s.n == 300
    np.testing.assert_allclose(s.mu, ref.mean(0), rtol=1e-14)
    np.testing.assert_allclose(s.sigma, np.cov(ref, rowvar=False), rtol=1e-13, atol=1e-15)


def test_stats_errors_and_small_n_warning():
    with pytest.raises(ValueError, match="at least 2 images.*N=1"):
        stats_from_features(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="NaN or Inf"):
        stats_from_features(torch.tensor([[0.0, float("inf")], [1.0, 2.0], [3.0, 4.0]]))
    with pytest.warns(UserWarning, match="N=4 <= feature dim 8"):
        stats_from_features(torch.randn(4, 8))


def test_round_trip_and_pytorch_fid_readable(tmp_path):
    s = stats_from_features(torch.randn(50, 6), mode="tf", name="samples", meta={"dims": 6})
    save_stats(s, tmp_path / "s.npz")
    with np.load(tmp_path / "s.npz") as f:  # what pytorch-fid / U-ViT read: f['mu'][:], f['sigma'][:]
        np.testing.assert_array_equal(f["mu"][:], s.mu)
        np.testing.assert_array_equal(f["sigma"][:], s.sigma)
        assert json.loads(str(f["meta"]))["dims"] == 6
    back = load_stats(tmp_path / "s.npz")
    assert (back.mode, back.n, back.meta["dims"], back.name) == ("tf", 50, 6, str(tmp_path / "s.npz"))


def test_small_n_file_warns(tmp_path):
    save_stats(FIDStats(np.zeros(4), np.eye(4), n=3, mode="pytorch-fid"), tmp_path / "s.npz")
    with pytest.warns(UserWarning, match="N=3 <= feature dim 4"):
        load_stats(tmp_path / "s.npz")


def test_legacy_uvit_file_warns(tmp_path):
    np.savez(tmp_path / "fid_stats_cifar10_train_pytorch.npz", mu=np.zeros(3), sigma=np.eye(3))
    with pytest.warns(UserWarning, match="no 'mode' metadata"):
        s = load_stats(tmp_path / "fid_stats_cifar10_train_pytorch.npz")
    assert s.mode is None and s.n is None and s.dims == 3


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_stats(tmp_path / "nope.npz")
    np.savez(tmp_path / "images.npz", np.zeros((2, 8, 8, 3), np.uint8))
    with pytest.raises(ValueError, match="not a FID statistics file.*'arr_0'"):
        load_stats(tmp_path / "images.npz")
    np.savez(tmp_path / "asym.npz", mu=np.zeros(2), sigma=np.array([[1.0, 2.0], [0.0, 1.0]]))
    with pytest.raises(ValueError, match="not symmetric"):
        load_stats(tmp_path / "asym.npz")
    np.savez(tmp_path / "mode.npz", mu=np.zeros(2), sigma=np.eye(2), mode="clean")
    with pytest.raises(ValueError, match="unknown FID mode 'clean'"):
        load_stats(tmp_path / "mode.npz")
    with pytest.raises(ValueError, match=r"sigma must be \(2, 2\)"):
        save_stats(FIDStats(np.zeros(2), np.eye(3)), tmp_path / "bad.npz")


def test_gather_rows_single_process_is_identity():
    x = torch.randn(5, 3)
    assert _gather_rows(x, process_state()) is x


def test_weights_missing_names_the_expected_file(tmp_path, monkeypatch):
    monkeypatch.delenv("UVIC_FID_WEIGHTS", raising=False)
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    with pytest.raises(FileNotFoundError, match=f"{WEIGHTS_NAME} not found.*{WEIGHTS_URL}.*--weights"):
        resolve_weights()
    with pytest.raises(FileNotFoundError, match=f"nowhere.pth.*weights argument.*{WEIGHTS_NAME}"):
        resolve_weights(tmp_path / "nowhere.pth")
    monkeypatch.setenv("UVIC_FID_WEIGHTS", str(tmp_path / "env.pth"))
    with pytest.raises(FileNotFoundError, match=r"env.pth.*\$UVIC_FID_WEIGHTS"):
        resolve_weights()


def test_a_checksum_error_names_the_callers_own_keyword(tmp_path):
    """Weights with another checksum: the error tells each caller how it skips the check, in its own spelling."""
    f = tmp_path / "w.pth"
    f.write_bytes(b"not the inception weights")
    images = torch.zeros(2, 3, 8, 8, dtype=torch.uint8)
    for call, option in [(lambda: load_extractor(weights=f, device="cpu"), "pass sha256=None only"),
                         (lambda: compute_stats(images, weights=f, device="cpu"), "pass weights_sha256=None only"),
                         (lambda: compute_fid(images, images, weights=f, device="cpu"), "pass weights_sha256=None only")]:
        with pytest.raises(ValueError, match=option):
            call()


def test_the_training_config_reads_the_standard_fid_layer():
    # uvic.config does not import the FID package (scipy and all) for one default, so the two are kept equal here.
    assert TrainConfig().eval_fid_dims == DEFAULT_DIMS == 2048


def test_weights_resolution_order_and_sha256(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.delenv("UVIC_FID_WEIGHTS", raising=False)
    f = tmp_path / "w.pth"
    f.write_bytes(b"not the inception weights")
    digest = sha256_file(f)
    with pytest.raises(ValueError, match=f"SHA-256 of .*w.pth' is {digest}, expected it to start with '6726825d'"):
        resolve_weights(f)
    assert resolve_weights(f, sha256=digest[:10]) == (f, digest)
    assert resolve_weights(f, sha256=None) == (f, digest)
    monkeypatch.setenv("UVIC_FID_WEIGHTS", str(f))
    assert resolve_weights(sha256=None)[0] == f
    monkeypatch.delenv("UVIC_FID_WEIGHTS")
    hub = tmp_path / "hub" / "checkpoints"
    hub.mkdir(parents=True)
    (hub / "weights-inception-2015-12-05-6726825d.pth").write_bytes(b"x")  # torch-fidelity's name is found too
    assert resolve_weights(sha256=None)[0].name == "weights-inception-2015-12-05-6726825d.pth"


def test_download_only_when_allowed(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.delenv("UVIC_FID_WEIGHTS", raising=False)
    calls = []

    def fake_download(url, dst, hash_prefix=None, **kwargs):
        calls.append((url, hash_prefix))
        open(dst, "wb").write(b"downloaded")

    monkeypatch.setattr(torch.hub, "download_url_to_file", fake_download)
    with pytest.raises(FileNotFoundError):
        resolve_weights()
    assert calls == []
    path, _ = resolve_weights(allow_download=True, sha256=None)
    assert calls == [(WEIGHTS_URL, "6726825d")] and path.name == WEIGHTS_NAME


def test_network_guard_is_active():
    import socket

    with pytest.raises(OSError, match="network access attempted"):
        socket.create_connection(("192.0.2.1", 80), timeout=1)  # TEST-NET-1 literal, no DNS


def test_a_failed_download_says_how_to_provide_the_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    monkeypatch.delenv("UVIC_FID_WEIGHTS", raising=False)
    with pytest.raises(FileNotFoundError) as e:
        resolve_weights(allow_download=True)  # offline: the guard refuses the connection
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"FID Inception weights {WEIGHTS_NAME} could not be downloaded")
    assert message.endswith(f"On a machine that is online, download {WEIGHTS_URL}; then pass its path with --weights "
                            f"or the UVIC_FID_WEIGHTS environment variable, or put it at "
                            f"{tmp_path / 'hub' / 'checkpoints' / WEIGHTS_NAME}")
    assert not (tmp_path / "hub" / "checkpoints" / WEIGHTS_NAME).exists()


def test_a_failed_stats_write_keeps_the_previous_file(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "ref.npz"
    save_stats(FIDStats(mu=np.zeros(3), sigma=np.eye(3), n=4, mode="pytorch-fid"), path)
    real_savez = np.savez

    def full_disk(f, **arrays):
        real_savez(f, **arrays)
        f.truncate(100)  # part of the archive reached the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_stats(FIDStats(mu=np.ones(3), sigma=2 * np.eye(3), n=4, mode="pytorch-fid"), path)
    assert (load_stats(path).mu == 0).all() and sorted(p.name for p in tmp_path.iterdir()) == ["ref.npz"]
