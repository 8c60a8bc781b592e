"""Run metrics on disk (`metrics.jsonl`) and the loss-curve plot drawn from them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def append_metrics(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON line (main process only)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records by step; a step logged twice (a run resumed from an earlier checkpoint) keeps the latest record."""
    by_step: dict[int, dict[str, Any]] = {}
    path = Path(path)
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                by_step[int(rec["step"])] = rec
    return [by_step[k] for k in sorted(by_step)]


def move_metrics_after(path: str | Path, step: int, dest: str | Path) -> int:
    """Move the records of `path` logged after `step` to the end of `dest` (a run resumed from `step` abandons
    them with its newer checkpoints); returns how many moved."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep, moved = [], []
    for line in path.read_text().splitlines():
        if line.strip():
            (moved if int(json.loads(line)["step"]) > step else keep).append(line + "\n")
    if moved:
        with open(dest, "a") as f:
            f.writelines(moved)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        tmp.replace(path)
    return len(moved)


def plot_loss_curve(metrics_path: str | Path, out_png: str | Path, title: str = "training loss") -> Path | None:
    """Plot `loss` against `step` (log-scale y) to `out_png`; returns None when there is nothing to plot."""
    records = [r for r in read_metrics(metrics_path) if "loss" in r]
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot(steps, losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    Path(out_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return Path(out_png)
