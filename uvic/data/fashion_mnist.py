"""Fashion-MNIST (Zalando Research: 70,000 28x28 grayscale images of clothing in 10 classes) from its original idx
files, gzipped or not.

The four files (`train-images-idx3-ubyte[.gz]`, `train-labels-idx1-ubyte[.gz]`, `t10k-images-idx3-ubyte[.gz]`,
`t10k-labels-idx1-ubyte[.gz]`) are looked for in `data.root`, then in torchvision's `<root>/FashionMNIST/raw`
layout (what `torchvision.datasets.FashionMNIST(root, download=True)` writes), then in the Debian package
`dataset-fashion-mnist`'s folder (`DEBIAN_DIR`). Each file's magic number (0x00000803 images, 0x00000801 labels),
dimensions and length are checked: a damaged or truncated file is one `DataError` naming it.

Items are `{"x": (1, S, S) float32 in [-1, 1], "label": () int64}` as the digits' (`uvic.data.images`): pixel
`p / 127.5 - 1`; S = `data.image_size` is 28, or larger with the images centred on a black (-1) border (32 for
a patch grid that needs it).
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import numpy as np
import torch

from uvic.errors import DataError


DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
SIDE = 28
SPLITS = {"train": ("train", 60_000), "test": ("t10k", 10_000)}
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
# idx magic: two zero bytes, the element type (0x08 = unsigned byte) and the number of dimensions.
_MAGIC = {1: 0x00000801, 3: 0x00000803}


def read_idx(path: str | Path, ndim: int) -> np.ndarray:
    """The uint8 array of an idx file (LeCun's MNIST format; `.gz` is decompressed).

    Args:
        path: the file.
        ndim: 3 for images ((N, rows, cols)), 1 for labels ((N,)).
    Returns:
        The array, shaped as the header says.
    Raises:
        DataError: "<path> is not an idx<ndim> file (<why>)": a bad gzip stream, a wrong magic number, or fewer or
            more bytes than the header's dimensions need.
    """
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise DataError(f"{path} is not a readable idx{ndim} file ({type(e).__name__}: {e})") from None
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path} is not an idx{ndim} file ({len(raw)} bytes, shorter than its {header}-byte header)")
    magic = int.from_bytes(raw[:4], "big")
    if magic != _MAGIC[ndim]:
        raise DataError(f"{path} is not an idx{ndim} file (magic number 0x{magic:08x}, expected 0x{_MAGIC[ndim]:08x})")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    need = header + int(np.prod(dims))
    if len(raw) != need:
        raise DataError(f"{path} is not an idx{ndim} file of shape {tuple(dims)}: it has {len(raw)} bytes, the header "
                        f"needs {need} ({'truncated' if len(raw) < need else 'trailing bytes'})")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims).copy()


def _file(folder: Path, stem: str) -> Path | None:
    for name in (stem, stem + ".gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def find_files(root: str | Path | None, split: str) -> tuple[Path, Path]:
    """The (images, labels) idx files of `split` ("train" or "test"): in `root`, `root/FashionMNIST/raw`, then
    `DEBIAN_DIR`, the first folder that holds both.

    Raises:
        FileNotFoundError: no folder holds them; the message lists where it looked and how to get them.
    """
    if split not in SPLITS:
        raise ValueError(f"Fashion-MNIST split {split!r}: expected 'train' or 'test'")
    prefix, _ = SPLITS[split]
    stems = (f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte")
    folders = [Path(root), Path(root) / "FashionMNIST" / "raw"] if root else []
    for folder in [*folders, DEBIAN_DIR]:
        found = [_file(folder, s) for s in stems]
        if all(found):
            return found[0], found[1]
    raise FileNotFoundError(
        f"Fashion-MNIST {split} files ({stems[0]}[.gz], {stems[1]}[.gz]) not found in {', '.join(map(str, folders))}"
        f"{' or ' if folders else ''}{DEBIAN_DIR}: install the Debian package dataset-fashion-mnist, or set data.root "
        f"to a folder with the four idx files (torchvision.datasets.FashionMNIST(ROOT, download=True) writes them "
        f"to ROOT/FashionMNIST/raw)")


def load_fashion_mnist(root: str | Path | None, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    """The (N, 28, 28) uint8 images and (N,) int64 labels of a split (60,000 train, 10,000 test).

    Raises:
        FileNotFoundError: see `find_files`; DataError: a file that is not what its name says (named), or images
            and labels of different counts, or a label outside 0..9.
    """
    images_path, labels_path = find_files(root, split)
    images, labels = read_idx(images_path, 3), read_idx(labels_path, 1)
    if images.shape[1:] != (SIDE, SIDE):
        raise DataError(f"{images_path}: images are {images.shape[2]}x{images.shape[1]}, Fashion-MNIST's are 28x28")
    if len(images) != len(labels):
        raise DataError(f"{images_path} holds {len(images)} images but {labels_path} holds {len(labels)} labels")
    if len(labels) and int(labels.max()) >= len(CLASSES):
        raise DataError(f"{labels_path}: label {int(labels.max())} is not a Fashion-MNIST class (0..9)")
    return images, labels.astype(np.int64)


def to_model_range(images: np.ndarray, image_size: int = SIDE) -> torch.Tensor:
    """(N, 28, 28) uint8 -> (N, 1, S, S) float32 in [-1, 1] (`p / 127.5 - 1`, the digits' range), centred on a
    black (-1) border when S = `image_size` > 28.

    Raises:
        ValueError: `image_size` < 28, or a border that cannot be centred (odd S - 28).
    """
    pad = image_size - images.shape[-1]
    if pad < 0 or pad % 2:
        raise ValueError(f"data.image_size={image_size}: Fashion-MNIST images are 28x28; use 28, or a larger size "
                         f"with an even difference (32: a 2-pixel black border)")
    x = torch.from_numpy(np.ascontiguousarray(images)).float().div(127.5).sub(1.0).unsqueeze(1)
    if pad:
        x = torch.nn.functional.pad(x, (pad // 2,) * 4, value=-1.0)
    return x.contiguous()
