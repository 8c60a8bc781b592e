"""Seed-per-image sampling: grids and FID folders whose images do not depend on batch size or process count.

Image i is generated from `torch.Generator("cpu").manual_seed(seed + i)` (EDM2's one-generator-per-seed rule)
and, in folder mode, saved as `{i:06d}.png`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image

from uvic.pipelines.pipeline_uvic import UViCPipeline


logger = logging.getLogger(__name__)


def load_pipeline(source: str | Path, sampler: str | None = None) -> UViCPipeline:
    """A `UViCPipeline` from a pipeline dir (`model_index.json`), a training run dir or a checkpoint dir.

    From a run or checkpoint the EMA weights of the (latest) checkpoint are used. `sampler` switches the
    scheduler (see `uvic.schedulers.SAMPLERS`); None keeps the saved one.
    """
    source = Path(source)
    if (source / "model_index.json").is_file():
        pipe = UViCPipeline.from_pretrained(str(source))
    elif source.is_dir():
        from uvic.training.tasks import task_from_checkpoint

        task, model, _ = task_from_checkpoint(source)
        pipe = task.pipeline(model)
    else:
        raise FileNotFoundError(f"{source} is neither a pipeline dir (model_index.json) nor a run/checkpoint dir")
    if sampler is not None:
        from uvic.schedulers import convert_scheduler

        pipe.scheduler = convert_scheduler(pipe.scheduler, sampler)
    return pipe


def generate(
    pipe: UViCPipeline,
    seeds: list[int],
    batch_size: int,
    num_inference_steps: int,
    class_labels: list[int] | None = None,
) -> np.ndarray:
    """Images for `seeds`, (N, H, W, C) uint8, one generator per image."""
    return np.concatenate([imgs for _, imgs in _batches(pipe, seeds, batch_size, num_inference_steps, class_labels)])


def _batches(pipe, seeds, batch_size, steps, class_labels) -> Iterator[tuple[list[int], np.ndarray]]:
    for k in range(0, len(seeds), batch_size):
        chunk = seeds[k : k + batch_size]
        gens = [torch.Generator("cpu").manual_seed(s) for s in chunk]
        labels = None if class_labels is None else class_labels[k : k + batch_size]
        out = pipe(batch_size=len(chunk), num_inference_steps=steps, generator=gens, class_labels=labels,
                   output_type="np").images
        # The same uint8 rounding as torchvision.utils.save_image (U-ViT `sample2dir`).
        yield chunk, (out * 255 + 0.5).clip(0, 255).astype(np.uint8)


def save_grid(images: np.ndarray, path: str | Path, nrow: int | None = None, pad: int = 2, scale: int = 1) -> Path:
    """Tile (N, H, W, C) uint8 images into one PNG, `nrow` per row (default about sqrt(N)).

    `scale` > 1 enlarges every image by pixel repetition first (for tiny images such as 8x8 digits).
    """
    if scale > 1:
        images = images.repeat(scale, axis=1).repeat(scale, axis=2)
    n, h, w, c = images.shape
    nrow = nrow or int(np.ceil(np.sqrt(n)))
    rows = int(np.ceil(n / nrow))
    grid = np.full((rows * (h + pad) + pad, nrow * (w + pad) + pad, c), 255, dtype=np.uint8)
    for i, img in enumerate(images):
        r, col = divmod(i, nrow)
        grid[pad + r * (h + pad) : pad + r * (h + pad) + h, pad + col * (w + pad) : pad + col * (w + pad) + w] = img
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid[..., 0] if c == 1 else grid).save(path)
    return path


def sample_to_folder(
    pipe: UViCPipeline,
    out_dir: str | Path,
    num_images: int,
    seed: int,
    batch_size: int,
    num_inference_steps: int,
    process_index: int = 0,
    num_processes: int = 1,
) -> int:
    """Write images 0..num_images-1 as `{i:06d}.png` (seed `seed + i`); this process does i % P == rank.

    Files that already exist are skipped, and each file is written to a temporary name then renamed, so an
    interrupted run can simply be restarted. Returns the number of images this process wrote.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(process_index, num_images, num_processes) if not (out_dir / f"{i:06d}.png").exists()]
    labels = balanced_class_labels(pipe, todo)
    for chunk, images in _batches(pipe, [seed + i for i in todo], batch_size, num_inference_steps, labels):
        for s, img in zip(chunk, images):
            final = out_dir / f"{s - seed:06d}.png"
            tmp = out_dir / f".{final.name}.tmp{os.getpid()}"
            Image.fromarray(img[..., 0] if img.shape[-1] == 1 else img).save(tmp, format="PNG")
            os.replace(tmp, final)
    logger.info("process %d wrote %d images to %s", process_index, len(todo), out_dir)
    return len(todo)


def balanced_class_labels(pipe: UViCPipeline, indices: list[int] | range) -> list[int] | None:
    """Class i % num_classes for image i (a balanced set) for a class-conditional transformer, else None."""
    k = pipe.transformer.config.num_classes
    return [i % k for i in indices] if k is not None and k > 0 else None
