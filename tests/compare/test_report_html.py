"""report.html in a real headless Chromium, offline: every figure decodes and is laid out, the tables show the
verdicts, and the page requests nothing but itself and its data URIs.

Chromium comes from Debian's packages (`apt-get install -y chromium`), which .ci/run installs when missing. Without
it the test skips (the browser is optional for a user's `make test`), except under CI (CI=true), where it fails, so
that CI can never pass without having looked at the page (`headless_chromium.require_chromium`)."""

import numpy as np
from headless_chromium import Chromium, require_chromium
from PIL import Image
from synthetic_runs import write_run

from uvic.compare.report import write_report


# What the page shows, read in the page: each image's decoding, its decoded (natural) size, the sum of its decoded
# RGBA bytes (drawn on a canvas) and its laid-out box, and the text of every table.
PROBE = """(async () => {
  const images = [...document.images];
  const decoded = await Promise.all(images.map((i) => i.decode().then(() => true, () => false)));
  return {
    images: images.map((i, n) => {
      const box = i.getBoundingClientRect(), style = getComputedStyle(i);
      const canvas = document.createElement("canvas");
      canvas.width = i.naturalWidth;
      canvas.height = i.naturalHeight;
      const context = canvas.getContext("2d");
      context.drawImage(i, 0, 0);
      let sum = 0;
      for (const byte of context.getImageData(0, 0, canvas.width, canvas.height).data) sum += byte;
      return {decoded: decoded[n], natural: [i.naturalWidth, i.naturalHeight], sum: sum, box: [box.width, box.height],
              shown: style.display !== "none" && style.visibility !== "hidden" && style.opacity !== "0"};
    }),
    tables: [...document.querySelectorAll("table")].map((t) =>
      [...t.rows].map((r) => [...r.cells].map((c) => c.innerText.trim()))),
  };
})()"""


def test_report_html_in_headless_chromium(make_comparison, tmp_path, no_network):
    require_chromium()
    plan = make_comparison(arms={"uvit": ["model.attention=softmax"], "uvic": [], "cog_all": ["model.depth=2"]})
    shift = {"uvit": 0.0, "uvic": -0.02, "cog_all": 0.03}  # val_loss: uvic better, cog_all worse
    for arm, d in shift.items():
        for seed in range(3):
            noise = 0.01 * ((seed * 7 + len(arm)) % 3 - 1)  # train_loss: differences of both signs: inconclusive
            write_run(plan, arm, seed, losses={s: 1 / s + noise for s in range(1, 101)},
                      val={50: 0.6 + d + seed / 100, 100: 0.5 + d + seed / 100},
                      shares={100: {"in_blocks.0": 0.0, "mid_block": 0.0 if arm == "uvit" else 0.4 + seed / 10}})
    data = write_report(plan.out)
    verdicts = {(name, arm): vs["verdict"] for name, entry in data["metrics"].items()
                for arm, vs in entry["vs_baseline"].items()}
    assert verdicts == {("val_loss", "uvic"): "better", ("val_loss", "cog_all"): "worse",
                        ("val_loss_mean", "uvic"): "better", ("val_loss_mean", "cog_all"): "worse",
                        ("train_loss", "uvic"): "inconclusive", ("train_loss", "cog_all"): "inconclusive"}
    page = plan.out / "report.html"

    with Chromium(tmp_path / "profile") as browser:
        shown = browser.open_and_evaluate(page.as_uri(), PROBE)
        requests = browser.requests

    # Figures: all of them, decoded whole (the pixels the browser draws are the PNG's), laid out with a visible box.
    figures = sorted((plan.out / "figures").glob("*.png"))
    assert len(shown["images"]) == len(figures) == 7  # 2 curves, 3 paired dot plots, the attention shares, samples
    for image in shown["images"]:
        assert image["decoded"] and image["shown"], image
        assert min(image["natural"]) > 100 and min(image["box"]) > 50, image
    on_disk = sorted((Image.open(f).size, int(np.asarray(Image.open(f).convert("RGBA"), np.int64).sum())) for f in figures)
    assert sorted((tuple(i["natural"]), i["sum"]) for i in shown["images"]) == on_disk
    # The results table shows every verdict, in the row of its metric and arm.
    results = next(t for t in shown["tables"] if t[0][:2] == ["metric", "arm"])
    rows, metric = {}, None
    for row in results[1:]:
        metric = row[0].split(" (")[0] or metric
        rows[metric, row[1]] = row[-1]
    assert rows == {("val_loss", "uvit"): "baseline", ("val_loss_mean", "uvit"): "baseline",
                    ("train_loss", "uvit"): "baseline", **verdicts}
    # The attention shares per block: the mean over seeds of each arm.
    shares = next(t for t in shown["tables"] if t[0][0] == "block")
    assert shares == [["block", "uvit", "uvic", "cog_all"], ["in_blocks.0", "0.000", "0.000", "0.000"],
                      ["mid_block", "0.000", "0.500", "0.500"]]
    # Offline: the page asked for nothing but itself and its embedded images.
    assert requests and all(url == page.as_uri() or url.startswith("data:image/png;base64,") for url in requests), \
        requests
