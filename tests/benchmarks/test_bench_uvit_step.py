"""benchmarks/bench_uvit_step.py on CPU: the tiny presets end to end, its interleaved timing on a fake clock, the
time budget and a failing row."""

import re

import bench_uvit_step as bus  # benchmarks/, on the path from conftest.py
import pytest
import torch


TINY = ["--rounds", "1", "--repeat", "1", "--batch", "2", "--sample-batch", "2", "--sample-steps", "1"]
NUMBER = r"\s+\d+\.\d"


def test_tiny_presets_print_every_row(capsys):
    """Training rows of a pixel, a text-conditional and a class-conditional model, then the sampling row; each with
    both models' numbers, the ratio and the backend of the Cog blocks (the torch backend on CPU)."""
    bus.main(["--presets", "tiny-cifar", "tiny-t2i", "tiny-class", *TINY])
    out = capsys.readouterr().out
    assert out.startswith("device=cpu")
    for what in ("train tiny-cifar batch 2 fp32 eager", "train tiny-t2i batch 2 fp32 eager",
                 "train tiny-class batch 2 fp32 eager"):
        assert re.search(rf"^{what}{NUMBER}+{NUMBER}+\s+ms/step{NUMBER}+\s+torch$", out, re.M), out
    assert re.search(rf"^sample tiny-cifar batch 2 1 steps fp32 eager{NUMBER}+{NUMBER}+\s+images/s{NUMBER}+\s+torch$",
                     out, re.M), out


def test_interleaved_alternates_and_reports_the_median_ratio(monkeypatch):
    """On a fake clock that each call advances (U-ViT 2 units, U-ViC 3, one round 5 extra for U-ViC): medians of
    the per-call times and the median of per-round ratios, with the order alternating each round."""
    clock, order = [0.0], []
    monkeypatch.setattr(bus.time, "perf_counter", lambda: clock[0])

    def call(name, cost):
        def fn():
            order.append(name)
            clock[0] += cost[len([n for n in order if n == name]) - 1] if isinstance(cost, list) else cost

        return fn

    uvic_costs = [3.0] * 2 + [8.0] + [3.0] * 4  # warm-up (1), then rounds of 2 calls: round 0 has one slow call
    secs, ratio = bus.interleaved({"U-ViT": call("U-ViT", 2.0), "U-ViC": call("U-ViC", uvic_costs)},
                                  torch.device("cpu"), rounds=3, repeat=2, warmup=1)
    assert order == ["U-ViT", "U-ViC"] + ["U-ViT"] * 2 + ["U-ViC"] * 2 + ["U-ViC"] * 2 + ["U-ViT"] * 2 + \
        ["U-ViT"] * 2 + ["U-ViC"] * 2
    assert secs == {"U-ViT": 2.0, "U-ViC": 3.0}  # the slow round (5.5 per call) is not the median
    assert ratio == 1.5


def test_time_budget_skips_the_remaining_rows(capsys):
    bus.main(["--presets", "tiny-cifar", "tiny-t2i", "--budget-s", "1e-9", *TINY])
    out = capsys.readouterr().out
    assert re.search(r"^train tiny-cifar batch 2 fp32 eager", out, re.M)
    assert "skipped after 0 s (time budget): train tiny-t2i fp32 eager, sample tiny-cifar fp32 eager" in out
    assert "train tiny-t2i batch" not in out


def test_a_failing_row_is_reported_and_the_others_still_run(monkeypatch, capsys):
    real = bus._row

    def row(kind, what, *args):
        if kind == "sample":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(kind, what, *args)

    monkeypatch.setattr(bus, "_row", row)
    with pytest.raises(SystemExit, match=r"^error: 1 row\(s\) failed: sample tiny-cifar batch 2 1 steps fp32 eager$"):
        bus.main(["--presets", "tiny-cifar", *TINY])
    out = capsys.readouterr().out
    assert re.search(r"^train tiny-cifar batch 2 fp32 eager\s+\d", out, re.M)
    assert "failed: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB" in out
