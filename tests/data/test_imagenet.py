"""ImageNet on a tiny ImageNet-layout folder: order and labels, preprocessing, class checks, features and resume."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_imagenet import WNIDS, make_imagenet
from tiny_models import VAE_TINY

from uvic.data.imagenet import ImageNet, ImageNetFeatures, center_crop_arr, extract_features, list_imagenet
from uvic.errors import DataError
from uvic.models.autoencoder import build_vae, encode_moments


RES = 16


@pytest.fixture
def root(tmp_path):
    return make_imagenet(tmp_path / "imagenet")


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    return build_vae(**VAE_TINY).eval()


def test_order_and_labels_follow_file_names(root):
    files, labels, wnids = list_imagenet(root, num_classes=3)
    assert wnids == WNIDS
    # Sorted folder by folder, then by file name (U-ViT's recursive listing); class = the file name's wnid prefix.
    expected = [p for w in WNIDS for p in sorted((root / "train" / w).iterdir())]
    assert files == expected
    assert labels.tolist() == [WNIDS.index(p.name.split("_")[0]) for p in expected] == [0] * 3 + [1] * 2 + [2] * 4
    ds = ImageNet(root, resolution=RES, num_classes=3)
    assert ds.class_counts().tolist() == [3, 2, 4]
    item = ds[4]
    assert item["x"].shape == (3, RES, RES) and item["x"].dtype == torch.float32 and int(item["label"]) == 1


def test_center_crop_arr_box_halving_then_crop():
    """A 2H x H image at target H/2: one BOX halving (2x2 means), no resize, then the central square."""
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, (32, 64, 3)).astype(np.uint8)
    out = center_crop_arr(Image.fromarray(arr), 16)
    halved = arr.reshape(16, 2, 32, 2, 3).astype(np.float64).mean(axis=(1, 3))  # (16, 32, 3)
    assert out.shape == (16, 16, 3)
    assert np.abs(out.astype(np.float64) - halved[:, 8:24]).max() <= 1  # BOX rounding


def test_center_crop_arr_bicubic_short_side():
    """No halving when the short side is below twice the target: one BICUBIC resize, sizes rounded, central crop."""
    img = Image.fromarray(np.random.default_rng(2).integers(0, 256, (30, 19, 3), dtype=np.uint8))  # W 19, H 30
    out = center_crop_arr(img, 16)
    resized = np.asarray(img.resize((16, round(30 * 16 / 19)), Image.BICUBIC))  # (25, 16)
    np.testing.assert_array_equal(out, resized[4:20])
    flat = Image.new("RGB", (50, 23), (10, 200, 30))
    assert (center_crop_arr(flat, 16) == np.array([10, 200, 30], dtype=np.uint8)).all()


def test_missing_and_extra_classes_are_one_line_errors(root):
    (root / "train" / "n09999999").mkdir()  # a class folder without images
    with pytest.raises(DataError, match=r"holds 3 classes .* expected 4.*without images: \['n09999999'\]"):
        list_imagenet(root, num_classes=4)
    with pytest.raises(DataError, match="expected 1000"):
        ImageNet(root)
    stray = root / "train" / WNIDS[0] / "n08888888_1.JPEG"  # a file named for a class that has no folder
    Image.new("RGB", (20, 20)).save(stray)
    with pytest.raises(DataError, match=r"holds 4 classes.*expected 3.*without a folder: \['n08888888'\]"):
        list_imagenet(root, num_classes=3)
    with pytest.raises(FileNotFoundError, match="no train/"):
        list_imagenet(root / "train")


def _reference_moments(vae, files):
    x = torch.stack([torch.from_numpy(center_crop_arr(Image.open(f), RES).copy()).permute(2, 0, 1) for f in files])
    x = x.float() / 127.5 - 1
    return encode_moments(vae, x).numpy(), encode_moments(vae, x.flip(-1)).numpy()


def test_features_plain_and_flipped(root, vae, tmp_path):
    out = extract_features(root, tmp_path / "f", vae, resolution=RES, num_classes=3, batch_size=4, num_workers=0,
                           device="cpu")
    files, labels, _ = list_imagenet(root, num_classes=3)
    plain, flipped = _reference_moments(vae, files)
    m = np.load(out / "moments.npy")
    assert m.shape == (9, 2, 8, RES // 2, RES // 2)
    np.testing.assert_allclose(m[:, 0], plain, atol=1e-5)
    np.testing.assert_allclose(m[:, 1], flipped, atol=1e-5)
    assert np.load(out / "labels.npy").tolist() == labels.tolist()
    assert json.loads((out / "classes.json").read_text()) == WNIDS
    assert json.loads((out / "meta.json").read_text())["num_images"] == 9
    assert not list(out.glob("*.pkl")) and all(p.suffix in (".npy", ".json") for p in out.iterdir())

    ds = ImageNetFeatures(out)
    assert len(ds) == 18
    np.testing.assert_allclose(ds[2]["x"].numpy(), plain[2], atol=1e-5)
    np.testing.assert_allclose(ds[9 + 2]["x"].numpy(), flipped[2], atol=1e-5)
    assert int(ds[9 + 5]["label"]) == labels[5]


class _FailingVAE(torch.nn.Module):
    """Encodes the probe and `ok` batches, then raises (an interrupted extraction)."""

    def __init__(self, vae, ok):
        super().__init__()
        self.vae, self.ok = vae, ok

    @property
    def device(self):
        return self.vae.device

    @property
    def dtype(self):
        return self.vae.dtype

    def encode(self, x):
        if self.ok < 0:
            raise KeyboardInterrupt
        self.ok -= 1
        return self.vae.encode(x)


def test_extraction_resumes_and_shards(root, vae, tmp_path):
    full = np.load(extract_features(root, tmp_path / "full", vae, resolution=RES, num_classes=3, batch_size=2,
                                    num_workers=0, device="cpu") / "moments.npy")
    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):  # the probe and 2 batches of 2 go through, then it stops
        extract_features(root, out, _FailingVAE(vae, ok=2), resolution=RES, num_classes=3, batch_size=2,
                         num_workers=0, device="cpu")
    assert np.load(out / "done.npy").sum() == 4
    with pytest.raises(DataError, match="incomplete"):
        ImageNetFeatures(out)
    extract_features(root, out, vae, resolution=RES, num_classes=3, batch_size=2, num_workers=0, device="cpu")
    assert np.load(out / "done.npy").all()
    np.testing.assert_allclose(np.load(out / "moments.npy"), full, atol=1e-6)

    # Two processes (run one after the other here) each take i % 2 == rank, and together equal one process.
    sharded = tmp_path / "sharded"
    for rank in (0, 1):
        extract_features(root, sharded, vae, resolution=RES, num_classes=3, batch_size=2, num_workers=0,
                         device="cpu", process_index=rank, num_processes=2)
        assert np.load(sharded / "done.npy").tolist() == [i % 2 <= rank for i in range(9)]
    np.testing.assert_allclose(np.load(sharded / "moments.npy"), full, atol=1e-6)

    # Another folder into the same output is refused.
    Image.new("RGB", (20, 20)).save(root / "train" / WNIDS[1] / f"{WNIDS[1]}_999.JPEG")
    with pytest.raises(DataError, match="different extraction"):
        extract_features(root, out, vae, resolution=RES, num_classes=3, num_workers=0, device="cpu")


def test_cli_extracts_and_reports_bad_folders_in_one_line(vae, tmp_path, capsys):
    from uvic.data.imagenet import main

    root = make_imagenet(tmp_path / "small", counts=(1, 1, 1))
    vae.save_pretrained(tmp_path / "vae")
    args = ["--root", str(root), "--vae", str(tmp_path / "vae"), "--num-classes", "3", "--num-workers", "0",
            "--batch-size", "4"]
    with pytest.raises(SystemExit) as e:  # --resolution accepts U-ViT's 256 and 512 only
        main([*args, "--out", str(tmp_path / "o"), "--resolution", "16"])
    assert e.value.code == 2
    main([*args, "--out", str(tmp_path / "o"), "--resolution", "256"])
    assert ImageNetFeatures(tmp_path / "o").moments.shape == (3, 2, 8, 128, 128)  # the tiny VAE halves once
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*args[:4], "--num-classes", "1000", "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and err[-1].startswith("error: ") and "expected 1000" in err[-1]
