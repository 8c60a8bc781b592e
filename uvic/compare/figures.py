"""The report's figures (matplotlib, Agg), each a PNG written atomically.

    curve_figure      a curve per arm (mean over seeds, band = min..max over seeds) and its paired difference
                      from the baseline over steps (mean over seeds, band = 95% Student-t interval)
    paired_dots       one final metric: a dot per (arm, seed), a line per seed joining its arms
    per_block_figure  a value per block (the share of negative attention weight): a panel per arm, the blocks in
                      execution order along x, a dot per seed and the mean over seeds as a bar
    samples_figure    the runs' last sample grids, a row per seed and a column per arm (the grids of every run
                      are drawn from the same sampling seeds, so cells of one row differ only by the arm)
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from uvic.compare.stats import mean_band
from uvic.io import atomic_write


# Sample grids shown per arm (rows); more seeds would make the figure too large to read.
MAX_SAMPLE_ROWS = 4


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out_png: Path) -> Path:
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out_png) as f:
        f.write(buf.getvalue())
    return out_png


def _matrix(by_seed: Mapping[int, Mapping[int, float]], steps: np.ndarray) -> np.ndarray:
    """(S, T) values of each seed at `steps`, NaN where a seed has none."""
    index = {int(s): i for i, s in enumerate(steps)}
    rows = np.full((len(by_seed), len(steps)), np.nan)
    for r, points in enumerate(by_seed.values()):
        for step, value in points.items():
            rows[r, index[step]] = value
    return rows


def curve_figure(title: str, arms: Sequence[str], data: Mapping[str, Mapping[int, Mapping[int, float]]],
                 out_png: Path, *, log_scale: bool = False, lower_is_better: bool = True) -> Path:
    """Draw a curve of each arm and, with two arms or more, each arm's paired difference from the first.

    Args:
        data: {arm: {seed: {step: value}}} of the finished runs (an arm may lack seeds).
    """
    plt = _pyplot()
    pairs = len(arms) > 1
    fig, axes = plt.subplots(1, 2 if pairs else 1, figsize=(11 if pairs else 6, 4), dpi=100, squeeze=False)
    ax = axes[0][0]
    for i, arm in enumerate(arms):
        by_seed = data.get(arm, {})
        steps = np.array(sorted({s for points in by_seed.values() for s in points}))
        if not len(steps):
            continue
        rows = _matrix(by_seed, steps)
        with warnings.catch_warnings():  # steps some seeds lack are NaN: "Mean of empty slice" is expected
            warnings.simplefilter("ignore", RuntimeWarning)
            mean, low, high = np.nanmean(rows, 0), np.nanmin(rows, 0), np.nanmax(rows, 0)
        ax.plot(steps, mean, color=f"C{i}", lw=1.2, label=f"{arm} ({len(by_seed)} seeds)")
        if len(by_seed) > 1:
            ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.2, lw=0)
    ax.set(xlabel="step", ylabel=title, title=f"{title} (mean over seeds, band: min..max)")
    if log_scale:
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    if pairs:
        ax = axes[0][1]
        base = data.get(arms[0], {})
        for i, arm in enumerate(arms[1:], start=1):
            seeds = sorted(set(base) & set(data.get(arm, {})))
            diffs = {s: {k: data[arm][s][k] - base[s][k] for k in set(data[arm][s]) & set(base[s])} for s in seeds}
            steps = np.array(sorted({k for d in diffs.values() for k in d}))
            if not len(steps):
                continue
            mean, low, high = mean_band(_matrix(diffs, steps))
            ax.plot(steps, mean, color=f"C{i}", lw=1.2, label=f"{arm} - {arms[0]} ({len(seeds)} pairs)")
            ax.fill_between(steps, low, high, color=f"C{i}", alpha=0.2, lw=0)
        ax.axhline(0, color="k", lw=0.8)
        better = "below" if lower_is_better else "above"
        ax.set(xlabel="step", ylabel=f"difference ({better} 0 is better)",
               title=f"paired difference from {arms[0]} (band: 95% interval)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out_png)


def paired_dots(name: str, arms: Sequence[str], values: Mapping[str, Mapping[int, float]], out_png: Path, *,
                lower_is_better: bool = True) -> Path:
    """A dot per (arm, seed) at x = the arm's position, a grey line per seed through the arms it has.

    Args:
        values: {arm: {seed: value}} of the finished runs.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(arms) + 1.5), 4), dpi=100)
    seeds = sorted({s for v in values.values() for s in v})
    for seed in seeds:
        xs = [i for i, arm in enumerate(arms) if seed in values.get(arm, {})]
        ax.plot(xs, [values[arms[i]][seed] for i in xs], color="0.6", lw=0.8, zorder=1)
    for i, arm in enumerate(arms):
        points = values.get(arm, {})
        ax.scatter([i] * len(points), list(points.values()), color=f"C{i}", s=28, zorder=2)
    ax.set_xticks(range(len(arms)), arms)
    ax.set_xlim(-0.5, len(arms) - 0.5)
    ax.set(ylabel=name, title=f"{name} per seed ({'lower' if lower_is_better else 'higher'} is better)")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    return _save(fig, out_png)


def per_block_figure(title: str, arms: Sequence[str], values: Mapping[str, Mapping[int, Mapping[str, float]]],
                     out_png: Path) -> Path:
    """A panel per arm: a bar per block at the mean over seeds, a dot per seed; blocks in the order the runs list
    them (execution order), the union over the arms so that the panels line up.

    Args:
        values: {arm: {seed: {block: value}}} of the finished runs.
    """
    plt = _pyplot()
    blocks = list(dict.fromkeys(b for arm in arms for per_seed in values.get(arm, {}).values() for b in per_seed))
    width = max(5.5, 0.35 * len(blocks) + 1.5)
    fig, axes = plt.subplots(len(arms), 1, figsize=(width, 2.4 * len(arms) + 0.6), dpi=100, sharex=True,
                             sharey=True, squeeze=False)
    x = np.arange(len(blocks))
    for i, arm in enumerate(arms):
        ax = axes[i][0]
        per_seed = values.get(arm, {})
        rows = np.array([[v.get(b, np.nan) for b in blocks] for v in per_seed.values()]).reshape(-1, len(blocks))
        if len(rows):
            with warnings.catch_warnings():  # a block some arm lacks is NaN in every seed
                warnings.simplefilter("ignore", RuntimeWarning)
                ax.bar(x, np.nanmean(rows, 0), color=f"C{i}", alpha=0.35, width=0.7)
            for row in rows:
                ax.scatter(x, row, color=f"C{i}", s=14, zorder=2)
        ax.set_title(f"{arm} ({len(per_seed)} seeds)", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    ax = axes[-1][0]
    ax.set_xticks(x, blocks, rotation=60, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(blocks) - 0.4)
    fig.suptitle(f"{title} (bar: mean over seeds, dot: a seed)", fontsize=10)
    fig.tight_layout()
    return _save(fig, out_png)


def samples_figure(arms: Sequence[str], grids: Mapping[str, Mapping[int, Path]], out_png: Path) -> Path | None:
    """The sample grids side by side: a column per arm, a row per seed (the first `MAX_SAMPLE_ROWS` seeds that
    have a grid in every arm, else in any). Returns None without any grid.

    Args:
        grids: {arm: {seed: PNG path}}.
    """
    from PIL import Image

    every = sorted(set.intersection(*(set(grids.get(a, {})) for a in arms))) if arms else []
    seeds = (every or sorted({s for g in grids.values() for s in g}))[:MAX_SAMPLE_ROWS]
    if not seeds:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(seeds), len(arms), figsize=(3 * len(arms), 3 * len(seeds) + 0.4), dpi=100,
                             squeeze=False)
    for r, seed in enumerate(seeds):
        for c, arm in enumerate(arms):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            path = grids.get(arm, {}).get(seed)
            if path is not None:
                with Image.open(path) as im:
                    ax.imshow(np.asarray(im.convert("RGB")), interpolation="nearest")
                ax.set_xlabel(path.stem, fontsize=7)
            if r == 0:
                ax.set_title(arm)
            if c == 0:
                ax.set_ylabel(f"seed {seed}")
    fig.tight_layout()
    return _save(fig, out_png)
