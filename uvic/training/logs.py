"""Run metrics on disk (`metrics.jsonl`) and the loss-curve plot drawn from them.

The file holds two kinds of lines, each with a "step": training log lines `{"step", "loss", "lr"}` (every
`train.log_every` steps) and validation lines `{"step", "val_loss", ...extras}` with no "loss" key (every
`train.val_every` steps, `uvic.training.validation`); both kinds may share a step. Read it with `read_metrics`
(or `metrics_of_kind`), which keeps the kinds apart and merges the lines of one kind and step.

A kill or a full disk during an append can leave a partial last line. Readers skip it (with a warning), and the
next append first cuts it off, so a resumed run never glues its records onto it. Any other line must be a record
as the run writes it (an integer "step" >= 0, numbers or {name: number} mappings as values); anything else is a
`RunRecordError` naming the file and the line, which a run reports when it starts (`check_metrics`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from uvic.errors import RunRecordError
from uvic.io import atomic_write


logger = logging.getLogger(__name__)


def append_metrics(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON line (main process only), fsync'd; a partial last line left by a kill is cut off first."""
    with open(path, "a+b") as f:
        end = f.seek(0, os.SEEK_END)
        if end > 0:
            f.seek(end - 1)
            if f.read(1) != b"\n":
                f.seek(0)
                keep = f.read().rfind(b"\n") + 1  # 0 when the partial line is the only one
                logger.warning("%s ended in a partial line (an interrupted write): removed it", path)
                f.truncate(keep)
        f.write((json.dumps(record) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _problem(record: Any) -> str | None:
    """What is wrong with a metrics line's record, or None: a "step" that is an integer >= 0, and values that are
    numbers or {name: number} mappings (per-block values)."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    step = record.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        return "no 'step'" if "step" not in record else f"'step' is {json.dumps(step)}, not an integer >= 0"
    for key, value in record.items():
        ok = _is_number(value) or (isinstance(value, dict) and all(_is_number(v) for v in value.values()))
        if key != "step" and not ok:
            return f"{key!r} is {json.dumps(value)}, not a number"
    return None


def _records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of every complete line of `path`; a partial last line is skipped with a warning.

    Raises:
        RunRecordError: a line other than the last is not a metrics record as the run writes it (the file and line
            are named).
    """
    lines = path.read_bytes().split(b"\n")
    out = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
            record = json.loads(line)
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            problem = f"{type(e).__name__}: {e}"
        else:
            problem = _problem(record)
        if problem is not None:
            if n == len(lines):  # no newline after it: a write that was cut short
                logger.warning("%s: skipping the partial last line %d (an interrupted write)", path, n)
                continue
            raise RunRecordError(f"{path} line {n} is not a metrics record ({problem}); correct or delete the line")
        out.append((line, record))
    return out


def check_metrics(path: str | Path) -> None:
    """Raise `RunRecordError` if a line of `path` (when it exists) other than a partial last one is not a metrics
    record; a run calls this when it starts, before it reads the file back."""
    path = Path(path)
    if path.is_file():
        _records(path)


# The kinds of metrics lines, in the order `read_metrics` gives them at one step.
KINDS = ("train", "val")


def line_kind(record: dict[str, Any]) -> str:
    """"train" for a training log line (it has "loss"), else "val" (a validation line has none)."""
    return "train" if "loss" in record else "val"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records by step, a step's training line before its validation line; the lines of one kind and step (a run
    resumed from an earlier checkpoint logs the steps after it again) are merged, the later values winning."""
    path = Path(path)
    merged: dict[tuple[int, int], dict[str, Any]] = {}
    for _, rec in _records(path) if path.is_file() else []:
        merged.setdefault((int(rec["step"]), KINDS.index(line_kind(rec))), {}).update(rec)
    return [merged[k] for k in sorted(merged)]


def metrics_of_kind(path: str | Path, kind: str) -> list[dict[str, Any]]:
    """`read_metrics` lines of one kind ("train" or "val"), by step."""
    return [r for r in read_metrics(path) if line_kind(r) == kind]


def move_metrics_after(path: str | Path, step: int, dest: str | Path | None) -> int:
    """Move the records of `path` logged after `step`, of both kinds, to the end of `dest` (a run resumed from
    `step` abandons them with its newer checkpoints), or drop them when `dest` is None (a run resumed from its
    latest checkpoint logs those steps again); returns how many moved."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep, moved = [], []
    for line, record in _records(path):
        (moved if int(record["step"]) > step else keep).append(line + "\n")
    if moved:
        if dest is not None:
            with open(dest, "a") as f:
                f.writelines(moved)
        with atomic_write(path, "w") as f:
            f.write("".join(keep))
    return len(moved)


def plot_loss_curve(metrics_path: str | Path, out_png: str | Path, title: str = "training loss") -> Path | None:
    """Plot the training `loss` and, when validated, `val_loss` against `step` (log-scale y) to `out_png`; returns
    None when there is nothing to plot."""
    records = read_metrics(metrics_path)
    curves = {name: [(r["step"], r[name]) for r in records if name in r] for name in ("loss", "val_loss")}
    if not curves["loss"] and not curves["val_loss"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for points, label, style in zip(curves.values(), ("training", "validation (held out)"), ("-", "o-")):
        if points:
            ax.plot(*zip(*points), style, lw=1, ms=3, label=label)
    if curves["val_loss"]:
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out_png) as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return Path(out_png)
