"""Paired statistics of one metric: an arm against the baseline over the training seeds both finished.

Each seed gives one paired difference d_i = arm_i - baseline_i (the two runs of a seed share initial weights, data
order and noise, so the seed-to-seed spread cancels in d). With n pairs, mean d and sample standard deviation s
(n - 1 in the denominator), the standard error is s / sqrt(n) and

    ci95     = mean d -/+ t_{0.975, n-1} * s / sqrt(n)      (Student t, n - 1 degrees of freedom)
    p_value  = 2 * P(T_{n-1} > |mean d| / (s / sqrt(n)))    (the two-sided paired t-test)
    relative = mean d / mean baseline                      (over the same seeds)
    verdict  = "better" if ci95 lies entirely on the better side of 0, "worse" if entirely on the other side,
               else "inconclusive"; always "inconclusive" with fewer than 2 pairs

Where a number is undefined it is None (JSON null):
- n = 0: everything but n; n = 1: ci95 and p_value (no degrees of freedom left), the verdict is inconclusive.
- all differences equal (s = 0): the interval is the point [d, d] (the formula with s = 0). If d = 0 (an A/A
  comparison) the t statistic is 0/0 and p_value is None; if d != 0 it is +-inf and p_value is 0.0, its limit as
  s -> 0, and the verdict follows the point interval. This is what `scipy.stats.ttest_rel` returns too; it arises
  when a metric does not depend on the seed at all (then the difference is exact, not noise).
- relative: None when the baseline mean is 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
from scipy.special import stdtr, stdtrit  # Student's t CDF and inverse (scipy.stats takes ~1 s to import)


Verdict = Literal["better", "worse", "inconclusive"]


@dataclass(frozen=True)
class Paired:
    """The paired comparison of one arm with the baseline on one metric (`report.json`'s `vs_baseline` entry)."""

    n: int
    mean_diff: float | None
    ci95: tuple[float, float] | None
    p_value: float | None
    relative: float | None
    verdict: Verdict

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ci95"] = list(self.ci95) if self.ci95 is not None else None
        return out


def paired(arm: Sequence[float], baseline: Sequence[float], lower_is_better: bool) -> Paired:
    """Compare `arm` with `baseline`, the values of the same seeds in the same order (see the module docstring).

    Args:
        arm, baseline: (n,) finite values, pair i from training seed i of both arms.
        lower_is_better: which side of 0 a difference is better on (losses, FID: True; accuracy: False).
    """
    a, b = np.asarray(arm, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired values need two 1-d sequences of one length, got {a.shape} and {b.shape}")
    n = len(a)
    if n == 0:
        return Paired(0, None, None, None, None, "inconclusive")
    d = a - b
    mean = float(d.mean())
    base = float(b.mean())
    relative = mean / base if base != 0 else None
    if n == 1:
        return Paired(1, mean, None, None, relative, "inconclusive")
    if np.all(d == d[0]):  # s = 0 exactly (a mean of equal floats need not equal them to the last bit)
        mean = float(d[0])
        ci = (mean, mean)
        p = None if mean == 0 else 0.0
    else:
        se = float(d.std(ddof=1)) / math.sqrt(n)
        half = t_quantile(0.975, n - 1) * se
        ci = (mean - half, mean + half)
        p = float(2 * stdtr(n - 1, -abs(mean) / se))  # 2 P(T > |t|) = 2 F(-|t|)
    return Paired(n, mean, ci, p, relative, verdict(ci, lower_is_better))


def t_quantile(q: float, dof: Any) -> Any:
    """The `q` quantile of Student's t with `dof` degrees of freedom (scalar or array)."""
    return stdtrit(dof, q) if np.ndim(dof) else float(stdtrit(dof, q))


def verdict(ci95: tuple[float, float] | None, lower_is_better: bool) -> Verdict:
    """"better" / "worse" if the interval lies strictly on one side of 0, else (or without one) "inconclusive"."""
    if ci95 is None:
        return "inconclusive"
    low, high = ci95
    if high < 0:
        return "better" if lower_is_better else "worse"
    if low > 0:
        return "worse" if lower_is_better else "better"
    return "inconclusive"


def paired_by_seed(arm: Mapping[Any, float], baseline: Mapping[Any, float], lower_is_better: bool) -> Paired:
    """`paired` over the seeds both mappings ({seed: value}) hold, in sorted seed order."""
    seeds = sorted(set(arm) & set(baseline))
    return paired([arm[s] for s in seeds], [baseline[s] for s in seeds], lower_is_better)


def mean_band(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over seeds and its 95% Student-t interval at each step, NaNs (steps a seed lacks) left out.

    Args:
        rows: (S, T) values of S seeds at T steps.
    Returns:
        (mean, low, high), each (T,); low = high = mean where fewer than 2 seeds have a value.
    """
    rows = np.asarray(rows, dtype=np.float64)
    n = np.sum(~np.isnan(rows), axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.nansum(rows, axis=0) / n
        half = np.zeros_like(mean)
        ok = n >= 2
        if ok.any():
            sd = np.sqrt(np.nansum((rows[:, ok] - mean[ok]) ** 2, axis=0) / (n[ok] - 1))
            half[ok] = t_quantile(0.975, n[ok] - 1) * sd / np.sqrt(n[ok])
    return mean, mean - half, mean + half


def fid_spreads(fids: Mapping[Any, Sequence[float]]) -> dict[str, Any]:
    """The two spreads of one arm's protocol FIDs (`uvic.compare.protocol_fid`): the training seeds' and the
    resamplings'.

    Args:
        fids: {training seed: the FIDs of that run's K resamplings (disjoint sampling seeds)}, K >= 1.
    Returns:
        {"runs": n, "gen_seeds": sorted distinct K, "mean": the mean over runs of the per-run means,
         "training_seed_sd": the sample standard deviation (n - 1) across runs of the per-run means (None with
         fewer than 2 runs), "resampling_sd": the mean over runs of each run's sample standard deviation across
         its resamplings (None unless every run has K >= 2)}.
    """
    runs = [np.asarray(v, dtype=np.float64) for v in fids.values() if len(v)]
    means = np.array([r.mean() for r in runs])
    return {
        "runs": len(runs),
        "gen_seeds": sorted({len(r) for r in runs}),
        "mean": float(means.mean()) if len(runs) else None,
        "training_seed_sd": float(means.std(ddof=1)) if len(runs) >= 2 else None,
        "resampling_sd": float(np.mean([r.std(ddof=1) for r in runs])) if runs and min(map(len, runs)) >= 2 else None,
    }
