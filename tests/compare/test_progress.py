"""`compare.py run`'s one progress line: runs done / running / waiting, the running runs' steps from their
metrics.jsonl, the time left from this command's rate; none with --quiet."""

import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path

from synthetic_runs import MAX_STEPS

from uvic.compare.plan import Arm, make_plan, write_plan
from uvic.compare.progress import Progress, format_duration, logged_step


ROOT = Path(__file__).resolve().parents[2]


def _lines(run_dir, steps, partial=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [{"step": s, "loss": 1.0 / s, "lr": 1e-3} for s in steps]
    lines.append({"step": steps[-1], "val_loss": 0.5})  # a validation line after the last training line
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + partial)


def test_logged_step_is_the_last_training_line_past_a_partial_one(tmp_path):
    assert logged_step(tmp_path) is None  # no metrics.jsonl yet
    _lines(tmp_path, range(1, 2001), partial='{"step": 2001, "lo')
    assert logged_step(tmp_path) == 2000


def test_the_line_counts_runs_and_steps_and_estimates_the_time_left(make_comparison):
    plan = make_comparison(seeds=(0, 1))  # 2 arms x 2 seeds of MAX_STEPS = 100 steps: 400 steps
    a0, b0, a1, _ = plan.runs
    (b0.run_dir / "checkpoints" / "step_000000040").mkdir(parents=True)  # b0 resumes from step 40
    (b0.run_dir / "checkpoints" / "step_000000040" / "meta.json").write_text("{}")
    now = [0.0]
    progress = Progress(plan, plan.runs, enabled=False, clock=lambda: now[0])
    progress.started(a0)
    progress.started(b0)
    _lines(a0.run_dir, range(1, 31))
    _lines(b0.run_dir, range(41, 61), partial='{"step": 6')
    now[0] = 100.0
    # 30 + 60 = 90 of 400 steps; this command trained 30 + 20 = 50 in 100 s: 310 steps left at 0.5/s = 620 s.
    text = progress.update([a0, b0], [], force=True)
    assert text == ("runs: 0 done, 2 running (uvit seed 0 30/100, uvic seed 0 60/100), 2 waiting; ~10 min left")
    assert (progress.bar.n, progress.bar.total) == (90, 400)
    # a0 ends: all its 100 steps count; a1 starts fresh. 160 of 400, 120 trained in 200 s: 240 at 0.6/s = 400 s.
    now[0] = 200.0
    progress.started(a1)
    assert progress.update([b0, a1], [a0], force=True) == (
        "runs: 1 done, 2 running (uvic seed 0 60/100, uvit seed 1 0/100), 1 waiting; ~7 min left")
    assert progress.bar.n == 160
    # Within the redraw interval nothing is read again unless forced (or a run ended).
    _lines(a1.run_dir, range(1, 11))
    assert progress.update([b0, a1], [a0]).startswith("runs: 1 done, 2 running (uvic seed 0 60/100, uvit seed 1 0/")
    assert "uvit seed 1 10/100" in progress.update([b0, a1], [a0], force=True)
    assert format_duration(59.4) == "59 s" and format_duration(3 * 3600 + 5 * 60) == "3 h 05 min"


def test_before_any_logged_step_there_is_no_estimate(make_comparison):
    plan = make_comparison(seeds=(0,))
    progress = Progress(plan, plan.runs[:1], enabled=False, clock=lambda: 5.0)
    progress.started(plan.runs[0])
    assert progress.update(plan.runs[:1], [], force=True) == (
        "runs: 0 done, 1 running (uvit seed 0 0/100), 0 waiting; time left: after the first logged steps")



def test_a_stopped_attempts_log_is_not_counted_as_trained_steps(make_comparison):
    # A run killed at step 95 resumes from its step-40 checkpoint: until train.py cuts metrics.jsonl back and logs
    # again, the old lines past 40 are not steps this command trained (they made the estimate "~3 s left").
    plan = make_comparison(seeds=(0,))
    run = plan.runs[0]
    (run.run_dir / "checkpoints" / "step_000000040").mkdir(parents=True)
    (run.run_dir / "checkpoints" / "step_000000040" / "meta.json").write_text("{}")
    _lines(run.run_dir, range(1, 96))
    os.utime(run.run_dir / "metrics.jsonl", (time.time() - 3600, time.time() - 3600))  # the killed attempt's
    now = [0.0]
    progress = Progress(plan, plan.runs[:1], enabled=False, clock=lambda: now[0])
    progress.started(run)
    now[0] = 10.0
    assert progress.update(plan.runs[:1], [], force=True) == (
        "runs: 0 done, 1 running (uvit seed 0 40/100), 0 waiting; time left: after the first logged steps")
    _lines(run.run_dir, range(1, 51))  # the resumed run: cut back to 40, then 10 steps in 10 s; 50 left at 1/s
    assert progress.update(plan.runs[:1], [], force=True) == (
        "runs: 0 done, 1 running (uvit seed 0 50/100), 0 waiting; ~50 s left")

# A stand-in for train.py that logs its steps and leaves a finished run: the plan's config (from plan.json two levels
# up), its steps in metrics.jsonl, the last checkpoint and pipeline/ (as tests/compare/test_run.py's).
FAKE_TRAIN = """
import json, os, sys, time
import yaml
args = dict(a.split("=", 1) for a in sys.argv[2:] if "=" in a)
run, steps = args["train.run_dir"], int(args["train.max_steps"])
os.makedirs(run, exist_ok=True)
plan = json.load(open(os.path.join(run, "..", "..", "plan.json")))
config = next(a["config"] for a in plan["arms"] if a["name"] == os.path.basename(os.path.dirname(run)))
config["train"]["seed"] = int(args["train.seed"])
open(f"{run}/config.yaml", "w").write(yaml.safe_dump(config))
with open(f"{run}/metrics.jsonl", "w") as f:
    for s in range(1, steps + 1):
        f.write(json.dumps({"step": s, "loss": 1.0, "lr": 0.001}) + "\\n")
        f.flush()
        time.sleep(0.01)
os.makedirs(f"{run}/checkpoints/step_{steps:09d}", exist_ok=True)
open(f"{run}/checkpoints/step_{steps:09d}/config.yaml", "w").write(yaml.safe_dump(config))
open(f"{run}/checkpoints/step_{steps:09d}/meta.json", "w").write("{}")
os.makedirs(f"{run}/pipeline", exist_ok=True)
"""


def _compare_main(monkeypatch, tmp_path, *extra):
    """compare.py's main() in this process, with the stand-in for train.py."""
    tmp_path.mkdir()
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    spec = importlib.util.spec_from_file_location("compare_script", ROOT / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "_script", lambda name: str(script) if name == "train.py" else name)
    out = tmp_path / "cmp"
    monkeypatch.setattr(sys, "argv", ["compare.py", "run", str(ROOT / "configs" / "demo_digits.yaml"),
                                      f"train.max_steps={MAX_STEPS}", "--arm", "uvit", "model.attention=softmax",
                                      "--arm", "uvic", "--seeds", "0", "--out", str(out), *extra])
    module.main()
    return out


def test_compare_run_shows_one_progress_line_and_none_with_quiet(monkeypatch, tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO)
    _compare_main(monkeypatch, tmp_path / "loud")
    err = capsys.readouterr().err
    assert "compare: 100%|" in err and "200/200 steps" in err
    assert "], runs: 2 done, 0 running, 0 waiting; 0 s left" in err
    assert "runs: 0 done, 1 running (uvit seed 0 0/100), 1 waiting" in err  # drawn as the first run starts
    _compare_main(monkeypatch, tmp_path / "quiet", "--quiet")
    err = capsys.readouterr().err
    assert "compare:" not in err and "runs: " not in err
    assert "uvic seed 0: finished in" in caplog.text  # the log lines stay


def test_a_plan_of_other_runs_is_counted_from_their_own_max_steps(tmp_path):
    plan = make_plan(str(ROOT / "configs" / "demo_digits.yaml"), ["train.max_steps=7"],
                     [Arm("a"), Arm("b", ("train.max_steps=9",))], [0], tmp_path / "cmp")
    write_plan(plan)
    assert Progress(plan, plan.runs, enabled=False).bar.total == 16
