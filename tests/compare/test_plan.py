"""Planning a comparison: the runs and their train.py commands, plan.json, and every bad input refused up front.

The command line is `compare.py` run in this process (conftest's `run_script`): each refusal is exit status 2 with
one `error:` line, no traceback, and nothing written."""

import json
import shlex
import sys
from pathlib import Path

import pytest
from synthetic_runs import CONFIG

from uvic.compare.plan import Arm, Plan, config_difference, load_plan, make_plan, plan_growth
from uvic.config import load_config
from uvic.errors import ConfigError


ARMS = ["--arm", "uvit", "model.attention=softmax", "--arm", "uvic"]


def _refused(run_script, *args):
    code, out, err = run_script("compare.py", *args)
    assert code == 2, err
    assert "Traceback" not in err and out == ""
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    return errors[0]


def test_plan_prints_one_train_command_per_run_and_writes_plan_json(tmp_path, run_script):
    out = tmp_path / "cmp"
    code, stdout, err = run_script("compare.py", "plan", CONFIG, "train.max_steps=50", *ARMS, "--seeds", "3", "1",
                                   "--out", out, "--launcher", "accelerate launch --num_processes 8")
    assert code == 0, err
    commands = [shlex.split(line) for line in stdout.splitlines()]
    assert len(commands) == 4
    expected = [(arm, seed) for seed in (3, 1) for arm in ("uvit", "uvic")]  # seed by seed: pairs finish together
    for argv, (arm, seed) in zip(commands, expected):
        assert argv[:5] == ["accelerate", "launch", "--num_processes", "8", "train.py"]
        assert argv[5] == CONFIG and argv[-1] == "--resume"
        overrides = argv[6:-1]
        assert overrides[0] == "train.max_steps=50"
        assert overrides[-2:] == [f"train.seed={seed}", f"train.run_dir={out / arm / f'seed_{seed}'}"]
        assert ("model.attention=softmax" in overrides) == (arm == "uvit")
    plan = json.loads((out / "plan.json").read_text())
    assert (plan["config"], plan["overrides"], plan["seeds"]) == (CONFIG, ["train.max_steps=50"], [3, 1])
    assert [(a["name"], a["overrides"]) for a in plan["arms"]] == [("uvit", ["model.attention=softmax"]),
                                                                   ("uvic", [])]
    assert plan["arms"][0]["config"]["model"]["attention"] == "softmax"
    assert plan["arms"][1]["config"]["train"]["max_steps"] == 50 and "seed" not in plan["arms"][1]["config"]["train"]
    assert sorted(p.name for p in out.iterdir()) == ["plan.json"]  # nothing trained
    # Without a launcher: the Python that checked the plan (the one `run` uses), not whatever `python` a job's
    # PATH finds.
    code, stdout, _ = run_script("compare.py", "plan", CONFIG, "train.max_steps=50", *ARMS, "--seeds", "3", "1",
                                 "--out", out)
    assert code == 0 and all(shlex.split(line)[:2] == [sys.executable, "train.py"] for line in stdout.splitlines())


def test_the_plan_round_trips_through_plan_json(tmp_path):
    plan = make_plan(CONFIG, ["train.max_steps=5"], [Arm("a", ("train.lr=0.01",)), Arm("b")], [0, 2], tmp_path)
    from uvic.compare.plan import write_plan

    write_plan(plan)
    assert load_plan(tmp_path) == plan
    assert [r.run_dir for r in plan.runs] == [tmp_path / "a/seed_0", tmp_path / "b/seed_0", tmp_path / "a/seed_2",
                                              tmp_path / "b/seed_2"]


def test_an_arm_with_the_baselines_config_is_a_warning(tmp_path, run_script):
    code, _, err = run_script("compare.py", "plan", CONFIG, "--arm", "a", "--arm", "b", "model.attention=cog",
                              "--seeds", "0", "--out", tmp_path / "cmp")
    assert code == 0 and "arm 'b' has the same config as the baseline 'a': this is an A/A comparison" in err
    code, _, err = run_script("compare.py", "plan", CONFIG, *ARMS, "--seeds", "0", "--out", tmp_path / "cmp2")
    assert code == 0 and "A/A" not in err


@pytest.mark.parametrize("args, message", [
    ([*ARMS[:3], "--arm", "uvic", "model.attn=cog"], "arm 'uvic' (seed 0): unknown config key(s) ['model.attn']"),
    (["train.lr=-1", *ARMS], "with the shared overrides: config key train.lr: must be > 0, got -1"),
    ([*ARMS, "--arm", "uvit"], "duplicate arm name 'uvit'"),
    (["--arm", "uvit"], "a comparison needs at least two arms"),
    ([*ARMS, "--arm", "model.attention=cog"], "arm name 'model.attention=cog' must be letters"),
    ([*ARMS, "--arm", "a/b"], "arm name 'a/b' must be letters"),
    ([*ARMS, "--arm", "figures"], "arm name 'figures' must be"),
    # The comparison's own files: `--arm attempts.json` made every rerun fail, `--arm plan.json` too.
    ([*ARMS, "--arm", "attempts.json"], "arm name 'attempts.json' must be"),
    ([*ARMS, "--arm", "plan.json"], "arm name 'plan.json' must be"),
    ([*ARMS, "--arm", "Report.HTML"], "arm name 'Report.HTML' must be"),  # one file on case-insensitive systems
    ([*ARMS, "--arm", "a" * 300], "at most 100 characters"),  # passed plan and failed run with an OSError
    ([*ARMS, "--arm", ".."], "arm name '..' must be"),
    ([*ARMS, "--arm", "é"], "arm name 'é' must be"),
    ([*ARMS, "--arm", "UVIC"], "duplicate arm name (letter case aside"),
    ([*ARMS, "--arm", "x", "train.seed=3"], "arm 'x': train.seed is set by the comparison for each run"),
    (["train.run_dir=/tmp/x", *ARMS], "the shared overrides: train.run_dir is set by the comparison"),
])
def test_bad_arms_are_refused_before_anything_is_written(tmp_path, run_script, args, message):
    out = tmp_path / "cmp"
    for command in ("plan", "run"):
        line = _refused(run_script, command, CONFIG, *args, "--seeds", "0", "1", "--out", out)
        assert message in line
        assert not out.exists()


@pytest.mark.parametrize("seeds, message", [(["1", "2", "1"], "duplicate seed 1"),
                                            (["-1"], "config key train.seed: must be in [0, 2**32), got -1")])
def test_bad_seeds_are_refused(tmp_path, run_script, seeds, message):
    assert message in _refused(run_script, "run", CONFIG, *ARMS, "--seeds", *seeds, "--out", tmp_path / "cmp")
    assert not (tmp_path / "cmp").exists()


def test_jobs_below_one_and_a_missing_config_are_refused(tmp_path, run_script):
    line = _refused(run_script, "run", CONFIG, *ARMS, "--seeds", "0", "--out", tmp_path / "cmp", "--jobs", "0")
    assert "--jobs: must be >= 1, got 0" in line
    line = _refused(run_script, "run", tmp_path / "no.yaml", *ARMS, "--seeds", "0", "--out", tmp_path / "cmp")
    assert "config file not found" in line
    assert not (tmp_path / "cmp").exists()


def test_an_out_dir_of_another_comparison_is_refused_naming_the_difference(tmp_path, run_script):
    out = tmp_path / "cmp"
    code, _, err = run_script("compare.py", "plan", CONFIG, "train.max_steps=50", *ARMS, "--seeds", "0", "1",
                              "--out", out)
    assert code == 0, err
    before = (out / "plan.json").read_bytes()
    cases = [
        (["train.max_steps=50", "--arm", "x", *ARMS], ["0", "1"],
         "arms ['uvit', 'uvic'] there, ['x', 'uvit', 'uvic'] here (the first is the baseline; a comparison grows by "
         "arms added after its own)"),
        (["train.max_steps=50", "--arm", "uvic", "--arm", "uvit", "model.attention=softmax"], ["0", "1"],
         "arms ['uvit', 'uvic'] there, ['uvic', 'uvit'] here (the first is the baseline"),
        (["train.max_steps=50", *ARMS[:3], "--arm", "x"], ["0", "1"],
         "arms ['uvit', 'uvic'] there, ['uvit', 'x'] here"),  # an arm dropped
        (["train.max_steps=50", *ARMS], ["0", "2"], "seeds [0, 1] there, [0, 2] here (a comparison grows by seeds, "
                                                    "[1] dropped)"),
        (["train.max_steps=60", *ARMS, "--arm", "x"], ["0", "1"], "arm 'uvit': train.max_steps is 50 there, 60 here"),
    ]
    for args, seeds, message in cases:
        line = _refused(run_script, "run", CONFIG, *args, "--seeds", *seeds, "--out", out)
        assert f"--out {out} holds another comparison ({message}" in line
        assert "); the results of two plans are never mixed: choose another --out" in line
        assert (out / "plan.json").read_bytes() == before and sorted(p.name for p in out.iterdir()) == ["plan.json"]
    # The same comparison, spelled differently (seed order, a neutral key, another spelling of a value), is accepted.
    code, _, err = run_script("compare.py", "plan", CONFIG, "train.max_steps=50", "train.lr=0.0015",
                              "train.cpu_threads=1", *ARMS, "--seeds", "1", "0", "--out", out)
    assert code == 0, err


def test_an_out_dir_that_is_not_a_comparison_is_never_written(tmp_path, run_script):
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    line = _refused(run_script, "plan", CONFIG, *ARMS, "--seeds", "0", "--out", out)
    assert "is not empty and holds no plan.json" in line and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    line = _refused(run_script, "report", out)
    assert "holds no plan.json: not a comparison directory" in line
    (out / "plan.json").write_text("{not json")
    assert "is not a comparison plan (JSONDecodeError" in _refused(run_script, "report", out)


def test_a_run_dir_of_another_config_is_not_overwritten(tmp_path, run_script):
    out = tmp_path / "cmp"
    assert run_script("compare.py", "plan", CONFIG, *ARMS, "--seeds", "0", "--out", out)[0] == 0
    run_dir = out / "uvic" / "seed_0"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("train: {seed: 0, max_steps: 3}\n")
    line = _refused(run_script, "run", CONFIG, *ARMS, "--seeds", "0", "--out", out)
    assert f"{run_dir}: its config.yaml differs from the plan:" in line and "it is not overwritten" in line


def test_plan_and_config_differences():
    a = {"model": {"depth": 12, "attention": "cog"}, "train": {"lr": 1e-3, "cpu_threads": 0}}
    b = {"model": {"depth": 12, "attention": "softmax"}, "train": {"lr": 1e-3, "cpu_threads": 4}}
    assert config_difference(a, b) == "model.attention is 'cog' there, 'softmax' here"
    assert config_difference(a, {**a, "train": {"lr": 1e-3, "cpu_threads": 2}}) is None
    assert config_difference(a, {"model": a["model"]}) == "train.lr is 0.001 there, '(unset)' here"
    plan = Plan("c.yaml", (), (Arm("a"), Arm("b")), (0, 1), Path("."), {"a": a, "b": a})
    assert plan_growth(plan, plan) is None
    with pytest.raises(ConfigError, match="needs at least one seed"):
        make_plan(CONFIG, [], [Arm("a"), Arm("b")], [], "x")


def test_the_arms_of_one_seed_start_from_the_same_weights_and_draw_the_same_data_noise_and_times(
        tmp_path, image_dir, tiny_overrides, monkeypatch):
    """Common random numbers through the real loop: each run of a plan is trained as its command trains it, and
    what the loss sees at each step (the weights, the batch, the times and the noise) is captured."""
    import torch

    import uvic.training.losses as losses
    from uvic.training import train

    seen = []
    eps_losses = losses.eps_losses

    def capture(model, x0, t, eps, noise, **kwargs):
        out = eps_losses(model, x0, t, eps, noise, **kwargs)
        seen[-1].append({"weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
                         "x0": x0.clone(), "t": t.clone(), "eps": eps.clone(), "losses": out.detach().clone()})
        return out

    monkeypatch.setattr(losses, "eps_losses", capture)
    shared = [o for o in tiny_overrides(tmp_path, image_dir, **{"train.max_steps": 2, "train.save_every": 2, "train.warmup_steps": 0})
              if not o.startswith("train.run_dir=")]
    config = str(Path(CONFIG).with_name("cifar10_uvic_s2.yaml"))  # RGB, as the test's images
    plan = make_plan(config, shared, [Arm("uvit", ("model.attention=softmax",)), Arm("uvic")], [5], tmp_path / "c")
    for run in plan.runs:
        seen.append([])
        train(load_config(config, run.overrides))
    uvit, uvic = seen
    assert len(uvit) == len(uvic) == 2  # one loss per step
    first = [steps[0]["weights"] for steps in seen]
    assert first[0].keys() == first[1].keys() and all(torch.equal(first[0][k], first[1][k]) for k in first[0])
    for a, b in zip(uvit, uvic):  # every step
        for key in ("x0", "t", "eps"):
            assert torch.equal(a[key], b[key]), key
    # ... and the arms do differ: the same inputs give another loss, and the weights part after the first step.
    assert not torch.equal(uvit[0]["losses"], uvic[0]["losses"])
    assert not all(torch.equal(uvit[1]["weights"][k], uvic[1]["weights"][k]) for k in first[0])
    # Another seed draws other numbers (the capture would see a seed that is ignored).
    seen.append([])
    train(load_config(config, [*shared, "model.attention=softmax", "train.seed=6", f"train.run_dir={tmp_path / 'o'}"]))
    assert not torch.equal(seen[-1][0]["eps"], uvit[0]["eps"])
    assert not all(torch.equal(seen[-1][0]["weights"][k], first[0][k]) for k in first[0])


@pytest.mark.parametrize("out_name", ["x #y", " lead", "123", "a: b"])
def test_out_reaches_train_py_literally(tmp_path, run_script, monkeypatch, out_name):
    """--out is a path: each run's train.run_dir, read back as train.py reads its overrides (`load_config`), is
    the planned run dir itself; YAML used to cut `x #y` at the comment and drop the leading space of ` lead`."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / out_name
    code, stdout, err = run_script("compare.py", "plan", CONFIG, *ARMS, "--seeds", "0", "--out", out)
    assert code == 0, err
    assert (out / "plan.json").is_file() and sorted(p.name for p in tmp_path.iterdir()) == [out_name]
    for line, arm in zip(stdout.splitlines(), ["uvit", "uvic"]):
        _, _, config, *overrides, resume = shlex.split(line)
        assert resume == "--resume"
        assert load_config(config, overrides).train.run_dir == str(tmp_path / out_name / arm / "seed_0")
    # A relative --out with a leading space stays relative, beside plan.json.
    plan = make_plan(CONFIG, [], [Arm("a"), Arm("b", ("model.attention=softmax",))], [0], Path(" rel"))
    assert load_config(CONFIG, plan.run("a", 0).overrides).train.run_dir == " rel/a/seed_0"


def test_arm_names_are_portable_file_names():
    from uvic.compare.plan import check_arm_name

    for bad in ["-x", ".x", "", "a/b", "a\\b", "a" * 101, "FIGURES", "report.md", 3, None, "a\n"]:
        with pytest.raises(ConfigError, match="must be letters"):
            check_arm_name(bad)
    for good in ["a", "a..b", "uvit_s2-1.0", "a" * 100, "plan"]:
        check_arm_name(good)


def test_an_out_that_cannot_be_passed_literally_is_refused(tmp_path, run_script):
    line = _refused(run_script, "plan", CONFIG, *ARMS, "--seeds", "0", "--out", tmp_path / "a\x85b")  # NEL: YAML reads it as a line break
    assert "cannot be passed to train.py literally" in line
    assert sorted(tmp_path.iterdir()) == []


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["arms"][1].update(name=7), "arm name 7 must be"),
    (lambda d: d["arms"][1].update(name="../../x"), "arm name '../../x' must be"),
    (lambda d: d["arms"][1].update(name="attempts.json"), "arm name 'attempts.json' must be"),
    (lambda d: d["arms"][1]["config"].pop("train"), "arm 'uvic''s config has no 'train' section"),
    (lambda d: d["arms"][0]["config"]["train"].update(max_steps="9"), "arm 'uvit''s config has train.max_steps '9'"),
])
def test_a_damaged_plan_json_is_refused_by_report_in_one_line(tmp_path, run_script, edit, message):
    out = tmp_path / "cmp"
    assert run_script("compare.py", "plan", CONFIG, *ARMS, "--seeds", "0", "--out", out)[0] == 0
    data = json.loads((out / "plan.json").read_text())
    edit(data)
    (out / "plan.json").write_text(json.dumps(data))
    line = _refused(run_script, "report", out)
    assert str(out / "plan.json") in line and message in line
    assert not (out / "report.json").exists()


def test_an_unwritable_out_is_one_line(tmp_path, run_script):
    (tmp_path / "file").write_text("")
    for out in ["/proc/uvic-test/cmp", tmp_path / "file" / "cmp"]:
        code, stdout, err = run_script("compare.py", "plan", CONFIG, *ARMS, "--seeds", "0", "--out", out)
        assert code != 0 and "Traceback" not in err and stdout == ""
        assert [line for line in err.splitlines() if "error:" in line] == [
            line for line in err.splitlines() if line.startswith("error: cannot write")], err


def test_a_comparison_grows_by_arms_and_seeds(tmp_path, run_script):
    """Arms added after the others and seeds added: accepted, plan.json grows, and the old runs are kept (the
    trainings themselves: tests/compare/test_run.py)."""
    out = tmp_path / "cmp"
    assert run_script("compare.py", "plan", CONFIG, "train.max_steps=50", *ARMS, "--seeds", "0", "--out", out)[0] == 0
    code, stdout, err = run_script("compare.py", "plan", CONFIG, "train.max_steps=50", *ARMS, "--arm", "cog_all",
                                   "model.keep_softmax_first=0", "--seeds", "0", "1", "--out", out)
    assert code == 0, err
    assert f"--out {out}: the comparison grows by arms ['cog_all'] and seeds [1]" in err
    assert len(stdout.splitlines()) == 6
    assert load_plan(out).arm_names == ["uvit", "uvic", "cog_all"] and load_plan(out).seeds == (0, 1)


@pytest.mark.parametrize("seeds", [[0.7, 1], [True, 2], ["0", "1"], [0, None]])
def test_plan_json_seeds_must_be_integers(make_comparison, seeds):
    """A hand-edited seed 0.7 or true read as seed 0 or 1 would report another seed's run dir as this one."""
    plan = make_comparison(seeds=(0, 1))
    data = json.loads((plan.out / "plan.json").read_text())
    data["seeds"] = seeds
    (plan.out / "plan.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"plan.json is not a comparison plan \(ValueError: seeds: .* is not an integer\)"):
        load_plan(plan.out)
