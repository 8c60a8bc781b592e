"""metrics.jsonl: training and validation lines side by side, and after an interrupted write: readers skip a partial
last line, the next append cuts it off."""

import json

import pytest

from uvic.config import load_config
from uvic.training import train
from uvic.training.logs import append_metrics, metrics_of_kind, move_metrics_after, plot_loss_curve, read_metrics


def _write(path, records, partial):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + partial)


def test_a_partial_last_line_is_skipped_and_cut_off(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}], '{"step": 3, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]
    append_metrics(path, {"step": 3, "loss": 0.25})
    assert path.read_text().splitlines() == ['{"step": 1, "loss": 1.0}', '{"step": 2, "loss": 0.5}',
                                             '{"step": 3, "loss": 0.25}']
    # A partial line that is the whole file.
    _write(path, [], '{"st')
    append_metrics(path, {"step": 1})
    assert path.read_text() == '{"step": 1}\n'


def test_moving_records_of_an_abandoned_branch_skips_a_partial_line(tmp_path):
    path, dest = tmp_path / "metrics.jsonl", tmp_path / "abandoned.jsonl"
    _write(path, [{"step": s} for s in (1, 2, 3)], '{"step": 4')
    assert move_metrics_after(path, 1, dest) == 2
    assert read_metrics(path) == [{"step": 1}] and read_metrics(dest) == [{"step": 2}, {"step": 3}]


def test_a_damaged_middle_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"^{path} line 2 is not a metrics record \(JSONDecodeError"):
        read_metrics(path)


def test_resume_after_a_write_cut_short(tmp_path, image_dir, tiny_overrides):
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.max_steps": 2})))
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "loss": 0.1')  # killed while logging step 3
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.max_steps": 4, "train.resume": "latest"})))
    assert [r["step"] for r in map(json.loads, metrics.read_text().splitlines())] == [1, 2, 3, 4]
    assert (run / "loss_curve.png").is_file()


def test_training_and_validation_lines_of_one_step_are_both_kept(tmp_path):
    """A validation line {"step", "val_loss", ...} shares its step with the training line; a step logged again (a
    resumed run) replaces the line of its own kind only; moving and dropping take both kinds."""
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 1, "loss": 2.0, "lr": 0.1}, {"step": 2, "loss": 1.5, "lr": 0.1},
                  {"step": 2, "val_loss": 1.9, "val_ppl": 6.7}, {"step": 3, "loss": 1.2, "lr": 0.1},
                  {"step": 2, "loss": 1.4, "lr": 0.1}], "")
    assert read_metrics(path) == [{"step": 1, "loss": 2.0, "lr": 0.1}, {"step": 2, "loss": 1.4, "lr": 0.1},
                                  {"step": 2, "val_loss": 1.9, "val_ppl": 6.7}, {"step": 3, "loss": 1.2, "lr": 0.1}]
    assert metrics_of_kind(path, "val") == [{"step": 2, "val_loss": 1.9, "val_ppl": 6.7}]
    assert [r["step"] for r in metrics_of_kind(path, "train")] == [1, 2, 3]
    assert plot_loss_curve(path, tmp_path / "curve.png") == tmp_path / "curve.png"
    only_val = tmp_path / "val.jsonl"
    _write(only_val, [{"step": 5, "val_loss": 1.0}], "")
    assert plot_loss_curve(only_val, tmp_path / "val.png") == tmp_path / "val.png"
    assert move_metrics_after(path, 1, tmp_path / "abandoned.jsonl") == 4
    assert read_metrics(path) == [{"step": 1, "loss": 2.0, "lr": 0.1}]
    assert len(read_metrics(tmp_path / "abandoned.jsonl")) == 3  # steps 2 (both kinds, latest) and 3
    _write(path, [{"step": 1, "loss": 2.0}, {"step": 2, "val_loss": 1.0}], "")
    assert move_metrics_after(path, 1, None) == 1 and read_metrics(path) == [{"step": 1, "loss": 2.0}]


@pytest.mark.parametrize("line, problem", [
    (b'{"step": "3", "loss": 0.1}', "'step' is \"3\", not an integer >= 0"),
    (b'{"step": 1.7, "loss": 0.1}', "'step' is 1.7, not an integer >= 0"),
    (b'{"step": -1, "loss": 0.1}', "'step' is -1, not an integer >= 0"),
    (b'{"loss": 0.1, "lr": 0.1}', "no 'step'"),
    (b'{"step": 2, "loss": "abc"}', "'loss' is \"abc\", not a number"),
    (b'{"step": 2, "val_loss": null}', "'val_loss' is null, not a number"),
    (b'{"step": 2, "attn_neg_share": {"1": "x"}}', "'attn_neg_share' is {\"1\": \"x\"}, not a number"),
    (b"[2, 0.1]", "expected a JSON object, got list"),
    (b'\xff{"step": 2}', "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"),
])
def test_a_wrongly_typed_line_names_the_file_and_line_wherever_it_is_read(tmp_path, line, problem):
    """A line that parses but is not a record as the run writes it (a step that is not an integer, a value that is
    not a number) was read as a wrong step or crashed the plot; every reader now refuses it, naming the line."""
    from uvic.errors import RunRecordError
    from uvic.training.logs import check_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "loss": 1.0, "lr": 0.1}\n' + line + b'\n{"step": 3, "loss": 0.5, "lr": 0.1}\n')
    message = f"{path} line 2 is not a metrics record ({problem}); correct or delete the line"
    for read in (read_metrics, check_metrics, lambda p: plot_loss_curve(p, tmp_path / "curve.png"),
                 lambda p: move_metrics_after(p, 1, tmp_path / "dest.jsonl")):
        with pytest.raises(RunRecordError) as e:
            read(path)
        assert str(e.value) == message
    assert not (tmp_path / "curve.png").exists() and not (tmp_path / "dest.jsonl").exists()


def test_per_block_values_are_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 2, "val_loss": 1.0, "attn_neg_share": {"blocks.1": 0.25, "blocks.2": 0}}], "")
    assert read_metrics(path) == [{"step": 2, "val_loss": 1.0, "attn_neg_share": {"blocks.1": 0.25, "blocks.2": 0}}]


def test_a_damaged_metrics_line_stops_the_run_at_start_up(tmp_path, image_dir, tiny_overrides, run_script):
    """Read back at resume, a bad line was found after config.yaml was rewritten (or, with a step of "2", read as
    step 2): it is now one error line when the run starts, and the run dir is left as it was."""
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.max_steps": 2})))
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0].replace('"step": 1', '"step": "1"'), *lines[1:]]) + "\n")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml",
                              *tiny_overrides(run, image_dir, **{"train.max_steps": 4}), "--resume")
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: {metrics} line 1 is not a metrics record ('step' is \"1\", not an integer >= 0); correct or delete "
        "the line")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
