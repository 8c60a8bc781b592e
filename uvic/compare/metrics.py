"""The report's registries: the numbers compared per run (`METRICS`) and the curves drawn over steps (`CURVES`).

A new metric is one `Metric` entry: its name (the key in report.json), whether lower is better (which side of 0
a difference is better on), and how it is read from a finished run's logs (`RunLogs`: the training and validation
lines of metrics.jsonl, eval.jsonl, and `path` for anything else the run dir holds). It returns None where the run
has no value (e.g. no validation or no FID while training); a metric no run has is left out of the report. The
statistics, tables, paired dot plots and report.json pick the entry up with no other edit. A new curve is one
`Curve` entry likewise: {step: value} from the logs, drawn per arm (mean over seeds) and as the paired difference.
A quantity with one value per block of the model (the share of negative attention weight) is one `PerBlock` entry:
{block: value} at the run's last validation, which must be at its last step like a metric's value
(`per_block_exclusion`), shown per arm with a point per seed, and tabled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvic.compare import protocol_fid
from uvic.compare.rundirs import RunLogs, finite
from uvic.training.validation import ATTN_NEG_SHARE


# Share of the logged training steps whose mean loss is `train_loss` (the last 5%: a single step's loss is noise).
TRAIN_LOSS_TAIL = 0.05


@dataclass(frozen=True)
class Metric:
    """One number per finished run."""

    name: str
    lower_is_better: bool
    read: Callable[[RunLogs], float | None]
    description: str
    # Where `read` takes its value: (the RunLogs list, "train" | "val" | "evals", and the record key), so that a
    # run left out can be told why (`exclusion`); None: `read` says it itself (the protocol FID).
    source: tuple[str, str] | None = None
    # For a value over every record of the source (a mean over training): the train-config key of the schedule the
    # run logs it on (e.g. "val_every"), so that a run missing one of those records is left out (`missing_step`).
    every: str | None = None


@dataclass(frozen=True)
class Curve:
    """One value per logged step of a finished run."""

    name: str
    title: str
    read: Callable[[RunLogs], dict[int, float]]
    lower_is_better: bool
    log_scale: bool = False


@dataclass(frozen=True)
class PerBlock:
    """One value per block of the model (in execution order) of a finished run."""

    name: str
    title: str
    read: Callable[[RunLogs], dict[str, float]]
    description: str
    # Where `read` takes its values, as `Metric.source`: a run whose last record of them is not at its last step is
    # left out (`per_block_exclusion`).
    source: tuple[str, str]


# The file each RunLogs list is read from.
FILES = {"train": "metrics.jsonl", "val": "metrics.jsonl", "evals": "eval.jsonl"}


def exclusion(metric: Metric, run: RunLogs, value: float | None, max_steps: int, every: int = 0) -> str | None:
    """Why a finished run's `value` of `metric` (`metric.read(run)`) is left out of the pairing, naming the file and
    what is wrong or which step is missing; None when it is counted. A value read from a run's records is counted
    only if the last record that has it is at `max_steps`, the run's last step (where train.py logs, validates and
    evaluates whatever it does every so many steps), so that the runs' values are only ever paired at one step."""
    if metric.source is None:
        return None if value is not None else "no value"
    why = _record_exclusion(run, metric.source, metric.name, value is None, max_steps)
    if why is None and metric.every is not None:
        kind, key = metric.source
        return missing_step([r for r in getattr(run, kind) if key in r], FILES[kind], key, metric.every, every,
                            max_steps)
    return why


def per_block_exclusion(entry: PerBlock, run: RunLogs, value: dict[str, float], max_steps: int) -> str | None:
    """Why a finished run's {block: value} of `entry` (`entry.read(run)`) is left out, as `exclusion`: no file, no
    record of it, no finite value in its last record, or that record not at `max_steps`; None when it is counted."""
    return _record_exclusion(run, entry.source, entry.name, not value, max_steps)


def _record_exclusion(run: RunLogs, source: tuple[str, str], name: str, no_value: bool, max_steps: int) -> str | None:
    """Why the value `name` read from the records `source` (kind, key) of `run` cannot be paired (see `exclusion`),
    or None; `no_value`: the read gave none."""
    kind, key = source
    file = FILES[kind]
    if not (run.path / file).is_file():
        return f"{file} is missing"
    records = [r for r in getattr(run, kind) if key in r]
    if not records:
        return f"{file} has no {key}"
    if no_value:
        bad = next((r for r in reversed(records) if finite(r[key]) is None), None)
        return (f"{file}: {key} is {bad[key]!r} at step {bad['step']}" if bad is not None
                else f"{file}: {name} of its {key} is not a finite number (the values overflow)")
    if records[-1]["step"] > max_steps:
        return (f"{file} has {key} at step {records[-1]['step']}, after the last step {max_steps}: not a record of "
                f"this run")
    if records[-1]["step"] != max_steps:
        return f"{file} has no {key} at step {max_steps}, the last step (its last is at step {records[-1]['step']})"
    return None


def missing_step(records: list[dict[str, Any]], file: str, key: str, name: str, every: int,
                 max_steps: int) -> str | None:
    """Why a value over every record of `key` (a mean over training) cannot be paired: the first step of the run's
    schedule (each multiple of `every`, the config's train.`name`, up to `max_steps`) that `records` lack, so
    that such a mean is over the same steps in every run; None when none is missing."""
    have = {r["step"] for r in records}
    for step in range(every, max_steps + 1, every) if every > 0 else ():
        if step not in have:
            return f"{file} has no {key} at step {step} (train.{name} = {every}): the mean is over every validation"
    return None


def last(records: list[dict[str, Any]], key: str) -> float | None:
    """`key` of the last record (by step) that has it."""
    values = [r[key] for r in records if key in r]
    return finite(values[-1]) if values else None


def lowest(records: list[dict[str, Any]], key: str) -> float | None:
    """The smallest finite `key` of the records."""
    values = [v for r in records if (v := finite(r.get(key))) is not None]
    return min(values) if values else None


def tail_mean(records: list[dict[str, Any]], key: str, fraction: float) -> float | None:
    """Mean of `key` over the last `fraction` of the records (at least one); None if any of them is not finite."""
    values = [r[key] for r in records if key in r]
    if not values:
        return None
    tail = [finite(v) for v in values[-max(1, math.ceil(fraction * len(values))):]]
    return None if None in tail else sum(tail) / len(tail)


def curve_mean(records: list[dict[str, Any]], key: str) -> float | None:
    """The mean of `key` over training: the trapezoidal area under its curve over the steps of the records that
    have it, divided by the span from the first to the last of them (the value itself when there is one record).
    A run that reaches a value sooner has a higher mean (accuracy) or a lower one (loss) even where the last value
    is the same. None if any of the values is not finite."""
    points = sorted((int(r["step"]), finite(r[key])) for r in records if key in r)
    if not points or any(v is None for _, v in points):
        return None
    if len(points) == 1:  # RunLogs holds one record per step, so two points span at least one step
        return points[0][1]
    area = sum((s1 - s0) * (v0 + v1) / 2 for (s0, v0), (s1, v1) in zip(points, points[1:]))
    return area / (points[-1][0] - points[0][0])


def mean_or_none(values: list[float]) -> float | None:
    """The mean of `values`, None when empty or not finite."""
    return finite(sum(values) / len(values)) if values else None


def last_per_block(records: list[dict[str, Any]], key: str) -> dict[str, float]:
    """{block: value} of `key` ({block: value}) in the last record (by step) that has it; finite values only ({}
    where that record's `key` is not a mapping: the record `per_block_exclusion` checks is the one read)."""
    values = [r[key] for r in records if key in r]
    if not values or not isinstance(values[-1], dict):
        return {}
    return {str(b): v for b, x in values[-1].items() if (v := finite(x)) is not None}


def series(records: list[dict[str, Any]], key: str) -> dict[int, float]:
    """{step: key} of the records with a finite `key`."""
    return {int(r["step"]): v for r in records if (v := finite(r.get(key))) is not None}


METRICS: tuple[Metric, ...] = (
    Metric("val_loss", True, lambda run: last(run.val, "val_loss"),
           "held-out validation loss at the last step (train.val_every)", ("val", "val_loss")),
    Metric("val_accuracy", False, lambda run: last(run.val, "val_accuracy"),
           "held-out accuracy on the answer tokens at the last step (LM synthetic tasks, data.synthetic)",
           ("val", "val_accuracy")),
    Metric("val_loss_mean", True, lambda run: curve_mean(run.val, "val_loss"),
           "validation loss averaged over training (area under its curve from the first to the last validation, "
           "over that span): lower when a run learns sooner", ("val", "val_loss"), "val_every"),
    Metric("val_accuracy_mean", False, lambda run: curve_mean(run.val, "val_accuracy"),
           "held-out accuracy averaged over training (area under its curve from the first to the last "
           "validation, over that span): higher when a run learns sooner", ("val", "val_accuracy"), "val_every"),
    Metric("train_loss", True, lambda run: tail_mean(run.train, "loss", TRAIN_LOSS_TAIL),
           f"training loss, mean over the last {TRAIN_LOSS_TAIL:.0%} of logged steps", ("train", "loss")),
    Metric("fid_last", True, lambda run: last(run.evals, "fid"),
           "FID while training (train.eval_every) at the last evaluation", ("evals", "fid")),
    Metric("fid_best", True, lambda run: lowest(run.evals, "fid"),
           "FID while training (train.eval_every), the lowest evaluation", ("evals", "fid")),
    # One run's mean over all it holds; the report pairs the means over the resamplings every paired run has
    # (`protocol_fid.paired_resamplings`), so that every mean is over the same sampling seeds.
    Metric(protocol_fid.METRIC, True, lambda run: mean_or_none(protocol_fid.read_fids(run.path)),
           "the protocol FID of the final weights (`--gen-seeds K`), the mean over its K resamplings (the first K, "
           "those every paired run has)"),
)

CURVES: tuple[Curve, ...] = (
    Curve("train_loss", "training loss", lambda run: series(run.train, "loss"), True, log_scale=True),
    Curve("val_loss", "validation loss", lambda run: series(run.val, "val_loss"), True, log_scale=True),
    Curve("val_accuracy", "held-out accuracy", lambda run: series(run.val, "val_accuracy"), False),
    Curve("fid", "FID while training", lambda run: series(run.evals, "fid"), True),
)

PER_BLOCK: tuple[PerBlock, ...] = (
    PerBlock(ATTN_NEG_SHARE, "share of negative attention weight",
             lambda run: last_per_block(run.val, ATTN_NEG_SHARE),
             "each block's share of negative attention weight at the last validation, on the fixed probe batch "
             "(train.val_probe_examples; softmax blocks: 0)", ("val", ATTN_NEG_SHARE)),
)
