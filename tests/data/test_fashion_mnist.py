"""The Fashion-MNIST idx reader on idx files written here by hand (big-endian header, then the bytes); CI has no
real files."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tiny_fashion_mnist import idx_bytes, write_split

from uvic.data import fashion_mnist as fm
from uvic.data.images import DATASETS, TEST_SPLITS
from uvic.errors import DataError


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """5 train and 3 test images of distinct patterns in tmp_path (gzipped train, plain test); no Debian folder."""
    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "no_debian")
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    test = rng.integers(0, 256, (3, 28, 28), dtype=np.uint8)
    write_split(tmp_path, "train", train, np.array([9, 0, 0, 3, 2]))
    write_split(tmp_path, "t10k", test, np.array([1, 2, 3]), gz=False)
    return tmp_path, train, test


def test_reads_both_splits_gz_or_not_with_labels_and_the_digits_range(tiny):
    root, train, test = tiny
    data = SimpleNamespace(root=str(root), image_size=28)
    ds, held_out = DATASETS["fashion_mnist"](data), TEST_SPLITS["fashion_mnist"](data)
    assert (len(ds), len(held_out)) == (5, 3)
    item = ds[0]
    assert item["x"].shape == (1, 28, 28) and item["x"].dtype == torch.float32
    # pixel p -> p / 127.5 - 1, computed here from the bytes written above
    np.testing.assert_allclose(item["x"][0].numpy(), train[0] / 127.5 - 1, atol=1e-6)
    assert [int(ds[i]["label"]) for i in range(5)] == [9, 0, 0, 3, 2]
    np.testing.assert_allclose(held_out[2]["x"][0].numpy(), test[2] / 127.5 - 1, atol=1e-6)
    assert int(held_out[2]["label"]) == 3


def test_padding_to_32_centres_the_image_on_black(tiny):
    root, train, _ = tiny
    x = DATASETS["fashion_mnist"](SimpleNamespace(root=str(root), image_size=32))[1]["x"][0]
    assert x.shape == (32, 32)
    np.testing.assert_allclose(x[2:30, 2:30].numpy(), train[1] / 127.5 - 1, atol=1e-6)
    assert (x[:2] == -1).all() and (x[:, 30:] == -1).all()
    with pytest.raises(ValueError, match="data.image_size=24"):
        DATASETS["fashion_mnist"](SimpleNamespace(root=str(root), image_size=24))


def test_torchvision_layout_and_debian_folder_are_found(tmp_path, monkeypatch):
    images, labels = np.zeros((2, 28, 28), np.uint8), np.array([4, 5])
    write_split(tmp_path / "tv" / "FashionMNIST" / "raw", "train", images, labels)
    write_split(tmp_path / "deb", "train", images + 7, labels)
    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "deb")
    _, got = fm.load_fashion_mnist(tmp_path / "tv", "train")
    assert got.tolist() == [4, 5]
    x, _ = fm.load_fashion_mnist(tmp_path / "elsewhere", "train")  # not in root: the Debian folder
    assert int(x[0, 0, 0]) == 7
    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "none")
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        fm.load_fashion_mnist(tmp_path / "elsewhere", "train")


@pytest.mark.parametrize("damage, why", [
    (lambda b: b[:-5], "truncated"),
    (lambda b: b + b"\0", "trailing bytes"),
    (lambda b: bytes([0, 0, 8, 1]) + b[4:], "magic number 0x00000801, expected 0x00000803"),
    (lambda b: b[:10], "shorter than its 16-byte header"),
])
def test_a_damaged_images_file_is_one_error_naming_it(tmp_path, damage, why):
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(damage(idx_bytes(np.zeros((3, 28, 28), np.uint8))))
    with pytest.raises(DataError, match=why) as e:
        fm.read_idx(path, 3)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_truncated_gzip_and_mismatched_counts_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(fm, "DEBIAN_DIR", tmp_path / "none")
    write_split(tmp_path, "train", np.zeros((3, 28, 28), np.uint8), np.array([1, 2]))
    with pytest.raises(DataError, match="3 images but .* 2 labels"):
        fm.load_fashion_mnist(tmp_path, "train")
    gz = tmp_path / "train-images-idx3-ubyte.gz"
    gz.write_bytes(gz.read_bytes()[:20])
    with pytest.raises(DataError, match=f"{gz} is not a readable idx3 file"):
        fm.load_fashion_mnist(tmp_path, "train")


def test_the_config_accepts_the_name():
    from uvic.config import load_config

    cfg = load_config("configs/fashion_mnist_uvic.yaml")
    assert cfg.data.name == "fashion_mnist"
