"""The metric and curve registries: what each entry reads from a run's logs."""

from pathlib import Path

import numpy as np
import pytest

from uvic.compare.metrics import CURVES, METRICS, PER_BLOCK
from uvic.compare.rundirs import RunLogs


def _logs(losses=(), val=(), fids=()):
    return RunLogs(Path("."), [{"step": i + 1, "loss": v, "lr": 0.1} for i, v in enumerate(losses)],
                   [{"step": s, "val_loss": v} for s, v in val], [{"step": s, "fid": v} for s, v in fids])


def _read(name, logs):
    return next(m for m in METRICS if m.name == name).read(logs)


def test_names_and_directions_are_unique_and_documented():
    assert [m.name for m in METRICS] == ["val_loss", "val_accuracy", "val_loss_mean", "val_accuracy_mean",
                                         "train_loss", "fid_last", "fid_best", "fid_protocol"]
    assert all(m.lower_is_better == ("accuracy" not in m.name) and m.description for m in METRICS)
    assert len({c.name for c in CURVES}) == len(CURVES)
    assert [b.name for b in PER_BLOCK] == ["attn_neg_share"] and all(b.description for b in PER_BLOCK)


def test_accuracy_is_the_last_validation_and_shares_the_last_line_that_has_them():
    shares = [{"a.0": 0.0, "a.1": 0.25}, {"a.0": 0.0, "a.1": 0.5, "a.2": float("nan")}]
    logs = RunLogs(Path("."), [], [{"step": 1, "val_loss": 2.0, "val_accuracy": 0.1, "attn_neg_share": shares[0]},
                                   {"step": 2, "val_loss": 1.0, "val_accuracy": 0.3, "attn_neg_share": shares[1]},
                                   {"step": 3, "val_loss": 0.5}], [])
    assert _read("val_accuracy", logs) == 0.3
    assert PER_BLOCK[0].read(logs) == {"a.0": 0.0, "a.1": 0.5}  # a non-finite share is left out
    assert PER_BLOCK[0].read(_logs(val=[(1, 0.5)])) == {}


@pytest.mark.parametrize("n, tail", [(100, 5), (1000, 50), (30, 2), (19, 1), (1, 1)])
def test_train_loss_is_the_mean_of_the_last_5_percent_of_logged_steps(n, tail):
    losses = [float(i * i) for i in range(n)]  # ceil(0.05 n) lines, at least one
    assert _read("train_loss", _logs(losses)) == sum(losses[-tail:]) / tail


def test_val_loss_is_the_last_validation_and_fid_the_last_and_best():
    logs = _logs([1.0], val=[(10, 0.5), (20, 0.4), (30, 0.45)], fids=[(10, 9.0), (20, 7.0), (30, 8.0)])
    assert (_read("val_loss", logs), _read("fid_last", logs), _read("fid_best", logs)) == (0.45, 8.0, 7.0)


def test_the_protocol_fid_is_the_mean_of_the_runs_resamplings(tmp_path):
    logs = RunLogs(tmp_path, [], [], [])
    assert _read("fid_protocol", logs) is None  # none computed
    (tmp_path / "fid_protocol.json").write_text('{"protocol": {}, "fids": [3.0, 4.5, 5.25]}')
    assert _read("fid_protocol", logs) == 4.25
    (tmp_path / "fid_protocol.json").write_text('{"protocol": {}, "fids": [3.0, Infinity]}')
    assert _read("fid_protocol", logs) is None


def test_curve_means_are_the_trapezoidal_area_over_the_span_of_the_validations():
    # A straight line's trapezoidal area is exact: its mean is the midpoint's value.
    line = _logs(val=[(s, 1.0 - 0.002 * s) for s in (100, 200, 300, 400, 500)])
    assert _read("val_loss_mean", line) == pytest.approx(1.0 - 0.002 * 300, abs=1e-15)
    # Unequally spaced, unordered steps: numpy's trapezoid over the sorted steps, divided by the span.
    rng = np.random.default_rng(0)
    steps = rng.choice(np.arange(1, 10_000), size=40, replace=False)
    values = rng.random(40)
    order = np.argsort(steps)
    expected = np.trapezoid(values[order], steps[order]) / (steps.max() - steps.min())
    assert _read("val_loss_mean", _logs(val=list(zip(steps.tolist(), values.tolist())))) == pytest.approx(expected)
    assert _read("val_loss_mean", _logs(val=[(7, 0.25)])) == 0.25  # one validation: its value
    assert _read("val_loss_mean", _logs(val=[(1, 0.5), (2, float("nan"))])) is None


def test_accuracy_mean_is_higher_for_the_run_that_learns_sooner_with_the_same_last_value():
    def run(curve):
        return RunLogs(Path("."), [], [{"step": s, "val_loss": 1.0, "val_accuracy": a} for s, a in curve], [])

    sooner = run([(250, 0.25), (500, 1.0), (750, 1.0), (1000, 1.0)])
    later = run([(250, 0.25), (500, 0.25), (750, 0.25), (1000, 1.0)])
    assert _read("val_accuracy", sooner) == _read("val_accuracy", later) == 1.0
    # Areas over the 750-step span: 250 * (0.625 + 1 + 1) and 250 * (0.25 + 0.25 + 0.625).
    assert _read("val_accuracy_mean", sooner) == pytest.approx(2.625 / 3)
    assert _read("val_accuracy_mean", later) == pytest.approx(1.125 / 3)


def test_absent_or_non_finite_values_are_none():
    empty = _logs()
    assert all(m.read(empty) is None for m in METRICS)
    assert _read("train_loss", _logs([1.0, float("nan")])) is None
    assert _read("fid_best", _logs(fids=[(1, float("inf")), (2, 3.0)])) == 3.0


def test_curves_are_step_to_value():
    logs = _logs([2.0, 1.0], val=[(2, 1.5)], fids=[(2, 30.0)])
    assert {c.name: c.read(logs) for c in CURVES} == {"train_loss": {1: 2.0, 2: 1.0}, "val_loss": {2: 1.5},
                                                       "val_accuracy": {}, "fid": {2: 30.0}}
