"""Exponential moving average of model weights (U-ViT `ema_update`): constant decay, from an exact copy."""

from __future__ import annotations

import copy

import torch
from torch import nn


class EMA:
    """EMA weights `ema <- decay * ema + (1 - decay) * param` after every optimizer step; buffers are copied.

    Unlike diffusers' `EMAModel` there is no warm-up of the decay (the official recipe uses 0.9999 from step 1).

    Args:
        model: the (unwrapped) model; the EMA starts as an exact copy of it.
        decay: constant decay rate.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
        self.decay = decay
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """One EMA step towards `model` (unwrapped, same architecture)."""
        ema_params = list(self.model.parameters())
        params = [p.detach().to(e.dtype) for p, e in zip(model.parameters(), ema_params)]
        torch._foreach_lerp_(ema_params, params, 1.0 - self.decay)
        for e, b in zip(self.model.buffers(), model.buffers()):
            e.copy_(b)

    def to(self, device: torch.device | str) -> "EMA":
        self.model.to(device)
        return self
