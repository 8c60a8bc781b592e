"""Image sources for FID: folders, `.npz` image arrays, in-memory generators, CIFAR-10 pickles, scikit-learn's
digits, COCO val2014-256.

Every source yields uint8 RGB images (3, H, W). Grayscale images (1 channel, PNG mode "L") have their channel
repeated, as pytorch-fid's `convert("RGB")` does. Float images are quantised exactly like
`torchvision.utils.save_image` (``x * 255 + 0.5``, clamped, truncated; `uvic.io.quantize_uint8`), so an in-memory
generator gives the same features as the PNGs U-ViT writes and reads back.

Map-style sources (`ImageFolder`, `ImageArray`, `cifar10`, `digits`, `CocoVal2014`) are `torch.utils.data.Dataset`s
that can be sharded across processes; `GeneratorSource` wraps a callable ``fn(n) -> batch`` or an iterable of
batches. Folders and datasets are read by the training readers (`uvic.data.images`, `uvic.data.mscoco`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import warnings
from pathlib import Path
from typing import Callable, Iterable, Iterator, Union

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from uvic.data.images import read_cifar10_batches, read_rgb, readable_images
from uvic.data.mscoco import center_crop_resize
from uvic.errors import DataError
from uvic.io import IMAGE_RANGE, quantize_uint8, read_npz


logger = logging.getLogger(__name__)

LOSSY_EXTENSIONS = (".jpg", ".jpeg", ".webp")
# PIL modes of the image files FID takes: RGB, and 8-bit grayscale (repeated to RGB).
IMAGE_MODES = ("RGB", "L")
ValueRange = tuple[float, float]
# The (low, high) of float images unless a caller says otherwise: [0, 1], as `uvic.io.quantize_uint8` takes them.
DEFAULT_VALUE_RANGE: ValueRange = IMAGE_RANGE
Batch = Union[torch.Tensor, np.ndarray]


def to_uint8(images: Batch, value_range: ValueRange = DEFAULT_VALUE_RANGE) -> torch.Tensor:
    """Convert a batch to (B, 3, H, W) uint8 RGB, quantising floats like `torchvision.utils.save_image`
    (`uvic.io.quantize_uint8`, the one quantisation) and repeating the channel of grayscale images.

    Args:
        images: (B, C, H, W) or (B, H, W, C) with C = 3 (RGB) or 1 (grayscale), torch or numpy; uint8 is taken as
            is, floats are mapped from `value_range` to [0, 1] (U-ViT's ``unpreprocess`` for (-1, 1)) and quantised.
        value_range: (low, high) of float inputs.
    Returns:
        (B, 3, H, W) uint8 tensor on the input's device (CPU for numpy).
    """
    x = torch.from_numpy(np.ascontiguousarray(images)) if isinstance(images, np.ndarray) else images
    if not torch.is_tensor(x) or x.dim() != 4:
        raise ValueError(f"expected a 4-D image batch, got {getattr(x, 'shape', type(x))}")
    if x.shape[1] not in (1, 3):
        if x.shape[-1] not in (1, 3):
            raise ValueError(f"expected (B, 3, H, W) or (B, H, W, 3) RGB images, or (B, 1, H, W) or (B, H, W, 1) "
                             f"grayscale ones, got shape {tuple(x.shape)}")
        x = x.permute(0, 3, 1, 2)
    return quantize_uint8(x, value_range).expand(-1, 3, -1, -1).contiguous()  # grayscale: R = G = B


def share_outside(images: Batch, value_range: ValueRange) -> float:
    """The share of the values of float `images` (any shape, numpy or torch) outside [low, high] = `value_range`,
    in [0, 1]; 0.0 for integer images. Read in chunks of images, so a large array costs no full-size copy."""
    if not (np.issubdtype(images.dtype, np.floating) if isinstance(images, np.ndarray) else images.is_floating_point()):
        return 0.0
    lo, hi = value_range
    outside, step = 0, max(1, 2**24 // max(1, math.prod(images.shape[1:])))
    for k in range(0, len(images), step):
        chunk = images[k : k + step]
        outside += int(((chunk < lo) | (chunk > hi)).sum())
    total = math.prod(images.shape)
    return outside / total if total else 0.0


def warn_outside(images: Batch, value_range: ValueRange, name: str) -> float:
    """Warn, giving the share, when float `images` hold values outside `value_range` (they are clamped to it when
    quantised, so a wrong --value-range would score other images than the ones meant); returns the share."""
    share = share_outside(images, value_range)
    if share > 0:
        lo, hi = value_range
        warnings.warn(f"{name}: {share:.2%} of the float values lie outside the value range [{lo:g}, {hi:g}] "
                      f"(--value-range {lo:g},{hi:g}) and are clamped to it; check that the range is the images' "
                      f"own (e.g. -1,1 for U-ViT's raw samples)", stacklevel=2)
    return share


class ImageFolder(Dataset):
    """Images in a folder (U-ViT's ``{idx}.png`` sample dirs), in natural sort order, every file checked before
    anything is computed (`uvic.data.images.readable_images`, the reader training uses too).

    All images must have one size and be RGB or grayscale (`IMAGE_MODES`; grayscale is repeated to RGB); the first
    offending file is named.

    Args:
        root: folder to read.
        recursive: also read sub-folders.
    """

    def __init__(self, root: str | os.PathLike, *, recursive: bool = False) -> None:
        self.root = Path(root)
        self.files = readable_images(self.root, recursive=recursive, remedy="nothing was computed")
        self.name = str(self.root)
        self._check()

    def _check(self) -> None:
        lossy = [p for p in self.files if p.suffix.lower() in LOSSY_EXTENSIONS]
        if lossy:
            warnings.warn(f"{len(lossy)} lossy-compressed images in {self.name} (e.g. {lossy[0].name}); "
                          "JPEG artefacts change FID, prefer PNG samples", stacklevel=3)
        first = None
        for p in self.files:
            with Image.open(p) as im:
                size, mode = im.size, im.mode
            if mode not in IMAGE_MODES:
                raise ValueError(f"image {str(p)!r} has mode {mode!r} ({Image.getmodebands(mode)} channels); "
                                 "FID takes RGB or 8-bit grayscale (L) images")
            if first is None:
                first = (p, size)
            elif size != first[1]:
                raise ValueError(f"image {str(p)!r} is {size[0]}x{size[1]}, but {str(first[0])!r} is "
                                 f"{first[1][0]}x{first[1][1]}; all images must have one size")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        """(3, H, W) uint8 (a grayscale file's channel repeated, by PIL's `convert("RGB")`)."""
        return torch.from_numpy(np.array(read_rgb(self.files[i]))).permute(2, 0, 1)


class ImageArray(Dataset):
    """Images held in an array: (N, H, W, C) or (N, C, H, W) with C = 3 or 1 (grayscale, repeated to RGB), uint8 or
    float in `value_range`.

    Args:
        images: the array (numpy or torch).
        value_range: range of float images (quantised like `save_image`).
        name: label recorded in the stats.
    """

    def __init__(self, images: Batch, *, value_range: ValueRange = DEFAULT_VALUE_RANGE, name: str = "array") -> None:
        if images.ndim != 4 or not {1, 3} & {images.shape[1], images.shape[-1]}:
            raise ValueError(f"{name}: expected (N, H, W, C) or (N, C, H, W) images with C = 3 (RGB) or 1 "
                             f"(grayscale), got shape {tuple(images.shape)}")
        self.images, self.value_range, self.name = images, value_range, name
        warn_outside(images, value_range, name)

    @classmethod
    def from_npz(cls, path: str | os.PathLike, *, key: str | None = None,
                 value_range: ValueRange = DEFAULT_VALUE_RANGE) -> "ImageArray":
        """Read an `.npz` of images (``arr_0`` as written by ``np.savez(path, images)``, or the only array)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"image archive {str(path)!r} does not exist")
        keys = read_npz(path, (), what="image archive")["__keys__"]
        if key is None:
            if "mu" in keys and "sigma" in keys:
                raise ValueError(f"{str(path)!r} holds FID statistics (mu, sigma), not images")
            if "mu" in keys or "sigma" in keys:
                missing = "sigma" if "mu" in keys else "mu"
                raise ValueError(f"{str(path)!r} looks like FID statistics but has no {missing!r} array (it has "
                                 f"{keys}); a statistics file needs both 'mu' and 'sigma'")
            key = "arr_0" if "arr_0" in keys else (keys[0] if len(keys) == 1 else None)
        if key not in keys:
            raise ValueError(f"{str(path)!r}: no image array {key!r}; arrays are {keys}, pass key=")
        images = read_npz(path, (key,), what="image archive")[key]
        return cls(images, value_range=value_range, name=str(path))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> torch.Tensor:
        """(3, H, W) uint8."""
        try:
            return to_uint8(self.images[i : i + 1], self.value_range)[0]
        except ValueError as e:  # NaN / Inf
            raise DataError(f"{self.name}: image {i}: {e}") from e


def cifar10(root: str | os.PathLike, split: str = "train", *, md5_check: bool = False) -> ImageArray:
    """A CIFAR-10 split read directly from the ``cifar-10-batches-py`` pickles.

    torchvision's loader insists on the md5 of every batch file; this reads them with
    `uvic.data.images.read_cifar10_batches` (the training reader, which refuses anything but plain data), with the
    same md5 table (`torchvision.datasets.CIFAR10`) applied only when `md5_check` is set.

    Args:
        root: the ``cifar-10-batches-py`` folder or its parent.
        split: "train" (50,000 images, U-ViT's reference) or "test" (10,000).
    Returns:
        `ImageArray` of (N, 32, 32, 3) uint8 named ``cifar10-<split>``.
    """
    from torchvision.datasets import CIFAR10

    if split not in ("train", "test"):
        raise ValueError(f"CIFAR-10 split must be 'train' or 'test', got {split!r}")
    root = Path(root)
    folder = root if (root / "batches.meta").exists() or root.name == CIFAR10.base_folder else root / CIFAR10.base_folder
    files = []
    for fname, md5 in CIFAR10.train_list if split == "train" else CIFAR10.test_list:
        path = folder / fname
        if not path.is_file():
            raise FileNotFoundError(f"CIFAR-10 batch {str(path)!r} not found; expected the python version "
                                    f"(cifar-10-python.tar.gz) extracted to {str(folder)!r}")
        if md5_check and (got := hashlib.md5(path.read_bytes()).hexdigest()) != md5:
            raise ValueError(f"md5 of {str(path)!r} is {got}, expected {md5} (corrupt or not the official file)")
        files.append(path)
    images, _ = read_cifar10_batches(files)  # a data-only unpickler: a batch file cannot run code
    return ImageArray(images, name=f"cifar10-{split}")


def digits(image_size: int = 8) -> ImageArray:
    """scikit-learn's 1,797 handwritten digits (shipped with it, no download) as training reads them
    (`uvic.data.DigitsDataset`, data.name "digits": gray levels 0..16 to [-1, 1], resized bilinearly to
    `image_size`), quantised like the samples of a model trained on them; grayscale, repeated to RGB.

    Args:
        image_size: the side of the samples (the config's `data.image_size`; 8, the digits' own, for the demo).
    Returns:
        `ImageArray` of (1797, 1, image_size, image_size) float images named ``digits:<image_size>``.
    """
    from uvic.data.images import DigitsDataset

    if image_size < 1:
        raise ValueError(f"digits image size must be >= 1, got {image_size}")
    return ImageArray(DigitsDataset(image_size).images, value_range=(-1.0, 1.0), name=f"digits:{image_size}")


def fashion_mnist(split: str = "train", root: str | None = None) -> ImageArray:
    """A Fashion-MNIST split as training reads it (`uvic.data.fashion_mnist`, data.name "fashion_mnist"): (N, 28, 28,
    1) uint8, grayscale repeated to RGB, named ``fashion_mnist:<split>``; 60,000 train or 10,000 test images.

    Args:
        split: "train" or "test".
        root: the folder of the idx files (None: the Debian package's, `uvic.data.fashion_mnist.DEBIAN_DIR`).
    """
    from uvic.data.fashion_mnist import load_fashion_mnist

    images, _ = load_fashion_mnist(root, split)
    return ImageArray(images[..., None], name=f"fashion_mnist:{split}")


def center_crop_lanczos(image: np.ndarray, resolution: int) -> np.ndarray:
    """U-ViT's MS-COCO preprocessing of an (H, W, 3) uint8 image (`uvic.data.mscoco.center_crop_resize`, which
    extracting the training features uses): centre square crop, then PIL Lanczos resize. Returns (R, R, 3) uint8."""
    return center_crop_resize(Image.fromarray(image, "RGB"), resolution)


class CocoVal2014(Dataset):
    """MS-COCO val2014 images at `resolution` with U-ViT's crop + Lanczos preprocessing (sorted ``*.jpg``).

    Args:
        root: the ``val2014`` folder (40,504 ``COCO_val2014_*.jpg``).
        resolution: output side, 256 for U-ViT's ``fid_stats_mscoco256_val.npz``.
    """

    def __init__(self, root: str | os.PathLike, resolution: int = 256) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"COCO val2014 folder {str(self.root)!r} does not exist")
        self.files = sorted(p for p in self.root.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
        if not self.files:
            raise ValueError(f"no .jpg images in {str(self.root)!r}")
        self.resolution = resolution
        self.name = f"coco-val2014-{resolution}"

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> torch.Tensor:
        """(3, resolution, resolution) uint8."""
        with Image.open(self.files[i]) as im:
            return torch.from_numpy(center_crop_resize(im, self.resolution).copy()).permute(2, 0, 1)


class GeneratorSource:
    """In-memory images from a callable ``fn(n) -> batch of n`` or an iterable of batches (no PNG round trip).

    Batches are (B, 3, H, W) or (B, H, W, 3), uint8 or float in `value_range` (quantised like `save_image`).

    Args:
        source: callable taking the number of images wanted, or an iterable / iterator of batches.
        num_samples: images to take (required for a callable; for an iterable, None means until exhausted).
        value_range: range of float batches.
        name: label recorded in the stats.
    """

    def __init__(self, source: Callable[[int], Batch] | Iterable[Batch], *, num_samples: int | None = None,
                 value_range: ValueRange = DEFAULT_VALUE_RANGE, name: str = "generator") -> None:
        if callable(source) and not isinstance(source, Iterable):
            if num_samples is None:
                raise ValueError("num_samples is required when the source is a callable fn(n) -> images")
        elif not isinstance(source, Iterable):
            raise ValueError(f"source must be a callable fn(n) -> images or an iterable of batches, got {type(source)}")
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        self.source, self.num_samples, self.value_range, self.name = source, num_samples, value_range, name

    def batches(self, num_samples: int | None, batch_size: int) -> Iterator[torch.Tensor]:
        """Yield (B, 3, H, W) uint8 batches, `num_samples` images in all (None: all of an iterable)."""
        left = num_samples
        if callable(self.source) and not isinstance(self.source, Iterable):
            while left > 0:
                batch = to_uint8(self.source(min(batch_size, left)), self.value_range)
                if len(batch) == 0:
                    raise ValueError("the generator returned an empty batch")
                batch = batch[:left]
                left -= len(batch)
                yield batch
            return
        for batch in self.source:
            batch = to_uint8(batch, self.value_range)
            if left is not None:
                batch = batch[:left]
                left -= len(batch)
            yield batch
            if left is not None and left <= 0:
                return
        if left is not None and left > 0:
            raise ValueError(f"the iterable ran out {left} images short of num_samples={num_samples}")


Source = Union[str, os.PathLike, Dataset, GeneratorSource, Callable[[int], Batch], Iterable[Batch]]


def open_source(spec: Source, *, value_range: ValueRange = DEFAULT_VALUE_RANGE, num_samples: int | None = None,
                recursive: bool = False, md5_check: bool = False) -> Dataset | GeneratorSource:
    """Turn a source spec into a map-style dataset or a `GeneratorSource`.

    String specs: a folder of images; an ``.npz`` of images; ``cifar10-train:ROOT`` / ``cifar10-test:ROOT``;
    ``digits:SIZE`` (scikit-learn's digits at side SIZE, as `data.name: digits` trains on them);
    ``fashion_mnist:train`` / ``fashion_mnist:test`` (optionally ``:ROOT``, the folder of the idx files);
    ``coco-val2014-256:VAL2014_DIR`` (any resolution in place of 256). Datasets and `GeneratorSource`s pass
    through; other callables and iterables become a `GeneratorSource`.
    """
    if isinstance(spec, (Dataset, GeneratorSource)):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        text = os.fspath(spec)
        if m := re.fullmatch(r"cifar10-(train|test):(.+)", text):
            return cifar10(m[2], m[1], md5_check=md5_check)
        if m := re.fullmatch(r"digits:(\d+)", text):
            return digits(int(m[1]))
        if m := re.fullmatch(r"fashion_mnist:(train|test)(?::(.+))?", text):
            return fashion_mnist(m[1], m[2])
        if m := re.fullmatch(r"coco-val2014-(\d+):(.+)", text):
            return CocoVal2014(m[2], int(m[1]))
        path = Path(text)
        if path.is_dir():
            return ImageFolder(path, recursive=recursive)
        if path.suffix == ".npz":
            return ImageArray.from_npz(path, value_range=value_range)
        raise FileNotFoundError(f"image source {text!r} is not a folder, an .npz file, cifar10-<split>:ROOT, "
                                "digits:SIZE, fashion_mnist:<split>[:ROOT] or coco-val2014-<res>:DIR")
    if callable(spec) or isinstance(spec, Iterable):
        return GeneratorSource(spec, num_samples=num_samples, value_range=value_range)
    raise ValueError(f"unsupported image source {type(spec)}")
