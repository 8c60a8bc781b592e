"""What the image tasks sample is pinned: the training-time sample grid (`on_sample`) and the images of FID while
training (`Evaluator`) of every image task, at a fixed seed, hashed pixel for pixel, and a tiny U-ViC's forward.

The hashes in tests/data_files/pinned_outputs.json were written by this module's `__main__` before the task
protocol was restructured (issue: tasks own their protocol), so a refactor of how tasks sample cannot change what
they sample. Regenerate them only for a change that is meant to change the images, and say so in its commit:

    python tests/training/tasks/test_pinned_outputs.py
"""

import hashlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image


TESTS = Path(__file__).resolve().parents[2]
STORE = TESTS / "data_files" / "pinned_outputs.json"
CASES = ["diffusion", "diffusion_labels", "t2i", "class_cond_pixels", "class_cond_latent"]


def _hash(array: np.ndarray) -> str:
    array = np.ascontiguousarray(array)
    return hashlib.sha256(f"{array.dtype}{array.shape}".encode() + array.tobytes()).hexdigest()


def _overrides(run_dir, **extra):
    base = {"model.img_size": 8, "model.patch_size": 2, "model.embed_dim": 16, "model.depth": 3,
            "model.num_heads": 2, "model.attention_backend": "torch", "train.run_dir": str(run_dir),
            "train.log_with": "none", "train.eval_every": 2, "train.eval_num_images": 5, "train.eval_fid_dims": 64,
            "train.eval_fid_weights_sha256": "none", "sample.num_images": 5, "sample.num_inference_steps": 2,
            "sample.batch_size": 2}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _images(folder: Path, n: int, size: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


def _config(case: str, tmp: Path, weights: Path, make_tiny_coco):
    """The run config of `case` (tiny model, 2 sampling steps, 5 images, FID on 5 images at the 64-d layer)."""
    from tiny_imagenet import make_imagenet
    from tiny_models import VAE_TINY

    from uvic.config import load_config
    from uvic.models.autoencoder import build_vae

    fid = {"train.eval_fid_weights": str(weights)}
    if case in ("diffusion", "diffusion_labels"):
        labels = {"model.num_classes": 3} if case == "diffusion_labels" else {}
        return load_config(None, _overrides(tmp / "run", **fid, **labels, **{
            "data.name": "image_folder", "data.root": str(_images(tmp / "train", 2, 8)), "data.image_size": 8,
            "train.eval_reference": str(_images(tmp / "ref", 3, 8))}))
    if case == "t2i":
        from tiny_models import tiny_t2i_config

        root, vae, _ = make_tiny_coco(tmp / "coco", 4, splits=("train", "val"))
        vae.save_pretrained(tmp / "vae")
        cfg = tiny_t2i_config(root, tmp / "run", tmp / "vae", model={"depth": 3, "attention_backend": "torch"},
                              train={"eval_every": 2, "eval_num_images": 5, "eval_fid_dims": 64,
                                     "eval_reference": str(_images(tmp / "ref", 3, 16)),
                                     "eval_fid_weights": str(weights), "eval_fid_weights_sha256": "none"},
                              sample={"num_images": 5, "batch_size": 2, "guidance_scale": 2.0})
        return cfg
    root = make_imagenet(tmp / "imagenet")
    common = {"task": "class_cond", "data.root": str(root), "data.image_size": 8, "data.num_classes": 3,
              "data.num_workers": 0, "model.num_classes": 3, "sample.guidance_scale": 1.0}
    if case == "class_cond_pixels":
        return load_config(None, _overrides(tmp / "run", **fid, **common, **{
            "train.eval_reference": str(_images(tmp / "ref", 3, 8))}))
    from uvic.data.imagenet import extract_features

    torch.manual_seed(0)
    vae = build_vae(scaling_factor=0.18215, **VAE_TINY).eval()
    feats = extract_features(root, tmp / "features", vae, resolution=16, num_classes=3, batch_size=4,
                             num_workers=0, device="cpu")
    vae.save_pretrained(tmp / "vae")
    return load_config(None, _overrides(tmp / "run", **fid, **{**common,
        "model.in_chans": 4, "model.num_classes": 4, "data.source": "features", "data.root": str(feats),
        "data.random_flip": False, "data.p_uncond": 0.15, "data.vae": str(tmp / "vae"),
        "diffusion.schedule": "discrete", "diffusion.beta_schedule": "scaled_linear",
        "diffusion.beta_start": 0.00085, "diffusion.beta_end": 0.012, "sample.guidance_scale": 1.4,
        "train.eval_reference": str(_images(tmp / "ref", 3, 16))}))


def _outputs(case: str, tmp: Path, weights: Path, make_tiny_coco) -> dict[str, str]:
    """{"grid": hash of the on_sample grid's pixels, "fid_images": hash of the evaluator's images}."""
    from uvic.training.evaluation import Evaluator
    from uvic.training.tasks import build_task

    cfg = _config(case, tmp, weights, make_tiny_coco)
    task = build_task(cfg)
    torch.manual_seed(0)
    model = task.build_model().eval()
    grid = task.on_sample(model, 7, tmp / "run")
    out = {"grid": _hash(np.asarray(Image.open(grid)))}
    state = SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0, is_main_process=True,
                            is_local_main_process=True)
    evaluator = Evaluator(cfg, task, state)
    with torch.inference_mode():
        images = np.concatenate([b.numpy() for b in evaluator._batches(model, 2)])
    out["fid_images"] = _hash(images)
    return out


def _uvic_forward() -> list[float]:
    """A tiny U-ViC's output (Cog in every block but the first and the last), rounded to 6 decimals."""
    from uvic.models import UViTModel

    torch.manual_seed(0)
    model = UViTModel(img_size=8, patch_size=2, in_chans=3, embed_dim=16, depth=5, num_heads=2,
                      attention_backend="torch").eval()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = model(x, torch.tensor([10.0, 500.0])).sample
    return [round(v, 6) for v in y.flatten().tolist()]


@pytest.fixture(scope="module")
def stored():
    return json.loads(STORE.read_text())


@pytest.mark.parametrize("case", CASES)
def test_sampled_images_are_unchanged(case, stored, tmp_path, weights_file, make_tiny_coco):
    assert _outputs(case, tmp_path, weights_file, make_tiny_coco) == stored["images"][case]


def test_uvic_forward_is_unchanged(stored):
    np.testing.assert_allclose(_uvic_forward(), stored["uvic_forward"], rtol=0, atol=2e-6)


def _load_fid_conftest():
    """tests/fid/conftest.py as a module: its session fixture `weights_file` (random-init FID-Inception weights)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fid_tests_conftest", TESTS / "fid" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_fid_conftest = _load_fid_conftest()
weights_file = _fid_conftest.weights_file


if __name__ == "__main__":
    import tempfile

    sys.path.insert(0, str(TESTS))
    import conftest  # noqa: E402  (tests/conftest.py: make_tiny_coco)

    make = conftest.make_tiny_coco.__wrapped__()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        (d / "weights").mkdir()
        weights = _fid_conftest.weights_file.__wrapped__(SimpleNamespace(mktemp=lambda name: d / "weights"))
        images = {case: _outputs(case, d / case, weights, make) for case in CASES}
    STORE.write_text(json.dumps({"images": images, "uvic_forward": _uvic_forward()}, indent=1) + "\n")
    print(f"wrote {STORE}")
