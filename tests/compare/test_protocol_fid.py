"""The protocol FID of `--gen-seeds K`: K FIDs per finished run from disjoint sampling seeds, each the harness's FID
of the sample.py protocol's images from the run's export; resumable; the report's two spreads and the paired
comparison of the per-run means; bad settings refused before anything trains.

Offline and cheap, as tests/training/test_evaluation.py: the random-init FID-Inception of tests/fid/conftest.py
read at its 64-d layer, and a reference made of a small image folder."""

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from uvic.compare.plan import Arm, make_plan, write_plan
from uvic.config import load_config
from uvic.training import train


ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "cifar10_uvic_s2.yaml")  # RGB, as the test's images
N = 4  # images per FID (train.eval_num_images)

_spec = importlib.util.spec_from_file_location("fid_tests_conftest", ROOT / "tests" / "fid" / "conftest.py")
_fid_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fid_conftest)
weights_file = _fid_conftest.weights_file


@pytest.fixture(autouse=True)
def _offline(no_network):
    """Nothing here may download weights or data."""


def _images(folder, n, seed):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory, weights_file):
    """A finished 2-arm x 2-seed comparison of tiny models, and the FID settings of the tests."""
    root = tmp_path_factory.mktemp("protocol_fid")
    images, reference = _images(root / "train", 10, 0), _images(root / "ref", 6, 1)
    shared = ["model.img_size=8", "model.patch_size=2", "model.embed_dim=16", "model.depth=2", "model.num_heads=2",
              "data.name=image_folder", f"data.root={images}", "data.image_size=8", "data.num_workers=0",
              "train.batch_size=4", "train.max_steps=3", "train.warmup_steps=0", "train.lr=1e-3",
              "train.ema_decay=0.5", "train.log_every=1", "train.sample_every=0", "train.save_every=3",
              "train.log_with=none", "train.cpu_threads=1", "sample.num_inference_steps=2", "sample.batch_size=3",
              "sample.seed=10"]
    plan = make_plan(CONFIG, shared, [Arm("uvit", ("model.attention=softmax",)), Arm("uvic")], [0, 1],
                     root / "cmp")
    write_plan(plan)
    for run in plan.runs:
        train(load_config(CONFIG, run.overrides))
    fid = [f"train.eval_num_images={N}", f"train.eval_reference={reference}", "train.eval_fid_dims=64",
           f"train.eval_fid_weights={weights_file}", "train.eval_fid_weights_sha256=none"]
    args = [CONFIG, *shared, "--arm", "uvit", "model.attention=softmax", "--arm", "uvic", "--seeds", "0", "1"]
    return {"out": plan.out, "fid": fid, "reference": reference, "weights": weights_file, "run_args": args}


@pytest.fixture
def cmp(trained, tmp_path):
    """A copy of the trained comparison for one test to change."""
    shutil.copytree(trained["out"], tmp_path / "cmp")
    return tmp_path / "cmp"


def _fids(out, arm, seed):
    return json.loads((out / arm / f"seed_{seed}" / "fid_protocol.json").read_text())


def _harness_fid(run_dir, first_seed, trained, tmp):
    """The harness's FID of images first_seed .. first_seed + N - 1 of the sample.py protocol from the export."""
    from uvic.fid import compute_fid
    from uvic.pipelines.sampling import sample_to_folder
    from uvic.training.runs import load_pipeline

    pipe = load_pipeline(run_dir / "pipeline")
    pipe.set_progress_bar_config(disable=True)
    sample_to_folder(pipe, tmp, N, seed=first_seed, num_inference_steps=2)
    return compute_fid(tmp, trained["reference"], dims=64, weights=trained["weights"], weights_sha256=None,
                       device="cpu", progress=False).fid


def test_each_run_gets_k_fids_of_disjoint_seeds_and_the_report_separates_the_spreads(cmp, trained, run_script,
                                                                                     tmp_path):
    code, stdout, err = run_script("compare.py", "report", cmp, "--gen-seeds", "2", "--fid", *trained["fid"])
    assert code == 0, err
    # Resampling j of a run is the harness's FID of the images of seeds sample.seed + j * N + i, i < N.
    record = _fids(cmp, "uvic", 1)
    assert record["protocol"] == {"num_images": N, "reference": str(trained["reference"]), "dims": 64,
                                  "weights": str(trained["weights"]), "sampler": "uvit_dpm_solver", "steps": 2,
                                  "first_seed": 10, "step": 3}
    assert len(record["fids"]) == 2 and record["fids"][0] != record["fids"][1]
    for j in (0, 1):
        expected = _harness_fid(cmp / "uvic" / "seed_1", 10 + j * N, trained, tmp_path / f"samples_{j}")
        assert record["fids"][j] == pytest.approx(expected, rel=1e-6)

    report = json.loads((cmp / "report.json").read_text())
    entry = report["metrics"]["fid_protocol"]
    fids = {arm: {s: _fids(cmp, arm, s)["fids"] for s in (0, 1)} for arm in ("uvit", "uvic")}
    means = {arm: {s: float(np.mean(v)) for s, v in by_seed.items()} for arm, by_seed in fids.items()}
    assert entry["values"] == {arm: {str(s): pytest.approx(m) for s, m in by_seed.items()}
                               for arm, by_seed in means.items()}
    assert entry["resamplings"] == {arm: {str(s): v for s, v in by_seed.items()} for arm, by_seed in fids.items()}
    for arm in ("uvit", "uvic"):
        per_run = [means[arm][s] for s in (0, 1)]
        assert entry["spreads"][arm] == {
            "runs": 2, "gen_seeds": [2], "mean": pytest.approx(np.mean(per_run)),
            "training_seed_sd": pytest.approx(np.std(per_run, ddof=1)),
            "resampling_sd": pytest.approx(np.mean([np.std(fids[arm][s], ddof=1) for s in (0, 1)]))}
    # The paired comparison is on the per-run means.
    vs = entry["vs_baseline"]["uvic"]
    assert vs["n"] == 2 and vs["mean_diff"] == pytest.approx(np.mean([means["uvic"][s] - means["uvit"][s]
                                                                      for s in (0, 1)]))
    assert "fid_protocol: uvic - uvit" in stdout
    # The random-init test weights, 64-d, 4 images: recorded, and the report calls it a smoke test whatever the
    # statistics say, in report.json, report.md and report.html.
    sha = hashlib.sha256(Path(trained["weights"]).read_bytes()).hexdigest()
    assert record["network"] == {"weights": Path(trained["weights"]).name, "weights_sha256": sha,
                                 "standard_weights": False, "trained": False, "mode": "pytorch-fid", "dims": 64}
    assert entry["comparable"] is False and vs["verdict"] == "smoke test"
    assert entry["reason"].startswith(f"the FID network's weights {Path(trained['weights']).name} were never "
                                      "trained (random-init test weights); 64-d features, not the standard FID's "
                                      "2048-d pool3; 4 images, fewer than the 10,000")
    assert entry["provenance"] == {"weights": Path(trained["weights"]).name, "weights_sha256": sha,
                                   "standard_weights": False, "trained": False, "mode": "pytorch-fid", "dims": 64,
                                   "num_images": N, "sampler": "uvit_dpm_solver", "steps": 2,
                                   "reference": str(trained["reference"])}
    assert "fid_protocol: uvic - uvit" in stdout and ": smoke test" in stdout
    assert "> **Smoke test: `fid_protocol` is not comparable" in (cmp / "report.md").read_text()
    assert '<div class="banner" role="alert">Smoke test: <code>fid_protocol</code>' in (cmp / "report.html").read_text()
    md = (cmp / "report.md").read_text()
    assert "| arm | runs | resamplings per run | mean | sd across training seeds | sd across resamplings |" in md
    assert (cmp / "figures" / "paired_fid_protocol.png").is_file()
    # A later plain `report` shows them too (they are read from the run dirs).
    (cmp / "report.json").unlink()
    assert run_script("compare.py", "report", cmp)[0] == 0
    assert json.loads((cmp / "report.json").read_text())["metrics"]["fid_protocol"] == entry


def test_the_fids_are_resumable_and_other_settings_are_refused(cmp, trained, run_script, monkeypatch):
    from uvic.training.evaluation import Evaluator

    calls = []
    fid = Evaluator.fid
    monkeypatch.setattr(Evaluator, "fid", lambda self, model, first_seed=None, step=None:
                        calls.append(first_seed) or fid(self, model, first_seed, step))
    # `run` with --gen-seeds: the runs are finished (skipped), then the FIDs, then the report.
    code, _, err = run_script("compare.py", "run", *trained["run_args"], "--out", cmp, "--gen-seeds", "1", "--fid",
                              *trained["fid"])
    assert code == 0 and "uvic seed 1: finished, skipped" in err, err
    assert calls == [10] * 4 and "fid_protocol" in json.loads((cmp / "report.json").read_text())["metrics"]
    first = {(arm, s): _fids(cmp, arm, s)["fids"] for arm in ("uvit", "uvic") for s in (0, 1)}
    # One run's file lost (a kill before its first FID): only that run is computed; more resamplings add to each.
    (cmp / "uvit" / "seed_1" / "fid_protocol.json").unlink()
    calls.clear()
    assert run_script("compare.py", "report", cmp, "--gen-seeds", "1", "--fid", *trained["fid"])[0] == 0
    assert calls == [10] and _fids(cmp, "uvit", 1)["fids"] == first["uvit", 1]
    calls.clear()
    assert run_script("compare.py", "report", cmp, "--gen-seeds", "2", "--fid", *trained["fid"])[0] == 0
    assert calls == [10 + N] * 4
    assert all(_fids(cmp, arm, s)["fids"][0] == first[arm, s][0] for arm, s in first)
    # Other settings: refused, naming the difference; the FIDs on disk stay, and the report is still written.
    before = (cmp / "uvic" / "seed_0" / "fid_protocol.json").read_text()
    (cmp / "report.json").unlink()
    code, _, err = run_script("compare.py", "report", cmp, "--gen-seeds", "2", "--fid", *trained["fid"],
                              f"train.eval_num_images={N + 1}")
    assert code == f"error: the protocol FID: {cmp / 'uvit' / 'seed_0' / 'fid_protocol.json'} holds FIDs of another " \
                   f"protocol (num_images is {N} there, {N + 1} here); it is not overwritten: move it away, or " \
                   "compute with the same settings"
    assert (cmp / "uvic" / "seed_0" / "fid_protocol.json").read_text() == before and (cmp / "report.json").is_file()


@pytest.mark.parametrize("extra, message", [
    (["--fid", "train.eval_num_images=8"], "--fid sets the protocol FID of --gen-seeds K: give --gen-seeds too"),
    (["--gen-seeds", "2", "--fid", "train.lr=1"], "--fid 'train.lr=1': only the FID protocol's keys can be set"),
    (["--gen-seeds", "2", "--fid", "train.eval_fid_dims=65", "train.eval_reference=digits:8"],
     "train.eval_fid_dims: 65 is not one of [64, 192, 768, 2048]"),
    (["--gen-seeds", "2"], "--gen-seeds needs a FID reference: train.eval_reference in the config, or --fid"),
    (["--gen-seeds", "2", "--fid", "train.eval_reference=missing.npz"], "train.eval_reference=missing.npz does not "
                                                                        "exist (arm 'a')"),
    (["--gen-seeds", "0"], "argument --gen-seeds: must be >= 1, got 0"),
])
def test_bad_fid_settings_are_refused_before_anything_trains(tmp_path, run_script, extra, message):
    out = tmp_path / "cmp"
    code, stdout, err = run_script("compare.py", "run", CONFIG, "--arm", "a", "model.attention=softmax", "--arm", "b",
                                   "--seeds", "0", "--out", out, *extra)
    assert code == 2 and "Traceback" not in err, err
    assert message in [line for line in err.splitlines() if "error:" in line][0], err
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == []


def test_a_task_without_images_has_no_protocol_fid(tmp_path):
    from uvic.compare.protocol_fid import Protocol, check_protocol
    from uvic.errors import ConfigError

    plan = make_plan(str(ROOT / "configs" / "lm_tiny.yaml"), ["data.path=x.txt"], [Arm("a", ("model.attention=softmax",)),
                     Arm("b")], [0], tmp_path / "cmp")
    with pytest.raises(ConfigError, match="arm 'a' trains a 'lm' model, which makes no images"):
        check_protocol(plan, Protocol(2, ("train.eval_reference=digits:8",)))


@pytest.mark.slow
def test_two_processes_compute_the_fids_of_one(cmp, trained, run_script, tmp_path):
    """`accelerate launch compare.py report --gen-seeds K`: the images of each FID are split across the processes,
    the main process writes; the same numbers as one process."""
    import os
    import socket
    import subprocess
    import sys

    one = tmp_path / "one"
    shutil.copytree(cmp, one)
    assert run_script("compare.py", "report", one, "--gen-seeds", "1", "--fid", *trained["fid"])[0] == 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                          "127.0.0.1", "--master_port", str(port), "compare.py", "report", str(cmp), "--gen-seeds",
                          "1", "--fid", *trained["fid"]], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"})
    assert two.returncode == 0, two.stderr[-3000:]
    for arm in ("uvit", "uvic"):
        for seed in (0, 1):
            assert _fids(cmp, arm, seed)["fids"] == pytest.approx(_fids(one, arm, seed)["fids"], rel=1e-6)
    values = [json.loads((d / "report.json").read_text())["metrics"]["fid_protocol"]["values"] for d in (cmp, one)]
    for arm in ("uvit", "uvic"):
        assert values[0][arm] == pytest.approx(values[1][arm], rel=1e-6)
