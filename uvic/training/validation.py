"""Held-out validation loss (`train.val_every`): one number per evaluation that depends only on the weights.

Every `train.val_every` steps and at the last step, the sampling weights (the EMA when there is one, in eval mode)
are scored on the first `train.val_examples` examples of the task's held-out set (`Task.validation_set`: the data's
test split where it has one, else `data.val_fraction` of the data chosen by `hold_out`, which training then never
sees). Each example's random draws come from its own generator (`example_generators`: seed `VALIDATION_SEED` plus
its index), so the value depends on the weights alone: not on the run's seed, the arm of a comparison, the batch
size, the process count or when the validation runs. The examples are cut into fixed batches of
`train.val_batch_size`; process r scores batches r, r + P, ..., and the per-example values are gathered and
averaged in example order in float64, so 1 and P processes give the same number bit for bit (on one device type).

What is scored is the task's (`Task.validation_losses`): for the diffusion tasks the epsilon loss at
`train.val_timesteps` times per example spanning the schedule (stratified: one in each quantile), with the
example's stored condition (no label or context dropout, no flip); for the LM the next-token cross-entropy of each
held-out block, and the perplexity.

What the attention does is measured beside it: the first `train.val_probe_examples` held-out examples (the probe
batch, the same for every arm, seed and step, with the validation's own noise and times) are run once more through
`Task.validation_losses` under `uvic.attention_probe.probe_attention`, which gives each attention block's share of
negative attention weight, 0.0 for softmax blocks (defined in
docs/attention.md, "Measuring the negative weights: the attention probe"). Every process computes the same probe;
0 examples turn it off, as does a model with no `uvic.attention` layer.

On disk, each validation appends one line to `run_dir/metrics.jsonl` (`uvic.training.logs`):

    {"step": S, "val_loss": float, ...task extras, e.g. "val_ppl" for the LM,
     "attn_neg_share": {block name: share, ...}}      # blocks in execution order

with no "loss" key (the training log lines have one); the trackers get the same values under the same names, the
shares as `attn_neg_share/<block name>` (`tracker_values`). What is scored is recorded once per start in
`run_dir/validation.json`: {"split": the held-out set in words (`Task.validation_split`), "examples": the number
of examples scored, "held_out": the size of the held-out set}.
A killed run resumes from its last checkpoint and validates again the steps after it, with the same values.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset, default_collate

from uvic.attention_probe import probe_attention
from uvic.errors import ConfigError
from uvic.io import atomic_write


logger = logging.getLogger(__name__)

__all__ = ["ATTN_NEG_SHARE", "HOLDOUT_SEED", "RECORD", "VALIDATION_SEED", "Validator", "example_generators", "hold_out",
           "held_out_subsets", "tracker_values"]

# Fixed seeds, independent of `train.seed`: which examples are held out, and each held-out example's draws.
HOLDOUT_SEED = 20_250_701
VALIDATION_SEED = 1_000_003
# The key of the per-block shares of negative attention weight in a validation line.
ATTN_NEG_SHARE = "attn_neg_share"
# The run dir's record of what the validations score (`Validator.record`).
RECORD = "validation.json"


def hold_out(num_items: int, fraction: float, groups: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Split items 0..N-1 into (training, held-out) index arrays, the same for every run.

    The held-out part is round(`fraction` x G) of the G groups (items of one group, e.g. the captions of one
    image or its flipped copy, are held out together), the first ones of a permutation drawn from `HOLDOUT_SEED`.

    Args:
        num_items: N.
        fraction: in (0, 1).
        groups: (N,) int group id of each item; None: every item its own group.
    Returns:
        (training indices ascending, held-out indices in the order of their groups in the permutation, so that a
        prefix is a random subset; ascending within a group).
    Raises:
        ValueError: the fraction holds out no group, or all of them.
    """
    groups = np.arange(num_items) if groups is None else np.asarray(groups)
    ids = np.unique(groups)
    k = round(fraction * len(ids))
    if not 1 <= k < len(ids):
        raise ValueError(f"data.val_fraction={fraction} of {len(ids)} items holds out {k}: the validation loss needs "
                         "at least one held-out item and one to train on")
    order = np.full(ids.max() + 1 if len(ids) else 0, -1, dtype=np.int64)
    order[ids[np.random.default_rng(HOLDOUT_SEED).permutation(len(ids))[:k]]] = np.arange(k)
    rank = order[groups]
    held = np.flatnonzero(rank >= 0)
    return np.flatnonzero(rank < 0), held[np.argsort(rank[held], kind="stable")]


def held_out_subsets(dataset: Dataset, fraction: float, groups: np.ndarray | None = None) -> tuple[Subset, Subset]:
    """(training subset, held-out subset) of `dataset` by `hold_out`."""
    train, held = hold_out(len(dataset), fraction, groups)
    return Subset(dataset, train.tolist()), Subset(dataset, held.tolist())


def example_generators(index: torch.Tensor) -> list[torch.Generator]:
    """One CPU generator per held-out example, seeded `VALIDATION_SEED + i` for example i ((B,) int64 `index`):
    every random draw of a validation comes from these."""
    return [torch.Generator().manual_seed(VALIDATION_SEED + int(i)) for i in index]


class Validator:
    """The validation loss of a run: its held-out examples and this process's batches of them, fixed at start-up
    (so a missing test split or an empty held-out set stops the run before training).

    Args:
        cfg: the run config (`train.val_*`).
        task: the run's task (`validation_set`, `validation_losses`, `validation_metrics`).
        state: the run's `Accelerator` (device, processes, autocast).
    Raises:
        ConfigError: the held-out set is empty.
    """

    def __init__(self, cfg: Any, task: Any, state: Any) -> None:
        tc = cfg.train
        self.task, self.state = task, state
        self.dataset = task.validation_set()
        n = len(self.dataset) if tc.val_examples == 0 else min(tc.val_examples, len(self.dataset))
        if n == 0:
            raise ConfigError("train.val_every: the held-out set is empty")
        self.num_examples = n
        self.split, self.held_out = task.validation_split(), len(self.dataset)
        batches = [list(range(k, min(k + tc.val_batch_size, n))) for k in range(0, n, tc.val_batch_size)]
        self.batches = batches[state.process_index :: state.num_processes]
        self.probe_index = list(range(min(tc.val_probe_examples, n)))  # the attention probe's examples
        logger.info("validation loss every %d steps on %d held-out examples", tc.val_every, n)

    def record(self, run_dir: str | Path) -> None:
        """Write `run_dir/validation.json` (`RECORD`; main process): what every validation of this run scores,
        {"split": `Task.validation_split()`, "examples": the number scored, "held_out": the size of the held-out
        set}, rewritten at each start."""
        with atomic_write(Path(run_dir) / RECORD, "w") as f:
            json.dump({"split": self.split, "examples": self.num_examples, "held_out": self.held_out}, f)

    def _batch(self, idx: list[int]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.state.device) for k, v in default_collate([self.dataset[i] for i in idx]).items()}

    def _scoring(self) -> ExitStack:
        """What scoring runs under: the global RNG states restored afterwards, no autograd, the run's autocast."""
        device = self.state.device
        stack = ExitStack()
        stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
        stack.enter_context(torch.inference_mode())
        stack.enter_context(self.state.autocast())
        return stack

    def local_values(self, model: nn.Module) -> list[tuple[list[int], dict[str, list[float]]]]:
        """This process's share: (example indices, {name: per-example values}) per batch."""
        out = []
        with self._scoring():
            for idx in self.batches:
                values = self.task.validation_losses(model, self._batch(idx), torch.tensor(idx))
                out.append((idx, {k: v.double().cpu().tolist() for k, v in values.items()}))
        return out

    def attention_shares(self, model: nn.Module) -> dict[str, float]:
        """{block name: share of negative attention weight} of `model` on the probe batch (`probe_index`), in
        execution order; {} without probe examples or attention layers."""
        if not self.probe_index:
            return {}
        with self._scoring(), probe_attention(model) as probe:
            self.task.validation_losses(model, self._batch(self.probe_index), torch.tensor(self.probe_index))
        return probe.negative_shares()

    def combine(self, shares: list[tuple[list[int], dict[str, list[float]]]]) -> dict[str, float]:
        """The metrics from every process's `local_values`: per-example values in example order, their float64
        means, then the task's `validation_metrics`."""
        full: dict[str, np.ndarray] = {}
        for idx, values in shares:
            for name, v in values.items():
                full.setdefault(name, np.full(self.num_examples, np.nan))[idx] = v
        if "val_loss" not in full or any(np.isnan(v).any() for v in full.values()):
            raise ValueError("validation_losses must give every example a value under 'val_loss' (and each extra)")
        return self.task.validation_metrics({name: float(v.mean()) for name, v in full.items()})

    def validate(self, model: nn.Module) -> dict[str, Any]:
        """The validation metrics of `model` (the sampling weights, eval mode; every process calls this and gets
        them): the task's numbers, and `ATTN_NEG_SHARE` {block: share} when the probe found attention layers. The
        global RNG states are left as they were."""
        from accelerate.utils import gather_object

        values = self.local_values(model)
        metrics: dict[str, Any] = self.combine(gather_object(values) if self.state.num_processes > 1 else values)
        attention = self.attention_shares(model)
        if attention:
            metrics[ATTN_NEG_SHARE] = attention
        return metrics


def tracker_values(metrics: dict[str, Any]) -> dict[str, float]:
    """`metrics` with each dict value {name: {key: v}} spread into scalars `name/key` (the trackers take scalars)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if isinstance(value, dict):
            out.update({f"{name}/{key}": v for key, v in value.items()})
        else:
            out[name] = value
    return out
