"""Fixtures shared by the training and script tests: a tiny image folder and the overrides of a seconds-long run."""

import logging
import runpy
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tiny_models import VAE_TINY


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def run_script(monkeypatch, capsys):
    """The function `(script, *args) -> (exit code, stdout, stderr)` that runs a script of the repository root
    (train.py, sample.py) in this process as `python SCRIPT ARGS` runs it there: an error the script turns into a
    message and an exit status gives that status; any other exception propagates (a subprocess would print a
    traceback), and log records, a logged traceback included, go to stderr as the scripts' `configure_logging`
    sends them (pytest's own logging setup makes that call a no-op here). It saves the seconds each interpreter
    start-up with torch and diffusers costs; what only a fresh process shows (several processes, a kill, the exact
    log line format, import-time warnings) keeps a subprocess."""

    def run(script, *args):
        monkeypatch.chdir(ROOT)
        monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
        root = logging.getLogger()
        handler, level = logging.StreamHandler(sys.stderr), root.level  # sys.stderr: capsys's, at this point
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        try:
            runpy.run_path(str(ROOT / script), run_name="__main__")
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code
        finally:
            root.removeHandler(handler)
            root.setLevel(level)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture
def image_dir(tmp_path):
    """Ten 8x8 RGB PNGs: with a global batch of 4 an epoch is 2 batches, so short runs cross epochs."""
    d = tmp_path / "images"
    d.mkdir()
    rng = np.random.default_rng(0)
    for i in range(10):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(d / f"{i}.png")
    return d


@pytest.fixture
def no_network(monkeypatch):
    """An offline machine: every connection attempt raises OSError (what urllib and huggingface_hub see offline)
    and huggingface_hub is in offline mode. Tests never download anything (the FID tests use this for all)."""

    def refuse(*args, **kwargs):
        raise OSError(f"network access attempted in a test: connect{args[1:]!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture
def tiny_overrides():
    """The function `(run_dir, image_dir, **extra) -> dotted overrides` of a tiny run."""
    return _tiny_overrides


def _tiny_overrides(run_dir, image_dir, **extra):
    """Dotted overrides for a seconds-long CPU run of a 2-block U-ViC on 8x8 images."""
    base = {
        "model.img_size": 8, "model.patch_size": 2, "model.embed_dim": 16, "model.depth": 2, "model.num_heads": 2,
        "data.name": "image_folder", "data.root": str(image_dir), "data.image_size": 8, "data.num_workers": 0,
        "train.run_dir": str(run_dir), "train.batch_size": 4, "train.max_steps": 4, "train.warmup_steps": 2,
        "train.lr": 1e-3, "train.ema_decay": 0.9, "train.log_every": 1, "train.sample_every": 0,
        "train.save_every": 2, "train.log_with": "none", "train.cpu_threads": 1,
        "sample.num_images": 4, "sample.num_inference_steps": 2,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]




@pytest.fixture(scope="session")
def make_tiny_coco():
    """The function `(root, n_images, splits) -> (features root, vae, text_encoder)`: random images with two captions
    each, extracted by the real `uvic.data.mscoco.extract_features` with a tiny VAE and CLIP (5 tokens of 16)."""
    import json

    import torch

    from uvic.data.mscoco import extract_features
    from uvic.models.autoencoder import build_vae
    from uvic.models.text_encoder import CLIPTextEncoder

    def make(root, n_images, splits=("val",)):
        rng = np.random.default_rng(0)
        (root / "img").mkdir(parents=True)
        images, anns = [], []
        for i in range(n_images):
            Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(root / "img" / f"{i}.png")
            images.append({"id": i, "file_name": f"{i}.png"})
            anns += [{"id": 10 * i + j, "image_id": i, "caption": f"photo {i} number {j}"} for j in range(2)]
        (root / "cap.json").write_text(json.dumps({"images": images, "annotations": anns}))
        torch.manual_seed(0)
        vae = build_vae(**VAE_TINY).eval()
        te = CLIPTextEncoder(context_length=5, width=16, heads=2, layers=1).eval()
        for split in splits:
            extract_features(root / "img", root / "cap.json", root / "feat", split, vae, te, resolution=16,
                             num_workers=0, device="cpu")
        return root / "feat", vae, te

    return make
