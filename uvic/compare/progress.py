"""The one progress line of `compare.py run` on the console: the runs finished, running and waiting, the steps of
the running ones (read from their metrics.jsonl), and an estimate of the time left.

    progress = Progress(plan, todo, enabled=not quiet)
    progress.started(run)                       # when train.py is launched
    progress.update(running, done)              # now and then; it reads the running runs' logs
    progress.close()

The bar counts the training steps of the runs this command trains (`todo`), each run's `train.max_steps`; a run
that ends (finished or failed) counts all of its steps. The estimate is the steps left over the rate of this
command's steps so far (all jobs together; a resumed run's steps before its checkpoint are not counted as this
command's), so it means something once a few steps were logged, and assumes the runs left train as fast as those.
A metrics.jsonl last written before its run was launched is a stopped attempt's (train.py cuts it back to the
checkpoint when it resumes) and is not read: its steps past the checkpoint would count as trained in no time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from uvic.compare.plan import Plan, Run
from uvic.training.checkpoint import list_checkpoints


def logged_step(run_dir: str | Path, tail_bytes: int = 16_384, since: float | None = None) -> int | None:
    """The step of the last training line ({"step", "loss", ...}) of `run_dir/metrics.jsonl`, read from its last
    `tail_bytes`; None without one, or when the file was last written before `since` (seconds since the epoch). A
    partial last line (a write in progress) is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            if since is not None and os.fstat(f.fileno()).st_mtime < since:
                return None
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().split(b"\n")
    except OSError:
        return None
    for raw in reversed(lines):
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict) and "loss" in record and isinstance(record.get("step"), int):
            return record["step"]
    return None


def format_duration(seconds: float) -> str:
    """A duration as "1 h 05 min", "12 min", "40 s"."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


class Progress:
    """The aggregate progress bar of the runs `todo` of `plan` (see the module docstring); silent when not
    `enabled`. `clock` (seconds) is for tests."""

    def __init__(self, plan: Plan, todo: Sequence[Run], *, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_steps = {run.key: plan.configs[run.arm]["train"]["max_steps"] for run in todo}
        self.total_runs = len(todo)
        self.clock, self.t0 = clock, clock()
        self.first: dict[str, int] = {}  # each started run's step when this command launched it
        self.launched: dict[str, float] = {}  # when (time.time()) this command launched each run
        self.steps: dict[str, int] = {}  # each started run's step now
        self.ended: set[str] = set()
        # Redrawn every second on a terminal; every minute into a file (a log of `compare.py run 2> log`).
        self.interval = 1.0 if sys.stderr.isatty() else 60.0
        self.bar = tqdm(total=sum(self.max_steps.values()), unit="step", desc="compare", disable=not enabled,
                        mininterval=self.interval, dynamic_ncols=True, leave=True,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps [{elapsed}]{postfix}")
        self.text, self.drawn = "", -float("inf")

    def started(self, run: Run) -> None:
        """`run` was launched: it continues from its last checkpoint (0 when it has none)."""
        steps = [step for step, _ in list_checkpoints(run.run_dir)] if run.run_dir.is_dir() else []
        self.first[run.key] = self.steps[run.key] = steps[-1] if steps else 0
        self.launched[run.key] = time.time()

    def update(self, running: Sequence[Run], done: Sequence[Run], force: bool = False) -> str:
        """Read the running runs' steps, count the `done` ones (ended: finished or failed) whole, and redraw, at
        most once per redraw interval unless `force` (a run started or ended); returns the line's text after the
        bar (also when disabled)."""
        ended = {run.key for run in done} - self.ended
        if not (force or ended) and time.monotonic() - self.drawn < self.interval:
            return self.text
        self.drawn = time.monotonic()
        self.ended |= ended
        for run in running:
            step = logged_step(run.run_dir, since=self.launched.get(run.key))
            if step is not None:
                self.steps[run.key] = max(self.steps.get(run.key, 0), step)
        now = {key: (self.max_steps[key] if key in self.ended else self.steps.get(key, 0)) for key in self.max_steps}
        n = sum(now.values())
        trained = sum(now[key] - first for key, first in self.first.items())
        elapsed = self.clock() - self.t0
        left = self.bar.total - n
        if left <= 0:
            eta = "0 s left"
        elif trained > 0 and elapsed > 0:
            eta = f"~{format_duration(left * elapsed / trained)} left"
        else:
            eta = "time left: after the first logged steps"
        waiting = self.total_runs - len(self.ended) - len(running)
        steps = ", ".join(f"{run.label} {self.steps.get(run.key, 0)}/{self.max_steps[run.key]}" for run in running)
        self.text = (f"runs: {len(self.ended)} done, {len(running)} running"
                     f"{f' ({steps})' if steps else ''}, {waiting} waiting; {eta}")
        self.bar.n = n
        self.bar.set_postfix_str(self.text, refresh=False)
        if not self.bar.disable:
            self.bar.refresh()
        return self.text

    def close(self) -> None:
        self.bar.close()
