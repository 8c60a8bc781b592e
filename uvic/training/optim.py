"""Optimizer parameter groups, chosen by each task (`Task.param_groups`) and used by the one training loop."""

from __future__ import annotations

from typing import Any

from torch import nn


def decay_all(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """One group: weight decay on every trainable parameter (U-ViT's recipe: pos_embed, norms and biases too,
    although its `no_weight_decay()` names pos_embed; nothing in its training code uses that list)."""
    return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]


def decay_matrices(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: decay on parameters with 2 or more dims (weight matrices, embeddings), none on 1-D ones
    (norm gains, biases), the usual LM recipe (nanoGPT's `configure_optimizers`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
