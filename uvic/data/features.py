"""The resumable feature extraction that the ImageNet and MS-COCO extractors share: the device to encode on, the
memory-mapped output arrays, and the loop that fills them batch by batch and marks each batch done only once its
data is on disk, so that a re-run after an interruption encodes exactly the items not yet marked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch


def extraction_device(device: str | torch.device | None) -> torch.device:
    """`device`, or by default CUDA when available, else the CPU."""
    return torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))


def open_or_create_npy(path: Path, shape: tuple[int, ...], dtype: str, fresh: bool) -> np.memmap:
    """A writable memory-mapped .npy of `shape` / `dtype`: created when `fresh` or missing, else reopened and checked."""
    if fresh or not path.is_file():
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape)
    arr = np.load(path, mmap_mode="r+")
    if arr.shape != shape or arr.dtype != np.dtype(dtype):
        raise ValueError(f"{path} has shape {arr.shape} {arr.dtype}, expected {shape} {dtype}; use a new output dir")
    return arr


def pending(done: np.ndarray, process_index: int = 0, num_processes: int = 1) -> list[int]:
    """The items (N,) `done` does not mark, those i with i % num_processes == process_index, in order."""
    return [i for i in np.flatnonzero(~np.asarray(done)).tolist() if i % num_processes == process_index]


def fill_pending(
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    write: Callable[[np.ndarray, torch.Tensor], None],
    outputs: Sequence[np.memmap],
    done: np.memmap,
    progress: Callable[[int], object] = lambda n: None,
) -> None:
    """For each batch (idx (B,) int64, x) of pending items: `write(idx, x)` fills the rows idx of `outputs`, which
    are flushed; only then are the items marked in `done` (N,) bool and that flushed, so an interruption never
    leaves an item marked but unwritten. `progress(B)` is called after each batch."""
    for idx, x in batches:
        idx = idx.numpy()
        write(idx, x)
        for array in outputs:
            array.flush()
        done[idx] = True
        done.flush()
        progress(len(idx))
