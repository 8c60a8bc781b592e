"""The report's figures: drawn from the data given, with the panels and rows the data call for."""

import numpy as np
from PIL import Image

from uvic.compare.figures import MAX_SAMPLE_ROWS, curve_figure, paired_dots, samples_figure


def _png(path):
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def test_curve_figure_has_a_difference_panel_only_with_two_arms(tmp_path):
    data = {"a": {0: {1: 1.0, 2: 0.5}, 1: {1: 1.1, 2: 0.6}}, "b": {0: {1: 0.9, 2: 0.4}, 1: {2: 0.5}}}
    one = _png(curve_figure("loss", ["a"], data, tmp_path / "one.png"))
    two = _png(curve_figure("loss", ["a", "b"], data, tmp_path / "two.png", log_scale=True))
    assert one.shape[0] == two.shape[0] and two.shape[1] > 1.5 * one.shape[1]
    assert one.std() > 0 and two.std() > 0


def test_paired_dots_draws_each_arm_in_its_colour(tmp_path):
    img = _png(paired_dots("val_loss", ["a", "b"], {"a": {0: 1.0, 1: 2.0}, "b": {0: 1.5}}, tmp_path / "d.png"))
    blue, orange = np.array([31, 119, 180]), np.array([255, 127, 14])  # matplotlib's C0, C1
    assert (np.abs(img - blue).sum(-1) < 30).sum() > 20 and (np.abs(img - orange).sum(-1) < 30).sum() > 20


def test_samples_figure_rows_are_seeds_every_arm_has(tmp_path):
    grids = {}
    for arm in ("a", "b"):
        for seed in range(6):
            if (arm, seed) == ("b", 2):
                continue
            path = tmp_path / f"{arm}{seed}.png"
            Image.fromarray(np.full((8, 8, 3), 20 + 40 * seed, np.uint8)).save(path)
            grids.setdefault(arm, {})[seed] = path
    assert samples_figure(["a", "b"], {}, tmp_path / "none.png") is None
    full = _png(samples_figure(["a", "b"], grids, tmp_path / "s.png"))
    single = _png(samples_figure(["a", "b"], {"a": {0: grids["a"][0]}, "b": {}}, tmp_path / "s1.png"))
    # MAX_SAMPLE_ROWS rows: the seeds that every arm has (0, 1, 3, 4; each grid is one grey 20 + 40 seed).
    assert MAX_SAMPLE_ROWS == 4 and full.shape[0] > 3 * single.shape[0]
    shown = {seed for seed in range(6) if (full == 20 + 40 * seed).all(-1).sum() > 1000}
    assert shown == {0, 1, 3, 4}
