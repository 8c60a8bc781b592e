"""FID while training (`train.eval_every`): eval.jsonl, best.json, rotation, --export best, a kill during an
evaluation, 2 processes = 1 process, the tensorboard event file, and the start-up checks.

The FID network is the random-init FID-Inception of tests/fid/conftest.py, read at its 64-d layer
(`train.eval_fid_dims`: the square root of a 2048-d covariance product takes ~20 s of CPU, one of 64-d
milliseconds), the reference statistics are made by the harness (`uvic.fid.compute_stats`) from a small image
folder, and every FID is checked against the harness scoring the same protocol's images written by the folder
writer (`sample.py --out-dir`)."""

import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from tiny_models import tiny_t2i_config

from uvic.config import load_config
from uvic.training import train
from uvic.training.checkpoint import list_checkpoints


ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
DIMS = 64  # the FID-Inception layer of every FID here (train.eval_fid_dims)

# The session fixture `weights_file` (random-init FID-Inception weights) of the FID tests.
_spec = importlib.util.spec_from_file_location("fid_tests_conftest", ROOT / "tests" / "fid" / "conftest.py")
_fid_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fid_conftest)
weights_file = _fid_conftest.weights_file


def _images(folder, n, size, seed=0):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory, weights_file):
    """Training images, reference images and the harness's reference statistics of them."""
    from uvic.fid import compute_stats, save_stats

    root = tmp_path_factory.mktemp("eval_data")
    train_images = _images(root / "train", 8, 8)
    ref_images = _images(root / "ref", 3, 8, seed=1)
    stats = compute_stats(ref_images, dims=DIMS, weights=weights_file, weights_sha256=None, device="cpu",
                          progress=False)
    save_stats(stats, root / "ref.npz")
    return {"train": train_images, "ref_images": ref_images, "ref": root / "ref.npz", "weights": weights_file}


@pytest.fixture(scope="module")
def defaults(tmp_path_factory):
    """A config file of no deltas: the CLI runs the same config as `load_config(None, ...)`."""
    path = tmp_path_factory.mktemp("config") / "defaults.yaml"
    path.write_text("{}\n")
    return str(path)


def _overrides(run_dir, data, **extra):
    base = {
        "model.img_size": 8, "model.patch_size": 2, "model.embed_dim": 16, "model.depth": 2, "model.num_heads": 2,
        "data.name": "image_folder", "data.root": str(data["train"]), "data.image_size": 8, "data.num_workers": 0,
        "train.run_dir": str(run_dir), "train.batch_size": 4, "train.max_steps": 4, "train.warmup_steps": 1,
        "train.lr": 1e-3, "train.ema_decay": 0.9, "train.log_every": 1, "train.sample_every": 2,
        "train.save_every": 2, "train.keep_checkpoints": 1, "train.log_with": "tensorboard", "train.cpu_threads": 1,
        "train.eval_every": 2, "train.eval_num_images": 3, "train.eval_reference": str(data["ref"]),
        "train.eval_fid_weights": str(data["weights"]), "train.eval_fid_weights_sha256": "none",
        "train.eval_fid_dims": DIMS, "sample.num_images": 2, "sample.num_inference_steps": 2, "sample.batch_size": 2,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def fid_run(tmp_path_factory, data):
    """An uninterrupted 4-step run evaluating at steps 2 and 4, keeping 1 checkpoint (plus the best)."""
    run = tmp_path_factory.mktemp("fid_run") / "run"
    train(load_config(None, _overrides(run, data)))
    return run


def _evaluations(run):
    return [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]


def _harness_fid(source, data, n=3, seed=0, steps=2, tmp=None):
    """The harness's FID of images 0..n-1 of the sample.py protocol (the folder writer) from a checkpoint dir."""
    from uvic.fid import compute_fid
    from uvic.pipelines.sampling import sample_to_folder
    from uvic.training.runs import load_pipeline

    pipe = load_pipeline(source)
    pipe.set_progress_bar_config(disable=True)
    sample_to_folder(pipe, tmp, n, seed=seed, num_inference_steps=steps)
    return compute_fid(tmp, data["ref"], weights=data["weights"], weights_sha256=None, device="cpu",
                       progress=False).fid


def test_each_evaluation_is_one_line_with_the_harness_fid(fid_run, data, tmp_path):
    records = _evaluations(fid_run)
    assert [r["step"] for r in records] == [2, 4]
    sampler = load_config(fid_run / "config.yaml").sample.sampler  # eval_sampler unset: the sample section's
    for r in records:
        assert set(r) == {"step", "fid", "num_images", "dims", "sampler", "steps", "checkpoint", "weights",
                          "weights_sha256", "standard_weights", "trained", "mode"}
        assert (r["num_images"], r["dims"], r["sampler"], r["steps"]) == (3, DIMS, sampler, 2)
        # The FID network: the random-init test weights, named with their SHA-256 (hashed here), never trained.
        weights = Path(data["weights"])
        assert (r["weights"], r["weights_sha256"], r["standard_weights"], r["trained"], r["mode"]) == (
            weights.name, hashlib.sha256(weights.read_bytes()).hexdigest(), False, False, "pytorch-fid")
        assert r["checkpoint"] == f"checkpoints/step_{r['step']:09d}"
        assert np.isfinite(r["fid"]) and r["fid"] > 0
    # The latest checkpoint always survives rotation: its FID is what the harness gives for sample.py's images.
    expected = _harness_fid(fid_run / "checkpoints" / "step_000000004", data, tmp=tmp_path / "samples")
    assert records[1]["fid"] == pytest.approx(expected, rel=1e-6)


def test_best_json_names_the_lowest_fid_and_rotation_keeps_it(fid_run):
    records = _evaluations(fid_run)
    best = json.loads((fid_run / "best.json").read_text())
    low = min(records, key=lambda r: r["fid"])
    assert best == {"step": low["step"], "fid": low["fid"], "checkpoint": low["checkpoint"]}
    # keep_checkpoints=1: the newest, and the best even when it is older. (Step 2 was the best when step 4 was saved,
    # so it was kept then; rotation at a later save removes it once it is neither.)
    steps = [s for s, _ in list_checkpoints(fid_run)]
    assert 4 in steps and low["step"] in steps and set(steps) <= {2, 4}
    assert (fid_run / best["checkpoint"]).is_dir()


def test_rotation_never_deletes_the_best_checkpoint(fid_run, data, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(fid_run, run)
    best = json.loads((run / "best.json").read_text())["step"]
    # Four more checkpoints with keep_checkpoints=1 and no more evaluations: the best is kept through every rotation.
    train(load_config(None, _overrides(run, data, **{"train.max_steps": 8, "train.save_every": 1,
                                                     "train.eval_every": 0, "train.sample_every": 0,
                                                     "train.log_with": "none", "train.resume": "latest"})))
    assert [s for s, _ in list_checkpoints(run)] == sorted({best, 8})


def test_export_best_exports_the_best_checkpoint(fid_run, tmp_path, run_script):
    run = tmp_path / "run"
    shutil.copytree(fid_run, run)
    shutil.rmtree(run / "pipeline")
    best = json.loads((run / "best.json").read_text())["checkpoint"]
    code, out, err = run_script("train.py", run / "config.yaml", f"train.run_dir={run}", "--export", "best")
    assert code == 0, err
    assert out.strip() == str(run / "pipeline")
    (weights,) = (run / "pipeline" / "transformer").glob("*.safetensors")
    exported, ema = load_file(weights), load_file(run / best / "ema.safetensors")
    assert exported.keys() == ema.keys() and all(torch.equal(exported[k], ema[k]) for k in ema)


def test_export_best_without_evaluations_is_one_line(tmp_path, run_script):
    code, _, err = run_script("train.py", "configs/demo_digits.yaml", f"train.run_dir={tmp_path}", "--export", "best")
    assert code == 1 and err.strip().splitlines()[-1] == (
        f"error: {tmp_path} has no best.json: no FID was computed while training (train.eval_every)")


def test_tensorboard_holds_the_sample_grids_and_eval_fid(fid_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # accelerate's tracker writes the run's events in train/ (its hparams go to a folder of their own).
    acc = EventAccumulator(str(fid_run / "train"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert "samples" in acc.Tags()["images"] and "eval/fid" in acc.Tags()["scalars"]
    images = acc.Images("samples")
    assert [e.step for e in images] == [2, 4]
    grid = np.asarray(Image.open(fid_run / "samples" / "step_0000004.png").convert("RGB"))
    assert (images[-1].height, images[-1].width) == grid.shape[:2]
    fids = {e.step: e.value for e in acc.Scalars("eval/fid")}
    assert fids == pytest.approx({r["step"]: r["fid"] for r in _evaluations(fid_run)}, rel=1e-6)


_SLOW_EVALUATION = """
import runpy, sys, time
from uvic.training.evaluation import Evaluator
evaluate = Evaluator.evaluate
Evaluator.evaluate = lambda *args, **kwargs: (time.sleep(600), evaluate(*args, **kwargs))[1]
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


def test_a_kill_during_an_evaluation_is_redone_on_resume(fid_run, data, defaults, tmp_path):
    run = tmp_path / "run"
    # An evaluation that takes minutes: the evaluation of step 2 is still running when the kill comes. (Not more
    # images: a resume may not change what FID is measured with, docs/training.md.)
    log = open(tmp_path / "first.log", "w")
    first = subprocess.Popen([sys.executable, "-c", _SLOW_EVALUATION, defaults, *_overrides(run, data)], cwd=ROOT,
                             env=ENV, stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.time() + 400
        while not (run / "checkpoints" / "step_000000002").is_dir() and time.time() < deadline:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)  # into the evaluation
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
        log.close()
    assert not (run / "eval.jsonl").exists()
    train(load_config(None, _overrides(run, data, **{"train.resume": "latest"})))
    lines = (run / "eval.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line complete
    assert [r["step"] for r in records] == [2, 4]  # step 2 evaluated again, once
    # The resumed run is the uninterrupted one: the same FIDs.
    assert [r["fid"] for r in records] == pytest.approx([r["fid"] for r in _evaluations(fid_run)], rel=1e-6)
    assert not list(run.glob(".eval.jsonl.tmp*")) and not list(run.glob(".best.json.tmp*"))


_EVALUATE = """
import sys, json
from accelerate import Accelerator
from uvic.training.evaluation import Evaluator
from uvic.training.runs import task_from_checkpoint
task, model, cfg = task_from_checkpoint(sys.argv[1])
state = Accelerator(cpu=True)
import pathlib; pathlib.Path(sys.argv[2]).mkdir(exist_ok=True)
fid = Evaluator(cfg, task, state).evaluate(model, 4, sys.argv[2], "checkpoints/step_000000004")
if state.is_main_process:
    print(json.dumps(fid))
"""


def test_two_processes_give_the_fid_of_one(fid_run, tmp_path):
    # One process: the run's own evaluation of step 4 (fid_run, one process; the harness gives the same number).
    (fid1,) = [r["fid"] for r in _evaluations(fid_run) if r["step"] == 4]
    script = tmp_path / "evaluate.py"
    script.write_text(_EVALUATE)
    ckpt = str(fid_run / "checkpoints" / "step_000000004")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # 3 images on 2 processes: 2 each, the fourth dropped after the gather.
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                          "127.0.0.1", "--master_port", str(port), str(script), ckpt, str(tmp_path / "two")],
                         cwd=ROOT, env={**ENV, "ACCELERATE_USE_CPU": "true"}, capture_output=True, text=True,
                         timeout=600)
    assert two.returncode == 0, two.stderr
    fid2 = json.loads(two.stdout.strip().splitlines()[-1])
    assert fid2 == pytest.approx(fid1, rel=1e-6)
    assert json.loads((tmp_path / "two" / "eval.jsonl").read_text())["fid"] == fid2


@pytest.mark.parametrize("problem", ["missing reference", "resolution", "feature size", "missing weights"])
def test_bad_evaluation_inputs_stop_the_run_before_training(data, defaults, tmp_path, problem, run_script):
    ref, extra = data["ref"], {}
    if problem == "missing reference":
        ref = tmp_path / "nothing.npz"
        expected = f"train.eval_reference '{ref}' does not exist"
    elif problem == "resolution":
        ref = _images(tmp_path / "big", 3, 16)
        expected = f"train.eval_reference '{ref}' holds 16x16 images, the model makes 8x8 ones"
    elif problem == "feature size":
        ref = tmp_path / "small.npz"
        np.savez(ref, mu=np.zeros(64), sigma=np.eye(64), mode=np.str_("pytorch-fid"), n=np.int64(100))
        extra = {"train.eval_fid_dims": 2048}  # the default, the standard FID
        expected = f"train.eval_reference '{ref}' holds 64-d features, the FID network gives 2048-d"
    else:
        extra = {"train.eval_fid_weights": str(tmp_path / "missing.pth")}
        expected = f"FID Inception weights not found at '{tmp_path / 'missing.pth'}'"
    run = tmp_path / "run"
    code, _, err = run_script("train.py", defaults, *_overrides(run, data, **{"train.eval_reference": str(ref), **extra}))
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: {expected}")
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


def test_text_to_image_evaluation_uses_the_validation_captions(data, make_tiny_coco, tmp_path):
    """The t2i protocol of sample.py --out-dir --features: random captions of the stored validation features."""
    from uvic.fid import compute_fid
    from uvic.pipelines.sampling import mscoco_prompt_embeds, sample_to_folder
    from uvic.training.runs import load_pipeline

    root, vae, _ = make_tiny_coco(tmp_path / "coco", 4, splits=("train", "val"))
    vae.save_pretrained(tmp_path / "vae")
    ref = _images(tmp_path / "ref", 3, 16)  # the tiny VAE decodes 8x8 latents to 16x16 images
    cfg = tiny_t2i_config(
        root, tmp_path / "run", tmp_path / "vae",
        train={"eval_every": 1, "eval_num_images": 2, "eval_reference": str(ref),
               "eval_fid_weights": str(data["weights"]), "eval_fid_weights_sha256": "none", "eval_fid_dims": DIMS},
        sample={"batch_size": 2},
    )
    train(cfg)
    (record,) = _evaluations(tmp_path / "run")
    pipe = load_pipeline(tmp_path / "run" / "checkpoints" / "step_000000001")
    pipe.set_progress_bar_config(disable=True)
    embeds, empty, _ = mscoco_prompt_embeds(root, 2, seed=0)
    sample_to_folder(pipe, tmp_path / "samples", 2, seed=0, num_inference_steps=2, prompt_embeds=embeds,
                     negative_prompt_embeds=empty, guidance_scale=cfg.sample.guidance_scale)
    expected = compute_fid(tmp_path / "samples", ref, dims=DIMS, weights=data["weights"], weights_sha256=None,
                           device="cpu", progress=False).fid
    assert record["step"] == 1 and record["fid"] == pytest.approx(expected, rel=1e-6)


def test_a_feature_layer_the_fid_network_lacks_is_refused_before_training(data, tmp_path):
    from uvic.errors import ConfigError

    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"train.eval_fid_dims: 100 is not one of \[64, 192, 768, 2048\]"):
        train(load_config(None, _overrides(run, data, **{"train.eval_fid_dims": 100})))
    assert not (run / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------------------
# The run's own records: eval.jsonl, best.json (checked at start-up), and the reference's mode and cache
# ---------------------------------------------------------------------------------------------------------


def _snapshot(run):
    """Every file of a run dir with its content: what a refused start must leave as it was."""
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _resume_more(run, data, defaults, run_script, *args, **extra):
    """train.py resuming `run` for 2 more steps (another evaluation is due at step 6)."""
    return run_script("train.py", defaults, *_overrides(run, data, **{"train.max_steps": 6, **extra}), "--resume",
                      *args)


_OUTSIDE = "../../other/checkpoints/step_000000002"


@pytest.mark.parametrize("edit, problem", [
    (lambda r: r.pop("fid"), "no 'fid'"),
    (lambda r: r.update(fid="abc"), "'fid' is \"abc\", not a finite number"),
    (lambda r: r.update(step="2"), "'step' is \"2\", not an integer >= 0"),
    (lambda r: r.pop("checkpoint"), "no 'checkpoint'"),
    (lambda r: r.update(fid=float("nan")), "'fid' is NaN, not a finite number"),
    (lambda r: r.update(step=1.7), "'step' is 1.7, not an integer >= 0"),
    (lambda r: r.update(step=True), "'step' is true, not an integer >= 0"),
    (lambda r: r.update(num_images="3"), "'num_images' is \"3\", not an integer"),
    (lambda r: r.update(checkpoint=_OUTSIDE), f"'checkpoint' is \"{_OUTSIDE}\", which is not a path inside the run "
                                              "dir"),
    (lambda r: r.update(checkpoint="/etc"), "'checkpoint' is \"/etc\", which is not a path inside the run dir"),
])
def test_a_bad_evaluation_record_stops_the_run_at_start_up(fid_run, data, defaults, tmp_path, run_script, edit,
                                                           problem):
    """A well-formed line with a missing or wrongly typed field, a NaN FID, a fractional step or a checkpoint
    outside the run dir: one error line naming the file and line when the run starts, nothing written (not a
    traceback at the next evaluation, nor a best.json naming a checkpoint that never existed)."""
    run = tmp_path / "run"
    shutil.copytree(fid_run, run)
    lines = (run / "eval.jsonl").read_text().splitlines()
    record = json.loads(lines[1])
    edit(record)
    lines[1] = json.dumps(record)
    (run / "eval.jsonl").write_text("\n".join(lines) + "\n")
    before = _snapshot(run)
    code, _, err = _resume_more(run, data, defaults, run_script)
    assert code == 1 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"error: {run / 'eval.jsonl'} line 2 is not an evaluation record: {problem}; correct or delete the line")
    assert _snapshot(run) == before


def test_undecodable_or_cut_evaluation_records_name_the_file(fid_run, data, defaults, tmp_path, run_script):
    run = tmp_path / "run"
    shutil.copytree(fid_run, run)
    good = (run / "eval.jsonl").read_bytes()
    (run / "eval.jsonl").write_bytes(b"\xff\xfe" + good)
    code, _, err = _resume_more(run, data, defaults, run_script)
    assert code == 1 and err.strip().splitlines()[-1] == (
        f"error: {run / 'eval.jsonl'} is not UTF-8 text (byte 0: invalid start byte); it is this run's record of its "
        "FID evaluations: restore it or remove it")
    (run / "eval.jsonl").write_bytes(good + b'{"step": 6, "fid": 1')
    code, _, err = _resume_more(run, data, defaults, run_script)
    assert code == 1 and err.strip().splitlines()[-1].startswith(
        f"error: {run / 'eval.jsonl'} line 3 is not an evaluation record: not JSON (")


def test_best_json_is_checked_at_start_up(fid_run, data, defaults, tmp_path, run_script):
    run = tmp_path / "run"
    shutil.copytree(fid_run, run)
    best = json.loads((run / "best.json").read_text())
    (run / "best.json").write_text(json.dumps({**best, "fid": "abc"}))
    before = _snapshot(run)
    code, _, err = _resume_more(run, data, defaults, run_script)
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: {run / 'best.json'} is not a best-checkpoint record: 'fid' is \"abc\", not a finite number; delete "
        "it and the run writes it again from eval.jsonl when it starts")
    assert _snapshot(run) == before
    # Deleted as the message says: the resumed run writes it again, from eval.jsonl.
    (run / "best.json").unlink()
    code, _, err = _resume_more(run, data, defaults, run_script, **{"train.eval_every": 0})
    assert code == 0, err[-3000:]
    low = min(_evaluations(run), key=lambda r: r["fid"])
    assert json.loads((run / "best.json").read_text()) == {k: low[k] for k in ("step", "fid", "checkpoint")}


def test_export_best_refuses_a_checkpoint_outside_the_run_dir(fid_run, tmp_path, run_script):
    run = tmp_path / "a" / "run"
    shutil.copytree(fid_run, run)
    other = tmp_path / "other" / "checkpoints" / "step_000000002"  # a real checkpoint, of another run
    shutil.copytree(fid_run / "checkpoints" / "step_000000004", other)
    (run / "best.json").write_text(json.dumps({"step": 2, "fid": 1.0, "checkpoint": _OUTSIDE}))
    before = _snapshot(run)
    code, _, err = run_script("train.py", run, "--export", "best")
    assert code == 1 and err.strip().splitlines()[-1] == (
        f"error: {run / 'best.json'} is not a best-checkpoint record: 'checkpoint' is \"{_OUTSIDE}\", which is not a "
        "path inside the run dir; delete it and the run writes it again from eval.jsonl when it starts")
    assert _snapshot(run) == before  # the other run's weights were not exported


def test_a_best_checkpoint_deleted_by_hand_is_reported_on_resume(fid_run, data, defaults, tmp_path, run_script):
    """best.json names the lowest FID among the evaluated checkpoints that exist: when its checkpoint is deleted by
    hand, the resumed run says so and names the next best that exists (which rotation then keeps)."""
    run = tmp_path / "run"
    shutil.copytree(fid_run, run)
    records = _evaluations(run)
    records[0]["fid"], records[1]["fid"] = 1.0, 5.0  # step 2 is the best
    (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "best.json").write_text(json.dumps({k: records[0][k] for k in ("step", "fid", "checkpoint")}))
    shutil.rmtree(run / "checkpoints" / "step_000000002", ignore_errors=True)  # by hand (if rotation kept it)
    # Resuming at step 4 = max_steps: nothing to train or evaluate, only the start-up and the export.
    code, _, err = run_script("train.py", run, *_overrides(run, data), "--resume")
    assert code == 0, err[-3000:]
    assert (f"{run / 'best.json'} named checkpoints/step_000000002 (step 2, FID 1.0000), which no longer exists "
            "(deleted by hand?); it now names checkpoints/step_000000004 (step 4, FID 5.0000), the lowest FID among "
            "the evaluated checkpoints that exist") in err
    assert json.loads((run / "best.json").read_text()) == {"step": 4, "fid": 5.0,
                                                           "checkpoint": "checkpoints/step_000000004"}


def test_a_reference_of_another_fid_mode_is_refused_at_start_up_and_taken_in_its_mode(data, defaults, tmp_path,
                                                                                      run_script):
    """A tf-mode reference stopped the run at its first evaluation, and every --resume stopped again: it is now a
    start-up error naming train.eval_fid_mode, which takes the mode; in tf mode the FID is the harness's tf FID."""
    from uvic.fid import compute_stats, save_stats

    ref = tmp_path / "ref_tf.npz"
    save_stats(compute_stats(data["ref_images"], mode="tf", dims=DIMS, weights=data["weights"], weights_sha256=None,
                             device="cpu", progress=False), ref)
    run = tmp_path / "run"
    overrides = _overrides(run, data, **{"train.eval_reference": str(ref), "train.max_steps": 2,
                                         "train.sample_every": 0, "train.log_with": "none"})
    code, _, err = run_script("train.py", defaults, *overrides)
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: train.eval_reference '{ref}' holds statistics of FID mode 'tf', and train.eval_fid_mode is "
        "'pytorch-fid': set train.eval_fid_mode=tf to score in that mode, or use a reference of mode 'pytorch-fid'")
    assert not run.exists()
    code, _, err = run_script("train.py", defaults, *overrides, "train.eval_fid_mode=tf")
    assert code == 0, err[-3000:]
    (record,) = _evaluations(run)
    from uvic.fid import compute_fid
    from uvic.pipelines.sampling import sample_to_folder
    from uvic.training.runs import load_pipeline

    pipe = load_pipeline(run / "checkpoints" / "step_000000002")
    pipe.set_progress_bar_config(disable=True)
    sample_to_folder(pipe, tmp_path / "samples", 3, seed=0, num_inference_steps=2)
    expected = compute_fid(tmp_path / "samples", ref, mode="tf", weights=data["weights"], weights_sha256=None,
                           device="cpu", progress=False)
    assert expected.mode == "tf" and record["fid"] == pytest.approx(expected.fid, rel=1e-6)


def test_image_reference_statistics_show_progress_and_are_cached_in_the_run_dir(data, defaults, tmp_path,
                                                                                 run_script, monkeypatch):
    """An image-folder reference: its statistics are computed once with a progress bar, cached in the run dir (the
    harness's statistics of the folder), read back by the next start, and computed again when a file changes."""
    import uvic.fid
    from uvic.fid import compute_stats, load_stats

    ref = tmp_path / "ref"
    shutil.copytree(data["ref_images"], ref)
    run = tmp_path / "run"
    overrides = _overrides(run, data, **{"train.eval_reference": str(ref), "train.max_steps": 2,
                                         "train.sample_every": 0, "train.log_with": "none"})
    code, _, err = run_script("train.py", defaults, *overrides)
    assert code == 0, err[-3000:]
    assert f"train.eval_reference {ref}: computing the statistics of its 3 images, once" in err
    assert "Inception features (pytorch-fid)" in err  # the progress bar
    cached = load_stats(run / "eval_reference.npz")
    expected = compute_stats(ref, dims=DIMS, weights=data["weights"], weights_sha256=None, device="cpu",
                             progress=False)
    assert np.array_equal(cached.mu, expected.mu) and np.array_equal(cached.sigma, expected.sigma)
    assert cached.mode == "pytorch-fid" and cached.n == 3

    # The next start reads them back: nothing is computed (compute_stats would fail).
    def refuse(*args, **kwargs):
        raise AssertionError("the reference statistics were computed again")

    monkeypatch.setattr(uvic.fid, "compute_stats", refuse)
    code, _, err = run_script("train.py", defaults, *overrides, "train.max_steps=4", "--resume")
    assert code == 0, err[-3000:]
    assert f"train.eval_reference {ref}: its statistics from {run / 'eval_reference.npz'}" in err
    monkeypatch.undo()

    # Another image under the same name: computed again, and the cache replaced.
    Image.fromarray(np.full((8, 8, 3), 7, np.uint8)).save(ref / "0.png")
    os.utime(ref / "0.png", ns=(1, 1))
    code, _, err = run_script("train.py", defaults, *overrides, "train.max_steps=6", "--resume")
    assert code == 0, err[-3000:]
    assert "computing the statistics of its 3 images" in err
    again = compute_stats(ref, dims=DIMS, weights=data["weights"], weights_sha256=None, device="cpu", progress=False)
    assert np.array_equal(load_stats(run / "eval_reference.npz").mu, again.mu)

    # A damaged cache is only a cache: computed again, with a warning.
    (run / "eval_reference.npz").write_bytes(b"PK\x03\x04 not a zip")
    code, _, err = run_script("train.py", defaults, *overrides, "train.max_steps=8", "--resume")
    assert code == 0, err[-3000:]
    assert f"{run / 'eval_reference.npz'} cannot be read (" in err and "computing the statistics of its 3" in err
    assert np.array_equal(load_stats(run / "eval_reference.npz").mu, again.mu)


def test_export_best_from_the_run_dir_says_what_it_exported(fid_run, tmp_path, run_script):
    """`train.py RUN_DIR --export best`: a run dir stands for its config; the log line names the step, the FID and
    the checkpoint, never the temporary folder the export is written to."""
    run = tmp_path / "run"
    shutil.copytree(fid_run, run)
    shutil.rmtree(run / "pipeline")
    best = json.loads((run / "best.json").read_text())
    code, out, err = run_script("train.py", run, "--export", "best")
    assert code == 0, err
    assert out.strip() == str(run / "pipeline")
    assert (f"exported step {best['step']} ({run / best['checkpoint']}; FID {best['fid']:.4f}, the lowest FID while "
            f"training (best.json)) to {run / 'pipeline'}") in err
    assert ".tmp-" not in err
    (weights,) = (run / "pipeline" / "transformer").glob("*.safetensors")
    exported, ema = load_file(weights), load_file(run / best["checkpoint"] / "ema.safetensors")
    assert all(torch.equal(exported[k], ema[k]) for k in ema)


@pytest.mark.parametrize("case", ["hand-written", "not the lowest", "no eval.jsonl", "checkpoint removed"])
def test_export_best_refuses_a_best_json_that_eval_jsonl_does_not_back(fid_run, tmp_path, run_script, case):
    """best.json names the lowest FID of eval.jsonl among the checkpoints that exist, or `--export best` refuses it
    (it exported a hand-written "FID 1.0000, the lowest FID while training")."""
    run = tmp_path / "run"
    shutil.copytree(fid_run, run)
    records = _evaluations(run)
    low = json.loads((run / "best.json").read_text())  # as the run wrote it: the lowest FID, a checkpoint that exists
    if case == "hand-written":
        best = {**low, "fid": 1.0}
    elif case == "not the lowest":  # another evaluated checkpoint that exists, with a lower FID
        best = low
        shutil.copytree(run / low["checkpoint"], run / "checkpoints" / "step_000000003")
        low = {"step": 3, "fid": low["fid"] / 2, "checkpoint": "checkpoints/step_000000003"}
        (run / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sorted(
            [*records, {**records[0], **low}], key=lambda r: r["step"])))
    elif case == "no eval.jsonl":
        best = {k: low[k] for k in ("step", "fid", "checkpoint")}
        (run / "eval.jsonl").unlink()
    else:
        best = {k: low[k] for k in ("step", "fid", "checkpoint")}
        shutil.rmtree(run / low["checkpoint"])
    (run / "best.json").write_text(json.dumps(best))
    before = _snapshot(run)
    code, _, err = run_script("train.py", run, "--export", "best")
    line = err.strip().splitlines()[-1]
    said = f"error: {run / 'best.json'} names {best['checkpoint']} (step {best['step']}, FID {best['fid']:.4f}), but "
    why = {"hand-written": "eval.jsonl holds no such evaluation", "not the lowest": "that is not the lowest FID of "
           "eval.jsonl", "no eval.jsonl": "eval.jsonl holds no such evaluation (it holds none)",
           "checkpoint removed": "that checkpoint no longer exists"}[case]
    assert code == 1 and line.startswith(said + why), line
    assert line.endswith("export a checkpoint by its path, or resume the run, which writes best.json again from "
                         "eval.jsonl")
    if case in ("hand-written", "not the lowest"):
        assert (f"the lowest FID of eval.jsonl among the checkpoints that exist is {low['checkpoint']} (step "
                f"{low['step']}, FID {low['fid']:.4f})") in line
    assert _snapshot(run) == before  # nothing exported
