"""Every metric of the report says where it comes from; a FID that is not the standard FID (test weights, other
weights or dims, too few images) is a smoke test, never better or worse; each metric's headline says what its
interval rules out as a share of the baseline."""

import json

import pytest
from synthetic_runs import MAX_STEPS, write_run

from uvic.compare.provenance import headline
from uvic.compare.report import build_report, write_report


# The record of the standard FID: the FID Inception weights (their SHA-256 starts with 6726825d), pool3, fid10k.
STANDARD = {"num_images": 10_000, "dims": 2048, "sampler": "uvit_dpm_solver", "steps": 50,
            "weights": "pt_inception-2015-12-05-6726825d.pth", "weights_sha256": "6726825d" + "0" * 56,
            "standard_weights": True, "trained": True, "mode": "pytorch-fid"}
TEST_WEIGHTS = {"weights": "pt_inception-random.pth", "weights_sha256": "ab" * 32, "standard_weights": False,
                "trained": False}


def _fid_comparison(plan, record, other=None):
    """uvic's FID 2 below uvit's on every seed (a certain `better` by the statistics); the uvic runs' eval records
    carry `other` in place of `record` where given."""
    for arm, fid in (("uvit", 20.0), ("uvic", 18.0)):
        for seed in range(3):
            write_run(plan, arm, seed, losses={MAX_STEPS: 1.0}, fids={MAX_STEPS: fid + seed},
                      fid_record=other if (other is not None and arm == "uvic") else record)


@pytest.mark.parametrize("change, reason", [
    (TEST_WEIGHTS, "the FID network's weights pt_inception-random.pth were never trained (random-init test weights)"),
    ({"weights": "mine.pth", "weights_sha256": "cd" * 32, "standard_weights": False},
     "the FID network's weights mine.pth (SHA-256 cdcdcdcdcdcd...) are not the standard FID Inception weights"),
    ({"dims": 64}, "64-d features, not the standard FID's 2048-d pool3"),
    ({"num_images": 9_999}, "9,999 images, fewer than the 10,000 of the smallest published FIDs"),
])
def test_a_fid_that_is_not_the_standard_fid_is_a_smoke_test_never_better(make_comparison, change, reason):
    plan = make_comparison()
    _fid_comparison(plan, {**STANDARD, **change})
    data = build_report(plan.out)
    for name in ("fid_last", "fid_best"):
        entry = data["metrics"][name]
        assert entry["comparable"] is False and reason in entry["reason"], entry["reason"]
        assert entry["vs_baseline"]["uvic"]["verdict"] == "smoke test"
        assert entry["vs_baseline"]["uvic"]["mean_diff"] == pytest.approx(-2.0)  # the statistics stay
        assert {k: entry["provenance"][k] for k in change} == change
        text = entry["headline"]["uvic"]["text"]
        assert "a smoke test, which says nothing about the models. Not comparable with published numbers: " \
               f"{entry['reason']}." in text and "better" not in text
    assert data["metrics"]["train_loss"]["comparable"] is True  # the runs' other metrics are unaffected
    # Every contrast of the same runs too: each pair (--all-pairs), and another baseline (--baseline).
    other = build_report(plan.out, baseline="uvic", all_pairs=True)["metrics"]["fid_last"]
    assert other["pairs"]["uvit - uvic"]["verdict"] == other["vs_baseline"]["uvit"]["verdict"] == "smoke test"
    assert other["headline"]["uvit"]["text"].startswith("uvit vs uvic: +11% of uvic's mean")  # 2 over the mean 19


def test_the_standard_fid_keeps_its_verdict_and_names_its_provenance(make_comparison):
    plan = make_comparison()
    _fid_comparison(plan, STANDARD)
    entry = build_report(plan.out)["metrics"]["fid_last"]
    assert entry["comparable"] is True and entry["reason"] is None
    assert entry["vs_baseline"]["uvic"]["verdict"] == "better"
    assert entry["provenance"] == {**STANDARD, "reference": ""}  # the demo config has no eval_reference


def test_runs_of_different_fid_settings_are_a_smoke_test_naming_the_difference(make_comparison):
    plan = make_comparison()
    _fid_comparison(plan, STANDARD, other={**STANDARD, "num_images": 50_000})
    entry = build_report(plan.out)["metrics"]["fid_last"]
    assert entry["provenance"]["num_images"] == [10_000, 50_000]
    assert entry["comparable"] is False and "the runs differ in num_images (10000, 50000)" in entry["reason"]
    assert entry["vs_baseline"]["uvic"]["verdict"] == "smoke test"


def test_records_from_before_the_network_was_recorded_fall_back_on_the_run_config(make_comparison):
    old = {k: STANDARD[k] for k in ("num_images", "dims", "sampler", "steps")}
    plan = make_comparison()  # no train.eval_fid_weights_sha256: the run checked the standard weights' prefix
    _fid_comparison(plan, old)
    entry = build_report(plan.out)["metrics"]["fid_last"]
    assert entry["comparable"] is True and entry["provenance"]["standard_weights"] is True
    assert entry["provenance"]["weights_sha256"] is None  # not recorded
    plan = make_comparison(out=plan.out.parent / "unchecked", overrides=["train.eval_fid_weights_sha256=none"])
    _fid_comparison(plan, old)
    entry = build_report(plan.out)["metrics"]["fid_last"]
    assert entry["comparable"] is False and "not known to be the standard FID Inception weights" in entry["reason"]
    assert entry["vs_baseline"]["uvic"]["verdict"] == "smoke test"


def test_the_smoke_test_is_a_banner_in_report_md_and_report_html(make_comparison):
    plan = make_comparison()
    _fid_comparison(plan, {**STANDARD, **TEST_WEIGHTS, "dims": 64, "num_images": 300})
    write_report(plan.out)
    md, html = (plan.out / "report.md").read_text(), (plan.out / "report.html").read_text()
    banner = ("Smoke test: `fid_last` is not comparable with published numbers: the FID network's weights "
              "pt_inception-random.pth were never trained (random-init test weights); 64-d features")
    assert f"> **{banner}" in md
    assert f'<div class="banner" role="alert">{banner.replace("`fid_last`", "<code>fid_last</code>")}' in html
    assert "| **smoke test** |" in md and "**better**" not in md and "**worse**" not in md
    assert '<span class="verdict smoke">smoke test</span>' in html
    # The provenance of the metric, in its section.
    assert "Provenance: FID network `pt_inception-random.pth`, SHA-256 `" + "ab" * 32 + "`, not the standard FID " \
           "Inception weights (never trained); 64-d features, mode pytorch-fid; 300 images, sampler uvit_dpm_solver " \
           "with 50 steps" in md
    assert json.loads((plan.out / "report.json").read_text())["metrics"]["fid_best"]["comparable"] is False


def test_headlines_say_what_the_interval_rules_out_as_a_share_of_the_baseline():
    """By hand: 2 pairs, differences 0 and 0.002 over a baseline of mean 1: mean 0.001, standard error 0.001,
    t(0.975, 1) = 12.7062, so the interval is 0.001 -/+ 0.0127062 = [-0.0117062, 0.0137062]."""
    vs = {"n": 2, "mean_diff": 0.001, "ci95": [-0.0117062, 0.0137062]}
    h = headline("uvic", "uvit", vs, 1.0, lower_is_better=True)
    assert h["relative"] == pytest.approx(0.001) and h["ci95_relative"] == pytest.approx([-0.0117062, 0.0137062])
    assert h["text"] == ("uvic vs uvit: +0.1% of uvit's mean (95% interval -1.2% to +1.4%, 2 seeds): it rules out "
                         "uvic being more than 1.2% better or 1.4% worse.")
    # Higher is better (accuracy): the same interval rules out the other way round; a baseline mean of 2 halves it.
    h = headline("uvic", "uvit", vs, 2.0, lower_is_better=False)
    assert h["ci95_relative"] == pytest.approx([-0.0058531, 0.0068531])
    assert h["text"].endswith("it rules out uvic being more than 0.69% better or 0.59% worse.")
    # Wholly on one side: 3 pairs -0.04, -0.03, -0.05 (sd 0.01, t(0.975, 2) = 4.3027): -0.04 -/+ 0.024841.
    vs = {"n": 3, "mean_diff": -0.04, "ci95": [-0.064841, -0.015159]}
    assert headline("uvic", "uvit", vs, 1.0, lower_is_better=True)["text"] == (
        "uvic vs uvit: -4% of uvit's mean (95% interval -6.5% to -1.5%, 3 seeds): uvic is better by 1.5% to 6.5%: it "
        "rules out no difference, and uvic being more than 6.5% better.")
    assert "uvic is worse by 1.5% to 6.5%" in headline("uvic", "uvit", vs, 1.0, lower_is_better=False)["text"]
    point = {"n": 3, "mean_diff": -0.05, "ci95": [-0.05, -0.05]}  # every seed the same difference
    assert "(95% interval -5% to -5%, 3 seeds): uvic is better by 5%: it rules out no difference" in headline(
        "uvic", "uvit", point, 1.0, lower_is_better=True)["text"]
    smoke = headline("uvic", "uvit", vs, 1.0, lower_is_better=True, smoke_test=True)["text"]
    assert smoke == "uvic vs uvit: -4% of uvit's mean (95% interval -6.5% to -1.5%, 3 seeds): a smoke test, which " \
                    "says nothing about the models."
    one = headline("uvic", "uvit", {"n": 1, "mean_diff": -0.01, "ci95": None}, 0.5, lower_is_better=True)
    assert one["relative"] == pytest.approx(-0.02) and one["ci95_relative"] is None
    assert "-2% of uvit's mean over 1 seed: no interval" in one["text"] and "rules out nothing" in one["text"]


def test_val_loss_says_how_many_held_out_examples_it_is_over(make_comparison):
    """Three seeds with differences -0.04, -0.03, -0.05 on a baseline val_loss of 1.0: the interval of the headline
    test above, and validation.json's count of examples in the sentence and the provenance."""
    plan = make_comparison()
    record = {"split": "the data's test split", "examples": 1000, "held_out": 10_000}
    for seed, d in enumerate((-0.04, -0.03, -0.05)):
        for arm, v in (("uvit", 1.0), ("uvic", 1.0 + d)):
            write_run(plan, arm, seed, losses={MAX_STEPS: 1.0}, val={MAX_STEPS: v}, validation=record)
    write_report(plan.out)
    entry = json.loads((plan.out / "report.json").read_text())["metrics"]["val_loss"]
    assert entry["provenance"] == record and entry["comparable"] is True
    assert entry["headline"]["uvic"]["ci95_relative"] == pytest.approx([-0.064841, -0.015159], abs=1e-6)
    text = ("uvic vs uvit: -4% of uvit's mean (95% interval -6.5% to -1.5%, 3 seeds): uvic is better by 1.5% to 6.5%: "
            "it rules out no difference, and uvic being more than 6.5% better. Over 1,000 held-out examples (the "
            "data's test split).")
    assert entry["headline"]["uvic"]["text"] == text
    md = (plan.out / "report.md").read_text()
    assert f"- `val_loss`: {text}" in md
    assert "Provenance: 1000 held-out examples (of 10000): the data's test split." in md


# A Fréchet distance in the Fashion-MNIST classifier's features (uvic.fid.classifier), as eval.jsonl records it.
CLASSIFIER = {"num_images": 1_000, "dims": 128, "sampler": "uvit_dpm_solver", "steps": 25,
              "weights": "fashion_mnist_cnn.safetensors", "weights_sha256": "9c" * 32, "standard_weights": False,
              "trained": True, "mode": "classifier", "title": "FD (Fashion-MNIST classifier)"}


def test_a_classifier_fd_keeps_its_verdict_and_is_never_called_a_fid(make_comparison, tmp_path):
    """Not the standard FID, and fewer images than published FIDs: but no published number stands beside a
    classifier's distance, and every arm is scored with the same weights and images, so its verdict stands (a
    smoke test only for never-trained weights); report.md names it by its feature space."""
    plan = make_comparison()
    _fid_comparison(plan, CLASSIFIER)
    data = write_report(plan.out)
    entry = data["metrics"]["fid_last"]
    assert entry["comparable"] is True and entry["reason"] is None
    assert entry["vs_baseline"]["uvic"]["verdict"] == "better"
    assert entry["provenance"]["title"] == "FD (Fashion-MNIST classifier)"
    md = (plan.out / "report.md").read_text()
    assert "### fid_last: FD (Fashion-MNIST classifier)" in md
    assert "Provenance: FD (Fashion-MNIST classifier), not a FID" in md
    untrained = make_comparison(out=tmp_path / "untrained")
    _fid_comparison(untrained, {**CLASSIFIER, "trained": False})
    entry = build_report(untrained.out)["metrics"]["fid_last"]
    assert entry["comparable"] is False and "never trained" in entry["reason"]
    assert entry["vs_baseline"]["uvic"]["verdict"] == "smoke test"


def test_a_protocol_fd_names_the_classifiers_own_feature_width(tmp_path):
    """The protocol's settings carry train.eval_fid_dims (2048 by default), which a classifier ignores: the
    provenance gives the width of the features used (the network record's), and none for an older record."""
    from types import SimpleNamespace

    from uvic.compare.provenance import _fid_record

    protocol = {"num_images": 1000, "dims": 2048, "sampler": "dpm_solver", "steps": 25, "reference": "ref.npz",
                "weights": "runs/fd/cnn.safetensors"}
    network = {"weights": "cnn.safetensors", "weights_sha256": "9c" * 32, "standard_weights": False,
               "trained": True, "mode": "classifier", "title": "FD (Fashion-MNIST classifier)"}
    for net, dims in (({**network, "dims": 128}, 128), (network, None),
                      ({**network, "mode": "pytorch-fid"}, 2048)):  # an Inception record: the protocol's dims
        (tmp_path / "fid_protocol.json").write_text(json.dumps({"protocol": protocol, "fids": [1.0], "network": net}))
        assert _fid_record("fid_protocol", SimpleNamespace(path=tmp_path), {})["dims"] == dims
    from uvic.compare.report import _provenance_text

    older = _fid_record("fid_protocol", SimpleNamespace(path=tmp_path), {})
    older.update(mode="classifier", dims=None)
    assert "SHA-256 `" + "9c" * 32 + "`; feature width not recorded; 1000 images" in _provenance_text(
        {"provenance": older})
