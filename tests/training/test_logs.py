"""metrics.jsonl after an interrupted write: readers skip a partial last line, the next append cuts it off."""

import json

import pytest

from uvic.config import load_config
from uvic.training import train
from uvic.training.logs import append_metrics, move_metrics_after, read_metrics


def _write(path, records, partial):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + partial)


def test_a_partial_last_line_is_skipped_and_cut_off(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}], '{"step": 3, "lo')
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]
    append_metrics(path, {"step": 3, "loss": 0.25})
    assert path.read_text().splitlines() == ['{"step": 1, "loss": 1.0}', '{"step": 2, "loss": 0.5}',
                                             '{"step": 3, "loss": 0.25}']  # fmt: skip
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
