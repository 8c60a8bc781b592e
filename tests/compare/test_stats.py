"""Paired statistics against scipy.stats (ttest_rel, the t distribution) and closed-form cases."""

import math

import numpy as np
import pytest
from scipy import stats

from uvic.compare.stats import fid_spreads, mean_band, paired, paired_by_seed, verdict


BASE = [0.0712, 0.0709, 0.0715, 0.0721, 0.0704]
ARM = [0.0701, 0.0700, 0.0709, 0.0707, 0.0698]


@pytest.mark.parametrize("n", [2, 3, 5])
def test_interval_and_p_value_agree_with_scipy(n):
    arm, base = ARM[:n], BASE[:n]
    got = paired(arm, base, lower_is_better=True)
    ref = stats.ttest_rel(arm, base)
    low, high = ref.confidence_interval(0.95)
    assert got.n == n
    assert got.mean_diff == pytest.approx(np.mean(np.subtract(arm, base)), rel=1e-12)
    assert got.ci95 == pytest.approx((low, high), rel=1e-9)
    assert got.p_value == pytest.approx(ref.pvalue, rel=1e-9)
    assert got.relative == pytest.approx(got.mean_diff / np.mean(base), rel=1e-12)


def test_known_numbers_by_hand():
    # d = (1, 2, 3): mean 2, s = 1, se = 1/sqrt(3); t = 2 sqrt(3) with 2 dof.
    got = paired([2, 4, 6], [1, 2, 3], lower_is_better=True)
    half = stats.t.ppf(0.975, 2) / math.sqrt(3)
    assert got.mean_diff == 2 and got.ci95 == pytest.approx((2 - half, 2 + half), rel=1e-12)
    assert half == pytest.approx(2.4841377, rel=1e-6)  # t_{0.975, 2} = 4.302653 over sqrt(3)
    assert got.p_value == pytest.approx(2 * stats.t.sf(2 * math.sqrt(3), 2), rel=1e-12)
    assert got.relative == 1.0 and got.verdict == "inconclusive"  # the interval (-0.48, 4.48) holds 0


def test_verdict_follows_the_side_of_the_interval_and_the_metric_direction():
    lower = paired(ARM, BASE, lower_is_better=True)
    assert lower.ci95[1] < 0 and lower.verdict == "better"
    assert paired(ARM, BASE, lower_is_better=False).verdict == "worse"
    assert paired(BASE, ARM, lower_is_better=True).verdict == "worse"
    assert paired(BASE, ARM, lower_is_better=False).verdict == "better"
    assert verdict((-1.0, 0.0), True) == "inconclusive"  # an end at exactly 0 is not "entirely on one side"
    assert verdict(None, True) == "inconclusive"


def test_fewer_than_two_pairs():
    none = paired([], [], lower_is_better=True)
    assert none.to_dict() == {"n": 0, "mean_diff": None, "ci95": None, "p_value": None, "relative": None,
                              "verdict": "inconclusive"}
    one = paired([1.5], [1.0], lower_is_better=True)
    assert (one.n, one.mean_diff, one.ci95, one.p_value, one.relative, one.verdict) == (1, 0.5, None, None, 0.5,
                                                                                       "inconclusive")


def test_an_aa_comparison_is_exactly_zero_and_inconclusive():
    got = paired(BASE, BASE, lower_is_better=True)
    assert got.mean_diff == 0.0 and got.ci95 == (0.0, 0.0) and got.relative == 0.0
    assert got.p_value is None and got.verdict == "inconclusive"
    assert math.isnan(stats.ttest_rel(BASE, BASE).pvalue)  # scipy: 0/0 as well


@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")  # scipy, on equal differences
def test_identical_nonzero_differences_give_a_point_interval():
    base = [1.0, 2.25, 3.5, 0.75]
    arm = [b + 0.5 for b in base]  # exact in binary: the differences are equal to the last bit
    got = paired(arm, base, lower_is_better=True)
    ref = stats.ttest_rel(arm, base)
    assert got.ci95 == (got.mean_diff, got.mean_diff) == tuple(ref.confidence_interval(0.95))
    assert got.p_value == 0.0 == ref.pvalue and got.verdict == "worse"


def test_pairs_only_the_seeds_both_arms_have():
    arm = {0: 2.0, 1: 4.0, 2: 6.0, 7: 100.0}
    base = {0: 1.0, 1: 2.0, 2: 3.0, 5: -100.0}
    assert paired_by_seed(arm, base, True) == paired([2, 4, 6], [1, 2, 3], True)


def test_relative_is_undefined_for_a_zero_baseline():
    assert paired([1.0, 2.0], [0.0, 0.0], True).relative is None


def test_mean_band_is_the_t_interval_per_step():
    rows = np.array([[1.0, 2.0, np.nan], [3.0, 2.5, 4.0], [2.0, 3.5, np.nan]])
    mean, low, high = mean_band(rows)
    for j in range(2):
        col = rows[:, j]
        ci = stats.ttest_1samp(col, 0).confidence_interval(0.95)
        assert mean[j] == pytest.approx(col.mean()) and (low[j], high[j]) == pytest.approx((ci.low, ci.high))
    assert mean[2] == low[2] == high[2] == 4.0  # one seed: no band


def test_fid_spreads_separate_training_seeds_from_resamplings():
    # Per-run means 11 and 14: sd across training seeds |14 - 11| / sqrt(2); resampling sds sqrt(2) and 0.
    out = fid_spreads({0: [10.0, 12.0], 1: [14.0, 14.0]})
    assert out == {"runs": 2, "gen_seeds": [2], "mean": 12.5, "training_seed_sd": pytest.approx(3 / math.sqrt(2)),
                   "resampling_sd": pytest.approx(math.sqrt(2) / 2)}
    # Undefined spreads are None: one run has no spread across seeds, one resampling none across resamplings.
    assert fid_spreads({3: [5.0, 7.0]})["training_seed_sd"] is None
    assert fid_spreads({0: [5.0], 1: [7.0, 8.0]})["resampling_sd"] is None
    assert fid_spreads({}) == {"runs": 0, "gen_seeds": [], "mean": None, "training_seed_sd": None,
                               "resampling_sd": None}
