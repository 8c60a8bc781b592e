"""Image sources: folder checks and order, .npz and generator quantisation, CIFAR-10 pickles, COCO crop."""

import pickle

import numpy as np
import pytest
import torch
import torchvision
from fid_testutils import smooth_images, write_pngs
from PIL import Image

from uvic.fid import CocoVal2014, GeneratorSource, ImageArray, ImageFolder, cifar10, open_source, to_uint8
from uvic.fid.inputs import center_crop_lanczos


def test_folder_reads_in_natural_order(tmp_path):
    images = smooth_images(12, size=8)
    ds = ImageFolder(write_pngs(tmp_path / "s", images))
    assert [p.name for p in ds.files[:3]] == ["0.png", "1.png", "2.png"] and ds.files[10].name == "10.png"
    got = torch.stack([ds[i] for i in range(len(ds))])
    assert got.dtype == torch.uint8 and torch.equal(got, torch.from_numpy(images).permute(0, 3, 1, 2))


def test_folder_names_first_image_of_wrong_size(tmp_path):
    folder = write_pngs(tmp_path / "s", smooth_images(3, size=8))
    Image.fromarray(smooth_images(1, size=9)[0]).save(folder / "1.png")
    with pytest.raises(ValueError, match=r"1\.png' is 9x9, but .*0\.png' is 8x8"):
        ImageFolder(folder)


def test_folder_takes_grayscale_images_and_names_one_with_alpha(tmp_path):
    """`sample.py --out-dir` writes 1-channel PNGs for a 1-channel model (the digits demo): FID reads them as
    pytorch-fid does, `convert("RGB")`, the gray level in all three channels."""
    images = smooth_images(3, size=8)
    folder = write_pngs(tmp_path / "s", images)
    Image.fromarray(images[2][..., 0]).save(folder / "2.png")  # mode "L", as sample.py saves a 1-channel image
    ds = ImageFolder(folder)
    assert torch.equal(ds[2], torch.from_numpy(np.repeat(images[2][..., :1], 3, axis=-1)).permute(2, 0, 1))
    assert torch.equal(ds[1], torch.from_numpy(images[1]).permute(2, 0, 1))
    Image.fromarray(np.dstack([images[0], images[0][..., :1]]), "RGBA").save(folder / "1.png")
    with pytest.raises(ValueError, match=r"1\.png' has mode 'RGBA' \(4 channels\); FID takes RGB or 8-bit grayscale"):
        ImageFolder(folder)


def test_grayscale_batches_and_arrays_repeat_the_channel(tmp_path):
    gray = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    rgb = to_uint8(gray.expand(-1, 3, -1, -1))
    assert torch.equal(to_uint8(gray), rgb) and torch.equal(to_uint8(gray.permute(0, 2, 3, 1).numpy()), rgb)
    got = torch.cat(list(GeneratorSource(lambda n: gray[:n], num_samples=2).batches(2, 2)))
    assert torch.equal(got, rgb)
    np.savez(tmp_path / "g.npz", rgb[:, :1].permute(0, 2, 3, 1).numpy())  # (N, H, W, 1) uint8
    ds = open_source(tmp_path / "g.npz")
    assert torch.equal(torch.stack([ds[0], ds[1]]), rgb)
    with pytest.raises(ValueError, match=r"C = 3 \(RGB\) or 1 \(grayscale\)"):
        ImageArray(np.zeros((2, 2, 8, 8), np.uint8))


def test_digits_source_is_what_training_reads(tmp_path):
    from sklearn.datasets import load_digits

    from uvic.data import DigitsDataset

    ds = open_source("digits:8")
    assert len(ds) == 1797 and ds.name == "digits:8"
    # The digits' own 8x8 gray levels 0..16, quantised as save_image does: uint8(255 v / 16 + 0.5), in R, G and B.
    levels = torch.from_numpy(load_digits().images[:5])
    want = (levels / 16 * 255 + 0.5).floor().to(torch.uint8)[:, None].expand(-1, 3, -1, -1)
    assert torch.equal(torch.stack([ds[i] for i in range(5)]), want)
    # At another side: the training images of data.image_size=16, [-1, 1] -> [0, 1], quantised.
    big = open_source("digits:16")
    x = DigitsDataset(16)[7]["x"]
    assert torch.equal(big[7], ((x + 1) / 2 * 255 + 0.5).clamp(0, 255).to(torch.uint8).expand(3, -1, -1))
    with pytest.raises(ValueError, match="digits image size must be >= 1"):
        open_source("digits:0")
    with pytest.raises(FileNotFoundError, match="digits:SIZE"):
        open_source("digits")


def test_folder_errors_and_jpeg_warning(tmp_path):
    with pytest.raises(FileNotFoundError, match="image folder not found"):
        ImageFolder(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no images"):
        ImageFolder(tmp_path / "empty")
    Image.fromarray(smooth_images(1, size=8)[0]).save(tmp_path / "empty" / "0.JPG")
    with pytest.warns(UserWarning, match="lossy"):
        assert len(ImageFolder(tmp_path / "empty")) == 1  # extensions are case-insensitive


@pytest.mark.parametrize("value_range", [(0.0, 1.0), (-1.0, 1.0)])
def test_float_quantisation_matches_save_image(tmp_path, value_range):
    lo, hi = value_range
    x = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(0)) * (hi - lo) * 1.1 + lo - 0.05 * (hi - lo)
    # Independent reference: torchvision.utils.save_image writes a PNG, PIL reads it back (U-ViT's round trip).
    ref = []
    for i, im in enumerate(x):
        unit = (im - lo) / (hi - lo)
        torchvision.utils.save_image(unit, tmp_path / f"{i}.png")
        ref.append(np.asarray(Image.open(tmp_path / f"{i}.png").convert("RGB")))
    ref = torch.from_numpy(np.stack(ref)).permute(0, 3, 1, 2)
    assert torch.equal(to_uint8(x, value_range), ref)
    assert torch.equal(to_uint8(x.permute(0, 2, 3, 1).numpy(), value_range), ref)  # NHWC numpy too


def test_to_uint8_rejects_bad_batches():
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\) or \(B, H, W, 3\)"):
        to_uint8(torch.zeros(2, 4, 8, 8))
    with pytest.raises(ValueError, match="NaN or Inf"):
        to_uint8(torch.full((1, 3, 2, 2), float("nan")))
    with pytest.raises(ValueError, match="4-D"):
        to_uint8(torch.zeros(3, 8, 8))


def test_npz_images(tmp_path):
    images = smooth_images(5, size=8)
    np.savez(tmp_path / "a.npz", images)
    np.savez(tmp_path / "b.npz", samples=images.transpose(0, 3, 1, 2))
    np.savez(tmp_path / "c.npz", images.astype(np.float32) / 255)
    expected = torch.from_numpy(images).permute(0, 3, 1, 2)
    for name in ("a", "b", "c"):
        ds = open_source(tmp_path / f"{name}.npz")
        assert torch.equal(torch.stack([ds[i] for i in range(len(ds))]), expected), name
    np.savez(tmp_path / "stats.npz", mu=np.zeros(2), sigma=np.eye(2))
    with pytest.raises(ValueError, match="holds FID statistics"):
        ImageArray.from_npz(tmp_path / "stats.npz")
    np.savez(tmp_path / "two.npz", x=images, y=images)
    with pytest.raises(ValueError, match=r"arrays are \['x', 'y'\]"):
        ImageArray.from_npz(tmp_path / "two.npz")


def write_fake_cifar(root, n_per_batch=4, seed=0):
    """cifar-10-batches-py with the real file names and pickle layout, random content."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    data = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        d = rng.integers(0, 256, size=(n_per_batch, 3072), dtype=np.uint8)
        data[name] = d
        with open(folder / name, "wb") as f:
            pickle.dump({b"batch_label": name.encode(), b"labels": [0] * n_per_batch, b"data": d,
                         b"filenames": [b"x.png"] * n_per_batch}, f)
    return data


def test_cifar10_pickles(tmp_path):
    data = write_fake_cifar(tmp_path)
    train = cifar10(tmp_path, "train")
    assert train.name == "cifar10-train" and len(train) == 20
    expected = np.concatenate([data[f"data_batch_{i}"] for i in range(1, 6)]).reshape(-1, 3, 32, 32)
    assert torch.equal(train[7], torch.from_numpy(expected[7]))
    # Channel planes: first 1024 bytes are red, row-major.
    assert train[0][0, 0, 1].item() == data["data_batch_1"][0, 1] and train[0][1, 0, 0] == data["data_batch_1"][0, 1024]
    test = open_source(f"cifar10-test:{tmp_path / 'cifar-10-batches-py'}")
    assert len(test) == 4 and torch.equal(test[3], torch.from_numpy(data["test_batch"][3].reshape(3, 32, 32)))
    with pytest.raises(ValueError, match="md5 of .*data_batch_1.* expected c99cafc152244af753f735de768cd75f"):
        cifar10(tmp_path, "train", md5_check=True)
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        cifar10(tmp_path / "nowhere", "train")
    with pytest.raises(ValueError, match="split"):
        cifar10(tmp_path, "val")


def test_coco_crop_and_lanczos(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "val2014").mkdir()
    img = rng.integers(0, 256, size=(40, 60, 3), dtype=np.uint8)
    Image.fromarray(img).save(tmp_path / "val2014" / "COCO_val2014_000000000042.jpg", quality=95)
    ds = open_source(f"coco-val2014-16:{tmp_path / 'val2014'}")
    assert isinstance(ds, CocoVal2014) and ds.name == "coco-val2014-16"
    decoded = np.asarray(Image.open(tmp_path / "val2014" / "COCO_val2014_000000000042.jpg").convert("RGB"))
    # Independent reference: PIL crop box (centre 40x40 of 60 wide) + Lanczos resize.
    ref = np.array(Image.fromarray(decoded).crop((10, 0, 50, 40)).resize((16, 16), Image.LANCZOS))
    assert torch.equal(ds[0], torch.from_numpy(ref).permute(2, 0, 1))
    assert center_crop_lanczos(decoded, 16).shape == (16, 16, 3)


def test_generator_source_counts_and_errors():
    images = torch.from_numpy(smooth_images(7, size=8)).permute(0, 3, 1, 2)
    pos = [0]

    def fn(n):
        out = images[pos[0] : pos[0] + n]
        pos[0] += n
        return out.float() / 255

    got = torch.cat(list(GeneratorSource(fn, num_samples=7).batches(7, 3)))
    assert torch.equal(got, images)
    assert sum(len(b) for b in GeneratorSource(iter([images[:4], images[4:]])).batches(5, 2)) == 5
    with pytest.raises(ValueError, match="num_samples is required"):
        GeneratorSource(fn)
    with pytest.raises(ValueError, match="ran out 3 images short"):
        list(GeneratorSource([images]).batches(10, 4))
    with pytest.raises(FileNotFoundError, match="not a folder, an .npz file"):
        open_source("no/such/thing")


# Unreadable images are named before anything is computed.


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_folder_names_an_unreadable_image_up_front(tmp_path, damage):
    from uvic.errors import DataError

    folder = write_pngs(tmp_path / "s", smooth_images(12, size=8))
    data = (folder / "7.png").read_bytes()
    (folder / "7.png").write_bytes(data[: len(data) - 30] if damage == "truncated" else b"")
    with pytest.raises(DataError, match=rf"^{folder / '7.png'} is not a readable image \(.*\); nothing was "
                                        rf"computed$"):
        ImageFolder(folder)


def test_cli_names_an_unreadable_image_before_loading_the_network(tmp_path, capsys):
    from uvic.fid.__main__ import main

    folder = write_pngs(tmp_path / "s", smooth_images(4, size=8))
    (folder / "3.png").write_bytes(b"")
    # The weights path does not exist: the folder check must come first for this message to appear.
    with pytest.raises(SystemExit) as e:
        main(["stats", str(folder), "--out", str(tmp_path / "o.npz"), "--weights", str(tmp_path / "w.pth")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: {folder / '3.png'} is not a readable image (UnidentifiedImageError")
    assert not (tmp_path / "o.npz").exists()


def test_float_images_outside_their_value_range_are_reported_with_the_share():
    """0..1 images read with value range (0, 0.5) scored silently (the upper half clamped to white): a warning now
    gives the share of values outside; images inside the range give none."""
    import warnings

    from uvic.fid.inputs import ImageArray, share_outside

    x = np.tile(np.array([0.25, 0.75, 0.1, 0.2], np.float32), 3 * 4 * 4 * 2).reshape(8, 4, 4, 3)  # 1 in 4 outside
    assert share_outside(x, (0.0, 0.5)) == 0.25
    assert share_outside(torch.from_numpy(x), (0.0, 0.5)) == 0.25
    assert share_outside((x * 255).astype(np.uint8), (0.0, 0.5)) == 0.0  # uint8 images have no value range
    with pytest.warns(UserWarning, match=r"array: 25\.00% of the float values lie outside the value range \[0, 0\.5\] "
                                         r"\(--value-range 0,0\.5\) and are clamped to it"):
        ImageArray(x, value_range=(0.0, 0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ImageArray(x, value_range=(0.0, 1.0))
        ImageArray(x * 2 - 1, value_range=(-1.0, 1.0))
