"""A tiny ImageNet-layout folder written by the tests (`train/<wnid>/<wnid>_<n>.JPEG`), shared by several folders."""

from pathlib import Path

import numpy as np
from PIL import Image


WNIDS = ["n01440764", "n01443537", "n02085620"]
# (W, H) per image: landscape, portrait, square, and sizes that need BOX halvings at 16 px.
SIZES = [(40, 24), (24, 40), (33, 33), (70, 35), (19, 30)]


def make_imagenet(root: Path, counts=(3, 2, 4), wnids=WNIDS, seed: int = 0) -> Path:
    """Write `counts[k]` random JPEGs for class `wnids[k]`; file numbers are unsorted so listing order matters."""
    rng = np.random.default_rng(seed)
    for k, (wnid, n) in enumerate(zip(wnids, counts)):
        folder = root / "train" / wnid
        folder.mkdir(parents=True, exist_ok=True)
        for j in range(n):
            w, h = SIZES[(k + j) % len(SIZES)]
            img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(img).save(folder / f"{wnid}_{(7 * j + 3) % 10}{j}.JPEG", quality=95)
    return root
