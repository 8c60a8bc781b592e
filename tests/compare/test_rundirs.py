"""Reading a run dir: logs kept apart by kind, partial lines skipped, a run's state from what is on disk."""

import json

import pytest
import yaml
from synthetic_runs import MAX_STEPS, write_run

from uvic.compare.rundirs import final_samples, read_attempts, read_logs, record_attempt, run_state


def test_training_and_validation_lines_of_one_step_are_both_kept(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0, "lr": 0.1}\n{"step": 2, "loss": 1.5, "lr": 0.1}\n{"step": 2, "val_loss": 1.7}\n'
        '{"step": 2, "attn_neg_share": {"1": 0.25}}\n'  # a line of extras: merged into the step's validation
        # A run resumed from step 1 logs step 2 again: the latest record of each kind wins.
        '{"step": 2, "loss": 1.4, "lr": 0.1}\n{"step": 3, "loss": 1.0, "lr": 0.1}\n{"step": 3, "val_loss": 1.2, "val_'
    )  # the last line was cut short by a kill
    (tmp_path / "eval.jsonl").write_text('{"step": 3, "fid": 40.0, "checkpoint": "checkpoints/step_000000003"}\n')
    logs = read_logs(tmp_path)
    assert [(r["step"], r["loss"]) for r in logs.train] == [(1, 2.0), (2, 1.4), (3, 1.0)]
    assert logs.val == [{"step": 2, "val_loss": 1.7, "attn_neg_share": {"1": 0.25}}]
    assert logs.evals == [{"step": 3, "fid": 40.0, "checkpoint": "checkpoints/step_000000003"}]


def test_a_damaged_middle_line_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"st\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ValueError, match="line 2 is not a metrics record"):
        read_logs(tmp_path)


def test_a_run_dir_without_logs_reads_as_empty(tmp_path):
    logs = read_logs(tmp_path)
    assert (logs.train, logs.val, logs.evals) == ([], [], [])


def test_run_states(make_comparison):
    plan = make_comparison(seeds=(0, 1, 2, 3, 4))
    write_run(plan, "uvit", 0, losses={1: 1.0})
    write_run(plan, "uvit", 1, losses=dict.fromkeys(range(1, 31), 1.0), finished=False)
    write_run(plan, "uvit", 2, losses=dict.fromkeys(range(1, 31), 1.0), finished=False)
    record_attempt(plan.out, plan.run("uvit", 2), 1, "error: the loss became NaN", "uvit/seed_2.log")
    record_attempt(plan.out, plan.run("uvit", 1), 0, "", "uvit/seed_1.log")  # exited 0 earlier, resumed since
    d = write_run(plan, "uvit", 3, losses={1: 1.0})
    (d / "checkpoints" / f"step_{MAX_STEPS:09d}" / "meta.json").unlink()  # export of an earlier step by hand
    attempts = read_attempts(plan.out)
    assert set(attempts) == {"uvit/seed_1", "uvit/seed_2"}
    state = {seed: run_state(plan, plan.run("uvit", seed), attempts) for seed in range(5)}
    assert (state[0].state, state[0].detail) == ("finished", "")
    assert (state[1].state, state[1].detail) == ("unfinished", f"last checkpoint at step 15 of {MAX_STEPS}")
    assert (state[2].state, state[2].detail) == ("failed", f"error: the loss became NaN; last checkpoint at step 15 "
                                                           f"of {MAX_STEPS}")
    assert state[3].state == "unfinished"  # pipeline/ alone is not completion: the last checkpoint must exist
    assert (state[4].state, state[4].detail) == ("missing", "")


def test_a_run_dir_of_another_config_is_a_mismatch_but_neutral_keys_do_not_count(make_comparison):
    plan = make_comparison(seeds=(0, 1))
    d = write_run(plan, "uvic", 0, losses={1: 1.0})
    text = (d / "config.yaml").read_text()
    (d / "config.yaml").write_text(text.replace("cpu_threads: 0", "cpu_threads: 1").replace("num_workers: 0",
                                                                                           "num_workers: 3"))
    assert run_state(plan, plan.run("uvic", 0), {}).state == "finished"
    (d / "config.yaml").write_text(text.replace("attention: cog", "attention: softmax"))
    state = run_state(plan, plan.run("uvic", 0), {})
    assert state.state == "mismatch" and "model.attention is 'cog' there, 'softmax' here" in state.detail
    d = write_run(plan, "uvic", 1, losses={1: 1.0})
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    cfg["train"]["seed"] = 7  # another seed's run copied here
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert "train.seed is 1 there, 7 here" in run_state(plan, plan.run("uvic", 1), {}).detail


def test_the_final_samples_are_the_grid_of_the_last_step_where_the_task_writes_it(tmp_path):
    from uvic.training.tasks import sample_path

    assert final_samples(tmp_path, 1000) is None
    (tmp_path / "samples").mkdir()
    for name in ["step_0000900.png", "step_0001200.png", "grid.png"]:  # none of the last step
        (tmp_path / "samples" / name).write_bytes(b"")
    assert final_samples(tmp_path, 1000) is None
    sample_path(tmp_path, 1000, ".png").write_bytes(b"")
    assert final_samples(tmp_path, 1000) == tmp_path / "samples" / "step_0001000.png"


def test_attempts_are_rewritten_whole(tmp_path, make_comparison):
    plan = make_comparison(seeds=(0,))
    record_attempt(plan.out, plan.run("uvic", 0), 1, "error: x", "uvic/seed_0.log")
    record_attempt(plan.out, plan.run("uvic", 0), 0, "", "uvic/seed_0.log")
    assert json.loads((plan.out / "attempts.json").read_text()) == {
        "uvic/seed_0": {"exit_code": 0, "error": "", "log": "uvic/seed_0.log"}}


def test_a_run_dir_counts_only_if_provably_the_arms_run(make_comparison):
    """The other arm's seed copied in with its config.yaml removed, a config.yaml edited back to the arm's while the
    checkpoints say otherwise, a record that is a symlink to the other arm's: none is this arm's run."""
    import shutil

    from uvic.compare.report import write_report

    plan = make_comparison(seeds=(0, 1, 2, 3))
    for seed in range(4):
        write_run(plan, "uvit", seed, losses={MAX_STEPS: 1.0}, val={MAX_STEPS: 0.5 + seed})
    mine = write_run(plan, "uvic", 0, losses={MAX_STEPS: 1.0}, val={MAX_STEPS: 0.4})
    # Seed 1: uvit's run copied in, its config.yaml removed.
    copied = plan.run("uvic", 1).run_dir
    shutil.copytree(plan.run("uvit", 1).run_dir, copied)
    (copied / "config.yaml").unlink()
    # Seed 2: uvit's run copied in and its config.yaml replaced by uvic's; its checkpoint still says softmax.
    relabelled = plan.run("uvic", 2).run_dir
    shutil.copytree(plan.run("uvit", 2).run_dir, relabelled)
    cfg = yaml.safe_load((mine / "config.yaml").read_text())
    cfg["train"]["seed"] = 2
    (relabelled / "config.yaml").write_text(yaml.safe_dump(cfg))
    # Seed 3: uvic's own run, but its metrics.jsonl a symlink to uvit's.
    linked = write_run(plan, "uvic", 3, losses={MAX_STEPS: 1.0}, val={MAX_STEPS: 0.1})
    (linked / "metrics.jsonl").unlink()
    (linked / "metrics.jsonl").symlink_to(plan.run("uvit", 3).run_dir / "metrics.jsonl")
    states = {seed: run_state(plan, plan.run("uvic", seed), {}) for seed in range(4)}
    assert states[0].state == "finished"
    assert (states[1].state, states[1].detail) == (
        "mismatch", "it holds checkpoints or an export but no config.yaml, so nothing shows it is this arm's run")
    assert states[2].state == "mismatch" and states[2].detail.startswith(f"its checkpoint step_{MAX_STEPS:09d}: "
                                                                         "config.yaml differs from the plan: ")
    assert "model.attention is 'cog' there, 'softmax' here" in states[2].detail
    assert states[3].state == "mismatch" and states[3].detail.startswith("its metrics.jsonl is a symlink (to ")
    data = write_report(plan.out)
    assert data["metrics"]["val_loss"]["values"]["uvic"] == {"0": 0.4}
    assert data["metrics"]["val_loss"]["vs_baseline"]["uvic"]["n"] == 1
    assert [data["runs"]["uvic"][str(s)]["state"] for s in range(4)] == ["finished"] + ["mismatch"] * 3
    md = (plan.out / "report.md").read_text()
    assert "- uvic seed 3: mismatch (its metrics.jsonl is a symlink (to " in md and "5 of 8 runs finished" in md


def test_a_record_that_resolves_outside_the_run_dir_is_a_mismatch(make_comparison, tmp_path):
    plan = make_comparison(seeds=(0,))
    d = write_run(plan, "uvic", 0, losses={MAX_STEPS: 1.0})
    elsewhere = tmp_path / "elsewhere"
    (d / "pipeline").rename(elsewhere)
    (d / "pipeline").symlink_to(elsewhere)
    state = run_state(plan, plan.run("uvic", 0), {})
    assert state.state == "mismatch" and state.detail == (f"its pipeline is a symlink (to {elsewhere}): a run's "
                                                          f"records must be its own files")
    (d / "pipeline").unlink()
    (d / "pipeline").mkdir()
    ckpt = d / "checkpoints" / f"step_{MAX_STEPS:09d}"
    (ckpt / "config.yaml").rename(tmp_path / "c.yaml")
    (ckpt / "config.yaml").symlink_to(tmp_path / "c.yaml")
    state = run_state(plan, plan.run("uvic", 0), {})
    assert state.state == "mismatch" and state.detail.startswith(f"its checkpoints/step_{MAX_STEPS:09d}/config.yaml "
                                                                 f"is a symlink")
    (ckpt / "config.yaml").unlink()
    state = run_state(plan, plan.run("uvic", 0), {})
    assert state.detail == f"its checkpoint step_{MAX_STEPS:09d} has no config.yaml, so nothing shows it is this arm's run"
    # A run dir, or an arm's folder, that is a symlink to another's (an A/A comparison's configs agree).
    aa = make_comparison(arms={"a": [], "b": []}, seeds=(0,), out=tmp_path / "aa")
    write_run(aa, "a", 0, losses={MAX_STEPS: 1.0})
    (aa.out / "b").mkdir()
    (aa.out / "b" / "seed_0").symlink_to(aa.run("a", 0).run_dir)
    state = run_state(aa, aa.run("b", 0), {})
    assert state.state == "mismatch" and state.detail.startswith(f"{aa.out / 'b' / 'seed_0'} is a symlink (to ")
    (aa.out / "b" / "seed_0").unlink()
    (aa.out / "b").rmdir()
    (aa.out / "b").symlink_to(aa.out / "a")
    assert run_state(aa, aa.run("b", 0), {}).detail.startswith(f"{aa.out / 'b'} is a symlink (to ")


def test_an_attempts_json_entry_that_is_not_a_record_is_ignored(make_comparison):
    plan = make_comparison(seeds=(0,))
    write_run(plan, "uvic", 0, losses={10: 1.0}, finished=False)
    (plan.out / "attempts.json").write_text(json.dumps({"uvic/seed_0": "boom", "uvit/seed_0": [1]}))
    assert read_attempts(plan.out) == {}
    state = run_state(plan, plan.run("uvic", 0), read_attempts(plan.out))
    assert (state.state, state.detail) == ("unfinished", f"last checkpoint at step 5 of {MAX_STEPS}")


@pytest.mark.parametrize("inside", [f"checkpoints/step_{MAX_STEPS:09d}/model.safetensors", "pipeline/unet/weights.bin"])
def test_weights_in_the_last_checkpoint_or_the_export_linked_to_another_arm_are_a_mismatch(make_comparison, inside):
    """The protocol FID samples the last checkpoint's weights: another arm's linked in would be scored as this one's."""
    plan = make_comparison(seeds=(0,))
    theirs = write_run(plan, "uvit", 0, losses={MAX_STEPS: 1.0}) / inside
    ours = write_run(plan, "uvic", 0, losses={MAX_STEPS: 1.0}) / inside
    theirs.parent.mkdir(parents=True, exist_ok=True)
    theirs.write_bytes(b"softmax weights")
    ours.parent.mkdir(parents=True, exist_ok=True)
    ours.symlink_to(theirs)
    state = run_state(plan, plan.run("uvic", 0), {})
    assert (state.state, state.detail) == ("mismatch", f"its {inside} is a symlink (to {theirs}): a run's records "
                                                       f"must be its own files")
    assert run_state(plan, plan.run("uvit", 0), {}).state == "finished"


def test_validation_json_linked_to_another_run_is_a_mismatch(make_comparison, tmp_path):
    """validation.json (the held-out split and count the headlines quote) is a record like metrics.jsonl: a symlink,
    a file outside the run dir, or one file hard-linked into two runs is not the run's own."""
    from uvic.compare.rundirs import shared_records

    plan = make_comparison(seeds=(0,))
    record = {"split": "the data's test split", "examples": 1000, "held_out": 10_000}
    theirs = write_run(plan, "uvit", 0, losses={MAX_STEPS: 1.0}, validation=record) / "validation.json"
    ours = write_run(plan, "uvic", 0, losses={MAX_STEPS: 1.0}, validation=record) / "validation.json"
    assert run_state(plan, plan.run("uvic", 0), {}).state == "finished"
    ours.unlink()
    ours.symlink_to(theirs)
    state = run_state(plan, plan.run("uvic", 0), {})
    assert (state.state, state.detail) == ("mismatch", f"its validation.json is a symlink (to {theirs}): a run's "
                                                       f"records must be its own files")
    ours.unlink()
    ours.hardlink_to(theirs)
    assert run_state(plan, plan.run("uvic", 0), {}).state == "finished"  # no symlink: only the pair shows it
    why = ("its validation.json is the same file as that of {} (a hard link or a folder mounted twice): a run's "
           "records must be its own files")
    assert shared_records(plan, plan.runs) == {("uvit", 0): why.format("uvic seed 0"),
                                               ("uvic", 0): why.format("uvit seed 0")}
