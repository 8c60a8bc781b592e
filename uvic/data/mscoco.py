"""MS-COCO 2014 text-to-image features: extraction (`python -m uvic.data.mscoco`) and the training dataset.

What is stored (U-ViT `scripts/extract_mscoco_feature.py`, docs/conventions.md, "MS-COCO text-to-image"):
* per image: the SD-VAE moments (8, 32, 32) float32 [mean(4), logvar(4)] of the central square crop, resized
  to 256 x 256 with Lanczos (crop first, then resize; no flip), pixels scaled to [-1, 1];
* per caption: CLIP ViT-L/14 `last_hidden_state` (77, 768) with the official EOT padding;
* once: `empty_context.npy`, the features of the empty caption "" (the CFG null condition).

Images are indexed 0..N-1 in sorted COCO image-id order and captions keep the annotation file's order per
image, as the official `MSCOCODatabase`.

Storage format (one folder per split, `OUT/{split}/`), chosen so that training reads with no decoding and no
per-file overhead (the official layout is one .npy per image and per caption, ~500k small files):

    meta.json            format/version, counts, shapes, dtypes, resolution, the models used
    images.json          [{"id": coco image id, "file_name": ...}, ...] in index order
    captions.json        all captions, flattened in index order
    caption_offsets.npy  (N + 1,) int64: the captions of image i are rows offsets[i]:offsets[i+1]
    moments.npy          (N, 8, 32, 32) float32, memory-mapped (np.load(mmap_mode="r"))
    contexts.npy         (M, 77, 768) float32 (or float16 with --context-dtype float16), memory-mapped
    done.npy             (N,) bool: image i (moments and all its captions) is written; extraction resumes here
    OUT/empty_context.npy (77, 768) float32

Sizes for train2014 (82,783 images, 414,113 captions): moments 2.7 GB, contexts 98 GB in float32 (49 GB in
float16); val2014 (40,504 images) about half of that.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from uvic.data.features import extraction_device, fill_pending, open_or_create_npy, pending


logger = logging.getLogger(__name__)

__all__ = [
    "center_crop_resize",
    "load_coco_captions",
    "extract_features",
    "MSCOCOFeatures",
    "load_empty_context",
    "main",
]

FORMAT = "uvic-mscoco-features"
VERSION = 1


# ---------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------


def center_crop_resize(image: Image.Image, resolution: int = 256) -> np.ndarray:
    """U-ViT `center_crop`: the central square of side min(H, W), then a Lanczos resize. Returns (R, R, 3) uint8."""
    arr = np.asarray(image.convert("RGB"))
    H, W = arr.shape[:2]
    c = min(H, W)
    crop = arr[(H - c) // 2 : (H + c) // 2, (W - c) // 2 : (W + c) // 2]
    return np.asarray(Image.fromarray(crop).resize((resolution, resolution), Image.LANCZOS))


def load_coco_captions(captions_json: str | os.PathLike) -> tuple[list[dict], list[list[str]]]:
    """Read a COCO captions file (e.g. captions_train2014.json).

    Returns:
        images: [{"id", "file_name"}] sorted by image id; captions: per image, in annotation-file order.
    """
    path = Path(captions_json)
    if not path.is_file():
        raise FileNotFoundError(f"COCO caption file not found: {path} (e.g. annotations/captions_train2014.json)")
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or "images" not in data or "annotations" not in data:
        raise ValueError(f"{path} is not a COCO captions file (needs 'images' and 'annotations')")
    images = sorted(({"id": im["id"], "file_name": im["file_name"]} for im in data["images"]), key=lambda d: d["id"])
    index = {im["id"]: i for i, im in enumerate(images)}
    captions: list[list[str]] = [[] for _ in images]
    for ann in data["annotations"]:
        if ann["image_id"] not in index:
            raise ValueError(f"{path}: annotation {ann.get('id')} refers to unknown image {ann['image_id']}")
        captions[index[ann["image_id"]]].append(ann["caption"])
    return images, captions


class _ImageFiles(Dataset):
    """(index, (3, R, R) float32 in [-1, 1]) for the images still to extract; decoded in DataLoader workers."""

    def __init__(self, root: Path, images: list[dict], indices: list[int], resolution: int) -> None:
        self.root, self.images, self.indices, self.resolution = root, images, indices, resolution

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        idx = self.indices[i]
        path = self.root / self.images[idx]["file_name"]
        if not path.is_file():
            raise FileNotFoundError(f"image {path} listed in the caption file is missing")
        with Image.open(path) as im:
            arr = center_crop_resize(im, self.resolution)
        x = torch.from_numpy(arr.copy()).permute(2, 0, 1).float() / 127.5 - 1.0
        return idx, x


# ---------------------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------------------


@torch.no_grad()
def extract_features(
    images_dir: str | os.PathLike,
    captions_json: str | os.PathLike,
    out_dir: str | os.PathLike,
    split: str,
    vae: torch.nn.Module,
    text_encoder: torch.nn.Module,
    resolution: int = 256,
    batch_size: int = 32,
    text_batch_size: int = 256,
    num_workers: int = 4,
    context_dtype: str = "float32",
    device: str | torch.device | None = None,
    max_images: int | None = None,
    models_info: dict | None = None,
) -> Path:
    """Write VAE moments and CLIP features of one COCO split to `out_dir/split` (format: module docstring).

    Resumable: images already marked in `done.npy` are skipped, so re-running after an interruption finishes
    the job. `out_dir/empty_context.npy` is written once.

    Args:
        images_dir: folder of the split's images (e.g. coco/train2014).
        captions_json: the split's caption file.
        vae: diffusers `AutoencoderKL` (moments = `encode(x).latent_dist.parameters`).
        text_encoder: `uvic.models.text_encoder.CLIPTextEncoder` (or anything with `encode_text(list[str])`).
        resolution: side of the crop-and-resize (256 for the official 32 x 32 latents).
        batch_size: images per VAE batch; text_batch_size: captions per text-encoder batch.
        context_dtype: "float32" (official) or "float16" (half the disk).
        device: where the models run (default: CUDA when available, else CPU).
        max_images: only the first `max_images` images (sorted id order), e.g. for a quick try.
        models_info: free-form description of the models, stored in meta.json.
    Returns:
        The split folder.
    """
    from uvic.models.autoencoder import encode_moments

    images_dir, out_dir = Path(images_dir), Path(out_dir)
    if not images_dir.is_dir():
        raise FileNotFoundError(f"image folder not found: {images_dir} (e.g. coco/train2014)")
    if context_dtype not in ("float32", "float16"):
        raise ValueError(f"context_dtype must be 'float32' or 'float16', got {context_dtype!r}")
    device = extraction_device(device)
    vae.to(device).eval()
    text_encoder.to(device).eval()

    images, captions = load_coco_captions(captions_json)
    if max_images is not None:
        images, captions = images[:max_images], captions[:max_images]
    counts = np.array([len(c) for c in captions], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    flat_captions = [c for cs in captions for c in cs]
    n_img, n_cap = len(images), len(flat_captions)

    # Shapes from the models themselves (one probe each), so tiny test models work unchanged.
    probe = encode_moments(vae, torch.zeros(1, 3, resolution, resolution, device=device))
    moments_shape = tuple(probe.shape[1:])
    empty = text_encoder.encode_text([""]).float().cpu()
    context_shape = tuple(empty.shape[1:])

    split_dir = out_dir / split
    split_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "split": split,
        "num_images": n_img,
        "num_captions": n_cap,
        "resolution": resolution,
        "moments_shape": list(moments_shape),
        "context_shape": list(context_shape),
        "context_dtype": context_dtype,
        "preprocessing": "center square crop, Lanczos resize, x / 127.5 - 1 (U-ViT MSCOCODatabase)",
        "models": models_info or {},
    }
    meta_path = split_dir / "meta.json"
    fresh = not meta_path.is_file()
    if not fresh:
        old = json.loads(meta_path.read_text())
        keys = ("format", "version", "num_images", "num_captions", "resolution", "moments_shape", "context_shape",
                "context_dtype")
        if any(old.get(k) != meta[k] for k in keys):
            raise ValueError(f"{split_dir} holds features of a different extraction ({meta_path}); use a new output dir")
        old_captions = json.loads((split_dir / "captions.json").read_text())
        if old_captions != flat_captions:
            raise ValueError(f"{split_dir} was extracted from different captions; use a new output dir")
    else:
        (split_dir / "images.json").write_text(json.dumps(images))
        (split_dir / "captions.json").write_text(json.dumps(flat_captions))
        np.save(split_dir / "caption_offsets.npy", offsets)
    np.save(out_dir / "empty_context.npy", empty[0].numpy())

    moments = open_or_create_npy(split_dir / "moments.npy", (n_img, *moments_shape), "float32", fresh)
    contexts = open_or_create_npy(split_dir / "contexts.npy", (max(n_cap, 1), *context_shape), context_dtype, fresh)
    done = open_or_create_npy(split_dir / "done.npy", (n_img,), "bool", fresh)
    if fresh:
        done[:] = False
        done.flush()
        meta_path.write_text(json.dumps(meta, indent=2))
    todo = pending(done)
    if not todo:
        logger.info("%s: all %d images already extracted", split_dir, n_img)
        return split_dir
    logger.info("%s: extracting %d of %d images (%d captions) on %s", split_dir, len(todo), n_img, n_cap, device)

    loader = DataLoader(
        _ImageFiles(images_dir, images, todo, resolution),
        batch_size=batch_size,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
    )

    def write(idx: np.ndarray, x: torch.Tensor) -> None:
        moments[idx] = encode_moments(vae, x.to(device)).cpu().numpy()
        rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in idx])
        for start in range(0, len(rows), text_batch_size):
            chunk = rows[start : start + text_batch_size]
            feats = text_encoder.encode_text([flat_captions[r] for r in chunk])
            contexts[chunk] = feats.float().cpu().numpy().astype(context_dtype)

    with tqdm(total=n_img, initial=n_img - len(todo), desc=f"mscoco {split}", unit="img") as bar:
        fill_pending(loader, write, [moments, contexts], done, bar.update)
    return split_dir


# ---------------------------------------------------------------------------------------------------------
# Training / sampling dataset
# ---------------------------------------------------------------------------------------------------------


def load_empty_context(root: str | os.PathLike) -> torch.Tensor:
    """(L, D) float32 features of the empty caption, `root/empty_context.npy`."""
    path = Path(root) / "empty_context.npy"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `python -m uvic.data.mscoco` to extract the features first")
    return torch.from_numpy(np.load(path)).float()


class MSCOCOFeatures(Dataset):
    """Extracted MS-COCO features of one split, for training and for drawing FID captions.

    Item r is caption row r with its image: `{"x": (8, 32, 32) float32 VAE moments, "context": (77, 768) float32
    CLIP features}`. The official `MSCOCOFeatureDataset` draws an image and then one of its captions with an
    unseeded RNG; indexing (image, caption) pairs instead keeps every draw in the training sampler, so runs
    resume exactly. The two differ only for the ~0.2% of COCO images with more than 5 captions, which are drawn
    slightly more often. Latents are drawn from the moments at training time (`uvic.models.autoencoder.
    sample_latents`) and the CFG context dropout is applied by the loss
    (`uvic.training.losses.text_to_image_loss`).

    Args:
        root: the extraction output folder (holding `{split}/` and `empty_context.npy`).
        split: "train" or "val" (whatever name the extraction used).
    """

    def __init__(self, root: str | os.PathLike, split: str = "train") -> None:
        self.root, self.split = Path(root), split
        self.dir = self.root / split
        meta_path = self.dir / "meta.json"
        if not meta_path.is_file():
            raise FileNotFoundError(
                f"no extracted MS-COCO features in {self.dir}: run `python -m uvic.data.mscoco --split {split} ...` first"
            )
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{meta_path} is not a {FORMAT} folder")
        done = np.load(self.dir / "done.npy")
        if not done.all():
            raise ValueError(
                f"{self.dir} is incomplete ({int(done.sum())} of {done.size} images extracted): rerun the same "
                "`python -m uvic.data.mscoco` command to finish it"
            )
        self.offsets = np.load(self.dir / "caption_offsets.npy")
        counts = np.diff(self.offsets)
        self.caption_image = np.repeat(np.arange(counts.size), counts)  # (M,) image index of each caption row
        self.images_with_captions = np.flatnonzero(counts > 0)
        self._moments: np.ndarray | None = None
        self._contexts: np.ndarray | None = None

    # Memory maps are opened lazily so that each DataLoader worker opens its own.
    @property
    def moments(self) -> np.ndarray:
        if self._moments is None:
            self._moments = np.load(self.dir / "moments.npy", mmap_mode="r")
        return self._moments

    @property
    def contexts(self) -> np.ndarray:
        if self._contexts is None:
            self._contexts = np.load(self.dir / "contexts.npy", mmap_mode="r")
        return self._contexts

    @property
    def captions(self) -> list[str]:
        return json.loads((self.dir / "captions.json").read_text())

    @property
    def empty_context(self) -> torch.Tensor:
        return load_empty_context(self.root)

    def __len__(self) -> int:
        return len(self.caption_image)

    def __getitem__(self, row: int) -> dict[str, torch.Tensor]:
        img = int(self.caption_image[row])
        return {
            "x": torch.from_numpy(np.array(self.moments[img])),
            "context": torch.from_numpy(np.array(self.contexts[row], dtype=np.float32)),
        }

    def draw_caption_rows(self, num: int, seed: int) -> np.ndarray:
        """`num` caption rows for sampling (FID): a random image, then one of its captions, as the official eval."""
        rng = np.random.default_rng(seed)
        imgs = self.images_with_captions[rng.integers(0, len(self.images_with_captions), size=num)]
        counts = self.offsets[imgs + 1] - self.offsets[imgs]
        return self.offsets[imgs] + (rng.random(num) * counts).astype(np.int64)

    def context(self, rows: np.ndarray | list[int]) -> torch.Tensor:
        """(len(rows), 77, 768) float32 features of the given caption rows."""
        return torch.from_numpy(np.asarray(self.contexts[np.asarray(rows)], dtype=np.float32))


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """CLI: extract one split. Run it once for train2014 and once for val2014."""
    from uvic.models.autoencoder import UVIT_VAE_SCALE, VAE_SPEC, load_vae
    from uvic.models.text_encoder import CLIPTextEncoder

    p = argparse.ArgumentParser(
        prog="python -m uvic.data.mscoco",
        description="Extract SD-VAE moments and CLIP ViT-L/14 text features of MS-COCO 2014 (resumable).",
    )
    p.add_argument("--images", required=True, help="image folder of the split, e.g. coco/train2014")
    p.add_argument("--captions", required=True, help="caption file, e.g. coco/annotations/captions_train2014.json")
    p.add_argument("--out", required=True, help="output root; the split goes to OUT/SPLIT")
    p.add_argument("--split", required=True, help="split name, e.g. train or val")
    p.add_argument("--vae", required=True, help=VAE_SPEC)
    p.add_argument("--clip", default="openai", help="open_clip ViT-L-14 tag, checkpoint file, or a CLIPTextEncoder dir")
    p.add_argument("--clip-cache-dir", default=None, help="open_clip / Hugging Face cache directory")
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--text-batch-size", type=int, default=256)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--context-dtype", choices=("float32", "float16"), default="float32")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--max-images", type=int, default=None, help="only the first N images (a quick try)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    vae = load_vae(args.vae, UVIT_VAE_SCALE)
    text_encoder = CLIPTextEncoder.from_spec(args.clip, cache_dir=args.clip_cache_dir)
    split_dir = extract_features(
        args.images,
        args.captions,
        args.out,
        args.split,
        vae,
        text_encoder,
        resolution=args.resolution,
        batch_size=args.batch_size,
        text_batch_size=args.text_batch_size,
        num_workers=args.num_workers,
        context_dtype=args.context_dtype,
        device=args.device,
        max_images=args.max_images,
        models_info={"vae": args.vae, "clip": args.clip},
    )
    print(f"features written to {split_dir}")


if __name__ == "__main__":
    main()
