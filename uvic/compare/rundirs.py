"""What the report reads from the run dirs of a comparison: each run's state, and the logs of a finished one.

A run dir is an ordinary `train.py` run dir (`config.yaml`, `checkpoints/step_*`, `metrics.jsonl`, `eval.jsonl`,
the sample grids at `uvic.training.tasks.sample_path`, `pipeline/`). A run is finished when its export `pipeline/` exists and it has a checkpoint at
`train.max_steps` (the export is written last, after that checkpoint). Only finished runs enter the statistics and
the figures; the others are named in the report with their state:

    finished     complete
    unfinished   started, not complete (killed, still running, or trained by hand and not yet done)
    failed       not complete, and its last attempt under `compare.py run` exited with an error (attempts.json)
    missing      never started
    mismatch     not provably the plan's run: its config.yaml (or a checkpoint's) is not the plan's config for it
                 (trained by another command), it has checkpoints but no config.yaml, or a record it holds
                 (`RECORDS`) is a symlink or lies outside it: never counted, never trained over

`compare.py run` records each attempt's exit status in `DIR/attempts.json` and its output in
`DIR/<arm>/seed_<seed>.log`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from uvic.compare.plan import Plan, Run, config_difference
from uvic.io import atomic_write
from uvic.training.checkpoint import checkpoint_dir, list_checkpoints
from uvic.training.evaluation import read_evaluations
from uvic.training.logs import line_kind, read_metrics
from uvic.training.tasks import sample_path


ATTEMPTS_FILE = "attempts.json"
# What the report and the comparison read in a run dir: each must be the run's own, never a symlink.
# validation.json: the held-out split and count the headlines quote (`uvic.compare.provenance`).
RECORDS = ("config.yaml", "metrics.jsonl", "eval.jsonl", "validation.json", "fid_protocol.json", "checkpoints",
           "pipeline", "samples")
# libyaml's safe loader where PyYAML has it: ten times faster than the Python one, which took most of a report.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
State = Literal["finished", "unfinished", "failed", "missing", "mismatch"]


@dataclass(frozen=True)
class RunLogs:
    """The logs of one finished run, each a list of records sorted by step (a key logged twice keeps the last).

    train: `metrics.jsonl` training lines {"step", "loss", "lr"}; val: its other lines, the validation ones
    {"step", "val_loss", ...extras}; evals: `eval.jsonl` lines {"step", "fid", ...} (FID while training).
    """

    path: Path
    train: list[dict[str, Any]]
    val: list[dict[str, Any]]
    evals: list[dict[str, Any]]


@dataclass(frozen=True)
class RunState:
    """A run's state and, unless finished, a few words on why (its step, error line or config difference)."""

    state: State
    detail: str = ""


def read_logs(run_dir: str | Path) -> RunLogs:
    """The training, validation and evaluation records of `run_dir`. A partial last line of metrics.jsonl (a kill
    during a write) is skipped.

    Raises:
        ValueError: metrics.jsonl is damaged before its last line.
    """
    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")  # lines of one kind and step merged, the later winning
    return RunLogs(run_dir, [r for r in records if line_kind(r) == "train"],
                   [r for r in records if line_kind(r) == "val"], read_evaluations(run_dir))


def run_state(plan: Plan, run: Run, attempts: dict[str, Any]) -> RunState:
    """The state of `run` (see the module docstring); `attempts` is `read_attempts(plan.out)`."""
    run_dir = run.run_dir
    for folder in (run_dir.parent, run_dir):  # another run's folder linked in would report its numbers as this one's
        if folder.is_symlink():
            return RunState("mismatch", f"{folder} is a symlink (to {os.readlink(folder)}): a run dir must be the "
                                        f"comparison's own folder")
    if not run_dir.is_dir():
        return RunState("missing")
    max_steps = plan.configs[run.arm]["train"]["max_steps"]
    why = _foreign_record(run_dir, max_steps) or _config_mismatch(plan, run) or _checkpoint_mismatch(plan, run)
    if why is not None:
        return RunState("mismatch", why)
    steps = [step for step, _ in list_checkpoints(run_dir)]
    if (run_dir / "pipeline").is_dir() and max_steps in steps:
        return RunState("finished")
    progress = f"last checkpoint at step {steps[-1]} of {max_steps}" if steps else f"no checkpoint yet (of {max_steps} steps)"
    attempt = attempts.get(run.key)
    if attempt is not None and attempt.get("exit_code") != 0:
        return RunState("failed", f"{attempt.get('error') or 'exit status ' + str(attempt.get('exit_code'))}; {progress}")
    return RunState("unfinished", progress)


def _foreign_record(run_dir: Path, max_steps: int) -> str | None:
    """Why a record of `run_dir` (`RECORDS`, every file of the last checkpoint and of the export, the last sample
    grid) is not the run's own file (a symlink, or a path that resolves outside the run dir), or None."""
    root = run_dir.resolve()
    last = checkpoint_dir(run_dir, max_steps)
    paths = [*(run_dir / name for name in RECORDS), last, last / "config.yaml", last / "meta.json",
             sample_path(run_dir, max_steps, ".png"), *_weight_files(run_dir, last)]
    for path in paths:
        name = path.relative_to(run_dir)
        if path.is_symlink():
            return f"its {name} is a symlink (to {os.readlink(path)}): a run's records must be its own files"
        if path.exists() and not path.resolve().is_relative_to(root):
            return f"its {name} lies outside it (in {path.resolve()}): a run's records must be its own files"
    return None


def shared_records(plan: Plan, runs: list[Run]) -> dict[tuple[str, int], str]:
    """{(arm, seed): why} of the `runs` that share a record file (`RECORDS`, the files of the last checkpoint and of
    the export) with another of them: one file under two names (a hard link, or a folder mounted twice) passes every
    symlink check, and would report one run's numbers as another's. Both runs are named."""
    owner: dict[tuple[int, int], tuple[Run, str]] = {}
    out: dict[tuple[str, int], str] = {}
    for run in runs:
        run_dir = run.run_dir
        last = checkpoint_dir(run_dir, plan.configs[run.arm]["train"]["max_steps"])
        for path in [*(run_dir / name for name in RECORDS if name != "checkpoints"), *_weight_files(run_dir, last)]:
            if not path.is_file():
                continue
            st = path.stat()
            name = path.relative_to(run_dir).as_posix()
            other = owner.setdefault((st.st_dev, st.st_ino), (run, name))
            if other[0] != run:
                for a, b in ((run, other[0]), (other[0], run)):
                    out.setdefault((a.arm, a.seed), f"its {name} is the same file as that of {b.label} (a hard link "
                                                    f"or a folder mounted twice): a run's records must be its own files")
    return out


def _weight_files(run_dir: Path, last: Path) -> list[Path]:
    """Everything inside the last checkpoint and the export `pipeline/` (the weights the protocol FID and sample.py
    load), sorted; nothing below a folder that is itself a symlink (that folder is named instead)."""
    out = []
    for folder in (last, run_dir / "pipeline"):
        if folder.is_dir() and not folder.is_symlink():
            out += sorted(folder.rglob("*"))  # rglob does not descend into symlinked folders
    return out


def _checkpoint_mismatch(plan: Plan, run: Run) -> str | None:
    """How a checkpoint of the run (its `config.yaml`, the config it trained with) differs from the plan, or
    None; a run dir that holds checkpoints or an export without a config.yaml is not provably the plan's run."""
    checkpoints = list_checkpoints(run.run_dir)
    if not (run.run_dir / "config.yaml").is_file():
        if checkpoints or (run.run_dir / "pipeline").exists():
            return "it holds checkpoints or an export but no config.yaml, so nothing shows it is this arm's run"
        return None
    for step, path in checkpoints:
        if not (path / "config.yaml").is_file():
            return f"its checkpoint {path.name} has no config.yaml, so nothing shows it is this arm's run"
        why = _config_difference_of(plan, run, path / "config.yaml")
        if why is not None:
            return f"its checkpoint {path.name}: {why}"
    return None


def _config_mismatch(plan: Plan, run: Run) -> str | None:
    """How the run's config.yaml differs from what the plan trains there (None if it agrees or is not written)."""
    path = run.run_dir / "config.yaml"
    if not path.is_file():
        return None
    why = _config_difference_of(plan, run, path)
    return f"its {why}" if why and why.startswith("config.yaml") else why


def _config_difference_of(plan: Plan, run: Run, path: Path) -> str | None:
    """"config.yaml differs from the plan: KEY is ..." for the config file `path` of `run`, or None if it agrees."""
    try:
        actual = yaml.load(path.read_text(), Loader=_YAML_LOADER)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        return f"{path} is unreadable ({type(e).__name__})"
    expected = json.loads(json.dumps(plan.configs[run.arm]))
    expected["train"].update(seed=run.seed)
    actual = actual if isinstance(actual, dict) else {}
    actual_train = actual.get("train") if isinstance(actual.get("train"), dict) else {}
    actual = {**actual, "train": {k: v for k, v in actual_train.items() if k not in ("run_dir", "resume")}}
    why = config_difference(expected, actual)
    return f"config.yaml differs from the plan: {why}" if why else None


def read_attempts(out: str | Path) -> dict[str, Any]:
    """{"<arm>/seed_<seed>": {"exit_code", "error", "log"}} of the last attempt of each run under `compare.py run`."""
    path = Path(out) / ATTEMPTS_FILE
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return _attempt_records(data)


def _attempt_records(data: Any) -> dict[str, Any]:
    """The entries of attempts.json's `data` that are attempt records (mappings); a hand-edited entry that is not
    one (a string, a list) is ignored, as a damaged attempts.json is, rather than failing the report."""
    if not isinstance(data, dict):
        return {}
    return {key: entry for key, entry in data.items() if isinstance(entry, dict)}


def record_attempt(out: str | Path, run: Run, exit_code: int, error: str, log: str) -> None:
    """Record the outcome of an attempt at `run` in `out/attempts.json` (rewritten atomically)."""
    attempts = read_attempts(out)
    attempts[run.key] = {"exit_code": exit_code, "error": error, "log": log}
    with atomic_write(Path(out) / ATTEMPTS_FILE, "w") as f:
        json.dump(attempts, f, indent=1)


def finite(value: Any) -> float | None:
    """`value` as a float if it is a finite number, else None (a missing or non-finite metric)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def final_samples(run_dir: str | Path, max_steps: int) -> Path | None:
    """The sample grid a run with `train.sample_every` > 0 draws at its last step, `max_steps`, or None."""
    path = sample_path(run_dir, max_steps, ".png")
    return path if path.is_file() else None
