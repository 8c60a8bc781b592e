"""sample.py with class-conditional pipelines: --class-labels (ids or U-ViT's random FID labels), --guidance-scale,
bad input before sampling, and 2 processes writing the same PNGs as 1."""

import json
import os
import re
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import VAE_TINY

import uvic.pipelines.sampling as sampling
from uvic.config import DiffusionConfig
from uvic.models import UViTModel
from uvic.models.autoencoder import build_vae
from uvic.pipelines import UViCPipeline
from uvic.pipelines.sampling import random_class_labels
from uvic.schedulers import build_scheduler


ROOT = Path(__file__).resolve().parent.parent
SD = DiffusionConfig(schedule="discrete", beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)


def _model(in_chans, num_classes):
    torch.manual_seed(0)
    return UViTModel(img_size=8, patch_size=2, in_chans=in_chans, embed_dim=16, depth=2, num_heads=2,
                     num_classes=num_classes, attention_backend="torch").eval()


@pytest.fixture(scope="module")
def latent_dir(tmp_path_factory):
    """A tiny ImageNet-256-style pipeline: 3 classes + the null class, VAE, guidance 1.4 by default."""
    path = tmp_path_factory.mktemp("latent") / "pipe"
    pipe = UViCPipeline(_model(4, 4), build_scheduler("uvit_dpm_solver", SD),
                        vae=build_vae(scaling_factor=0.18215, **VAE_TINY).eval(), null_class=True,
                        label_dropout=0.1, default_guidance_scale=1.4)
    pipe.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pixel_dir(tmp_path_factory):
    """A tiny ImageNet-64-style pipeline: 3 classes, no null class, training-class counts [1, 0, 3]."""
    path = tmp_path_factory.mktemp("pixel") / "pipe"
    UViCPipeline(_model(3, 3), build_scheduler("dpm_solver", DiffusionConfig()),
                 class_counts=[1, 0, 3]).save_pretrained(path)
    return path


def _cli(monkeypatch, capsys, *args):
    """Run sample.py in this process; returns (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["sample.py", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "sample.py"), run_name="__main__")
    return e.value.code, capsys.readouterr().err


def test_random_labels_follow_u_vit(latent_dir, pixel_dir):
    latent, pixel = UViCPipeline.from_pretrained(latent_dir), UViCPipeline.from_pretrained(pixel_dir)
    uniform = np.bincount(random_class_labels(latent, 6000, seed=1), minlength=4)
    assert uniform[3] == 0 and (np.abs(uniform[:3] / 6000 - 1 / 3) < 0.03).all()  # never the null class
    freq = np.bincount(random_class_labels(pixel, 4000, seed=1), minlength=3) / 4000
    assert freq[1] == 0 and abs(freq[2] - 0.75) < 0.03 and abs(freq[0] - 0.25) < 0.03
    # Label i does not depend on how many images are drawn after it (one draw from the seed).
    assert random_class_labels(latent, 10, seed=3) == random_class_labels(latent, 10, seed=3)
    no_counts = UViCPipeline(pixel.transformer, pixel.scheduler)
    with pytest.raises(ValueError, match="training-class frequencies"):
        random_class_labels(no_counts, 4)


def test_bad_labels_and_guidance_are_refused_before_sampling(latent_dir, pixel_dir, tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("sampling started before the input was validated")

    monkeypatch.setattr(sampling, "generate", refuse)
    monkeypatch.setattr(sampling, "sample_to_folder", refuse)
    grid = tmp_path / "g.png"
    cases = [
        ((latent_dir, "--class-labels", "0", "3"), r"--class-labels 3 is outside \[0, 3\) \(the last id is the null"),
        ((latent_dir, "--class-labels", "cat"), "takes class ids or `random`"),
        ((pixel_dir, "--guidance-scale", "1.5"), "needs a class-conditional model with a null class"),
    ]
    for args, message in cases:
        code, err = _cli(monkeypatch, capsys, *args, "--grid", grid)
        last = err.strip().splitlines()[-1]
        assert code == 2 and last.startswith("sample.py: error: ") and re.search(message, last), err
        assert not grid.exists()


def test_grid_with_labels_and_default_guidance(latent_dir, tmp_path, monkeypatch, capsys):
    calls = []
    real = UViCPipeline.__call__

    def spy(self, **kwargs):
        calls.append(kwargs)
        return real(self, **kwargs)

    monkeypatch.setattr(UViCPipeline, "__call__", spy)
    monkeypatch.setattr(sys, "argv", ["sample.py", str(latent_dir), "--grid", str(tmp_path / "g.png"),
                                      "--num-images", "3", "--steps", "2", "--class-labels", "2", "0", "-q"])
    runpy.run_path(str(ROOT / "sample.py"), run_name="__main__")
    assert (tmp_path / "g.png").is_file()
    assert calls[0]["class_labels"] == [2, 0, 2] and "guidance_scale" not in calls[0]  # the pipeline's 1.4


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_random_labels_two_processes_equal_one(latent_dir, tmp_path, run_script):
    """A guided latent pipeline with U-ViT's random labels: the same PNGs and labels from 1 and 2 processes."""
    pipe = latent_dir
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    args = ["sample.py", str(pipe), "--num-images", "5", "--steps", "2", "--batch-size", "2", "--seed", "7",
            "--class-labels", "random", "-q"]
    # One process: this one, with one thread as the two processes have (OMP_NUM_THREADS=1).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        code, _, err = run_script(*args, "--out-dir", tmp_path / "one")
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err[-3000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                          "127.0.0.1", "--master_port", str(_free_port()), *args, "--out-dir", str(tmp_path / "two")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "one").glob("*.png"))
    assert names == [f"{i:06d}.png" for i in range(5)] == sorted(p.name for p in (tmp_path / "two").glob("*.png"))
    for n in names:
        assert (tmp_path / "one" / n).read_bytes() == (tmp_path / "two" / n).read_bytes(), n
    labels = json.loads((tmp_path / "one" / "class_labels.json").read_text())
    assert labels == json.loads((tmp_path / "two" / "class_labels.json").read_text())
    expected = random_class_labels(UViCPipeline.from_pretrained(pipe), 5, seed=7)
    assert labels == expected
