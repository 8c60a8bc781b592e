"""Data loading for training: a sharded, epoch-seeded batch sampler that resumes exactly.

We do not hand the DataLoader to `accelerator.prepare`: accelerate's sharding re-seeds and re-counts epochs
on its own, and its scheduler/epoch counters would have to be restored separately. Here the order of epoch e is
`randperm(N, seed + e)` on every process, global batch b is `perm[b G : (b + 1) G]` with G = B x P, and process r
takes the slice [r B, (r + 1) B). Resuming at micro-batch k of epoch e is just `start_batch=k`.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class ShardedBatchSampler(Sampler[list[int]]):
    """Yields this process's index lists, one per global batch, dropping the last incomplete global batch.

    Args:
        num_items: dataset length N.
        batch_size: per-process batch B.
        seed: shuffling seed, the same on every process.
        process_index, num_processes: r and P.
    """

    def __init__(self, num_items: int, batch_size: int, seed: int, process_index: int = 0, num_processes: int = 1):
        if num_items < batch_size * num_processes:
            raise ValueError(
                f"the dataset has {num_items} items, fewer than one global batch of "
                f"{batch_size} x {num_processes} processes"
            )
        self.n, self.b, self.seed = num_items, batch_size, seed
        self.rank, self.world = process_index, num_processes
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select epoch `epoch` and skip its first `start_batch` batches (for resuming)."""
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        return self.n // (self.b * self.world) - self.start_batch

    def __iter__(self) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        glob = self.b * self.world
        for k in range(self.start_batch, self.n // glob):
            start = k * glob + self.rank * self.b
            yield perm[start : start + self.b]

    @property
    def batches_per_epoch(self) -> int:
        return self.n // (self.b * self.world)


def build_loader(dataset: Dataset, batch_sampler: ShardedBatchSampler, num_workers: int) -> DataLoader:
    """A DataLoader over `batch_sampler` (items must be dicts of tensors, collated by the default collate)."""
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=False,
    )
