"""The report of a comparison directory: report.json, report.md, a self-contained report.html and figures/*.png.

    data = write_report("runs/cmp")     # reads runs/cmp/plan.json and whatever runs have finished

report.json has this shape (for other tools; `runs` names every run's state, see `uvic.compare.rundirs`):

    {"baseline": "uvit", "arms": ["uvit", "uvic"], "seeds": [0, 1, 2],
     "metrics": {"val_loss": {"lower_is_better": true,
                              "values": {"uvit": {"0": 0.0712, ...}, "uvic": {...}},
                              "vs_baseline": {"uvic": {"n": 3, "mean_diff": -0.0011, "ci95": [-0.0019, -0.0003],
                                                       "p_value": 0.03, "relative": -0.0155, "verdict": "better"}},
                              "excluded": {"uvit": {}, "uvic": {"2": "metrics.jsonl: val_loss is nan at step 600"}},
                              "provenance": {"split": "the data's test split", "examples": 10000, "held_out": 10000},
                              "comparable": true, "reason": null,
                              "headline": {"uvic": {"relative": -0.0155, "ci95_relative": [-0.027, -0.004],
                                                    "text": "uvic vs uvit: -1.6% of uvit's mean (...)"}}},
                 "train_loss": {...}},
     "per_block": {"attn_neg_share": {"uvit": {"0": {"in_blocks.0": 0.0, ...}, ...}, "uvic": {...}}},
     "per_block_excluded": {"attn_neg_share": {"uvit": {}, "uvic": {"1": "metrics.jsonl has no attn_neg_share ..."}}},
     "runs": {"uvit": {"0": {"state": "finished", "detail": ""}, ...}, ...}}

`values` holds finished runs only, and `vs_baseline` pairs the seeds both arms finished (`uvic.compare.stats`);
`excluded` names each finished run a metric leaves out and why (`uvic.compare.metrics.exclusion`: a missing file,
a value that is not finite, no value at the run's last step; for `fid_protocol`, a record of another protocol or
step, `uvic.compare.protocol_fid.record_exclusions`), so that no seed leaves a pairing silently. `fid_protocol`'s
value of a run is the mean of its first K resamplings, K the fewest any run paired holds (the same sampling seeds
in every run: `uvic.compare.protocol_fid.paired_resamplings`); its `resamplings` are those K per run, and
`resamplings_left_out` {arm: {seed: [FID]}} the later ones of runs that hold more. A statistic that
overflows (values near the float limit) is null: report.json is always valid JSON. A metric no finished run
records (`uvic.compare.metrics.METRICS`) is left out, and so is a per-block quantity
(`PER_BLOCK`: each finished run's {block: value} at its last validation, which must be at its last step:
`per_block_excluded` names the runs left out and why, `uvic.compare.metrics.per_block_exclusion`). `provenance`,
`comparable`, `reason` and `headline` (`uvic.compare.provenance`): where the numbers come from (a FID's network,
dims, images, sampler and steps; a validation metric's held-out split and examples), whether a FID is the
standard one (if not, every verdict is "smoke test", also in `pairs`, and the report opens with a banner), and
what each interval rules out as a share of the baseline's mean. report.md and report.html are the
same document (one list of blocks, two renderers): the runs, a table of every metric with the verdicts, per-seed
values, and the figures; the HTML embeds them as base64 PNG data URIs, so it opens offline with nothing beside it.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from uvic.compare import figures, provenance
from uvic.compare.metrics import (
    CURVES,
    METRICS,
    PER_BLOCK,
    Curve,
    Metric,
    exclusion,
    mean_or_none,
    per_block_exclusion,
)
from uvic.compare.plan import Plan, load_plan, rebase, shell_command
from uvic.compare.protocol_fid import FILE as PROTOCOL_FILE
from uvic.compare.protocol_fid import METRIC as PROTOCOL_FID
from uvic.compare.protocol_fid import paired_resamplings, read_fids, read_record, record_exclusions
from uvic.compare.rundirs import (
    RunLogs,
    RunState,
    final_samples,
    finite,
    read_attempts,
    read_logs,
    run_state,
    shared_records,
)
from uvic.compare.stats import fid_spreads, paired_by_seed
from uvic.errors import StorageError, storage_errors
from uvic.io import atomic_write


FIGURES = "figures"
VERDICTS = ("better", "worse", "inconclusive", provenance.SMOKE_TEST)


@dataclass
class _Gathered:
    """The plan, every run's state and the logs of the finished runs, read once."""

    plan: Plan
    states: dict[tuple[str, int], RunState]
    logs: dict[tuple[str, int], RunLogs]


def _gather(out: Path, baseline: str | None = None) -> _Gathered:
    plan = load_plan(out)
    if baseline is not None:  # another arm's contrasts from the same runs
        plan = rebase(plan, baseline)
    attempts = read_attempts(out)
    states, logs = {}, {}
    for run in plan.runs:
        key = (run.arm, run.seed)
        states[key] = run_state(plan, run, attempts)
    finished = [run for run in plan.runs if states[run.arm, run.seed].state == "finished"]
    for key, why in shared_records(plan, finished).items():  # one file counted for two runs: neither counts
        states[key] = RunState("mismatch", why)
    for run in plan.runs:
        key = (run.arm, run.seed)
        if states[key].state == "finished":
            try:
                logs[key] = read_logs(run.run_dir)
            except ValueError as e:  # a damaged metrics.jsonl: named, never counted
                states[key] = RunState("failed", f"unreadable logs: {e}")
    return _Gathered(plan, states, logs)


def _values(g: _Gathered, metric: Metric,
            paired_fids: dict[tuple[str, int], list[float]]) -> dict[str, dict[int, float]]:
    """{arm: {seed: value}} of `metric` over the finished runs that have it; the protocol FID's is the mean of
    `paired_fids` (`_protocol_fids`: the resamplings every run paired has), not of all the run holds."""
    out: dict[str, dict[int, float]] = {}
    for (arm, seed), run in g.logs.items():
        # A mean of finite values can overflow: no value (`excluded` says why).
        value = finite(mean_or_none(paired_fids.get((arm, seed), [])) if metric.name == PROTOCOL_FID
                       else metric.read(run))
        if value is not None:
            out.setdefault(arm, {})[seed] = value
    return out


def _protocol_fids(g: _Gathered) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], str]]:
    """The protocol FIDs each finished run is paired on ({(arm, seed): FIDs}: the first k of each, k the fewest any
    run paired holds, `uvic.compare.protocol_fid.paired_resamplings`), and {(arm, seed): why} of the finished runs
    left out (a missing or unusable record, another step or protocol: `record_exclusions`)."""
    order = {(run.arm, run.seed): i for i, run in enumerate(g.plan.runs)}
    records: dict[tuple[str, int], Any] = {}
    for key in sorted(g.logs, key=order.__getitem__):
        try:
            records[key] = read_record(g.logs[key].path)
        except ValueError as e:
            records[key] = str(e)
    reasons = record_exclusions(records, {key: g.plan.configs[key[0]]["train"]["max_steps"] for key in records})
    return paired_resamplings(records, reasons), reasons


def build_report(out: str | Path, baseline: str | None = None, all_pairs: bool = False) -> dict[str, Any]:
    """The report.json data of comparison directory `out` (nothing is written); `baseline`, `all_pairs`: see
    `write_report`."""
    return _with_pairs(_report_data(_gather(Path(out), baseline)), all_pairs)


def _report_data(g: _Gathered) -> dict[str, Any]:
    plan = g.plan
    arms, base = plan.arm_names, plan.baseline
    metrics = {}
    paired_fids, protocol_reasons = _protocol_fids(g)
    for metric in METRICS:
        values = _values(g, metric, paired_fids)
        if not values and not _present(g, metric):
            continue
        excluded = _exclude(g, metric, values, protocol_reasons if metric.name == PROTOCOL_FID else {})
        vs = {arm: paired_by_seed(values.get(arm, {}), values.get(base, {}), metric.lower_is_better).to_dict()
              for arm in arms[1:]}
        metrics[metric.name] = {
            "lower_is_better": metric.lower_is_better,
            "values": {arm: {str(s): v for s, v in sorted(values.get(arm, {}).items())} for arm in arms},
            "vs_baseline": vs,
            "excluded": excluded,
        }
    if PROTOCOL_FID in metrics:  # the K resamplings behind each run's mean, and the two spreads they separate
        by_arm: dict[str, dict[int, list[float]]] = {}
        later: dict[str, dict[str, list[float]]] = {arm: {} for arm in arms}  # resamplings not every run has
        for (arm, seed), run in sorted(g.logs.items()):
            if str(seed) not in metrics[PROTOCOL_FID]["values"][arm]:  # left out (`excluded`)
                continue
            by_arm.setdefault(arm, {})[seed] = fids = paired_fids[arm, seed]
            if more := read_fids(run.path)[len(fids):]:
                later[arm][str(seed)] = more
        metrics[PROTOCOL_FID]["resamplings"] = {arm: {str(s): f for s, f in by_arm.get(arm, {}).items()}
                                                for arm in arms}
        metrics[PROTOCOL_FID]["resamplings_left_out"] = later
        metrics[PROTOCOL_FID]["spreads"] = {arm: fid_spreads(by_arm.get(arm, {})) for arm in arms}
    per_block, per_block_excluded = _per_block(g)
    for name, entry in metrics.items():  # where each number comes from; a smoke-test FID is never better or worse
        provenance.annotate(name, entry, g.logs, plan)
    runs = {arm: {str(seed): {"state": g.states[arm, seed].state, "detail": g.states[arm, seed].detail}
                  for seed in plan.seeds} for arm in arms}
    return _finite_only({"baseline": base, "arms": arms, "seeds": list(plan.seeds), "metrics": metrics,
                         "per_block": per_block, "per_block_excluded": per_block_excluded, "runs": runs})


def _per_block(g: _Gathered) -> tuple[dict[str, Any], dict[str, Any]]:
    """report.json's `per_block`, {name: {arm: {seed: {block: value}}}} of the finished runs whose values are of
    their last step, and `per_block_excluded`, {name: {arm: {seed: why}}} of the others
    (`uvic.compare.metrics.per_block_exclusion`), for each entry of `PER_BLOCK` some finished run records."""
    arms = g.plan.arm_names
    per_block, per_block_excluded = {}, {}
    for entry in PER_BLOCK:
        kind, key = entry.source
        values: dict[str, dict[str, dict[str, float]]] = {}
        excluded: dict[str, dict[str, str]] = {arm: {} for arm in arms}
        present = False
        for (arm, seed), run in sorted(g.logs.items()):
            present = present or any(key in r for r in getattr(run, kind))
            by_block = entry.read(run)
            max_steps = g.plan.configs[arm]["train"]["max_steps"]
            if (why := per_block_exclusion(entry, run, by_block, max_steps)) is not None:
                excluded[arm][str(seed)] = why
            else:
                values.setdefault(arm, {})[str(seed)] = by_block
        if values:
            per_block[entry.name] = {arm: values[arm] for arm in arms if arm in values}
        if present:
            per_block_excluded[entry.name] = excluded
    return per_block, per_block_excluded


def _with_pairs(data: dict[str, Any], all_pairs: bool) -> dict[str, Any]:
    """`data` with, when `all_pairs`, each metric's `pairs`: {"<arm> - <other>": paired comparison} of every arm
    with every arm before it (baseline first), over the seeds both have a value of (`values`, after `excluded`)."""
    if not all_pairs:
        return data
    arms = data["arms"]
    for name, entry in data["metrics"].items():
        lower = entry["lower_is_better"]
        entry["pairs"] = {f"{a} - {b}": paired_by_seed(entry["values"][a], entry["values"][b], lower).to_dict()
                          for i, a in enumerate(arms) for b in arms[:i]}
        provenance.smoke_test_verdicts(entry)  # a FID that is not comparable is a smoke test in every pair too
    return _finite_only(data)


def _present(g: _Gathered, metric: Metric) -> bool:
    """Whether any finished run records `metric` at all (a value that is not finite included): then the metric is
    reported, with the runs it leaves out named, even where none of them has a usable value."""
    for run in g.logs.values():
        if metric.source is None:
            if (run.path / PROTOCOL_FILE).is_file():
                return True
        elif any(metric.source[1] in r for r in getattr(run, metric.source[0])):
            return True
    return False


def _exclude(g: _Gathered, metric: Metric, values: dict[str, dict[int, float]],
             reasons: dict[tuple[str, int], str]) -> dict[str, dict[str, str]]:
    """{arm: {seed: why}} of the finished runs whose value of `metric` is left out of its pairing (why: `reasons`,
    the protocol FID's from `_protocol_fids`, or the file and what is wrong, or which step is missing:
    `uvic.compare.metrics.exclusion`); they are removed from `values`, so that no seed leaves a pairing silently and
    values are paired only at one step."""
    order = {(run.arm, run.seed): i for i, run in enumerate(g.plan.runs)}
    finished = sorted(g.logs, key=order.__getitem__)
    max_steps = {key: g.plan.configs[key[0]]["train"]["max_steps"] for key in finished}
    out: dict[str, dict[str, str]] = {arm: {} for arm in g.plan.arm_names}
    for arm, seed in finished:
        value = values.get(arm, {}).get(seed)
        every = g.plan.configs[arm]["train"].get(metric.every, 0) if metric.every else 0
        why = reasons.get((arm, seed)) or exclusion(metric, g.logs[arm, seed], value, max_steps[arm, seed], every)
        if why is not None:
            out[arm][str(seed)] = why
            values.get(arm, {}).pop(seed, None)
    return out


def _finite_only(data: Any) -> Any:
    """`data` with every float that is not finite (a statistic of huge values that overflowed) as None, so that
    report.json is valid JSON whatever the runs logged."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: _finite_only(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite_only(v) for v in data]
    return data


def write_report(out: str | Path, baseline: str | None = None, all_pairs: bool = False) -> dict[str, Any]:
    """Write report.json, report.md, report.html and figures/*.png into comparison directory `out`; returns the
    report.json data. `baseline`: the arm every other is compared with (default: the plan's first), read from the
    same runs; `all_pairs`: each metric also gets `pairs`, {"<arm> - <other>": the paired comparison} of every two
    arms (each arm against every arm before it, baseline first).

    Raises:
        FileNotFoundError: `out` holds no plan.json. ConfigError: the plan does not parse. StorageError: a file
            or folder of the report cannot be written (no permission, a folder or file in the way); a report file
            of an earlier report that is not rewritten is removed, so that none is ever taken for the current one.
    """
    out = Path(out)
    g = _gather(out, baseline)
    written: list[str] = []
    try:
        with storage_errors(f"cannot write the report into {out}"):
            _check_own_folder(out, FIGURES)
            data = _with_pairs(_report_data(g), all_pairs)
            blocks = _document(g, data, _draw(g, data, out / FIGURES))
            texts = {"report.json": json.dumps(data, indent=1, allow_nan=False), "report.md": to_markdown(blocks, out),
                     "report.html": to_html(blocks, title=f"Comparison: {' vs '.join(data['arms'])}")}
            for name, text in texts.items():
                with atomic_write(out / name, "w") as f:
                    f.write(text)
                written.append(name)
    except BaseException:
        _withdraw_stale(out, keep=written)
        raise
    return data


REPORT_FILES = ("report.json", "report.md", "report.html")


def _check_own_folder(out: Path, name: str) -> None:
    """Refuse a folder of the report (`figures`) that is a symlink or resolves outside `out`: its figures would be
    drawn, and stale ones removed, wherever it points.

    Raises:
        StorageError: naming the folder and where it points.
    """
    folder = out / name
    if folder.is_symlink():
        raise StorageError(f"{folder}: {name} is a symlink (to {os.readlink(folder)}); the report writes only inside "
                           f"{out}: remove it")
    if folder.exists() and not folder.resolve().is_relative_to(out.resolve()):
        raise StorageError(f"{folder} lies outside {out} (in {folder.resolve()}); the report writes only inside it: "
                           f"remove it")


def _withdraw_stale(out: Path, keep: list[str]) -> None:
    """Remove the report files of an earlier report (those not in `keep`, just written): a report that failed
    leaves none that would pass for the current one."""
    for name in REPORT_FILES:
        path = out / name
        if name not in keep and (path.is_file() or path.is_symlink()):
            try:
                path.unlink()
            except OSError:  # it stays; the error line of the failure says the report was not written
                pass


# ---------------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------------


def _draw(g: _Gathered, data: dict[str, Any], folder: Path) -> dict[str, Path]:
    """Draw every figure the finished runs allow; returns {figure key: PNG path}. Figures of an earlier report
    that no longer apply are removed, so the folder always matches the report."""
    arms = g.plan.arm_names
    drawn: dict[str, Path] = {}
    for curve in CURVES:
        series = _curve_data(g, curve)
        if any(series.values()):
            drawn[f"curve_{curve.name}"] = figures.curve_figure(
                curve.title, arms, series, folder / f"curve_{curve.name}.png", log_scale=curve.log_scale,
                lower_is_better=curve.lower_is_better)
    for name, entry in data["metrics"].items():
        values = {arm: {int(s): v for s, v in by_seed.items()} for arm, by_seed in entry["values"].items()}
        if not any(values.values()):  # every finished run left out (`excluded`)
            continue
        drawn[f"paired_{name}"] = figures.paired_dots(name, arms, values, folder / f"paired_{name}.png",
                                                      lower_is_better=entry["lower_is_better"])
    for name, by_arm in data["per_block"].items():
        values = {arm: {int(s): v for s, v in by_seed.items()} for arm, by_seed in by_arm.items()}
        title = next(entry.title for entry in PER_BLOCK if entry.name == name)
        drawn[f"blocks_{name}"] = figures.per_block_figure(title, arms, values, folder / f"blocks_{name}.png")
    grids: dict[str, dict[int, Path]] = {}
    for (arm, seed), run in g.logs.items():
        if (grid := final_samples(run.path, g.plan.configs[arm]["train"]["max_steps"])) is not None:
            grids.setdefault(arm, {})[seed] = grid
    if (samples := figures.samples_figure(arms, grids, folder / "samples.png")) is not None:
        drawn["samples"] = samples
    if folder.is_dir():
        for stale in set(folder.glob("*.png")) - set(drawn.values()):
            stale.unlink()
    return drawn


def _curve_data(g: _Gathered, curve: Curve) -> dict[str, dict[int, dict[int, float]]]:
    out: dict[str, dict[int, dict[int, float]]] = {}
    for (arm, seed), run in sorted(g.logs.items()):
        points = curve.read(run)
        if points:
            out.setdefault(arm, {})[seed] = points
    return out


# ---------------------------------------------------------------------------------------------------------
# The document: blocks, rendered as Markdown or HTML
# ---------------------------------------------------------------------------------------------------------
# A block is ("h1" | "h2" | "h3" | "p" | "banner", text), ("list", [text]), ("table", header, rows) or ("figure", path,
# caption); a banner is a warning set apart (a smoke test).
# Text may hold `code` spans; a table cell that is a verdict is emphasised by both renderers.


def _fmt(value: float | None, spec: str = ".4g") -> str:
    return "n/a" if value is None else format(value, spec)


def _document(g: _Gathered, data: dict[str, Any], drawn: dict[str, Path]) -> list[tuple]:
    """The report's blocks: what was compared, the runs, the results, the figures, and how to read a verdict."""
    return [*_header_blocks(g.plan, data), *_banner_blocks(data), *_run_blocks(g), *_headline_blocks(data),
            *_result_blocks(data, drawn),
            *_figure_blocks(data, drawn), ("h2", "What a verdict means"), ("p", MEANING)]


MEANING = ("The interval covers the uncertainty from the training seeds of this comparison: which initial weights, data "
           "order and noise a run drew. It says whether the difference is larger than what another set of seeds would "
           "plausibly give, in this setting (this config, data, steps and model size); it says nothing about other "
           "settings. `inconclusive` does not mean equal: these seeds cannot tell, and the interval shows how large a "
           "difference they rule out. Each arm and metric is tested on its own, without a correction for testing "
           "several; with 2 or 3 seeds only large, consistent differences can be `better` or `worse`.")


def _header_blocks(plan: Plan, data: dict[str, Any]) -> list[tuple]:
    shared = shell_command(plan.overrides) if plan.overrides else "none"
    return [
        ("h1", f"Comparison: {' vs '.join(data['arms'])}"),
        ("p", f"Config `{plan.config}`, shared overrides `{shared}`; baseline `{data['baseline']}`; training seeds "
              f"{', '.join(map(str, plan.seeds))}. Every run of one seed starts from the same initial weights and sees "
              f"the same data order and noise, so the arms differ only by their overrides."),
        ("table", ["arm", "overrides"], [[arm.name, f"`{shell_command(arm.overrides)}`" if arm.overrides else "none"]
                                         for arm in plan.arms]),
    ]


def _run_blocks(g: _Gathered) -> list[tuple]:
    done = [key for key, s in g.states.items() if s.state == "finished"]
    others = [(key, s) for key, s in g.states.items() if s.state != "finished"]
    if not others:
        return [("h2", "Runs"), ("p", f"All {len(done)} runs finished.")]
    return [("h2", "Runs"),
            ("p", f"{len(done)} of {len(g.states)} runs finished. Only finished runs are counted; these are left out "
                  f"of the statistics and figures:"),
            ("list", [f"{arm} seed {seed}: {s.state}" + (f" ({s.detail})" if s.detail else "")
                      for (arm, seed), s in others])]


def _result_blocks(data: dict[str, Any], drawn: dict[str, Path]) -> list[tuple]:
    """The table of every metric and arm with the verdicts, then each metric's per-seed values and dot plot."""
    arms, base = data["arms"], data["baseline"]
    if not data["metrics"]:
        return [("h2", "Results"), ("p", "No finished run yet: nothing to compare.")]
    rows = []
    for name, entry in data["metrics"].items():
        better = "lower" if entry["lower_is_better"] else "higher"
        for arm in arms:
            vals = list(entry["values"][arm].values())
            spread = f" ± {_fmt(_stdev(vals))}" if len(vals) > 1 else ""
            cell = f"{_fmt(_mean(vals))}{spread}" if vals else "n/a"
            if arm == base:
                rows.append([f"{name} ({better} is better)", arm, cell, str(len(vals)), "", "", "", "baseline"])
                continue
            vs = entry["vs_baseline"][arm]
            ci = f" [{_fmt(vs['ci95'][0])}, {_fmt(vs['ci95'][1])}]" if vs["ci95"] else ""
            relative = "n/a" if vs["relative"] is None else f"{100 * vs['relative']:+.3g}%"
            rows.append(["", arm, cell, str(vs["n"]), f"{_fmt(vs['mean_diff'])}{ci}", relative,
                         _fmt(vs["p_value"], ".2g"), vs["verdict"]])
    blocks: list[tuple] = [
        ("h2", "Results"),
        ("table", ["metric", "arm", "mean ± sd over seeds", "n", f"difference vs {base} (95% interval)", "relative",
                   "p", "verdict"], rows),
        ("p", "n: the finished seeds of the baseline, and the seeds both arms finished (the pairs) of the others. "
              "Difference: the mean over those seeds of (arm - baseline), with its 95% Student-t interval; p: the "
              "two-sided paired t-test; relative: the difference over the baseline's mean. A verdict is `better` or "
              "`worse` when the whole interval lies on one side of 0, else `inconclusive` (always with fewer than 2 "
              "seeds)."),
    ]
    described = {m.name: m.description for m in METRICS}
    for name, entry in data["metrics"].items():
        table = []
        for seed in sorted({int(s) for v in entry["values"].values() for s in v}):
            vals = [entry["values"][arm].get(str(seed)) for arm in arms]
            diffs = [None if v is None or vals[0] is None else v - vals[0] for v in vals[1:]]
            table.append([str(seed), *map(_fmt, vals), *map(_fmt, diffs)])
        title = (entry.get("provenance") or {}).get("title")
        heading = f"{name}: {title}" if isinstance(title, str) and title != "FID" else name
        blocks += [("h3", heading), ("p", described[name] + ". " + _provenance_text(entry)),
                   ("table", ["seed", *arms, *(f"{arm} - {base}" for arm in arms[1:])], table)]
        blocks += _excluded_blocks(entry.get("excluded", {}))
        blocks += _pair_blocks(entry.get("pairs", {}))
        if "spreads" in entry:
            blocks += _spread_blocks(arms, entry["spreads"], entry.get("resamplings_left_out", {}))
        if f"paired_{name}" in drawn:
            blocks.append(("figure", drawn[f"paired_{name}"], f"{name} per seed: a line joins the arms of one seed"))
    return blocks


def _pair_blocks(pairs: dict[str, dict[str, Any]]) -> list[tuple]:
    """Every pair of arms (`write_report(all_pairs=True)`), each as a row of the results table."""
    if not pairs:
        return []
    rows = [[pair, str(vs["n"]), _fmt(vs["mean_diff"]) + (f" [{_fmt(vs['ci95'][0])}, {_fmt(vs['ci95'][1])}]"
                                                          if vs["ci95"] else ""),
             "n/a" if vs["relative"] is None else f"{100 * vs['relative']:+.3g}%", _fmt(vs["p_value"], ".2g"),
             vs["verdict"]] for pair, vs in pairs.items()]
    return [("p", "Every pair of arms (a - b over the seeds both have):"),
            ("table", ["pair", "n", "difference (95% interval)", "relative", "p", "verdict"], rows)]


_LEFT_OUT = "Finished runs left out of this metric (not paired, not in the mean)"


def _excluded_blocks(excluded: dict[str, dict[str, str]], intro: str = _LEFT_OUT) -> list[tuple]:
    """The finished runs a metric (or a per-block quantity) leaves out, each with why (report.json's `excluded`)."""
    items = [f"{arm} seed {seed}: {why}" for arm, by_seed in excluded.items() for seed, why in by_seed.items()]
    if not items:
        return []
    return [("p", f"{intro}:"), ("list", items)]


def _stdev(values: list[float]) -> float | None:
    """The sample standard deviation, None where it overflows (values near the float limit)."""
    try:
        return statistics.stdev(values)
    except (OverflowError, ValueError):
        return None


def _banner_blocks(data: dict[str, Any]) -> list[tuple]:
    """A banner per metric that compares with no published number (`uvic.compare.provenance`)."""
    return [("banner", f"Smoke test: `{name}` is not comparable with published numbers: {entry['reason']}. Its "
                       f"verdicts are `{provenance.SMOKE_TEST}`, never better or worse.")
            for name, entry in data["metrics"].items() if entry.get("comparable") is False]


def _headline_blocks(data: dict[str, Any]) -> list[tuple]:
    """Per metric and arm: the paired difference and its interval as a share of the baseline's mean, and what it
    rules out (report.json's `headline`)."""
    items = [f"`{name}`: {h['text']}" for name, entry in data["metrics"].items()
             for h in entry.get("headline", {}).values()]
    return [("h2", "Headlines"), ("list", items)] if items else []


def _provenance_text(entry: dict[str, Any]) -> str:
    """Where a metric's numbers come from (report.json's `provenance`), in a sentence."""
    p = entry.get("provenance") or {}
    show = lambda v: "not recorded" if v is None else ", ".join(map(str, v)) if isinstance(v, list) else str(v)
    width = "feature width not recorded" if p.get("dims") is None else f"{show(p['dims'])}-d features"
    if "num_images" in p and p.get("mode") == "classifier":  # uvic.fid.classifier's features: never called a FID
        return (f"Provenance: {show(p.get('title'))}, not a FID: a Fréchet distance in the features of the classifier "
                f"`{show(p['weights'])}`, SHA-256 `{show(p['weights_sha256'])}`; {width}; "
                f"{show(p['num_images'])} images, sampler {show(p['sampler'])} with {show(p['steps'])} steps; "
                f"reference `{show(p['reference'])}`. It compares only with distances of the same weights and number "
                f"of images.")
    if "num_images" in p:
        standard = {True: "the standard FID Inception weights", False: "not the standard FID Inception weights",
                    None: "not known to be the standard FID Inception weights"}
        kind = standard.get(p["standard_weights"], show(p["standard_weights"]))
        trained = " (never trained)" if p.get("trained") is False else ""
        return (f"Provenance: FID network `{show(p['weights'])}`, SHA-256 `{show(p['weights_sha256'])}`, "
                f"{kind}{trained}; {width}, mode {show(p['mode'])}; {show(p['num_images'])} "
                f"images, sampler {show(p['sampler'])} with {show(p['steps'])} steps; reference "
                f"`{show(p['reference'])}`.")
    if "examples" in p:
        return (f"Provenance: {show(p['examples'])} held-out examples (of {show(p['held_out'])}): "
                f"{show(p['split'])}.")
    if "logged_steps" in p:
        return f"Provenance: training batches, the mean of the last {show(p['logged_steps'])} logged steps."
    return ""


def _spread_blocks(arms: list[str], spreads: dict[str, dict[str, Any]],
                   left_out: dict[str, dict[str, list[float]]]) -> list[tuple]:
    """The protocol FID's two spreads per arm (`uvic.compare.stats.fid_spreads`), and the resamplings of runs that
    hold more than every run paired has (`left_out`: {arm: {seed: the later FIDs}})."""
    rows = []
    for arm in arms:
        s = spreads[arm]
        ratio = (s["training_seed_sd"] / s["resampling_sd"] if s["training_seed_sd"] is not None
                 and s["resampling_sd"] else None)
        rows.append([arm, str(s["runs"]), "/".join(map(str, s["gen_seeds"])) or "0", _fmt(s["mean"]),
                     _fmt(s["training_seed_sd"]), _fmt(s["resampling_sd"]), _fmt(ratio, ".3g")])
    return [("table", ["arm", "runs", "resamplings per run", "mean", "sd across training seeds",
                       "sd across resamplings", "ratio"], rows),
            ("p", "Each run's FID is computed once per resampling, with disjoint sampling seeds (the same for every "
                  "run). sd across training seeds: the standard deviation across runs of the per-run means (it "
                  "still holds 1/K of the resampling variance); sd across resamplings: the mean over runs of the "
                  "standard deviation across their resamplings. The paired comparison above uses the per-run means.")
            ] + _left_out_resamplings(spreads, left_out)


def _left_out_resamplings(spreads: dict[str, dict[str, Any]],
                          left_out: dict[str, dict[str, list[float]]]) -> list[tuple]:
    """A sentence naming the runs whose later resamplings not every paired run has, which their means leave out;
    k, the number each mean is over, is the spreads' `gen_seeds` (one value: every run is paired on k)."""
    items = [f"{arm} seed {seed}: {len(fids)}" for arm, by_seed in left_out.items() for seed, fids in by_seed.items()]
    k = next((s["gen_seeds"][0] for s in spreads.values() if s["gen_seeds"]), None)
    if not items or k is None:
        return []
    return [("p", f"Each run's mean is over its first {k} resamplings, those every paired run has (the same sampling "
                  f"seeds in every run); later ones left out: {', '.join(items)}.")]


def _figure_blocks(data: dict[str, Any], drawn: dict[str, Path]) -> list[tuple]:
    blocks: list[tuple] = []
    curves = [(c, drawn[f"curve_{c.name}"]) for c in CURVES if f"curve_{c.name}" in drawn]
    if curves:
        blocks.append(("h2", "Curves"))
        blocks += [("figure", path, f"{curve.title}: per arm, and the paired difference from {data['baseline']}")
                   for curve, path in curves]
    for entry in PER_BLOCK:
        excluded = data.get("per_block_excluded", {}).get(entry.name, {})
        if entry.name not in data["per_block"] and not any(excluded.values()):
            continue
        blocks += [("h2", entry.title[0].upper() + entry.title[1:]), ("p", f"`{entry.name}`: {entry.description}; "
                                                                           "the mean over the finished seeds.")]
        if entry.name in data["per_block"]:
            by_arm = data["per_block"][entry.name]
            names = list(dict.fromkeys(b for per_seed in by_arm.values() for v in per_seed.values() for b in v))
            arms = [arm for arm in data["arms"] if arm in by_arm]
            rows = [[name, *(_fmt(_mean([v[name] for v in by_arm[arm].values() if name in v]), ".3f")
                             for arm in arms)] for name in names]
            blocks += [("table", ["block", *arms], rows),
                       ("figure", drawn[f"blocks_{entry.name}"], f"{entry.title} per block: a bar at the mean over "
                                                                 "seeds, a dot per seed")]
        blocks += _excluded_blocks(excluded, "Finished runs left out (not in the mean)")
    if "samples" in drawn:
        blocks += [("h2", "Samples"), ("figure", drawn["samples"], "each run's last sample grid; every grid is drawn "
                                                                   "from the same sampling seeds")]
    return blocks


def _mean(values: list[float]) -> float | None:
    """The mean, None when there are no values or it overflows (values near the float limit)."""
    try:
        return statistics.fmean(values) if values else None
    except OverflowError:
        return None


_CODE = re.compile(r"`([^`]*)`")


def to_markdown(blocks: list[tuple], root: Path) -> str:
    """Render `blocks` as Markdown; figure paths are made relative to `root` (the report's folder)."""
    lines: list[str] = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + block[1], ""]
        elif kind == "p":
            lines += [block[1], ""]
        elif kind == "banner":
            lines += [f"> **{block[1]}**", ""]
        elif kind == "list":
            lines += [f"- {item}" for item in block[1]] + [""]
        elif kind == "table":
            header, rows = block[1], block[2]
            cell = lambda text: (f"**{text}**" if text in VERDICTS else text).replace("|", "\\|")
            lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows] + [""]
        elif kind == "figure":
            lines += [f"![{block[2]}]({block[1].relative_to(root).as_posix()})", ""]
    return "\n".join(lines)


_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 72rem; margin: 2rem auto; padding: 0 1rem; color: #222; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.6rem; text-align: left; }
th { background: #f3f3f3; }
code { background: #f3f3f3; padding: 0 0.2rem; }
figure { margin: 1rem 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { font-size: 0.85rem; color: #555; }
.verdict { font-weight: bold; }
.better { color: #1a7f37; } .worse { color: #b42318; } .inconclusive { color: #6b6b6b; } .smoke { color: #b54708; }
.banner { border: 2px solid #b54708; background: #fffaeb; color: #7a2e0e; padding: 0.6rem 1rem; margin: 1rem 0;
          font-weight: bold; }
"""


def _inline(text: str) -> str:
    return _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", html.escape(text, quote=False))


def to_html(blocks: list[tuple], title: str) -> str:
    """Render `blocks` as one self-contained HTML page (figures as data URIs, styles inline, no script)."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"]
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{_inline(block[1])}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{_inline(block[1])}</p>")
        elif kind == "banner":
            parts.append(f'<div class="banner" role="alert">{_inline(block[1])}</div>')
        elif kind == "list":
            parts.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in block[1]) + "</ul>")
        elif kind == "table":
            header, rows = block[1], block[2]

            def cell(text: str) -> str:
                if text in VERDICTS:
                    return f'<td><span class="verdict {text.split()[0]}">{text}</span></td>'
                return f"<td>{_inline(text)}</td>"

            parts.append("<table><thead><tr>" + "".join(f"<th>{_inline(h)}</th>" for h in header) + "</tr></thead>"
                         "<tbody>" + "".join("<tr>" + "".join(cell(c) for c in row) + "</tr>" for row in rows)
                         + "</tbody></table>")
        elif kind == "figure":
            png = base64.b64encode(block[1].read_bytes()).decode("ascii")
            alt = html.escape(block[2])
            parts.append(f'<figure><img src="data:image/png;base64,{png}" alt="{alt}"><figcaption>{alt}'
                         "</figcaption></figure>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
