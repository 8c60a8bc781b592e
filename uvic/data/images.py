"""Image datasets for unconditional diffusion: CIFAR-10, a folder of images, scikit-learn's 8x8 digits and
Fashion-MNIST.

Items are `{"x": (C, H, W) float32 in [-1, 1], "label": () int64}` (U-ViT's `ToTensor` + `Normalize(0.5, 0.5)`).
Random flips are not applied here: the training task draws them on the device from the run's seeded generator,
so that they resume exactly and do not depend on data-loader workers.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from uvic.errors import DataError
from uvic.io import UnsafeFileError, load_data_pickle


logger = logging.getLogger(__name__)

_CIFAR_DIR = "cifar-10-batches-py"
_CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
IMAGE_EXTENSIONS = (".bmp", ".jpg", ".jpeg", ".pgm", ".png", ".ppm", ".tif", ".tiff", ".webp")


def _to_model_range(images_uint8: np.ndarray) -> torch.Tensor:
    """(N, H, W, C) uint8 -> (N, C, H, W) float32 in [-1, 1]."""
    return torch.from_numpy(images_uint8).permute(0, 3, 1, 2).float().div(127.5).sub(1.0).contiguous()


class _TensorImages(Dataset):
    """Images held in memory as one (N, C, H, W) tensor in [-1, 1], with (N,) labels."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels
        self.channels = images.shape[1]

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.images[i], "label": self.labels[i]}


class Cifar10(_TensorImages):
    """A CIFAR-10 split, read from the python-pickle batches: "train" (50,000 32x32 RGB images) or "test"
    (10,000, the held-out set of the validation loss).

    Args:
        root: folder that holds (or will hold) `cifar-10-batches-py/data_batch_{1..5}` and `test_batch`.
        download: fetch the archive with torchvision when the batches are missing.
        split: "train" or "test".
    Raises:
        FileNotFoundError: the batches are missing and could not be downloaded; the message says where to put them.
    """

    def __init__(self, root: str | Path, download: bool = True, split: str = "train") -> None:
        if split not in ("train", "test"):
            raise ValueError(f"CIFAR-10 split {split!r}: expected 'train' or 'test'")
        folder = Path(root) / _CIFAR_DIR
        files = [folder / f"data_batch_{i}" for i in range(1, 6)] if split == "train" else [folder / "test_batch"]
        if not all(f.is_file() for f in files) and download:
            _download_cifar10(Path(root))
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"CIFAR-10 not found: {folder} lacks {missing}. Download {_CIFAR_URL} and extract it into {root} "
                f"(so that {folder}/data_batch_1 exists), or set data.download=true on a machine that is online."
            )
        data, labels = read_cifar10_batches(files)
        images = data.transpose(0, 2, 3, 1)  # (N, 32, 32, 3)
        super().__init__(_to_model_range(images), torch.from_numpy(labels))


def read_cifar10_batches(files: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of CIFAR-10 python batches (`data_batch_1`..`5`, `test_batch`), in file order.

    The batches are pickles; they are read with a data-only unpickler (`uvic.io.load_data_pickle`) that builds
    dicts, lists, bytes, str, ints and uint8 arrays only, so a batch file cannot run code.

    Returns:
        ((N, 3, 32, 32) uint8 images, the rows' R, G, B planes; (N,) int64 labels).
    Raises:
        UnsafeFileError: a file holds anything else (a class, a function); DataError: a file is not a batch.
    """
    data, labels = [], []
    for f in files:
        try:
            batch = load_data_pickle(f, dtypes=("u1",), what="CIFAR-10 batch")
        except UnsafeFileError:
            raise
        except DataError as e:
            raise DataError(f"{f} is not a CIFAR-10 python batch (not a readable pickle: {e.__cause__})") from e
        try:
            if not isinstance(batch, dict):
                raise TypeError(f"a {type(batch).__name__}, not a dict")
            rows = batch[b"data"] if b"data" in batch else batch["data"]
            rows = np.asarray(rows, dtype=np.uint8).reshape(-1, 3, 32, 32)  # R(1024) G(1024) B(1024) per row
            got = batch[b"labels"] if b"labels" in batch else batch["labels"]
            got = np.asarray([int(v) for v in got], dtype=np.int64)
            if len(got) != len(rows):
                raise ValueError(f"{len(rows)} images but {len(got)} labels")
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{f} is not a CIFAR-10 python batch (a dict with 'data' (N, 3072) uint8 and 'labels'): "
                            f"{type(e).__name__}: {e}") from e
        data.append(rows)
        labels.append(got)
    return np.concatenate(data), np.concatenate(labels)


def _download_cifar10(root: Path) -> None:
    import torchvision

    try:
        torchvision.datasets.CIFAR10(str(root), train=True, download=True)
    except Exception as e:  # noqa: BLE001 - offline shows up as URLError, OSError, RuntimeError...
        raise FileNotFoundError(
            f"CIFAR-10 is not under {root / _CIFAR_DIR} and downloading it failed ({type(e).__name__}: {e}). "
            f"Download {_CIFAR_URL} and extract it into {root}, or set data.root to where it is."
        ) from e


def _natural_key(path: Path) -> tuple:
    # U-ViT writes {idx}.png: order 2.png before 10.png so a folder matches the generation order.
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", path.name) if t)


def find_images(root: str | Path, *, recursive: bool = True) -> list[Path]:
    """The image files (`IMAGE_EXTENSIONS`, any case) in `root`, and in its sub-folders when `recursive`, sorted by
    folder and then in natural name order (`2.png` before `10.png`, the order of U-ViT's `{idx}.png` samples).

    Raises:
        FileNotFoundError: `root` is not a folder, or holds no image files.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root}")
    files = [p for p in (root.rglob("*") if recursive else root.iterdir())
             if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()]
    if not files:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) {'under' if recursive else 'in'} {root}")
    return sorted(files, key=lambda p: (p.parent.as_posix(), _natural_key(p)))


def readable_images(root: str | Path, *, recursive: bool = True, skip_bad: bool = False, remedy: str) -> list[Path]:
    """`find_images(root)` with every file checked (`check_image`: the header, and for PNG the chunk checksums
    through to the end of the file) before anything reads one: the one image-folder reader of training
    (`ResizedImageFolder`) and of the FID harness (`uvic.fid.ImageFolder`, which neither crops nor resizes).

    Args:
        root, recursive: as `find_images`.
        skip_bad: leave unreadable files out (each is logged) instead of raising.
        remedy: the end of the error message (what the caller can do, or what did not happen).
    Raises:
        FileNotFoundError: `root` is missing or holds no (readable) images.
        DataError: "<first unreadable file> is not a readable image (<why>)[; N more unreadable file(s) under
            <root>]; <remedy>", when `skip_bad` is False.
    """
    paths = find_images(root, recursive=recursive)
    bad = [(p, why) for p in paths if (why := check_image(p)) is not None]
    if bad and not skip_bad:
        (first, why), more = bad[0], len(bad) - 1
        raise DataError(f"{first} is not a readable image ({why})" + (f"; {more} more unreadable file(s) under "
                        f"{root}" if more else "") + f"; {remedy}")
    for p, why in bad:
        logger.warning("skipping unreadable image %s (%s)", p, why)
    skipped = {p for p, _ in bad}
    kept = [p for p in paths if p not in skipped]
    if not kept:
        raise FileNotFoundError(f"no readable images under {root}: all {len(paths)} were skipped")
    return kept


def read_rgb(path: str | Path) -> Any:
    """The image file at `path` decoded as an RGB `PIL.Image` (loaded into memory).

    Raises:
        DataError: the file cannot be decoded (damaged since `check_image` passed, or damage only a decode finds).
    """
    from PIL import Image

    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:
        raise DataError(f"{path} is not a readable image ({type(e).__name__}: {' '.join(str(e).split())})") from e


class ResizedImageFolder(Dataset):
    """Every image under `root` (`readable_images`: recursive, natural order), center-cropped to a square and
    resized; grayscale and RGB files alike give 3 channels (`read_rgb`).

    Every file is checked when the dataset is built, so a non-image or a truncated file is reported by name before
    training starts rather than when it comes up mid-run.

    Args:
        root: folder of image files (`IMAGE_EXTENSIONS`).
        image_size: output side H = W.
        skip_bad: leave unreadable files out (each is logged) instead of raising.
    Raises:
        FileNotFoundError: `root` is missing or holds no (readable) images.
        DataError: an unreadable file, named, when `skip_bad` is False.
    """

    def __init__(self, root: str | Path, image_size: int, skip_bad: bool = False) -> None:
        from torchvision import transforms

        self.paths = readable_images(root, recursive=True, skip_bad=skip_bad,
                                     remedy="remove them, or set data.skip_bad_images=true to skip them")
        self.transform = transforms.Compose([
            transforms.Resize(image_size),
            transforms.CenterCrop(image_size),
            transforms.ToTensor(),
            transforms.Normalize(0.5, 0.5),
        ])
        self.channels = 3

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.transform(read_rgb(self.paths[i])), "label": torch.tensor(-1)}


def check_image(path: str | Path) -> str | None:
    """None if `path` opens as an image, else why not. Reads the header; `Image.verify` also walks a PNG's chunks
    and checksums to the end of the file (catching truncation) without decoding pixels."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img.verify()
    except Exception as e:  # noqa: BLE001 - PIL reports damage as OSError, SyntaxError, struct.error, ...
        return f"{type(e).__name__}: {' '.join(str(e).split())}"
    return None


class DigitsDataset(_TensorImages):
    """scikit-learn's 1,797 handwritten 8x8 digits (shipped with the package, no download), upscaled.

    Gray levels 0..16 are mapped to [-1, 1] and resized bilinearly to `image_size`; one channel.

    Args:
        image_size: output side H = W (e.g. 32).
    """

    def __init__(self, image_size: int = 32) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x = torch.from_numpy(digits.images).float().unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
        x = torch.nn.functional.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
        super().__init__((x.clamp(0, 1) * 2 - 1).contiguous(), torch.from_numpy(digits.target).long())


class FashionMnist(_TensorImages):
    """A Fashion-MNIST split from its idx files (`uvic.data.fashion_mnist`): "train" (60,000) or "test" (10,000,
    the held-out set of the validation loss); one channel, pixels as the digits' ([-1, 1]), labels 0..9.

    Args:
        root: the folder of the idx files, or of torchvision's `FashionMNIST/raw`; the Debian package's folder after.
        image_size: 28, or larger for a black border (32).
        split: "train" or "test".
    """

    def __init__(self, root: str | Path | None, image_size: int = 28, split: str = "train") -> None:
        from uvic.data.fashion_mnist import load_fashion_mnist, to_model_range

        images, labels = load_fashion_mnist(root, split)
        super().__init__(to_model_range(images, image_size), torch.from_numpy(labels))


DATASETS: dict[str, Callable[[Any], Dataset]] = {
    "cifar10": lambda data: Cifar10(data.root, download=data.download),
    "image_folder": lambda data: ResizedImageFolder(data.root, data.image_size, skip_bad=data.skip_bad_images),
    "digits": lambda data: DigitsDataset(data.image_size),
    "fashion_mnist": lambda data: FashionMnist(data.root, data.image_size),
}


# The datasets of DATASETS that have a test split: the held-out set of the validation loss (the others hold out
# `data.val_fraction` of their images).
TEST_SPLITS: dict[str, Callable[[Any], Dataset]] = {
    "cifar10": lambda data: Cifar10(data.root, download=data.download, split="test"),
    "fashion_mnist": lambda data: FashionMnist(data.root, data.image_size, split="test"),
}


def build_image_dataset(data: Any) -> Dataset:
    """The dataset named by `data.name` (a `uvic.config.DataConfig`)."""
    if data.name not in DATASETS:
        raise ValueError(f"unknown dataset {data.name!r}; expected one of {sorted(DATASETS)}")
    return DATASETS[data.name](data)
