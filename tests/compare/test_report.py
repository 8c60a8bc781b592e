"""The report of synthetic comparison directories: report.json's shape and numbers, what is left out, the files."""

import base64
import io
import json
import math
import re
import time

import numpy as np
import pytest
from PIL import Image
from scipy import stats
from synthetic_runs import MAX_STEPS, write_run

from uvic.compare.report import build_report, write_report


STEPS = range(1, MAX_STEPS + 1)


def _losses(level, seed):
    """A decreasing loss curve, different per seed."""
    return {s: level + 1.0 / s + 0.01 * seed + 0.001 * math.sin(s + seed) for s in STEPS}


def _full(plan, levels={"uvit": 0.5, "uvic": 0.48}, seeds=(0, 1, 2)):
    for arm, level in levels.items():
        for seed in seeds:
            write_run(plan, arm, seed, losses=_losses(level, seed), val={50: level + 0.1 + 0.01 * seed,
                                                                         100: level + 0.05 + 0.01 * seed},
                      fids={50: 30 + 10 * level + seed, 100: 20 + 10 * level + seed + (arm == "uvic") * 0.1})


@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")  # scipy, on equal differences
def test_report_json_has_the_documented_shape_and_the_paired_statistics(make_comparison):
    plan = make_comparison()
    _full(plan)
    data = write_report(plan.out)
    assert json.loads((plan.out / "report.json").read_text()) == data
    assert set(data) == {"baseline", "arms", "seeds", "metrics", "per_block", "runs"} and data["per_block"] == {}
    assert (data["baseline"], data["arms"], data["seeds"]) == ("uvit", ["uvit", "uvic"], [0, 1, 2])
    assert list(data["metrics"]) == ["val_loss", "val_loss_mean", "train_loss", "fid_last", "fid_best"]
    for name, entry in data["metrics"].items():
        assert set(entry) == {"lower_is_better", "values", "vs_baseline"} and entry["lower_is_better"] is True
        assert set(entry["values"]) == {"uvit", "uvic"} and set(entry["vs_baseline"]) == {"uvic"}
        assert set(entry["vs_baseline"]["uvic"]) == {"n", "mean_diff", "ci95", "p_value", "relative", "verdict"}
    # Values, read independently of the registry: the last 5 of 100 training lines; the last validation line.
    for arm, level in [("uvit", 0.5), ("uvic", 0.48)]:
        for seed in range(3):
            loss = _losses(level, seed)
            assert data["metrics"]["train_loss"]["values"][arm][str(seed)] == pytest.approx(
                np.mean([loss[s] for s in range(96, 101)]), rel=1e-12)
            assert data["metrics"]["val_loss"]["values"][arm][str(seed)] == level + 0.05 + 0.01 * seed
            # Two validations: the mean over their span is their midpoint.
            assert data["metrics"]["val_loss_mean"]["values"][arm][str(seed)] == pytest.approx(
                level + 0.075 + 0.01 * seed, rel=1e-12)
            assert data["metrics"]["fid_best"]["values"][arm][str(seed)] == min(30 + 10 * level, 20 + 10 * level
                                                                                + (arm == "uvic") * 0.1) + seed
    # The statistics, against scipy.
    for name, entry in data["metrics"].items():
        arm = [entry["values"]["uvic"][str(s)] for s in range(3)]
        base = [entry["values"]["uvit"][str(s)] for s in range(3)]
        ref = stats.ttest_rel(arm, base)
        vs = entry["vs_baseline"]["uvic"]
        assert vs["n"] == 3 and vs["mean_diff"] == pytest.approx(np.mean(arm) - np.mean(base), abs=1e-12)
        if np.isfinite(ref.pvalue) and ref.pvalue > 0:
            assert vs["ci95"] == pytest.approx(list(ref.confidence_interval(0.95)), rel=1e-6)
            assert vs["p_value"] == pytest.approx(ref.pvalue, rel=1e-6)
        assert vs["relative"] == pytest.approx(vs["mean_diff"] / np.mean(base))
    assert data["metrics"]["val_loss"]["vs_baseline"]["uvic"]["verdict"] == "better"  # -0.02 on every seed
    assert data["metrics"]["val_loss"]["vs_baseline"]["uvic"]["p_value"] == 0.0
    assert all(s == {"state": "finished", "detail": ""} for seeds in data["runs"].values() for s in seeds.values())


def test_unfinished_failed_missing_and_foreign_runs_are_named_and_never_counted(make_comparison):
    plan = make_comparison(seeds=(0, 1, 2, 3))
    _full(plan, seeds=(0, 1))
    write_run(plan, "uvit", 2, losses=_losses(0.5, 2))
    write_run(plan, "uvic", 2, losses=dict.fromkeys(range(1, 41), 0.0), finished=False)  # killed at step 40
    write_run(plan, "uvit", 3, losses=_losses(0.5, 3), finished=False)
    (plan.out / "attempts.json").write_text(json.dumps({"uvit/seed_3": {"exit_code": 1, "error": "error: boom",
                                                                        "log": "uvit/seed_3.log"}}))
    other = write_run(plan, "uvic", 1, losses=_losses(0.48, 1), val={100: 0.5})
    (other / "config.yaml").write_text((other / "config.yaml").read_text().replace("lr: 0.0015", "lr: 0.1"))
    data = write_report(plan.out)
    runs = data["runs"]
    assert runs["uvic"]["2"] == {"state": "unfinished", "detail": f"last checkpoint at step 20 of {MAX_STEPS}"}
    assert runs["uvit"]["3"]["state"] == "failed" and runs["uvit"]["3"]["detail"].startswith("error: boom;")
    assert runs["uvic"]["3"] == {"state": "missing", "detail": ""}
    assert runs["uvic"]["1"]["state"] == "mismatch" and "train.lr is 0.0015 there, 0.1 here" in runs["uvic"]["1"]["detail"]
    train = data["metrics"]["train_loss"]
    assert set(train["values"]["uvit"]) == {"0", "1", "2"} and set(train["values"]["uvic"]) == {"0"}
    assert train["vs_baseline"]["uvic"]["n"] == 1 and train["vs_baseline"]["uvic"]["verdict"] == "inconclusive"
    md = (plan.out / "report.md").read_text()
    assert "4 of 8 runs finished" in md
    for line in ["uvic seed 2: unfinished (last checkpoint at step 20 of 100)", "uvit seed 3: failed (error: boom;",
                 "uvic seed 3: missing", "uvic seed 1: mismatch (its config.yaml differs from the plan:"]:
        assert f"- {line}" in md


def test_metrics_no_run_has_are_left_out_and_an_empty_comparison_reports_nothing(make_comparison):
    plan = make_comparison()
    assert build_report(plan.out)["metrics"] == {}
    write_report(plan.out)
    assert "No finished run yet" in (plan.out / "report.md").read_text()
    for seed in range(3):
        for arm in ("uvit", "uvic"):
            write_run(plan, arm, seed, losses=_losses(0.5, seed), grid=False)
    data = write_report(plan.out)
    assert list(data["metrics"]) == ["train_loss"]
    assert sorted(p.name for p in (plan.out / "figures").iterdir()) == ["curve_train_loss.png",
                                                                       "paired_train_loss.png"]


def test_report_files_link_every_figure_and_the_html_embeds_them(make_comparison):
    plan = make_comparison()
    _full(plan)
    write_report(plan.out)
    figures = sorted(p.name for p in (plan.out / "figures").iterdir())
    assert figures == ["curve_fid.png", "curve_train_loss.png", "curve_val_loss.png", "paired_fid_best.png",
                       "paired_fid_last.png", "paired_train_loss.png", "paired_val_loss.png", "paired_val_loss_mean.png",
                       "samples.png"]
    md = (plan.out / "report.md").read_text()
    assert sorted(re.findall(r"\]\(figures/([^)]+)\)", md)) == figures
    assert "| val_loss (lower is better) | uvit |" in md and "**better**" in md
    page = (plan.out / "report.html").read_text()
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert len(sources) == len(figures) and all(s.startswith("data:image/png;base64,") for s in sources)
    # Self-contained: no attribute points anywhere but a data URI, no stylesheet or script is fetched.
    assert re.findall(r'(?:src|href)="([^"]*)"', page) == sources
    assert "http://" not in page and "https://" not in page and "url(" not in page and "<script" not in page
    sizes = [Image.open(io.BytesIO(base64.b64decode(s.split(",", 1)[1]))).size for s in sources]
    assert all(w > 100 and h > 100 for w, h in sizes)


def test_per_block_attention_shares_and_accuracy_are_reported_from_the_last_validation(make_comparison):
    """The validation lines' `attn_neg_share` {block: share} (the last line's per run) becomes report.json's
    `per_block`, a table of the means over seeds and a figure; `val_accuracy` a metric where higher is better."""
    plan = make_comparison()
    blocks = ["in_blocks.0", "mid_block", "out_blocks.0"]
    last = {}
    for arm in ("uvit", "uvic"):
        for seed in range(3):
            cog = 0.0 if arm == "uvit" else 0.3 + 0.1 * seed
            last[arm, seed] = {"in_blocks.0": 0.0, "mid_block": cog, "out_blocks.0": 0.0}
            write_run(plan, arm, seed, losses=_losses(0.5, seed), val={50: 0.6, 100: 0.5}, grid=False,
                      shares={50: dict.fromkeys(blocks, 0.9), 100: last[arm, seed]},
                      extra_lines=json.dumps({"step": 100, "val_accuracy": 0.5 + 0.1 * (arm == "uvic") + 0.01 * seed})
                      + "\n")
    data = write_report(plan.out)
    assert data["per_block"] == {"attn_neg_share": {arm: {str(s): last[arm, s] for s in range(3)}
                                                    for arm in ("uvit", "uvic")}}
    accuracy = data["metrics"]["val_accuracy"]
    assert accuracy["lower_is_better"] is False and accuracy["vs_baseline"]["uvic"]["verdict"] == "better"
    assert accuracy["vs_baseline"]["uvic"]["mean_diff"] == pytest.approx(0.1)
    md = (plan.out / "report.md").read_text()
    assert "| block | uvit | uvic |" in md and "| mid_block | 0.000 | 0.400 |" in md and "| in_blocks.0 | 0.000 | 0.000 |" in md
    assert "](figures/blocks_attn_neg_share.png)" in md and "](figures/curve_val_accuracy.png)" in md
    assert Image.open(plan.out / "figures" / "blocks_attn_neg_share.png").size[0] > 100


def test_report_of_100_runs_with_1000_lines_each_takes_under_10_s_of_cpu(make_comparison):
    plan = make_comparison(seeds=range(50), overrides=["train.max_steps=1000"])
    for arm, level in [("uvit", 0.5), ("uvic", 0.48)]:
        for seed in range(50):
            write_run(plan, arm, seed, losses={s: level + 1 / s + 0.01 * seed for s in range(1, 1001)},
                      val=dict.fromkeys(range(100, 1001, 100), level), grid=seed < 4)
    start = time.process_time()
    data = write_report(plan.out)
    cpu = time.process_time() - start
    assert all(len(v) == 50 for v in data["metrics"]["train_loss"]["values"].values())
    assert cpu < 10, f"report of 100 runs took {cpu:.1f} s of CPU"
