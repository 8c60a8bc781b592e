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
from uvic.errors import StorageError


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
    assert set(data) == {"baseline", "arms", "seeds", "metrics", "per_block", "per_block_excluded", "runs"}
    assert data["per_block"] == data["per_block_excluded"] == {}
    assert (data["baseline"], data["arms"], data["seeds"]) == ("uvit", ["uvit", "uvic"], [0, 1, 2])
    assert list(data["metrics"]) == ["val_loss", "val_loss_mean", "train_loss", "fid_last", "fid_best"]
    for name, entry in data["metrics"].items():
        assert set(entry) == {"lower_is_better", "values", "vs_baseline", "excluded", "provenance", "comparable",
                              "reason", "headline"}
        assert entry["lower_is_better"] is True and entry["excluded"] == {"uvit": {}, "uvic": {}}
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


def test_per_block_shares_are_paired_only_at_the_last_step(make_comparison):
    """A run whose last shares are of step 50 (its step-100 validation without them) or of a step after the last
    would put another step's shares beside the others' step-100 ones: it is left out, named, as a metric's run."""
    plan = make_comparison(seeds=(0, 1, 2))
    at = {seed: {"in_blocks.0": 0.0, "mid_block": 0.1 * (seed + 1)} for seed in range(3)}
    early = {"in_blocks.0": 0.0, "mid_block": 0.9}
    for arm in ("uvit", "uvic"):
        for seed in range(3):
            write_run(plan, arm, seed, losses={MAX_STEPS: 1.0}, val={50: 0.6, MAX_STEPS: 0.5}, grid=False,
                      shares={50: early, MAX_STEPS: at[seed]})
    write_run(plan, "uvic", 1, losses={MAX_STEPS: 1.0}, val={50: 0.6, MAX_STEPS: 0.5}, grid=False,
              shares={50: early})
    write_run(plan, "uvic", 2, losses={MAX_STEPS: 1.0}, val={50: 0.6, MAX_STEPS: 0.5, 150: 0.4}, grid=False,
              shares={50: early, MAX_STEPS: at[2], 150: early})
    data = write_report(plan.out)
    assert data["per_block"] == {"attn_neg_share": {"uvit": {str(s): at[s] for s in range(3)}, "uvic": {"0": at[0]}}}
    assert data["per_block_excluded"] == {"attn_neg_share": {"uvit": {}, "uvic": {
        "1": f"metrics.jsonl has no attn_neg_share at step {MAX_STEPS}, the last step (its last is at step 50)",
        "2": f"metrics.jsonl has attn_neg_share at step 150, after the last step {MAX_STEPS}: not a record of this "
             "run"}}}
    md = (plan.out / "report.md").read_text()
    assert "| mid_block | 0.200 | 0.100 |" in md  # uvit: the mean of 0.1, 0.2, 0.3; uvic: seed 0's alone
    assert (f"- uvic seed 1: metrics.jsonl has no attn_neg_share at step {MAX_STEPS}, the last step (its last is at "
            "step 50)") in md


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


def _strict_json(path):
    """report.json parsed as strict JSON: NaN or Infinity in it (not JSON) is an error."""
    def refuse(token):
        raise ValueError(f"{token} in {path}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_no_seed_leaves_a_pairing_silently(make_comparison):
    """A NaN validation loss, a finished run without metrics.jsonl, a run whose last validation line is lost: each
    is named under the metric it leaves, with the file and what is wrong, and values are paired at one step only."""
    plan = make_comparison(seeds=(0, 1, 2, 3))
    _full(plan, seeds=(0, 1, 2, 3))
    nan = plan.run("uvic", 1).run_dir / "metrics.jsonl"
    lines = nan.read_text().splitlines()
    last_val = max(i for i, line in enumerate(lines) if "val_loss" in line)
    lines[last_val] = '{"step": 100, "val_loss": NaN}'  # Python's json writes a NaN so
    nan.write_text("\n".join(lines) + "\n")
    (plan.run("uvic", 2).run_dir / "metrics.jsonl").unlink()
    cut = plan.run("uvit", 3).run_dir / "metrics.jsonl"
    cut.write_text("".join(line + "\n" for line in cut.read_text().splitlines() if '"val_loss"' not in line
                           or '"step": 50' in line))
    data = write_report(plan.out)
    val = data["metrics"]["val_loss"]
    assert val["excluded"] == {
        "uvit": {"3": "metrics.jsonl has no val_loss at step 100, the last step (its last is at step 50)"},
        "uvic": {"1": "metrics.jsonl: val_loss is nan at step 100", "2": "metrics.jsonl is missing"}}
    assert set(val["values"]["uvit"]) == {"0", "1", "2"} and set(val["values"]["uvic"]) == {"0", "3"}
    # Paired: only seed 0 is in both; its difference is the hand-made 0.48 - 0.5 at step 100.
    assert val["vs_baseline"]["uvic"]["n"] == 1
    assert val["vs_baseline"]["uvic"]["mean_diff"] == pytest.approx(-0.02, abs=1e-12)
    assert data["metrics"]["val_loss_mean"]["excluded"]["uvit"] == val["excluded"]["uvit"]
    assert data["metrics"]["train_loss"]["excluded"] == {"uvit": {}, "uvic": {"2": "metrics.jsonl is missing"}}
    assert data["metrics"]["fid_last"]["excluded"] == {"uvit": {}, "uvic": {}}  # eval.jsonl is intact
    assert all(s["state"] == "finished" for seeds in data["runs"].values() for s in seeds.values())
    md = (plan.out / "report.md").read_text()
    section = md.split("### val_loss\n", 1)[1].split("### ", 1)[0]
    assert "Finished runs left out of this metric" in section
    for line in ["uvit seed 3: metrics.jsonl has no val_loss at step 100, the last step (its last is at step 50)",
                 "uvic seed 1: metrics.jsonl: val_loss is nan at step 100", "uvic seed 2: metrics.jsonl is missing"]:
        assert f"- {line}" in section
    assert _strict_json(plan.out / "report.json") == data


@pytest.mark.filterwarnings("ignore:No artists with labels:UserWarning")  # uvic's validation curve has no point
def test_the_console_summary_names_the_runs_left_out(make_comparison, run_script):
    plan = make_comparison(seeds=(0,))
    for arm in ("uvit", "uvic"):
        write_run(plan, arm, 0, losses={MAX_STEPS: 1.0}, val={MAX_STEPS: 0.5 if arm == "uvit" else float("nan")},
                  grid=False)
    code, stdout, err = run_script("compare.py", "report", plan.out)
    assert code == 0, err
    assert "val_loss: finished runs left out: uvic seed 0 (metrics.jsonl: val_loss is nan at step 100)" in stdout


def test_a_metric_every_run_lost_is_still_reported_with_why(make_comparison):
    plan = make_comparison(seeds=(0,))
    for arm in ("uvit", "uvic"):
        write_run(plan, arm, 0, losses={MAX_STEPS: 1.0}, val={MAX_STEPS: float("nan")}, grid=False)
    data = write_report(plan.out)
    assert data["metrics"]["val_loss"]["values"] == {"uvit": {}, "uvic": {}}
    assert data["metrics"]["val_loss"]["excluded"] == {arm: {"0": "metrics.jsonl: val_loss is nan at step 100"}
                                                       for arm in ("uvit", "uvic")}
    assert data["metrics"]["val_loss"]["vs_baseline"]["uvic"]["n"] == 0


def _protocol_record(run_dir, fids, **settings):
    protocol = {"num_images": 1000, "reference": "ref.npz", "dims": 2048, "weights": "", "sampler": "dpm",
                "steps": 25, "first_seed": 0, "step": MAX_STEPS, **settings}
    (run_dir / "fid_protocol.json").write_text(json.dumps({"protocol": protocol, "fids": fids}))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy and matplotlib, on 1e308
def test_huge_and_non_finite_values_never_break_the_report(make_comparison):
    """val_loss 1e308 is shown as it is (its statistics overflow to null); FIDs "nan" / "inf" (strings, or a NaN)
    in fid_protocol.json leave that run out, named; report.json stays valid JSON, and an older report is replaced."""
    plan = make_comparison(seeds=(0, 1, 2))
    (plan.out / "report.json").write_text('{"stale": true}')
    for arm in ("uvit", "uvic"):
        for seed in range(3):
            huge = seed > 0
            d = write_run(plan, arm, seed, losses={MAX_STEPS: 1.0}, val={MAX_STEPS: 1e308 if huge else 0.5},
                          grid=False)
            _protocol_record(d, [10.0 + seed + (arm == "uvic"), 11.0])
    _protocol_record(plan.run("uvic", 1).run_dir, [10.0, "nan"])
    _protocol_record(plan.run("uvic", 2).run_dir, ["inf", 10.0])
    (plan.run("uvit", 2).run_dir / "fid_protocol.json").write_text(
        '{"protocol": {"step": 100}, "fids": [NaN]}')
    data = write_report(plan.out)
    assert _strict_json(plan.out / "report.json") == data
    val = data["metrics"]["val_loss"]
    assert val["values"]["uvit"] == {"0": 0.5, "1": 1e308, "2": 1e308} and val["excluded"]["uvit"] == {}
    fid = data["metrics"]["fid_protocol"]
    assert fid["excluded"] == {"uvit": {"2": "fid_protocol.json: fids[0] is nan, not a finite number"},
                               "uvic": {"1": "fid_protocol.json: fids[1] is 'nan', not a finite number",
                                        "2": "fid_protocol.json: fids[0] is 'inf', not a finite number"}}
    assert fid["values"] == {"uvit": {"0": 10.5, "1": 11.0}, "uvic": {"0": 11.0}}
    assert fid["resamplings"] == {"uvit": {"0": [10.0, 11.0], "1": [11.0, 11.0]}, "uvic": {"0": [11.0, 11.0]}}
    md = (plan.out / "report.md").read_text()
    assert "- uvic seed 2: fid_protocol.json: fids[0] is 'inf', not a finite number" in md
    assert "stale" not in (plan.out / "report.json").read_text()


def test_fids_of_two_protocols_are_never_paired(make_comparison):
    plan = make_comparison(seeds=(0, 1, 2))
    for arm in ("uvit", "uvic"):
        for seed in range(3):
            d = write_run(plan, arm, seed, losses={MAX_STEPS: 1.0}, grid=False)
            _protocol_record(d, [20.0 + seed + (arm == "uvic")])
    _protocol_record(plan.run("uvic", 1).run_dir, [5.0], num_images=300)
    _protocol_record(plan.run("uvit", 2).run_dir, [5.0], reference="other.npz")
    _protocol_record(plan.run("uvit", 0).run_dir, [5.0], step=MAX_STEPS // 2)
    fid = write_report(plan.out)["metrics"]["fid_protocol"]
    assert fid["excluded"] == {
        "uvit": {"0": f"fid_protocol.json is of step {MAX_STEPS // 2}, not the run's last step {MAX_STEPS}",
                 "2": "fid_protocol.json is of another protocol than the other 3 run(s)' (reference is 'other.npz' "
                      "here, 'ref.npz' there)"},
        "uvic": {"1": "fid_protocol.json is of another protocol than the other 3 run(s)' (num_images is 300 here, "
                      "1000 there)"}}
    assert fid["values"] == {"uvit": {"1": 21.0}, "uvic": {"0": 21.0, "2": 23.0}}
    assert fid["vs_baseline"]["uvic"]["n"] == 0


def test_protocol_fids_are_paired_on_the_resamplings_every_run_has(make_comparison):
    """uvit seed 0 holds 3 resamplings, every other run 2 (a report killed during the third FIDs): resampling j is
    the images of the same sampling seeds in every run, so every mean is over resamplings 0 and 1, never 3 beside
    2; the later FID is named, and a run of another protocol does not lower the count."""
    plan = make_comparison(seeds=(0, 1, 2))
    fids = {("uvit", 0): [10.0, 12.0, 20.0], ("uvit", 1): [11.0, 13.0], ("uvit", 2): [12.0, 12.0],
            ("uvic", 0): [9.0, 10.0], ("uvic", 1): [10.0, 11.0], ("uvic", 2): [11.0, 12.0]}
    for (arm, seed), values in fids.items():
        _protocol_record(write_run(plan, arm, seed, losses={MAX_STEPS: 1.0}, grid=False), values)
    data = write_report(plan.out, all_pairs=True)
    fid = data["metrics"]["fid_protocol"]
    assert fid["values"] == {"uvit": {"0": 11.0, "1": 12.0, "2": 12.0}, "uvic": {"0": 9.5, "1": 10.5, "2": 11.5}}
    assert fid["excluded"] == {"uvit": {}, "uvic": {}}
    assert fid["resamplings"]["uvit"] == {"0": [10.0, 12.0], "1": [11.0, 13.0], "2": [12.0, 12.0]}
    assert fid["resamplings_left_out"] == {"uvit": {"0": [20.0]}, "uvic": {}}
    assert fid["spreads"]["uvit"]["gen_seeds"] == [2] and fid["spreads"]["uvit"]["mean"] == pytest.approx(35 / 3)
    # Differences -1.5, -1.5, -0.5 (the means of 3 and 2 would give -3.5 at seed 0).
    assert fid["vs_baseline"]["uvic"]["mean_diff"] == pytest.approx(-3.5 / 3)
    assert fid["pairs"]["uvic - uvit"]["mean_diff"] == pytest.approx(-3.5 / 3)
    md = (plan.out / "report.md").read_text()
    assert ("Each run's mean is over its first 2 resamplings, those every paired run has (the same sampling seeds "
            "in every run); later ones left out: uvit seed 0: 1.") in md
    # A run of 1 resampling of another protocol is left out as such and does not lower the count to 1.
    _protocol_record(plan.run("uvic", 2).run_dir, [5.0], num_images=300)
    fid = build_report(plan.out)["metrics"]["fid_protocol"]
    assert fid["values"] == {"uvit": {"0": 11.0, "1": 12.0, "2": 12.0}, "uvic": {"0": 9.5, "1": 10.5}}
    assert list(fid["excluded"]["uvic"]) == ["2"]


@pytest.mark.parametrize("damage, what", [
    (lambda out: (out / "report.html").mkdir(), "is a directory"),
    (lambda out: (out / "figures").write_text("not a folder"), "a file is in the way"),
])
def test_local_damage_in_out_is_one_line_and_no_stale_report_stays(make_comparison, run_script, damage, what):
    plan = make_comparison(seeds=(0,))
    for arm in ("uvit", "uvic"):
        write_run(plan, arm, 0, losses=_losses(0.5, 0), val={MAX_STEPS: 0.5}, grid=False)
    for name in ("report.json", "report.md"):
        (plan.out / name).write_text("an earlier report")
    damage(plan.out)
    code, stdout, err = run_script("compare.py", "report", plan.out)
    assert code == 1 and stdout == "" and "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot write the report into {plan.out}: {what}"), err
    # What was written is this report; an earlier one is never left to pass for it.
    for name in ("report.json", "report.md"):
        assert not (plan.out / name).is_file() or (plan.out / name).read_text() != "an earlier report"


def test_an_unwritable_out_for_run_is_one_line(run_script, tmp_path):
    from synthetic_runs import CONFIG

    (tmp_path / "file").write_text("")
    for out in ["/proc/uvic-test/cmp", tmp_path / "file" / "cmp"]:
        code, stdout, err = run_script("compare.py", "run", CONFIG, "--arm", "a", "--arm", "b",
                                       "model.attention=softmax", "--seeds", "0", "--out", out)
        errors = [line for line in err.splitlines() if "error:" in line]
        assert code == 2 and "Traceback" not in err and stdout == ""
        assert len(errors) == 1 and f"cannot write --out {out}: " in errors[0], err


@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")  # scipy, on equal differences
def test_report_baseline_and_every_pair_from_the_same_runs(make_comparison, run_script):
    """`report --baseline ARM` compares every arm with ARM; `--all-pairs` adds each pair of arms. The differences are
    checked against the hand-made values: arm levels 0.5, 0.48 and 0.45 plus 0.01 per seed at the last validation."""
    plan = make_comparison(arms={"uvit": ["model.attention=softmax"], "uvic": [], "cog_all":
                                 ["model.keep_softmax_first=0", "model.keep_softmax_last=0"]})
    levels = {"uvit": 0.5, "uvic": 0.48, "cog_all": 0.45}
    wobble = {0: 0.0, 1: 0.002, 2: -0.001}  # per (arm, seed), so that the intervals have a width
    val = {(arm, s): level + 0.01 * s + wobble[s] * (arm == "cog_all") for arm, level in levels.items() for s in range(3)}
    for (arm, seed), v in val.items():
        write_run(plan, arm, seed, losses={MAX_STEPS: 1.0}, val={MAX_STEPS: v}, grid=False)
    code, stdout, err = run_script("compare.py", "report", plan.out, "--baseline", "uvic", "--all-pairs")
    assert code == 0, err
    data = json.loads((plan.out / "report.json").read_text())
    assert (data["baseline"], data["arms"]) == ("uvic", ["uvic", "uvit", "cog_all"])
    entry = data["metrics"]["val_loss"]
    assert set(entry["vs_baseline"]) == {"uvit", "cog_all"}
    assert set(entry["pairs"]) == {"uvit - uvic", "cog_all - uvic", "cog_all - uvit"}
    for pair, vs in entry["pairs"].items():
        a, b = pair.split(" - ")
        diffs = [val[a, s] - val[b, s] for s in range(3)]
        ref = stats.ttest_rel([val[a, s] for s in range(3)], [val[b, s] for s in range(3)])
        assert vs["n"] == 3 and vs["mean_diff"] == pytest.approx(np.mean(diffs), abs=1e-12)
        if b == "uvic":
            assert entry["vs_baseline"][a] == vs
        if a == "cog_all":  # the one arm with a spread of differences
            assert vs["ci95"] == pytest.approx(list(ref.confidence_interval(0.95)), rel=1e-6)
    assert entry["pairs"]["cog_all - uvit"]["verdict"] == "better"  # -0.05 +- 0.003
    assert "val_loss: cog_all - uvit = " in stdout
    md = (plan.out / "report.md").read_text()
    assert "| pair | n | difference (95% interval) | relative | p | verdict |" in md and "| cog_all - uvit | 3 |" in md
    code, _, err = run_script("compare.py", "report", plan.out, "--baseline", "nope")
    assert code == 2 and "--baseline 'nope' is not an arm of this comparison (uvit, uvic, cog_all)" in err


def test_a_figures_folder_that_is_a_symlink_out_of_the_comparison_is_refused_and_nothing_outside_is_touched(
        make_comparison, tmp_path):
    plan = make_comparison()
    _full(plan)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "precious.png").write_bytes(b"not a figure of this report")
    (plan.out / "figures").symlink_to(outside)
    with pytest.raises(StorageError, match="figures is a symlink"):
        write_report(plan.out)
    assert [p.name for p in outside.iterdir()] == ["precious.png"]  # nothing drawn there, nothing removed
    assert (outside / "precious.png").read_bytes() == b"not a figure of this report"
    assert not (plan.out / "report.json").exists()


def test_a_record_hard_linked_between_two_runs_makes_both_a_mismatch(make_comparison):
    """A hard link passes every symlink check, and uvic's metrics.jsonl linked to uvit's reports a difference of 0."""
    plan = make_comparison()
    _full(plan)
    ours = plan.run("uvic", 0).run_dir / "metrics.jsonl"
    ours.unlink()
    ours.hardlink_to(plan.run("uvit", 0).run_dir / "metrics.jsonl")
    data = build_report(plan.out)
    why = ("its metrics.jsonl is the same file as that of {} (a hard link or a folder mounted twice): a run's records "
           "must be its own files")
    assert data["runs"]["uvic"]["0"] == {"state": "mismatch", "detail": why.format("uvit seed 0")}
    assert data["runs"]["uvit"]["0"] == {"state": "mismatch", "detail": why.format("uvic seed 0")}
    assert data["metrics"]["val_loss"]["values"] == {"uvit": {"1": pytest.approx(0.56), "2": pytest.approx(0.57)},
                                                     "uvic": {"1": pytest.approx(0.54), "2": pytest.approx(0.55)}}
    assert [s["state"] for arm in ("uvit", "uvic") for s in data["runs"][arm].values()].count("finished") == 4


def test_a_curve_mean_over_fewer_validations_than_the_schedule_is_left_out(make_comparison):
    """With its step-50 validation line deleted, a run's val_loss_mean would be its step-100 value alone, paired with
    the other runs' means over steps 50 and 100."""
    plan = make_comparison(seeds=(0, 1), overrides=["train.val_every=50"])
    for arm in ("uvit", "uvic"):
        for seed in (0, 1):
            write_run(plan, arm, seed, losses={MAX_STEPS: 1.0}, val={50: 2.0 + seed, 100: 1.0 + seed})
    write_run(plan, "uvic", 0, losses={MAX_STEPS: 1.0}, val={100: 1.0})
    data = build_report(plan.out)
    mean = data["metrics"]["val_loss_mean"]
    assert mean["excluded"] == {"uvit": {}, "uvic": {"0": "metrics.jsonl has no val_loss at step 50 (train.val_every "
                                                          "= 50): the mean is over every validation"}}
    assert mean["values"] == {"uvit": {"0": 1.5, "1": 2.5}, "uvic": {"1": 2.5}}  # (2 + 1) / 2, (3 + 2) / 2
    assert data["metrics"]["val_loss"]["values"]["uvic"] == {"0": 1.0, "1": 2.0}  # the last step is there


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy and matplotlib, on 1e308
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_mean_over_training_that_overflows_is_left_out_and_the_report_is_written(make_comparison):
    """Finite values whose mean is not finite (the area under 0.9 and 1e308 over 50 steps is inf) are a value of no
    run: left out and named, never a null among the values that the tables cannot read."""
    plan = make_comparison(seeds=(0, 1))
    for arm in ("uvit", "uvic"):
        for seed in (0, 1):
            write_run(plan, arm, seed, losses={MAX_STEPS: 1.0},
                      val={50: 0.9, MAX_STEPS: 1e308 if (arm, seed) == ("uvic", 0) else 0.5})
    data = write_report(plan.out)
    assert json.loads((plan.out / "report.json").read_text()) == data
    mean = data["metrics"]["val_loss_mean"]
    assert mean["excluded"] == {"uvit": {}, "uvic": {"0": "metrics.jsonl: val_loss_mean of its val_loss is not a "
                                                          "finite number (the values overflow)"}}
    assert mean["values"] == {"uvit": {"0": pytest.approx(0.7), "1": pytest.approx(0.7)},
                              "uvic": {"1": pytest.approx(0.7)}}
    assert data["metrics"]["val_loss"]["values"]["uvic"] == {"0": 1e308, "1": 0.5}  # shown as it is


def test_a_value_logged_after_the_last_step_is_left_out_as_such(make_comparison):
    """A line after train.max_steps (another run's, or a longer run's) is named as what it is, not as a missing step."""
    plan = make_comparison(seeds=(0,))
    write_run(plan, "uvit", 0, losses={MAX_STEPS: 1.0}, val={MAX_STEPS: 0.5})
    write_run(plan, "uvic", 0, losses={MAX_STEPS: 1.0}, val={MAX_STEPS: 0.5, 150: 9.0})
    assert build_report(plan.out)["metrics"]["val_loss"]["excluded"]["uvic"] == {
        "0": f"metrics.jsonl has val_loss at step 150, after the last step {MAX_STEPS}: not a record of this run"}
