"""train.py / sample.py end to end, including real 2-process CPU runs (torchrun + accelerate, gloo).

One-process runs of a script go through conftest's `run_script` (the script in this process) unless the test is
about what a fresh process shows (start-up, log lines, a second process, `accelerate launch`)."""

import os
import shutil
import socket
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file


ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(args, **kw):
    return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600, **kw)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch2(script, *args):
    """2 CPU processes: torchrun, with ACCELERATE_USE_CPU so accelerate picks MULTI_CPU (gloo).

    (`accelerate launch --cpu` starts one process per machine unless mpirun is configured.)
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), script, *args]
    return subprocess.run(cmd, cwd=ROOT, env={**ENV, "ACCELERATE_USE_CPU": "true"}, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture
def tiny(tiny_overrides):
    """conftest's `tiny_overrides` for a 3-step run with one checkpoint at the end."""
    return lambda run_dir, image_dir, **extra: tiny_overrides(
        run_dir, image_dir, **{"train.max_steps": 3, "train.warmup_steps": 1, "train.save_every": 3, **extra})


def test_train_dry_run_prints_the_resolved_config():
    r = _run([sys.executable, "train.py", "configs/cifar10_uvic_s2.yaml", "train.batch_size=64", "--dry-run"])
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["train"]["batch_size"] == 64 and cfg["model"]["attention"] == "cog" and cfg["train"]["lr"] == 2e-4


@pytest.mark.parametrize("args, expected", [(["123"], "123"), (["runs/a: b/step_1"], "runs/a: b/step_1"), ([], "latest")])
def test_resume_path_is_taken_verbatim(args, expected, run_script):
    # Not parsed as YAML: "123" would become an int, "a: b" a mapping; a bare --resume means the latest.
    code, out, err = run_script("train.py", "configs/demo_digits.yaml", "--dry-run", "--resume", *args)
    assert code == 0, err
    assert yaml.safe_load(out)["train"]["resume"] == expected


def test_bad_config_key_exits_with_a_clear_message():
    r = _run([sys.executable, "train.py", "configs/demo_digits.yaml", "train.learning_rate=1", "--dry-run"])
    assert r.returncode == 2 and "unknown config key(s) ['train.learning_rate']" in r.stderr
    assert "Traceback" not in r.stderr


def test_sample_help_and_missing_source(tmp_path, run_script):
    code, out, _ = run_script("sample.py", "--help")
    assert code == 0 and "--out-dir" in out
    code, _, err = run_script("sample.py", tmp_path / "nothing", "--grid", tmp_path / "g.png")
    assert code == 2 and "neither a pipeline dir" in err and "Traceback" not in err


def _class_pipeline(path):
    """A tiny class-conditional UViCPipeline (3 classes) saved at `path`; returns the pipeline."""
    from uvic.config import DiffusionConfig
    from uvic.models import UViTModel
    from uvic.pipelines import UViCPipeline
    from uvic.schedulers import build_scheduler

    torch.manual_seed(0)
    model = UViTModel(img_size=8, patch_size=2, in_chans=3, embed_dim=16, depth=2, num_heads=2, num_classes=3)
    pipe = UViCPipeline(model.eval(), build_scheduler("dpm_solver", DiffusionConfig()))
    pipe.save_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_sample_grid_of_a_class_conditional_pipeline(tmp_path, run_script):
    from uvic.pipelines.sampling import generate

    pipe = _class_pipeline(tmp_path / "pipe")
    code, _, err = run_script("sample.py", tmp_path / "pipe", "--grid", tmp_path / "grid.png", "--num-images", "4",
                              "--steps", "2", "--batch-size", "3", "--seed", "5")
    assert code == 0, err[-3000:]
    grid = np.asarray(Image.open(tmp_path / "grid.png")).astype(int)
    # Image i has seed 5 + i and class i % 3, as in --out-dir mode.
    cells = [grid[2 + r * 10 : 10 + r * 10, 2 + c * 10 : 10 + c * 10] for r in range(2) for c in range(2)]
    balanced = generate(pipe, [5, 6, 7, 8], batch_size=4, num_inference_steps=2, class_labels=[0, 1, 2, 0]).astype(int)
    shifted = generate(pipe, [5, 6, 7, 8], batch_size=4, num_inference_steps=2, class_labels=[1, 2, 0, 1]).astype(int)
    assert max(np.abs(cell - want).max() for cell, want in zip(cells, balanced)) <= 1
    # The labels reach the model (an untrained model's images are mostly saturated, so some cells barely move).
    assert max(np.abs(cell - other).max() for cell, other in zip(cells, shifted)) > 1


def test_export_writes_the_ema_weights_of_the_checkpoint(tmp_path, image_dir, tiny, run_script):
    from uvic.config import load_config
    from uvic.pipelines import UViCPipeline
    from uvic.training import train

    run = tmp_path / "run"
    overrides = tiny(run, image_dir, **{"train.max_steps": 4, "train.save_every": 2})
    train(load_config(ROOT / "configs" / "cifar10_uvic_s2.yaml", overrides))
    for ckpt, arg in [(run / "checkpoints" / "step_000000004", []),  # default: the latest
                      (run / "checkpoints" / "step_000000002", [str(run / "checkpoints" / "step_000000002")])]:
        shutil.rmtree(run / "pipeline")
        code, out, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *overrides, "--export", *arg)
        assert code == 0, err[-3000:]
        assert out.strip() == f"{run}/pipeline"
        exported = UViCPipeline.from_pretrained(run / "pipeline").transformer.state_dict()
        ema, raw = load_file(str(ckpt / "ema.safetensors")), load_file(str(ckpt / "model.safetensors"))
        assert exported.keys() == ema.keys()
        for k, v in exported.items():
            torch.testing.assert_close(v, ema[k], rtol=0, atol=0)
        assert any(not torch.equal(ema[k], raw[k]) for k in ema)  # the EMA, not the raw weights


def _png_files(folder):
    """{name: (bytes, inode, mtime_ns)} of the PNGs in `folder`."""
    return {p.name: (p.read_bytes(), p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(folder.glob("*.png"))}


def test_sample_out_dir_rerun_keeps_existing_files_and_regenerates_missing_ones(tmp_path, run_script):
    _class_pipeline(tmp_path / "pipe")
    args = ["sample.py", str(tmp_path / "pipe"), "--out-dir", str(tmp_path / "out"), "--num-images", "4", "--steps",
            "2", "--batch-size", "1", "--seed", "3"]  # batch 1: the same computation on re-run
    code, _, err = run_script(*args)
    assert code == 0, err[-3000:]
    first = _png_files(tmp_path / "out")
    assert list(first) == [f"{i:06d}.png" for i in range(4)]
    (tmp_path / "out" / "000002.png").unlink()
    code, _, err = run_script(*args)
    assert code == 0, err[-3000:]
    second = _png_files(tmp_path / "out")
    for name in ["000000.png", "000001.png", "000003.png"]:
        assert second[name] == first[name]  # untouched: same bytes, same file, not rewritten
    assert second["000002.png"][0] == first["000002.png"][0]  # regenerated identically (seed 3 + 2, class 2)
    assert "wrote 1 images" in err


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path, image_dir, tiny, run_script):
    from uvic.config import load_config
    from uvic.pipelines.sampling import sample_to_folder
    from uvic.training import train
    from uvic.training.runs import load_pipeline

    # The same global batch (4) as 1 x 4 and 2 x 2: same data order, same noise, averaged gradients. The one-process
    # runs are this process's (the library train.py and sample.py call), the two-process ones the scripts'. Both
    # validate at their last step on 3 held-out images, one per validation batch (2 processes: 2 + 1).
    one, two = tmp_path / "one", tmp_path / "two"
    val = {"train.val_every": 3, "data.val_fraction": 0.3, "train.val_batch_size": 1}
    train(load_config(ROOT / "configs" / "cifar10_uvic_s2.yaml", tiny(one, image_dir, **val)))
    r2 = _launch2("train.py", "configs/cifar10_uvic_s2.yaml", *tiny(two, image_dir, **val))
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "processes=2 local_batch=2" in r2.stderr
    a = load_file(str(one / "checkpoints/step_000000003/model.safetensors"))
    b = load_file(str(two / "checkpoints/step_000000003/model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert (two / "pipeline/model_index.json").is_file()
    # The 2-process validation loss is the one this process gives the same weights, bit for bit.
    from uvic.training.checkpoint import load_model_weights
    from uvic.training.logs import metrics_of_kind
    from uvic.training.tasks import build_task
    from uvic.training.validation import Validator

    cfg = load_config(two / "config.yaml")
    task = build_task(cfg)
    model = load_model_weights(task.build_model(), two / "checkpoints/step_000000003", "ema").eval()
    state = SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1, autocast=nullcontext)
    assert metrics_of_kind(two / "metrics.jsonl", "val") == [{"step": 3, **Validator(cfg, task, state).validate(model)}]

    # sample.py: 1 process, batch 3 vs 2 processes, batch 2; a grid from the run dir (EMA of the last checkpoint).
    pipe = load_pipeline(one / "pipeline")
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        sample_to_folder(pipe, tmp_path / "s1", 5, seed=7, num_inference_steps=3, batch_size=3)
    s2 = _launch2("sample.py", str(one / "pipeline"), "--out-dir", str(tmp_path / "s2"), "--num-images", "5",
                   "--steps", "3", "--batch-size", "2", "--seed", "7")
    assert s2.returncode == 0, s2.stderr[-3000:]
    files = sorted(p.name for p in (tmp_path / "s1").iterdir())
    assert files == [f"{i:06d}.png" for i in range(5)] == sorted(p.name for p in (tmp_path / "s2").iterdir())
    for f in files:
        x = np.asarray(Image.open(tmp_path / "s1" / f)).astype(int)
        y = np.asarray(Image.open(tmp_path / "s2" / f)).astype(int)
        assert np.abs(x - y).max() <= 1
    code, _, err = run_script("sample.py", one, "--grid", tmp_path / "grid.png", "--num-images", "4", "--steps", "2",
                              "--sampler", "euler_maruyama")
    assert code == 0, err[-3000:]
    assert Image.open(tmp_path / "grid.png").size == (2 * 10 + 2, 2 * 10 + 2)


@pytest.mark.parametrize("config_text, overrides, message", [
    (None, ["train.max_steps=0"], "config key train.max_steps: must be >= 1, got 0"),
    (None, ["train.betas=[0.9"], "override 'train.betas=[0.9' is not valid YAML: "),
    ("train:\n  lr: [1e-4\n", [], "config file {config} is not valid YAML: "),
])
def test_bad_config_values_and_yaml_exit_with_one_line(tmp_path, config_text, overrides, message, run_script):
    # A YAML syntax error or a value out of range: one line and exit status 2, never a parser traceback or an
    # untrained model exported with exit 0.
    config = "configs/demo_digits.yaml"
    if config_text is not None:
        config = tmp_path / "broken.yaml"
        config.write_text(config_text)
    code, _, err = run_script("train.py", config, *overrides)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"train.py: error: {message.format(config=config)}")


def test_unreadable_training_image_exits_with_one_line_before_training(tmp_path, image_dir, tiny, run_script):
    (image_dir / "5.png").write_bytes((image_dir / "5.png").read_bytes()[:60])  # truncated
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *tiny(tmp_path / "run", image_dir))
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: {image_dir / '5.png'} is not a readable image (")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_resume_followed_by_an_override_resumes_the_latest_and_applies_it(run_script):
    code, out, err = run_script("train.py", "configs/demo_digits.yaml", "--resume", "train.max_steps=150",
                                "train.lr=0.001", "--dry-run")
    assert code == 0, err
    train = yaml.safe_load(out)["train"]
    assert train["resume"] == "latest" and train["max_steps"] == 150 and train["lr"] == 0.001


def test_a_failed_start_leaves_no_lock(tmp_path, image_dir, tiny, run_script):
    run = tmp_path / "run"
    # The model expects 16x16 images, the folder holds 8x8 ones: refused after the run dir was locked.
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *tiny(run, image_dir, **{"model.img_size": 16}))
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("error: dataset 'image_folder' gives images of shape (3, 8, 8)")
    assert run.is_dir() and not (run / ".lock").exists()


def test_export_followed_by_an_override_is_not_taken_as_a_checkpoint(tmp_path, image_dir, tiny, run_script):
    from uvic.config import load_config
    from uvic.training import train

    run = tmp_path / "run"
    train(load_config(ROOT / "configs" / "cifar10_uvic_s2.yaml", tiny(run, image_dir)))
    shutil.rmtree(run / "pipeline")
    code, out, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *tiny(tmp_path / "elsewhere", image_dir),
                                "--export", f"train.run_dir={run}")
    assert code == 0, err
    assert out.strip() == str(run / "pipeline") and (run / "pipeline" / "model_index.json").is_file()


@pytest.mark.parametrize("case", ["bad config", "bad input"])
def test_under_accelerate_launch_a_bad_start_is_one_error_line(tmp_path, image_dir, tiny, case):
    # `accelerate launch -q`: the launcher exits 1 without re-raising the script's exit as its own traceback.
    args = (["configs/cifar10_uvic_s2.yaml", "train.learning_rate=1"] if case == "bad config" else
            ["configs/cifar10_uvic_s2.yaml", *tiny(tmp_path / "run", image_dir, **{"model.img_size": 16})])
    r = _run([sys.executable, "-m", "accelerate.commands.launch", "-q", "--cpu", "--num_processes", "1",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "train.py", *args])
    assert r.returncode == 1 and "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: error: unknown config key(s) ['train.learning_rate']" if case == "bad config"
                           else "error: dataset 'image_folder' gives images of shape (3, 8, 8)")


def test_cpu_users_do_not_see_the_cuda_home_warning(tmp_path):
    if not (torch.cuda._is_compiled() and torch.version.cuda) or torch.cuda.is_available():
        pytest.skip("torch logs the warning only from a CUDA build without a GPU")
    env = {**ENV, "CUDA_HOME": str(tmp_path)}
    show = "import logging; logging.basicConfig(); import torch.utils.cpp_extension"
    hide = "from uvic.errors import configure_logging; configure_logging(); import torch.utils.cpp_extension"
    shown = subprocess.run([sys.executable, "-c", show], cwd=ROOT, env=env, capture_output=True, text=True)
    hidden = subprocess.run([sys.executable, "-c", hide], cwd=ROOT, env=env, capture_output=True, text=True)
    assert "No CUDA runtime is found" in shown.stderr  # the set-up does provoke it
    assert hidden.returncode == 0 and "No CUDA runtime is found" not in hidden.stderr


def test_training_output_names_final_paths_once_and_stays_off_the_progress_bar(tmp_path, image_dir, tiny):
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "train.py", "configs/cifar10_uvic_s2.yaml", *tiny(run, image_dir)], cwd=ROOT,
                       env={**ENV, "TQDM_MININTERVAL": "0"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.replace("\r", "\n").splitlines()
    logged = [line for line in lines if " INFO " in line]
    # The first step says it compiles, and how long it took.
    assert any("the first step includes one-time compilation" in line for line in logged)
    assert any("first step done in " in line for line in logged)
    # One line for the one checkpoint, the final pipeline path, and no temporary name anywhere.
    assert [line.rsplit(": ", 1)[-1] for line in logged if "checkpoint" in line] == [
        f"[RANK 0] saved checkpoint {run / 'checkpoints' / 'step_000000003'}"]
    assert any(line.endswith(f"exported the sampling weights to {run / 'pipeline'}") for line in logged)
    assert ".tmp" not in r.stderr
    # Every log line starts a line of its own: none follows a progress-bar state on the same line.
    assert all(line.split(" INFO ")[0].count(":") == 2 and "it/s" not in line.split(" INFO ")[0] for line in logged)
