"""Training randomness that does not depend on the number of processes.

Every process draws the random numbers of the whole global batch from one generator seeded identically on all
ranks, then keeps its own rows. Rank r of P with local batch B gets rows [r B, (r + 1) B), the rows its data
shard holds (see `uvic.training.data.ShardedBatchSampler`), so a P-process run sees the same noise for the same
image as a 1-process run with the same global batch. The generator state is checkpointed, so resuming continues
the same stream.
"""

from __future__ import annotations

import torch


class ShardedRNG:
    """A seeded generator whose draws are sliced per process.

    Args:
        seed: the same on every process.
        process_index, num_processes: this rank and the world size.
        device: where the numbers are drawn (a generator on that device).
    """

    def __init__(self, seed: int, process_index: int, num_processes: int, device: torch.device | str) -> None:
        self.rank, self.world = process_index, num_processes
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def _draw(self, fn, shape: tuple[int, ...], **kwargs) -> torch.Tensor:
        b = shape[0]
        full = fn((b * self.world, *shape[1:]), generator=self.generator, device=self.device, **kwargs)
        return full[self.rank * b : (self.rank + 1) * b]

    def rand(self, *shape: int) -> torch.Tensor:
        """U(0, 1) of shape (B, ...) for this process's B rows."""
        return self._draw(torch.rand, shape)

    def randn(self, *shape: int) -> torch.Tensor:
        """N(0, 1) of shape (B, ...) for this process's B rows."""
        return self._draw(torch.randn, shape)

    def randint(self, high: int, *shape: int) -> torch.Tensor:
        """Integers in [0, high) of shape (B, ...) for this process's B rows."""
        b = shape[0]
        full = torch.randint(high, (b * self.world, *shape[1:]), generator=self.generator, device=self.device)
        return full[self.rank * b : (self.rank + 1) * b]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])
