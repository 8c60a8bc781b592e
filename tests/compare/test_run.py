"""Training a plan: resumable, `--jobs` at a time, failures recorded; and end to end on tiny real runs: a kill and
the same command again give the report of the plan's commands run by hand, and an A/A comparison is exact.

The orchestration tests run a stand-in for train.py (a few lines of Python that write what a finished run leaves,
or fail): they check `run_plan` itself in milliseconds. The end-to-end test trains real tiny U-ViTs."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file
from synthetic_runs import CONFIG

from uvic.compare.plan import Arm, make_plan, write_plan
from uvic.compare.run import pending_runs, run_plan
from uvic.compare.rundirs import read_attempts
from uvic.errors import ConfigError


ROOT = Path(__file__).resolve().parents[2]

# A stand-in for train.py: `train.run_dir=...` from its argv; writes the run's config (the plan's, from plan.json
# two levels up), the last checkpoint and pipeline/ of train.max_steps=N, records its argv and start / end times,
# and fails (exit 1, an `error:` line) for arm "bad".
FAKE_TRAIN = """
import json, os, sys, time
import yaml
args = dict(a.split("=", 1) for a in sys.argv[2:] if "=" in a)
run = args["train.run_dir"]
os.makedirs(run, exist_ok=True)
plan = json.load(open(os.path.join(run, "..", "..", "plan.json")))
config = next(a["config"] for a in plan["arms"] if a["name"] == os.path.basename(os.path.dirname(run)))
config["train"]["seed"] = int(args["train.seed"])
open(f"{run}/config.yaml", "w").write(yaml.safe_dump(config))
start = time.time()
time.sleep(float(os.environ.get("FAKE_TRAIN_SECONDS", "0.3")))
if "/bad/" in run:
    print("error: the loss became NaN or Inf at or before step 3", file=sys.stderr)
    sys.exit(1)
step = int(args.get("train.max_steps", 3200))
os.makedirs(f"{run}/checkpoints/step_{step:09d}", exist_ok=True)
open(f"{run}/checkpoints/step_{step:09d}/config.yaml", "w").write(yaml.safe_dump(config))
open(f"{run}/checkpoints/step_{step:09d}/meta.json", "w").write("{}")
os.makedirs(f"{run}/pipeline", exist_ok=True)
json.dump({"argv": sys.argv, "start": start, "end": time.time()}, open(f"{run}/fake.json", "w"))
"""


def _plan(tmp_path, arms=("a", "b"), seeds=(0, 1), overrides=()):
    plan = make_plan(CONFIG, ["train.max_steps=7", *overrides], [Arm(a) for a in arms], list(seeds), tmp_path / "cmp")
    write_plan(plan)
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    return plan, str(script)


def test_failures_are_recorded_and_the_other_runs_go_on(tmp_path):
    plan, script = _plan(tmp_path, arms=("a", "bad", "c"))
    failed = run_plan(plan, train_script=script)
    assert [r.label for r in failed] == ["bad seed 0", "bad seed 1"]
    attempts = read_attempts(plan.out)
    assert attempts["bad/seed_1"] == {"exit_code": 1, "log": "bad/seed_1.log",
                                      "error": "error: the loss became NaN or Inf at or before step 3"}
    assert attempts["a/seed_0"] == {"exit_code": 0, "error": "", "log": "a/seed_0.log"}
    assert all((plan.out / arm / f"seed_{s}" / "fake.json").is_file() for arm in ("a", "c") for s in (0, 1))
    # The log holds the command and its output.
    log = (plan.out / "bad" / "seed_0.log").read_text().splitlines()
    assert log[0].startswith("=== ") and shlex.split(log[0].split(": ", 1)[1])[1] == script and "error:" in log[1]
    # Run again: the finished runs are skipped, only the failed ones are attempted again.
    before = {p: p.stat().st_mtime_ns for p in plan.out.glob("[ac]/seed_*/fake.json")}
    assert [r.label for r in pending_runs(plan)] == ["bad seed 0", "bad seed 1"]
    assert len(run_plan(plan, train_script=script)) == 2
    assert {p: p.stat().st_mtime_ns for p in plan.out.glob("[ac]/seed_*/fake.json")} == before
    assert len([line for line in (plan.out / "bad" / "seed_0.log").read_text().splitlines()
                if line.startswith("=== ")]) == 2


def test_jobs_run_at_once_each_with_its_share_of_the_cores(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_TRAIN_SECONDS", "2")  # longer than 3 interpreters take to start on a loaded machine
    plan, script = _plan(tmp_path, seeds=(0, 1, 2))
    assert run_plan(plan, jobs=3, train_script=script) == []
    records = [json.loads((r.run_dir / "fake.json").read_text()) for r in plan.runs]
    # At most 3 at once, and the first 3 overlap.
    for t in [r["start"] for r in records] + [r["end"] - 1e-3 for r in records]:
        assert sum(r["start"] <= t < r["end"] for r in records) <= 3
    first = records[:3]
    assert max(r["start"] for r in first) < min(r["end"] for r in first)
    threads = max(1, len(os.sched_getaffinity(0)) // 3)
    for run, record in zip(plan.runs, records):
        argv = record["argv"]
        assert argv[1:] == [CONFIG, *run.overrides, f"train.cpu_threads={threads}", "--resume"]
    # A config that sets its threads keeps them; one job at a time changes nothing.
    monkeypatch.delenv("FAKE_TRAIN_SECONDS")
    plan, script = _plan(tmp_path / "t", overrides=["train.cpu_threads=5"])
    run_plan(plan, jobs=2, train_script=script)
    assert not any("train.cpu_threads=1" in a for r in plan.runs
                   for a in json.loads((r.run_dir / "fake.json").read_text())["argv"])


def test_a_run_that_exits_0_without_finishing_is_a_failure(tmp_path):
    plan, _ = _plan(tmp_path, seeds=(0,))
    fails, quits = tmp_path / "fails.py", tmp_path / "quits.py"
    fails.write_text("import sys\nsys.exit('error: an earlier attempt')\n")
    quits.write_text("print('something odd')\n")
    assert len(run_plan(plan, train_script=str(fails))) == 2
    assert read_attempts(plan.out)["a/seed_0"]["error"] == "error: an earlier attempt"
    assert len(run_plan(plan, train_script=str(quits))) == 2
    # The error of the last attempt (the log holds both).
    error = read_attempts(plan.out)["a/seed_0"]["error"]
    assert error == "train.py exited with status 0 but the run is not complete (something odd)"


# ---------------------------------------------------------------------------------------------------------
# End to end, real training
# ---------------------------------------------------------------------------------------------------------


def _tiny_shared(image_dir):
    """The shared overrides: a 2-block U-ViT on 8x8 images, 16 steps, a checkpoint every 4, a grid at the end."""
    return ["model.img_size=8", "model.patch_size=2", "model.embed_dim=16", "model.depth=2", "model.num_heads=2",
            "data.name=image_folder", f"data.root={image_dir}", "data.image_size=8", "data.num_workers=0",
            "train.batch_size=4", "train.max_steps=16", "train.warmup_steps=2", "train.lr=1e-3",
            "train.ema_decay=0.9", "train.log_every=1", "train.sample_every=16", "train.save_every=4",
            "train.log_with=none", "train.cpu_threads=1", "sample.num_images=4", "sample.num_inference_steps=2",
            "train.val_every=4"]


def _wait_unlocked(run_dirs, timeout=120.0):
    """Wait until no process holds the run dirs (the killed comparison's trainings have exited)."""
    from uvic.errors import RunLockedError
    from uvic.training.lock import RunDirLock

    deadline = time.time() + timeout
    for run_dir in run_dirs:
        while True:
            lock = RunDirLock(run_dir)
            try:
                lock.acquire()
                lock.release()
                break
            except RunLockedError:
                assert time.time() < deadline, f"{run_dir} is still held"
                time.sleep(0.2)


@pytest.mark.slow
def test_run_killed_then_run_again_equals_the_plan_run_by_hand_and_aa_is_exact(tmp_path, image_dir, run_script):
    shared = _tiny_shared(image_dir)
    arms = ["--arm", "a", "--arm", "b"]  # A/A: the same overrides
    args = [str(ROOT / "configs" / "cifar10_uvic_s2.yaml"), *shared, *arms, "--seeds", "0", "1"]

    # 1. The plan's commands, run by hand (in this process), then `report`.
    hand = tmp_path / "hand"
    code, stdout, err = run_script("compare.py", "plan", *args, "--out", hand)
    assert code == 0 and "A/A comparison" in err, err
    for line in stdout.splitlines():
        python, script, *rest = shlex.split(line)
        assert (python, script) == (sys.executable, "train.py")
        code, _, err = run_script(script, *rest)
        assert code == 0, err[-3000:]
    code, _, err = run_script("compare.py", "report", hand)
    assert code == 0, err
    by_hand = json.loads((hand / "report.json").read_text())

    # 2. `run`, killed (SIGKILL: no clean-up) once a run has its first checkpoint, then the same command again.
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "compare.py"), "run", *map(str, args), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen, deadline = out / "a" / "seed_0", time.time() + 300  # the first run of the plan
    while not (seen / "checkpoints" / "step_000000004" / "meta.json").is_file():
        assert first.poll() is None and time.time() < deadline, first.stderr.read().decode()[-3000:]
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    first.stderr.close()
    _wait_unlocked([seen])  # its training dies with its parent
    assert not (seen / "pipeline").exists()  # killed mid-run
    report = out / "report.json"
    assert not report.exists()
    again = subprocess.run([*command, "--jobs", "4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "4 of 4 runs finished" in again.stdout
    assert "], runs: 4 done, 0 running, 0 waiting; 0 s left" in again.stderr  # the one progress line, at its end
    log = (seen.parent / f"{seen.name}.log").read_text()
    assert [line[:4] for line in log.splitlines() if line.startswith("=== ")] == ["=== "] * 2  # two attempts
    assert "resumed from" in log
    by_run = json.loads(report.read_text())

    # 3. The same numbers, bit for bit; A/A: identical arms, a difference of exactly 0.
    assert by_run["metrics"] == by_hand["metrics"]
    metrics = by_run["metrics"]
    assert {"train_loss", "val_loss"} <= set(metrics)
    for name, entry in metrics.items():
        assert entry["values"]["a"] == entry["values"]["b"] and len(entry["values"]["a"]) == 2, name
        assert entry["vs_baseline"]["b"] == {"n": 2, "mean_diff": 0.0, "ci95": [0.0, 0.0], "p_value": None,
                                             "relative": 0.0, "verdict": "inconclusive"}, name
    for seed in (0, 1):
        weights = [load_file(out / arm / f"seed_{seed}" / "pipeline" / "transformer" /
                             "diffusion_pytorch_model.safetensors") for arm in ("a", "b")]
        assert weights[0].keys() == weights[1].keys()
        assert all(np.array_equal(weights[0][k], weights[1][k]) for k in weights[0])
        grids = [np.asarray(Image.open(out / arm / f"seed_{seed}" / "samples" / "step_0000016.png")) for arm in "ab"]
        assert np.array_equal(*grids)
    assert (out / "report.html").is_file() and (out / "figures" / "samples.png").is_file()


def test_a_three_arm_placement_comparison_runs_end_to_end(tmp_path, image_dir, run_script):
    """The paper's placement ablation as ordinary arms: U-ViT (softmax everywhere), U-ViC (Cog between a softmax
    first and last block) and Cog everywhere, 2 seeds; the plan's commands run by hand, then `report`."""
    from uvic.models.layers import Attention
    from uvic.training.runs import load_pipeline

    shared = [o for o in _tiny_shared(image_dir) if not o.startswith(("train.max_steps", "train.save_every",
                                                                       "train.sample_every", "train.val_every"))]
    shared += ["train.max_steps=4", "train.save_every=4", "train.sample_every=4", "train.val_every=2"]
    arms = ["--arm", "uvit", "model.attention=softmax", "--arm", "uvic",
            "--arm", "cog_all", "model.keep_softmax_first=0", "model.keep_softmax_last=0"]
    out = tmp_path / "cmp"
    code, stdout, err = run_script("compare.py", "plan", str(ROOT / "configs" / "cifar10_uvic_s2.yaml"), *shared,
                                   *arms, "--seeds", "0", "1", "--out", out)
    assert code == 0, err
    for line in stdout.splitlines():
        _, script, *rest = shlex.split(line)
        code, _, err = run_script(script, *rest)
        assert code == 0, err[-3000:]
    code, stdout, err = run_script("compare.py", "report", out)
    assert code == 0, err
    assert "6 of 6 runs finished" in stdout
    report = json.loads((out / "report.json").read_text())
    assert (report["baseline"], report["arms"]) == ("uvit", ["uvit", "uvic", "cog_all"])

    # Each arm trained the placement it names: blocks in execution order (in, mid, out).
    for arm, kinds in [("uvit", ["softmax"] * 3), ("uvic", ["softmax", "cog", "softmax"]), ("cog_all", ["cog"] * 3)]:
        model = load_pipeline(out / arm / "seed_0" / "pipeline").transformer
        assert [m.attention for m in model.modules() if isinstance(m, Attention)] == kinds, arm

    # The values are the runs' own last validation lines, and each arm is paired with the baseline seed by seed.
    val = report["metrics"]["val_loss"]
    for arm in report["arms"]:
        for seed in (0, 1):
            lines = (out / arm / f"seed_{seed}" / "metrics.jsonl").read_text().splitlines()
            last = [json.loads(line) for line in lines if "val_loss" in line][-1]
            assert last["step"] == 4 and val["values"][arm][str(seed)] == last["val_loss"]
    for arm in ("uvic", "cog_all"):
        diffs = [val["values"][arm][s] - val["values"]["uvit"][s] for s in ("0", "1")]
        vs = val["vs_baseline"][arm]
        assert vs["n"] == 2 and vs["mean_diff"] == pytest.approx(np.mean(diffs), rel=1e-12)
        assert vs["ci95"][0] < vs["mean_diff"] < vs["ci95"][1] and vs["verdict"] in ("better", "worse", "inconclusive")
        assert all(d != 0 for d in diffs)  # the placements are different models
    assert set(report["metrics"]["train_loss"]["vs_baseline"]) == {"uvic", "cog_all"}
    rows = [line for line in (out / "report.md").read_text().splitlines() if line.startswith("|  | ")]
    for arm in ("uvic", "cog_all"):  # a row per metric with its verdict, against the baseline
        verdict = val["vs_baseline"][arm]["verdict"]
        assert any(row.startswith(f"|  | {arm} |") and row.endswith(f"| **{verdict}** |") for row in rows), rows
    assert {p.name for p in (out / "figures").glob("*.png")} >= {"paired_val_loss.png", "curve_val_loss.png",
                                                                 "samples.png"}


def test_the_error_line_is_read_past_a_progress_bar(tmp_path):
    from uvic.compare.run import _error_line

    log = tmp_path / "seed_0.log"
    log.write_bytes(b"=== 2026-01-01 00:00:00: python train.py\n"
                    b"\r  0%|          | 0/6 [00:00<?, ?it/s]\r 50%|#####     | 3/6 [00:01<00:01, 2.90it/s]"
                    b"error: run dir x is in use by another training run (PID 12)\n")
    assert _error_line(log) == "error: run dir x is in use by another training run (PID 12)"
    log.write_bytes(b"=== header\nerror: a [b]error: c\n")  # a line that is an error line is kept whole
    assert _error_line(log) == "error: a [b]error: c"


def test_a_second_run_on_one_out_is_refused_up_front(tmp_path, run_script):
    """Another process holds the comparison (`compare.py run`): a second `run` exits 2 naming its PID and writes
    nothing; once it is gone, the same command runs."""
    from uvic.compare.run import lock_comparison

    plan, _ = _plan(tmp_path, seeds=(0,))
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
                               "from uvic.compare.run import lock_comparison\n"
                               f"lock = lock_comparison(Path({str(plan.out)!r}))\nprint('held', flush=True)\n"
                               "sys.stdin.read()\nlock.release()\n"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        before = {p.name: p.read_bytes() for p in plan.out.iterdir() if p.is_file()}
        code, out, err = run_script("compare.py", "run", CONFIG, "train.max_steps=7", "--arm", "a", "--arm", "b",
                                    "--seeds", "0", "--out", plan.out)
        assert code == 2 and out == "" and "Traceback" not in err
        errors = [line for line in err.splitlines() if "error:" in line]
        assert errors == [f"compare.py run: error: --out {plan.out} is in use by another `compare.py run` (PID "
                          f"{holder.pid}); wait for it to finish, or stop it (the same command continues it)"]
        assert {p.name: p.read_bytes() for p in plan.out.iterdir() if p.is_file()} == before
        assert not (plan.out / "a").exists()
    finally:
        holder.communicate("")
    assert holder.returncode == 0
    lock_comparison(plan.out).release()  # free again
    assert sorted(p.name for p in plan.out.iterdir()) == ["plan.json"]


def test_a_grown_comparison_trains_only_its_new_runs_and_keeps_the_others_bit_for_bit(tmp_path):
    from uvic.compare.plan import check_out_dir

    plan, script = _plan(tmp_path, arms=("a", "b"), seeds=(0,))
    assert run_plan(plan, train_script=script) == []
    old = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in plan.out.rglob("*") if p.is_file()
           and p.name not in ("plan.json", "attempts.json")}
    assert len(old) >= 2 * 5  # per run: config.yaml, fake.json, the checkpoint's two files, the log
    grown = make_plan(CONFIG, ["train.max_steps=7"], [Arm("a"), Arm("b"), Arm("c", ("train.lr=0.01",))], [0, 1],
                      plan.out)
    check_out_dir(grown)
    write_plan(grown)
    new = ["c seed 0", "a seed 1", "b seed 1", "c seed 1"]
    assert [r.label for r in pending_runs(grown)] == new
    assert run_plan(grown, train_script=script) == []
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in old} == old
    assert sorted(read_attempts(plan.out)) == sorted(r.key for r in grown.runs)
    for run in grown.runs:
        argv = json.loads((run.run_dir / "fake.json").read_text())["argv"]
        assert argv[1:] == [CONFIG, *run.overrides, "--resume"]
        assert (run.label in new) == (run.log_path.stat().st_mtime_ns not in [m for _, m in old.values()])


def _spin(seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        pass


@pytest.mark.slow
def test_a_comparison_run_twice_gives_identical_reports_even_beside_a_cpu_load(tmp_path, image_dir, run_script):
    """The same command, torch and thread counts give report.json values bit for bit, whatever else the CPU does:
    U-ViT vs U-ViC (the Cog arm's torch backend) trained twice, two runs at once with two threads each, the second
    time beside busy processes that keep every core loaded."""
    import multiprocessing

    shared = [o for o in _tiny_shared(image_dir) if not o.startswith(("train.max_steps", "train.save_every",
                                                                       "train.sample_every", "train.cpu_threads"))]
    shared += ["train.max_steps=8", "train.save_every=8", "train.sample_every=0", "train.cpu_threads=2"]
    args = [str(ROOT / "configs" / "cifar10_uvic_s2.yaml"), *shared, "--arm", "uvit", "model.attention=softmax",
            "--arm", "uvic", "--seeds", "0", "--jobs", "2"]
    reports = []
    for loaded in (False, True):
        busy = []
        if loaded:  # one spinning process per core, for longer than the comparison takes
            busy = [multiprocessing.get_context("spawn").Process(target=_spin, args=(600.0,), daemon=True)
                    for _ in range(min(4, len(os.sched_getaffinity(0))))]
            for p in busy:
                p.start()
        try:
            out = tmp_path / f"cmp_{int(loaded)}"
            code, stdout, err = run_script("compare.py", "run", *args, "--out", out)
        finally:
            for p in busy:
                p.terminate()
                p.join()
        assert code == 0 and "2 of 2 runs finished" in stdout, err[-3000:]
        reports.append(json.loads((out / "report.json").read_text()))
    quiet, loaded = reports
    assert {"train_loss", "val_loss"} <= set(quiet["metrics"])
    values = quiet["metrics"]["val_loss"]["values"]
    assert values["uvit"]["0"] != values["uvic"]["0"]  # two models: the equality below is not of constants
    assert loaded["metrics"] == quiet["metrics"]
    assert loaded.get("per_block") == quiet.get("per_block")


def test_a_run_log_that_is_a_symlink_out_of_the_comparison_is_refused_before_anything_is_written(
        make_comparison, tmp_path):
    """`compare.py run` appends each run's output to OUT/<arm>/seed_<seed>.log: a symlink there would be followed."""
    plan = make_comparison(seeds=(0,))
    outside = tmp_path / "elsewhere.txt"
    outside.write_text("kept")
    plan.run("uvic", 0).log_path.parent.mkdir(parents=True)
    plan.run("uvic", 0).log_path.symlink_to(outside)
    with pytest.raises(ConfigError, match=r"uvic/seed_0.log is a symlink \(to .*elsewhere.txt\): the comparison "
                                          r"writes its logs only inside --out; remove it"):
        pending_runs(plan)
    assert outside.read_text() == "kept"


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_kept(tmp_path):
    """OUT/.lock as a symlink: the lock's PID was written through it, over whatever file it named outside --out."""
    from uvic.compare.run import lock_comparison
    from uvic.errors import StorageError

    out = tmp_path / "cmp"
    out.mkdir()
    outside = tmp_path / "precious.txt"
    outside.write_text("kept\n")
    (out / ".lock").symlink_to(outside)
    with pytest.raises(StorageError, match=r"cmp/\.lock is a symlink \(to .*precious.txt\): a lock must be the "
                                           r"folder's own file; remove it"):
        lock_comparison(out)
    assert outside.read_text() == "kept\n" and (out / ".lock").is_symlink()
