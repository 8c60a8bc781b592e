"""What the attention does: the share of negative attention weight per block of a model, on one forward pass.

Cog attention's weights `sign(p) * softmax(|p|)` (paper Eq. 3) can be negative; softmax's never are. The paper keeps
softmax in the last layer because the signs of that layer's weights come out nearly all one sign. This probe
measures it: for every attention call a model makes inside `probe_attention`, the weights are recomputed by the
reference formula (`uvic.attention.attention_weights`, in float64, with the call's own masks, scale, window and
softcap), and for each query row i of each head and example

    share_i = sum_{j: w_ij < 0} |w_ij| / sum_j |w_ij|

the negative part of the row's weight mass. For Cog, sum_j |w_ij| = 1, so share_i is the softmax(|p_i|) mass on
the keys with p_ij < 0; for softmax it is 0. Rows with no weight (no kept key) are left out. A block's share is the
mean of share_i over every row of its calls: over queries, heads, the examples of the batch and, when the forward
pass runs the model several times (a diffusion task's validation timesteps), over those calls too.

A block is the module holding the attention layer: the name of the module that called the op without its last
component (`in_blocks.0.attn` -> `in_blocks.0`, `model.layers.3.self_attn` -> `model.layers.3`), as
`model.named_modules()` names it. Blocks are reported in the order they first ran, softmax blocks included
(share 0.0), so the placement shows in the numbers.

    with probe_attention(model) as probe:
        model(x, t)
    probe.negative_shares()     # {"in_blocks.0": 0.0, "in_blocks.1": 0.41, ..., "out_blocks.1": 0.0}

Nothing of this runs outside the `with`: `uvic.attention.attention_op` returns the plain op unless a probe is
recording, and the hooks that name the modules are removed when the block ends. The validation runs it on a fixed
probe batch (`uvic.training.validation`, `train.val_probe_examples`) and logs `attn_neg_share`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import uvic.attention as _attention
from uvic.attention import AttentionKind, attention_weights


__all__ = ["PROBE_CHUNK_SCORES", "AttentionProbe", "negative_share_rows", "probe_attention"]

# Scores whose weights are computed at once: 2**22 float64 values (32 MiB), so a long sequence is done in slices of
# heads and examples rather than one (B, nh, L, L) tensor.
PROBE_CHUNK_SCORES = 2**22


def negative_share_rows(weights: torch.Tensor) -> tuple[float, int]:
    """(sum of share_i, number of rows) over the rows of `weights` that carry any weight (see the module docstring).

    Args:
        weights: (..., Lq, Lk) attention weights.
    """
    mass = weights.abs().sum(-1)
    negative = (-weights).clamp_min(0).sum(-1)
    rows = mass > 0
    return float((negative[rows] / mass[rows]).sum()), int(rows.sum())


@dataclass
class _Tally:
    total: float = 0.0
    rows: int = 0


class AttentionProbe:
    """The per-block tallies of one `probe_attention` block."""

    def __init__(self) -> None:
        self._tallies: dict[str, _Tally] = {}

    def negative_shares(self) -> dict[str, float]:
        """{block name: mean share of negative weight} in the order the blocks first ran; blocks whose calls had
        no row with weight (empty inputs) are left out."""
        return {name: t.total / t.rows for name, t in self._tallies.items() if t.rows}

    def record(self, block: str, kind: AttentionKind, q: torch.Tensor, k: torch.Tensor, **kwargs: Any) -> None:
        """Add one attention call of `block`: q (B, nh, Lq, hd), k (B, nh, Lk, hd) and the op's keyword arguments
        (`causal`, `key_padding_mask`, `scale`, `window`, `softcap`; `backend` is ignored)."""
        tally = self._tallies.setdefault(block, _Tally())
        q, k = q.detach().double(), k.detach().double()
        B, nh, Lq, _ = q.shape
        Lk = k.shape[2]
        mask = kwargs.get("key_padding_mask")
        options = {"causal": kwargs.get("causal", False), "scale": kwargs.get("scale"),
                   "window": kwargs.get("window"), "softcap": kwargs.get("softcap"), "attention": kind}
        per_head = max(1, Lq * Lk)
        heads = max(1, min(nh, PROBE_CHUNK_SCORES // per_head))
        items = max(1, PROBE_CHUNK_SCORES // (per_head * nh)) if heads == nh else 1
        for b in range(0, B, items):
            for h in range(0, nh, heads):
                w = attention_weights(q[b : b + items, h : h + heads], k[b : b + items, h : h + heads],
                                      key_padding_mask=None if mask is None else mask[b : b + items], **options)
                total, rows = negative_share_rows(w)
                tally.total += total
                tally.rows += rows


def _block_name(module_name: str) -> str:
    """The block of an attention layer named `module_name`: its parent module (itself at the top level)."""
    return module_name.rpartition(".")[0] or module_name or "model"  # "model": the op called by the root


@contextmanager
def probe_attention(model: nn.Module) -> Iterator[AttentionProbe]:
    """Record the attention calls `model` makes inside the block (see the module docstring).

    Every call of an op from `uvic.attention.attention_op` made while a module of `model` runs is recorded under
    that module's block, and still returns the op's own output, so the forward pass is unchanged (calls from
    outside `model` are not recorded). Probes do not nest. The hooks and the recording end with the block, also when it raises.

    Raises:
        RuntimeError: a probe is already recording.
    """
    if _attention._observer is not None:
        raise RuntimeError("probe_attention is already recording: probes do not nest")
    probe = AttentionProbe()
    running: list[str] = []  # names of the modules of `model` whose forward is running, innermost last

    def enter(name: str) -> Callable[..., None]:
        return lambda module, args: running.append(name)  # returns None: the inputs are left as they are

    def leave(module: nn.Module, args: Any, output: Any) -> None:  # None: the output is left as it is
        running.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave, always_call=True))

    def observer(op: Callable[..., torch.Tensor], kind: AttentionKind) -> Callable[..., torch.Tensor]:
        if not running:  # a call from outside `model`
            return op
        block = _block_name(running[-1])

        def observed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            probe.record(block, kind, q, k, **kwargs)
            return op(q, k, v, **kwargs)

        return observed

    _attention._observer = observer
    try:
        yield probe
    finally:
        _attention._observer = None
        for handle in handles:
            handle.remove()
