"""ImageNet (ILSVRC-2012) for class-conditional diffusion: the image folder, U-ViT's preprocessing, SD-VAE features.

Reading (U-ViT `datasets.ImageNet`): every image under `ROOT/train/` (any depth, suffixes .jpg/.jpeg/.png/.gif in
any case), listed in sorted order level by level; the class of a file is the wnid prefix of its *file name*
(`n01440764_10026.JPEG` -> `n01440764`), and the sorted wnids are numbered 0..K-1. A folder whose class count is
not the expected one (1000) is an error that names what is missing or extra.

Preprocessing (`center_crop_arr`, U-ViT's copy of guided-diffusion's): halve the image with a BOX filter while its
short side is at least twice the target, resize with BICUBIC so that the short side is the target (sizes rounded),
then take the central square; pixels to [-1, 1]. The 64 x 64 pixel models train on that with a random horizontal
flip; the 256 / 512 latent models train on SD-VAE moments of it (`python -m uvic.data.imagenet`).

Features (U-ViT `scripts/extract_imagenet_feature.py` stores `(moments, label)` per item as a pickle, 2 x 1,281,167
files, each image once as is and once flipped; here the same numbers in data-only files, `OUT/`):

    meta.json    format/version, counts, resolution, moments shape, the models used
    classes.json the sorted wnids (class id = position)
    files.json   the image paths relative to ROOT/train, in index order
    labels.npy   (N,) int64 class ids
    moments.npy  (N, 2, 2C, h, w) float32 [mean(C), logvar(C)] of image i as is ([:, 0]) and flipped ([:, 1]),
                 memory-mapped
    done.npy     (N,) bool: image i is written; extraction resumes from here

Extraction is resumable (rerun the same command) and can be split across processes (`accelerate launch -m
uvic.data.imagenet ...`): process p encodes the unfinished images i with i % P == p, all writing into the same
memory-mapped files on one machine. Sizes for the 1,281,167 training images: 84 GB at 256 (moments 2 x 8 x 32 x 32)
and 336 GB at 512. The latents are drawn from the moments at training time with the scale of U-ViT's ImageNet
autoencoder, `LATENT_SCALE` = 0.18215 (its `get_model` default; MS-COCO uses 0.23010).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from uvic.data.features import extraction_device, fill_pending, open_or_create_npy, pending
from uvic.errors import DataError
from uvic.io import atomic_write


logger = logging.getLogger(__name__)

__all__ = [
    "LATENT_SCALE",
    "NUM_CLASSES",
    "ImageNet",
    "ImageNetFeatures",
    "center_crop_arr",
    "extract_features",
    "list_imagenet",
    "main",
]

FORMAT = "uvic-imagenet-features"
VERSION = 1
NUM_CLASSES = 1000  # ILSVRC-2012 classes
NUM_TRAIN_IMAGES = 1_281_167
# U-ViT libs/autoencoder.get_model's default scale_factor, which its ImageNet 256 / 512 configs use.
LATENT_SCALE = 0.18215
_SUFFIXES = ("jpg", "jpeg", "png", "gif")


# ---------------------------------------------------------------------------------------------------------
# The folder and the preprocessing
# ---------------------------------------------------------------------------------------------------------


def _list_images(folder: Path) -> list[Path]:
    """Image files under `folder`, sorted level by level as U-ViT's `_list_image_files_recursively`."""
    out: list[Path] = []
    for entry in sorted(os.listdir(folder)):
        path = folder / entry
        if path.is_dir():
            out.extend(_list_images(path))
        elif "." in entry and entry.rsplit(".", 1)[-1].lower() in _SUFFIXES:
            out.append(path)
    return out


def list_imagenet(root: str | os.PathLike, num_classes: int = NUM_CLASSES) -> tuple[list[Path], np.ndarray, list[str]]:
    """The training images of an ImageNet folder with U-ViT's labels.

    Args:
        root: the folder holding `train/<wnid>/*.JPEG`.
        num_classes: how many classes the folder must have (1000 for ImageNet; tests use a few).
    Returns:
        (files (N,) in index order, labels (N,) int64, wnids (K,) sorted; class id = position in wnids).
    Raises:
        FileNotFoundError: no `root/train` folder.
        DataError: no images, or a class count other than `num_classes` (naming the empty and the unexpected classes).
    """
    train = Path(root) / "train"
    if not train.is_dir():
        raise FileNotFoundError(f"ImageNet folder {root} has no train/ subfolder (expected {train}/<wnid>/*.JPEG)")
    files = _list_images(train)
    if not files:
        raise DataError(f"no images (.jpg/.jpeg/.png/.gif) under {train}")
    names = [f.name.split("_")[0] for f in files]
    wnids = sorted(set(names))
    if len(wnids) != num_classes:
        folders = {p.name for p in train.iterdir() if p.is_dir()}
        empty = sorted(folders - set(wnids))
        extra = sorted(set(wnids) - folders)
        detail = "".join([f"; class folders without images: {empty[:5]}" if empty else "",
                          f"; file-name classes without a folder: {extra[:5]}" if extra else ""])
        raise DataError(f"{train} holds {len(wnids)} classes (wnid file-name prefixes), expected {num_classes}{detail}")
    index = {w: i for i, w in enumerate(wnids)}
    return files, np.array([index[n] for n in names], dtype=np.int64), wnids


def center_crop_arr(image: Image.Image, image_size: int) -> np.ndarray:
    """U-ViT / guided-diffusion `center_crop_arr`: BOX halvings, BICUBIC resize of the short side, central crop.

    Returns:
        (image_size, image_size, 3) uint8.
    """
    image = image.convert("RGB")
    # Halving with BOX first while the image is at least twice the target (better downsampling than one resize).
    while min(*image.size) >= 2 * image_size:
        image = image.resize(tuple(x // 2 for x in image.size), resample=Image.BOX)
    scale = image_size / min(*image.size)
    image = image.resize(tuple(round(x * scale) for x in image.size), resample=Image.BICUBIC)
    arr = np.asarray(image)
    y, x = (arr.shape[0] - image_size) // 2, (arr.shape[1] - image_size) // 2
    return arr[y : y + image_size, x : x + image_size]


def _load(path: Path, resolution: int) -> torch.Tensor:
    """(3, R, R) float32 in [-1, 1] of one image file, preprocessed; a broken file is named in the error."""
    try:
        with Image.open(path) as im:
            im.load()
            arr = center_crop_arr(im, resolution)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read image {path}: {e}") from e
    return torch.from_numpy(np.array(arr)).permute(2, 0, 1).float() / 127.5 - 1.0


class ImageNet(Dataset):
    """The ImageNet training images, preprocessed at `resolution` (the ImageNet 64 pixel models).

    Items are `{"x": (3, R, R) float32 in [-1, 1], "label": () int64}`; no flip here (the training task draws
    it from the run's generator, as for CIFAR-10).

    Args:
        root: the folder holding `train/`.
        resolution: R (64 for U-ViT's ImageNet 64 configs).
        num_classes: the class count the folder must have.
    """

    def __init__(self, root: str | os.PathLike, resolution: int = 64, num_classes: int = NUM_CLASSES) -> None:
        self.root, self.resolution = Path(root), resolution
        self.files, self.labels, self.wnids = list_imagenet(root, num_classes)
        if len(self.files) != NUM_TRAIN_IMAGES:
            logger.info("%s: %d training images (ILSVRC-2012 has %d)", root, len(self.files), NUM_TRAIN_IMAGES)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": _load(self.files[i], self.resolution), "label": torch.tensor(int(self.labels[i]))}

    def class_counts(self) -> np.ndarray:
        """(K,) int64 images per class (U-ViT's `sample_label` draws FID labels in these proportions)."""
        return np.bincount(self.labels, minlength=len(self.wnids)).astype(np.int64)


# ---------------------------------------------------------------------------------------------------------
# Feature extraction
# ---------------------------------------------------------------------------------------------------------


class _Todo(Dataset):
    def __init__(self, files: list[Path], indices: list[int], resolution: int) -> None:
        self.files, self.indices, self.resolution = files, indices, resolution

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k: int) -> tuple[int, torch.Tensor]:
        i = self.indices[k]
        return i, _load(self.files[i], self.resolution)


def _prepare_output(out_dir: Path, meta: dict, files: list[str], labels: np.ndarray, wnids: list[str],
                    moments_shape: tuple[int, ...]) -> None:
    """Create the output files, or check that an existing output is the same extraction (main process)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta_path = out_dir / "meta.json"
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        keys = ("format", "version", "num_images", "num_classes", "resolution", "moments_shape")
        if any(old.get(k) != meta[k] for k in keys) or json.loads((out_dir / "files.json").read_text()) != files:
            raise DataError(f"{out_dir} holds features of a different extraction ({meta_path}); use a new output dir")
        return
    n = len(files)
    (out_dir / "classes.json").write_text(json.dumps(wnids))
    (out_dir / "files.json").write_text(json.dumps(files))
    np.save(out_dir / "labels.npy", labels)
    open_or_create_npy(out_dir / "moments.npy", (n, 2, *moments_shape), "float32", fresh=True).flush()
    done = open_or_create_npy(out_dir / "done.npy", (n,), "bool", fresh=True)
    done[:] = False
    done.flush()
    # meta.json last: its presence means the folder is complete and ready to be filled.
    with atomic_write(meta_path, "w") as f:
        f.write(json.dumps(meta, indent=2))


@torch.no_grad()
def extract_features(
    root: str | os.PathLike,
    out_dir: str | os.PathLike,
    vae: torch.nn.Module,
    resolution: int = 256,
    num_classes: int = NUM_CLASSES,
    batch_size: int = 64,
    num_workers: int = 4,
    device: str | torch.device | None = None,
    process_index: int = 0,
    num_processes: int = 1,
    wait_for_everyone: Callable[[], None] = lambda: None,
    models_info: dict | None = None,
) -> Path:
    """Write SD-VAE moments of every training image, as is and flipped, to `out_dir` (format: module docstring).

    Resumable: images marked in `done.npy` are skipped. Process `process_index` of `num_processes` encodes the
    unfinished images i with i % num_processes == process_index; the main process creates the files first and
    `wait_for_everyone` (e.g. `Accelerator.wait_for_everyone`) holds the others until it has.

    Args:
        root: the ImageNet folder (holding `train/`).
        out_dir: the features folder.
        vae: diffusers `AutoencoderKL` (moments = `encode(x).latent_dist.parameters`).
        resolution: crop-and-resize side (256 or 512).
        num_classes: the class count the folder must have.
        batch_size: images per VAE batch (each batch is encoded as is and flipped together).
        device: where the VAE runs (default: CUDA when available, else CPU).
    Returns:
        `out_dir`.
    """
    from uvic.models.autoencoder import encode_moments

    out_dir = Path(out_dir)
    files, labels, wnids = list_imagenet(root, num_classes)
    train = Path(root) / "train"
    rel = [str(f.relative_to(train)) for f in files]
    device = extraction_device(device)
    vae.to(device).eval()
    # The moments' shape from the model itself (one probe), so tiny test models work unchanged.
    moments_shape = tuple(encode_moments(vae, torch.zeros(1, 3, resolution, resolution, device=device)).shape[1:])
    meta = {
        "format": FORMAT, "version": VERSION, "num_images": len(files), "num_classes": len(wnids),
        "resolution": resolution, "moments_shape": list(moments_shape),
        "preprocessing": "center_crop_arr (BOX halvings, BICUBIC short side, central crop), x / 127.5 - 1; "
                         "moments[:, 0] as is, moments[:, 1] flipped left-right (U-ViT extract_imagenet_feature.py)",
        "models": models_info or {},
    }
    if process_index == 0:
        _prepare_output(out_dir, meta, rel, labels, wnids, moments_shape)
    wait_for_everyone()

    moments = np.load(out_dir / "moments.npy", mmap_mode="r+")
    done = np.load(out_dir / "done.npy", mmap_mode="r+")
    todo = pending(done, process_index, num_processes)
    logger.info("%s: process %d extracts %d of %d images on %s", out_dir, process_index, len(todo), len(files), device)
    loader = DataLoader(_Todo(files, todo, resolution), batch_size=batch_size, num_workers=num_workers,
                        pin_memory=device.type == "cuda")

    def write(idx: np.ndarray, x: torch.Tensor) -> None:
        x = x.to(device)
        both = encode_moments(vae, torch.cat([x, x.flip(-1)])).cpu().numpy()  # (2B, 2C, h, w)
        moments[idx] = np.stack([both[: len(idx)], both[len(idx) :]], axis=1)

    batches = tqdm(loader, desc=f"imagenet{resolution} [{process_index}]", disable=process_index != 0)
    fill_pending(batches, write, [moments], done)
    return out_dir


class ImageNetFeatures(Dataset):
    """Extracted ImageNet features for training the latent models: 2N items (each image as is and flipped).

    Item j is image j % N, flipped when j >= N: `{"x": (2C, h, w) float32 moments, "label": () int64}`. The
    latent is drawn from the moments by the loss (`uvic.models.autoencoder.sample_latents`).

    Args:
        root: the extraction output folder.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        meta_path = self.root / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"no extracted ImageNet features in {root}: run `python -m uvic.data.imagenet` first")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT:
            raise DataError(f"{meta_path} is not a {FORMAT} folder")
        done = np.load(self.root / "done.npy")
        if not done.all():
            raise DataError(f"{root} is incomplete ({int(done.sum())} of {done.size} images extracted): rerun the "
                            "same `python -m uvic.data.imagenet` command to finish it")
        self.labels = np.load(self.root / "labels.npy")
        self.num_classes = int(self.meta["num_classes"])
        self._moments: np.ndarray | None = None

    @property
    def moments(self) -> np.ndarray:
        """(N, 2, 2C, h, w), opened lazily so that each DataLoader worker maps its own."""
        if self._moments is None:
            self._moments = np.load(self.root / "moments.npy", mmap_mode="r")
        return self._moments

    def __len__(self) -> int:
        return 2 * len(self.labels)

    def __getitem__(self, j: int) -> dict[str, torch.Tensor]:
        flip, i = divmod(j, len(self.labels))
        return {"x": torch.from_numpy(np.array(self.moments[i, flip])), "label": torch.tensor(int(self.labels[i]))}


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """CLI: extract the training set's VAE moments (run under `accelerate launch` to use several GPUs)."""
    from accelerate import Accelerator

    from uvic.errors import cli_errors
    from uvic.models.autoencoder import VAE_SPEC, load_vae

    p = argparse.ArgumentParser(
        prog="python -m uvic.data.imagenet",
        description="Extract SD-VAE moments of ImageNet train images, as is and flipped (resumable, multi-process).",
    )
    p.add_argument("--root", required=True, help="ImageNet folder holding train/<wnid>/*.JPEG")
    p.add_argument("--out", required=True, help="output folder, e.g. data/imagenet256_features")
    p.add_argument("--vae", required=True, help=VAE_SPEC)
    p.add_argument("--resolution", type=int, choices=(256, 512), default=256)
    p.add_argument("--num-classes", type=int, default=NUM_CLASSES)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=8)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    state = Accelerator()
    with cli_errors():
        vae = load_vae(args.vae, LATENT_SCALE)
        out = extract_features(args.root, args.out, vae, resolution=args.resolution, num_classes=args.num_classes,
                               batch_size=args.batch_size, num_workers=args.num_workers, device=state.device,
                               process_index=state.process_index, num_processes=state.num_processes,
                               wait_for_everyone=state.wait_for_everyone, models_info={"vae": args.vae})
    state.wait_for_everyone()
    if state.is_main_process:
        print(f"features written to {out}")


if __name__ == "__main__":
    main()
