"""Where each metric of a comparison report comes from, whether it can stand beside published numbers, and its
headline: what the paired interval rules out, as a share of the baseline.

    annotate(name, entry, logs, plan)    # adds "provenance", "comparable", "reason", "headline" to report.json's entry

`provenance`, read from the records of the runs the metric counts (`entry["values"]`):
- a FID (`fid_last`, `fid_best`: the run's eval.jsonl record of that evaluation; `fid_protocol`: its
  fid_protocol.json): {"weights": the FID network's weights file, "weights_sha256", "standard_weights": whether it
  is the FID Inception network (`uvic.fid.inception.is_standard_weights`), "trained", "mode", "dims",
  "num_images", "sampler", "steps", "reference"}. A value every run agrees on is given as is, values that differ
  as the sorted list of them; null where the records do not say (eval.jsonl lines from before the network was
  recorded fall back on the run config: without `train.eval_fid_weights_sha256` the run checked the standard
  weights' SHA-256 prefix, so they were the standard ones, whose full SHA-256 is then not known).
- `val_*`: {"split": the held-out set in words, "examples": the number scored, "held_out": the set's size}, from
  each run's validation.json (`uvic.training.validation.RECORD`); null for runs from before it was written.
- `train_loss`: {"split": "training batches", "logged_steps": the number of logged steps it is the mean of (the
  last `uvic.compare.metrics.TRAIN_LOSS_TAIL` of them)}.

- any other metric: {} (a new entry of `uvic.compare.metrics.METRICS` adds its case here).

A Fréchet distance in a trained classifier's features (`mode` "classifier", `title` e.g. "FD (Fashion-MNIST
classifier)", `uvic.fid.classifier`) has no published counterpart; it is comparable between the arms when every run
used the same weights (recorded SHA-256), images, sampler and reference, and its verdicts stand.
`comparable` is false, with the `reason`, for a FID that is not the standard FID: weights other than the FID
Inception network's (random-init test weights say so) or not known to be, features other than the 2048-d pool3,
fewer than `MIN_FID_IMAGES` images, or runs that differ in any of these. Such a number compares with no published
one, and a difference of it says nothing about the models: every verdict of the metric is `SMOKE_TEST`, never
better or worse (the statistics stay, for checking the machinery). Other metrics have no published counterpart to
mismatch and are always comparable.

`headline`, per arm: {"relative": mean difference / baseline mean, "ci95_relative": its 95% interval over the
baseline's mean over the same seeds (null with fewer than 2 pairs, or a baseline mean <= 0), "text": the sentence
report.md shows, e.g. "uvic vs uvit: -0.47% of uvit's mean (95% interval -2.4% to +1.5%): rules out uvic being more
than 2.4% better or 1.5% worse"}.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from uvic.compare.metrics import TRAIN_LOSS_TAIL
from uvic.compare.plan import Plan
from uvic.compare.protocol_fid import FILE as PROTOCOL_FILE
from uvic.compare.protocol_fid import METRIC as PROTOCOL_FID
from uvic.compare.rundirs import RunLogs
from uvic.fid.classifier import CLASSIFIER_MODE


SMOKE_TEST = "smoke test"
# The fewest images of a FID that published numbers use: U-ViT's fid10k while training (papers' tables: 50,000).
# FID is biased upwards by a term ~ 1/N, so a FID of fewer images compares with none of them.
MIN_FID_IMAGES = 10_000
STANDARD_DIMS = 2048  # pool3, the feature layer of the standard FID
FIDS = ("fid_last", "fid_best", PROTOCOL_FID)
_FID_KEYS = ("weights", "weights_sha256", "standard_weights", "trained", "mode", "dims", "num_images", "sampler",
             "steps", "reference")


def annotate(name: str, entry: dict[str, Any], logs: dict[tuple[str, int], RunLogs], plan: Plan) -> None:
    """Add "provenance", "comparable", "reason" and "headline" to report.json's `entry` of metric `name` (its
    "values" name the runs it counts; `logs` holds every finished run's), and make every verdict of a metric that is
    not comparable `SMOKE_TEST`."""
    counted = [(arm, int(seed)) for arm, by_seed in entry["values"].items() for seed in by_seed]
    runs = [logs[key] for key in counted if key in logs]
    if name in FIDS:
        per_run = [_fid_record(name, run, plan.configs[arm]["train"]) for (arm, _), run in zip(counted, runs)]
        provenance = _merge(per_run, _FID_KEYS)
        title = _merge(per_run, ("title",))["title"]  # a classifier's distance names its feature space
        if title is not None:
            provenance["title"] = title
        reasons = fid_reasons(provenance)
    elif name.startswith("val_"):
        provenance = _merge([_validation_record(run) for run in runs], ("split", "examples", "held_out"))
        reasons = []
    elif name == "train_loss":  # the mean over the last TRAIN_LOSS_TAIL of the logged steps
        tails = [{"n": max(1, math.ceil(TRAIN_LOSS_TAIL * len([r for r in run.train if "loss" in r])))}
                 for run in runs]
        provenance = {"split": "training batches", "logged_steps": _merge(tails, ("n",))["n"]}
        reasons = []
    else:  # a metric this module does not know: nothing to say where it comes from
        provenance, reasons = {}, []
    entry["provenance"] = provenance
    entry["comparable"] = not reasons
    entry["reason"] = "; ".join(reasons) if reasons else None
    smoke_test_verdicts(entry)
    base = plan.baseline
    entry["headline"] = {}
    for arm, vs in entry["vs_baseline"].items():
        seeds = set(entry["values"][arm]) & set(entry["values"][base])
        base_mean = _mean([entry["values"][base][s] for s in seeds])
        entry["headline"][arm] = headline(arm, base, vs, base_mean, entry["lower_is_better"],
                                          suffix=_suffix(name, provenance, reasons), smoke_test=bool(reasons))


def smoke_test_verdicts(entry: dict[str, Any]) -> None:
    """Make every verdict of an annotated `entry` that is not comparable (`vs_baseline`, and `pairs` where the
    report has them) `SMOKE_TEST`."""
    if entry.get("comparable") is False:
        for vs in [*entry["vs_baseline"].values(), *entry.get("pairs", {}).values()]:
            vs["verdict"] = SMOKE_TEST


def fid_reasons(provenance: dict[str, Any]) -> list[str]:
    """Why a FID of `provenance` (`annotate`'s) compares with no published FID; [] when it is the standard FID."""
    reasons = []
    for key in ("weights", "weights_sha256", "standard_weights", "trained", "dims", "num_images", "mode",
                "sampler", "steps", "reference"):
        if isinstance(provenance.get(key), list):
            reasons.append(f"the runs differ in {key} ({', '.join(map(str, provenance[key]))})")
    standard, trained, weights = provenance.get("standard_weights"), provenance.get("trained"), provenance.get("weights")
    if provenance.get("mode") == CLASSIFIER_MODE:  # a Fréchet distance in a trained classifier's own features:
        # no published number to stand beside, but the arms of one comparison are scored alike (same weights,
        # same number of images, checked above), so its differences say something about the models.
        if trained is False:
            reasons.append(f"the classifier weights {weights} were never trained")
        if not provenance.get("weights_sha256"):
            reasons.append("the classifier weights' SHA-256 is not recorded")
        return reasons
    if trained is False:
        reasons.append(f"the FID network's weights {weights} were never trained (random-init test weights)")
    elif standard is False:
        sha = provenance.get("weights_sha256")
        reasons.append(f"the FID network's weights {weights} (SHA-256 {str(sha)[:12]}...) are not the standard FID "
                       f"Inception weights pt_inception-2015-12-05-6726825d.pth")
    elif standard is None:
        reasons.append("the FID network's weights are not known to be the standard FID Inception weights (their "
                       "SHA-256 was neither recorded nor checked)")
    dims = provenance.get("dims")
    if isinstance(dims, int) and dims != STANDARD_DIMS:
        reasons.append(f"{dims}-d features, not the standard FID's {STANDARD_DIMS}-d pool3")
    n = provenance.get("num_images")
    if isinstance(n, int) and n < MIN_FID_IMAGES:
        reasons.append(f"{n:,} images, fewer than the {MIN_FID_IMAGES:,} of the smallest published FIDs (FID is "
                       f"biased by the number of images)")
    elif n is None:
        reasons.append("the number of images is not recorded")
    return reasons


def _fid_record(name: str, run: RunLogs, train_cfg: dict[str, Any]) -> dict[str, Any]:
    """The provenance of one run's FID of metric `name` (see the module docstring)."""
    if name == PROTOCOL_FID:
        try:
            data = json.loads((Path(run.path) / PROTOCOL_FILE).read_text())
            protocol, network = data.get("protocol") or {}, data.get("network") or {}
        except (OSError, ValueError, AttributeError):
            protocol, network = {}, {}
        out = {k: protocol.get(k) for k in ("dims", "num_images", "sampler", "steps", "reference")}
        out["weights"] = network.get("weights") or (Path(protocol["weights"]).name if protocol.get("weights")
                                                     else None)
        out.update({k: network.get(k) for k in ("weights_sha256", "standard_weights", "trained", "mode", "title")})
        if isinstance(network.get("dims"), int):  # the features used (the protocol's is train.eval_fid_dims)
            out["dims"] = network["dims"]
        elif out["mode"] == CLASSIFIER_MODE:  # an older record: train.eval_fid_dims is not a classifier's width
            out["dims"] = None
        return out
    records = [r for r in run.evals if "fid" in r]
    if not records:
        return dict.fromkeys(_FID_KEYS)
    record = records[-1] if name == "fid_last" else min(records, key=lambda r: r["fid"])
    out = {k: record.get(k) for k in ("dims", "num_images", "sampler", "steps", "weights", "weights_sha256",
                                      "standard_weights", "trained", "mode", "title")}
    out["reference"] = train_cfg.get("eval_reference")
    if out["standard_weights"] is None:  # a record from before the network was: what the run config checked
        out.update(_configured_weights(train_cfg))
    return out


def _configured_weights(train_cfg: dict[str, Any]) -> dict[str, Any]:
    """What a run config says of its FID network: without `train.eval_fid_weights_sha256` the run checked that the
    weights' SHA-256 starts with the standard one's, so they were the standard weights (full SHA-256 unknown)."""
    from uvic.fid.inception import WEIGHTS_NAME, is_standard_weights

    sha = str(train_cfg.get("eval_fid_weights_sha256") or "")
    weights = train_cfg.get("eval_fid_weights") or ""
    out: dict[str, Any] = {"weights": Path(weights).name if weights else WEIGHTS_NAME,
                           "mode": train_cfg.get("eval_fid_mode")}
    if sha == "":
        out["standard_weights"] = True
    elif sha.lower() != "none" and len(sha) >= 8:
        out["standard_weights"] = is_standard_weights(sha)
    return out


def _validation_record(run: RunLogs) -> dict[str, Any]:
    from uvic.training.validation import RECORD

    try:
        data = json.loads((Path(run.path) / RECORD).read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _merge(records: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, Any]:
    """{key: the value every record has, or the sorted list of the distinct values where they differ; None where
    no record has it}."""
    out: dict[str, Any] = {}
    for key in keys:
        values = list(dict.fromkeys(json.dumps(r.get(key)) for r in records))
        if not values:
            out[key] = None
        elif len(values) == 1:
            out[key] = json.loads(values[0])
        else:
            out[key] = sorted((json.loads(v) for v in values), key=str)
    return out


def _mean(values: list[float]) -> float | None:
    """The mean, None without values or where it is not finite (values near the float limit overflow)."""
    try:
        mean = statistics.fmean(values) if values else None
    except OverflowError:
        return None
    return mean if mean is not None and math.isfinite(mean) else None


def _suffix(name: str, provenance: dict[str, Any], reasons: list[str]) -> str:
    """What the headline adds: a smoke test's warning, or a validation metric's held-out examples."""
    if reasons:
        return f" Not comparable with published numbers: {'; '.join(reasons)}."
    if name.startswith("val_"):
        n, split = provenance.get("examples"), provenance.get("split")
        if isinstance(n, int):
            return f" Over {n:,} held-out examples ({split})." if isinstance(split, str) else \
                f" Over {n:,} held-out examples."
        return " The number of held-out examples is not recorded (runs from before validation.json)."
    return ""


def _pct(x: float, sign: bool = False) -> str:
    """100 x as a percentage with 2 significant digits (whole numbers from 10%)."""
    v = 100 * x
    text = f"{abs(v):.2g}" if abs(v) < 10 else f"{abs(v):.0f}"
    text = text if "e" not in text else f"{abs(v):.0f}"
    return (("-" if v < 0 else "+") if sign else "") + text + "%"


def headline(arm: str, base: str, vs: dict[str, Any], base_mean: float | None, lower_is_better: bool,
             suffix: str = "", smoke_test: bool = False) -> dict[str, Any]:
    """The headline of `arm` against `base` on one metric: `vs` is its report.json `vs_baseline` entry
    (`uvic.compare.stats.Paired`), `base_mean` the baseline's mean over the paired seeds (see the module docstring).
    A `smoke_test` headline gives the numbers and says they are a smoke test, never what they rule out.
    """
    n, diff, ci = vs["n"], vs["mean_diff"], vs["ci95"]
    if n == 0 or diff is None:
        return {"relative": None, "ci95_relative": None, "text": f"{arm} vs {base}: no seed both finished.{suffix}"}
    shares = [diff / base_mean, *(c / base_mean for c in ci or ())] if base_mean is not None and base_mean > 0 else []
    if not shares or not all(math.isfinite(v) for v in shares):
        interval = f" (95% interval {ci[0]:.4g} to {ci[1]:.4g})" if ci else ""
        why = ("it is not finite" if base_mean is None else "it is 0" if base_mean == 0
               else "it is not positive" if base_mean < 0 else "the share is not finite")
        return {"relative": None, "ci95_relative": None,
                "text": f"{arm} vs {base}: {diff:+.4g}{interval}, over {n} seed(s); not a share of {base}'s mean "
                        f"({why}).{suffix}"}
    relative = diff / base_mean
    if ci is None:
        return {"relative": relative, "ci95_relative": None,
                "text": f"{arm} vs {base}: {_pct(relative, True)} of {base}'s mean over 1 seed: no interval "
                        f"(fewer than 2 paired seeds), so it rules out nothing.{suffix}"}
    lo, hi = ci[0] / base_mean, ci[1] / base_mean
    # g: the difference on the side where positive is better.
    g_lo, g_hi = (-hi, -lo) if lower_is_better else (lo, hi)
    span = lambda a, b: _pct(a) if _pct(a) == _pct(b) else f"{_pct(a)} to {_pct(b)}"
    if smoke_test:
        ruled = f"a {SMOKE_TEST}, which says nothing about the models"
    elif g_lo > 0:
        ruled = (f"{arm} is better by {span(g_lo, g_hi)}: it rules out no difference, and {arm} being more than "
                 f"{_pct(g_hi)} better")
    elif g_hi < 0:
        ruled = (f"{arm} is worse by {span(-g_hi, -g_lo)}: it rules out no difference, and {arm} being more than "
                 f"{_pct(-g_lo)} worse")
    else:
        ruled = f"it rules out {arm} being more than {_pct(g_hi)} better or {_pct(-g_lo)} worse"
    text = (f"{arm} vs {base}: {_pct(relative, True)} of {base}'s mean (95% interval {_pct(lo, True)} to "
            f"{_pct(hi, True)}, {n} seeds): {ruled}.{suffix}")
    return {"relative": relative, "ci95_relative": [lo, hi], "text": text}
