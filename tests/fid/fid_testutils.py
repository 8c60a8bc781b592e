"""Helpers shared by the FID tests (a uniquely named module: several test folders have a conftest.py)."""

import numpy as np
import torch
from PIL import Image


def smooth_images(n, size=16, seed=0):
    """(n, size, size, 3) uint8 smooth random images (low-frequency, so resizing conventions matter)."""
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, size=(n, 3, 4, 4)).astype(np.float32)
    up = torch.nn.functional.interpolate(torch.from_numpy(coarse), size=(size, size), mode="bicubic",
                                         align_corners=False)
    noise = torch.from_numpy(rng.normal(0, 8, size=up.shape).astype(np.float32))
    return (up + noise).clamp(0, 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def write_pngs(folder, images, digits=0):
    """Save (n, H, W, 3) uint8 images as `{i}.png` in `folder` (zero-padded to `digits`); returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(images):
        Image.fromarray(im).save(folder / f"{i:0{digits}d}.png")
    return folder
