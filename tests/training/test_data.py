import pickle

import numpy as np
import pytest
import torch

from uvic.config import DataConfig
from uvic.data import Cifar10, DigitsDataset, ResizedImageFolder, build_image_dataset
from uvic.training.data import ShardedBatchSampler


def _write_cifar(root, n_per_batch=3):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = []
    for b in range(1, 6):
        data = rng.integers(0, 256, (n_per_batch, 3072), dtype=np.uint8)
        images.append(data)
        with open(folder / f"data_batch_{b}", "wb") as f:
            pickle.dump({"data": data, "labels": [b] * n_per_batch, "batch_label": f"batch {b}"}, f)
    return np.concatenate(images)


def test_cifar10_reads_the_python_batches(tmp_path):
    raw = _write_cifar(tmp_path)
    ds = Cifar10(tmp_path, download=False)
    assert len(ds) == 15
    item = ds[4]
    assert item["x"].shape == (3, 32, 32) and item["x"].dtype == torch.float32
    # CHW row-major layout of the CIFAR batches, mapped to [-1, 1] (ToTensor + Normalize(0.5, 0.5))
    expected = torch.from_numpy(raw[4].reshape(3, 32, 32).astype(np.float32)) / 127.5 - 1
    torch.testing.assert_close(item["x"], expected)
    assert item["label"] == 2


def test_cifar10_missing_offline_says_where_to_put_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cifar-10-batches-py.*Download https://www.cs.toronto.edu"):
        Cifar10(tmp_path / "nowhere", download=False)
    with pytest.raises(FileNotFoundError, match="CIFAR-10"):
        build_image_dataset(DataConfig(name="cifar10", root=str(tmp_path / "nowhere"), download=False))


def test_corrupt_cifar_batch_is_a_clear_error(tmp_path):
    _write_cifar(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="data_batch_3 is not a CIFAR-10 python batch"):
        Cifar10(tmp_path, download=False)


def test_digits_and_image_folder(tmp_path):
    from sklearn.datasets import load_digits

    ds = DigitsDataset(8)
    assert len(ds) == 1797 and ds[0]["x"].shape == (1, 8, 8)
    # at the native size, bilinear resizing is the identity: x = 2 * v / 16 - 1
    torch.testing.assert_close(ds[7]["x"][0], torch.from_numpy(load_digits().images[7]).float() / 8 - 1)
    assert DigitsDataset(16)[0]["x"].shape == (1, 16, 16)
    with pytest.raises(FileNotFoundError, match="no images"):
        ResizedImageFolder(tmp_path, 8)
    with pytest.raises(FileNotFoundError, match="image folder not found"):
        ResizedImageFolder(tmp_path / "missing", 8)
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        build_image_dataset(DataConfig(name="mnist"))


def test_sharded_sampler_splits_global_batches_and_resumes():
    single = ShardedBatchSampler(23, batch_size=4, seed=1)
    shards = [ShardedBatchSampler(23, batch_size=2, seed=1, process_index=r, num_processes=2) for r in range(2)]
    for epoch in range(2):
        for s in [single, *shards]:
            s.set_epoch(epoch)
        one = list(single)
        two = [a + b for a, b in zip(*shards)]
        assert one == two and len(one) == 23 // 4
        assert sorted(sum(one, [])) == sorted(set(sum(one, [])))  # no repeats within an epoch
    single.set_epoch(0)
    e0 = list(single)
    single.set_epoch(1)
    assert list(single) != e0  # reshuffled per epoch
    single.set_epoch(0, start_batch=3)
    assert list(single) == e0[3:] and len(single) == len(e0) - 3
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ShardedBatchSampler(3, batch_size=2, seed=0, num_processes=2)
