"""The class_cond task: label dropout statistics, latents from stored moments, config checks, ImageNet pixel and
latent runs in the training loop (with an exact resume), and the held-out validation."""

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_imagenet import make_imagenet
from tiny_models import VAE_TINY, SpyDenoiser

from uvic.config import load_config
from uvic.data.imagenet import extract_features
from uvic.models.autoencoder import build_vae
from uvic.pipelines import UViCPipeline
from uvic.training import train
from uvic.training.checkpoint import list_checkpoints
from uvic.training.rng import ShardedRNG
from uvic.training.runs import load_pipeline
from uvic.training.tasks import task_class
from uvic.training.tasks.class_cond import ClassConditionalTask, drop_labels
from uvic.training.validation import VALIDATION_SEED


def _pixels(run_dir, root, **extra):
    """Overrides of a tiny ImageNet-64-style run: 3 classes, 8x8 pixels, VP-SDE, no null class."""
    base = {
        "task": "class_cond", "model.img_size": 8, "model.patch_size": 2, "model.embed_dim": 16, "model.depth": 2,
        "model.num_heads": 2, "model.num_classes": 3, "model.attention_backend": "torch",
        "data.root": str(root), "data.image_size": 8, "data.num_classes": 3, "data.num_workers": 0,
        "train.run_dir": str(run_dir), "train.batch_size": 4, "train.max_steps": 4, "train.warmup_steps": 2,
        "train.lr": 1e-3, "train.ema_decay": 0.9, "train.log_every": 1, "train.sample_every": 0,
        "train.save_every": 2, "train.log_with": "none", "train.cpu_threads": 1,
        "sample.num_images": 3, "sample.num_inference_steps": 2, "sample.guidance_scale": 1.0,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def test_drop_labels():
    labels = torch.tensor([3, 1, 4, 1, 5])
    drop = torch.tensor([True, False, False, True, False])
    assert drop_labels(labels, 1000, drop).tolist() == [1000, 1, 4, 1000, 5]


@pytest.mark.parametrize("p_uncond", [0.1, 0.15])
def test_label_dropout_statistics_and_latents(p_uncond, tmp_path):
    """p_uncond of the labels become the null class (the model's last id), independently of the class; latents are
    drawn from the moments with scale 0.18215; the network sees the discrete t + 1."""
    cfg = load_config(None, _pixels(tmp_path, tmp_path, **{
        "model.in_chans": 4, "model.num_classes": 4, "data.source": "features", "data.random_flip": False,
        "data.p_uncond": p_uncond, "diffusion.schedule": "discrete", "diffusion.beta_schedule": "scaled_linear",
        "diffusion.beta_start": 0.00085, "diffusion.beta_end": 0.012}))
    task = ClassConditionalTask(cfg)
    spy, B = SpyDenoiser("class_labels"), 20_000
    labels = torch.arange(B) % 3
    moments = torch.cat([torch.full((B, 4, 2, 2), 2.0), torch.full((B, 4, 2, 2), -30.0)], dim=1)  # z = 0.18215 * 2
    task.loss(spy, {"x": moments, "label": labels}, ShardedRNG(0, 0, 1, "cpu"))
    x_t, n, y = spy.calls[0]
    dropped = y == 3
    assert ((y == labels) | dropped).all()
    # Binomial(20000, p): 5 standard deviations is under 0.011.
    assert abs(dropped.float().mean().item() - p_uncond) < 0.011
    for c in range(3):
        assert abs(dropped[labels == c].float().mean().item() - p_uncond) < 0.02
    assert n.min() >= 1 and n.max() <= 1000 and n.dtype == torch.int64
    # x_t = sqrt(abar) z0 + sqrt(1 - abar) eps with z0 = 0.3643: the mean over samples with n = 1 is z0.
    early = x_t[n <= 3].mean().item()
    assert abs(early - 0.18215 * 2) < 0.02


def test_config_errors_are_named(tmp_path):
    def task(**extra):
        return ClassConditionalTask(load_config(None, _pixels(tmp_path, tmp_path, **extra)))

    with pytest.raises(ValueError, match="model.num_classes=5 must be data.num_classes"):
        task(**{"model.num_classes": 5})
    with pytest.raises(ValueError, match="no null class|has none: set model.num_classes=4"):
        task(**{"data.p_uncond": 0.1})
    with pytest.raises(ValueError, match="guidance_scale=1.4 needs a null class"):
        task(**{"sample.guidance_scale": 1.4})
    with pytest.raises(ValueError, match="random_flip"):
        task(**{"data.source": "features", "model.num_classes": 4})
    assert task(**{"model.num_classes": 4, "data.p_uncond": 0.1}).null_class


def test_model_num_classes_follows_the_data_unless_set():
    """A run on fewer classes changes data.num_classes only: the model has those classes, plus the null class when
    label dropout trains one; a preset's own count (ImageNet 256's 1001) follows too; a value the config sets wins."""
    configs = Path(__file__).resolve().parents[3] / "configs"
    assert load_config(configs / "imagenet256_uvic_l2.yaml").model.num_classes == 1001  # the official runs as before
    assert load_config(configs / "imagenet64_uvic_m4.yaml").model.num_classes == 1000
    assert load_config(configs / "imagenet256_uvic_l2.yaml", ["data.num_classes=10"]).model.num_classes == 11
    assert load_config(configs / "imagenet64_uvic_m4.yaml", ["data.num_classes=10"]).model.num_classes == 10
    small = configs / "class_cond_small.yaml"
    assert load_config(small).model.num_classes == 11
    assert load_config(small, ["data.num_classes=3", "data.p_uncond=0", "sample.guidance_scale=1"]).model.num_classes == 3
    assert load_config(small, ["data.num_classes=3", "model.num_classes=5"]).model.num_classes == 5  # set: kept
    assert load_config(small, ["model.preset=uvic-tiny-class", "data.num_classes=3"]).model.num_classes == 4


def test_the_small_class_conditional_config_trains_on_a_few_classes(tmp_path, run_script):
    """configs/class_cond_small.yaml on a 3-class folder (as docs/training.md shows it), shrunk to a tiny model: no
    model.num_classes to keep in step by hand; the export has the 3 classes and the null class of guidance."""
    root = make_imagenet(tmp_path / "classes")
    run = tmp_path / "run"
    code, _, err = run_script(
        "train.py", "configs/class_cond_small.yaml", f"data.root={root}", "data.num_classes=3",
        "model.preset=uvic-tiny-class", "data.image_size=8", "data.num_workers=0", f"train.run_dir={run}",
        "train.max_steps=2", "train.batch_size=4", "train.log_with=none", "train.sample_every=0", "train.cpu_threads=1",
        "sample.num_inference_steps=2")
    assert code == 0, err[-3000:]
    pipe = UViCPipeline.from_pretrained(run / "pipeline")
    assert pipe.transformer.config.num_classes == 4 and pipe.config.null_class and pipe.num_labels == 3
    assert pipe.config.default_guidance_scale == pytest.approx(1.4)


def test_imagenet_pixel_run_resumes_exactly_and_exports(tmp_path):
    assert task_class("class_cond") is ClassConditionalTask
    root = make_imagenet(tmp_path / "imagenet")
    full, part = tmp_path / "full", tmp_path / "part"
    train(load_config(None, _pixels(full, root, **{"train.sample_every": 4})))
    train(load_config(None, _pixels(part, root, **{"train.max_steps": 2})))
    train(load_config(None, _pixels(part, root, **{"train.resume": "latest"})))
    a = load_file(str(list_checkpoints(full)[-1][1] / "ema.safetensors"))
    b = load_file(str(list_checkpoints(part)[-1][1] / "ema.safetensors"))
    assert list_checkpoints(full)[-1][0] == list_checkpoints(part)[-1][0] == 4
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert (full / "samples" / "step_0000004.png").is_file()
    pipe = UViCPipeline.from_pretrained(full / "pipeline")
    assert pipe.vae is None and not pipe.config.null_class and pipe.config.class_counts == [3, 2, 4]
    from_run = load_pipeline(full)  # a run dir: the latest checkpoint's EMA weights through the task's pipeline
    assert from_run.config.class_counts == [3, 2, 4] and from_run.num_labels == 3
    with pytest.raises(ValueError, match="holds 3 classes .* expected 4"):  # a class missing from the folder
        train(load_config(None, _pixels(tmp_path / "r", root, **{"data.num_classes": 4, "model.num_classes": 4})))


def test_imagenet_latent_run_with_label_dropout(tmp_path):
    """Features extracted by `uvic.data.imagenet`, the discrete schedule, p_uncond, a guided sample grid, and an
    exported pipeline with the VAE (scale 0.18215), null class and guidance."""
    root = make_imagenet(tmp_path / "imagenet")
    torch.manual_seed(0)
    vae = build_vae(scaling_factor=0.18215, **VAE_TINY).eval()
    feats = extract_features(root, tmp_path / "features", vae, resolution=16, num_classes=3, batch_size=4,
                             num_workers=0, device="cpu")
    vae.save_pretrained(tmp_path / "vae")
    run = tmp_path / "run"
    over = _pixels(run, feats, **{
        "model.in_chans": 4, "model.num_classes": 4, "data.source": "features", "data.random_flip": False,
        "data.p_uncond": 0.15, "data.vae": str(tmp_path / "vae"), "diffusion.schedule": "discrete",
        "diffusion.beta_schedule": "scaled_linear", "diffusion.beta_start": 0.00085, "diffusion.beta_end": 0.012,
        "sample.sampler": "uvit_dpm_solver", "sample.guidance_scale": 1.4, "train.sample_every": 4})
    train(load_config(None, over))
    assert (run / "samples" / "step_0000004.png").is_file()
    pipe = UViCPipeline.from_pretrained(run / "pipeline")
    assert pipe.config.null_class and pipe.config.label_dropout == 0.15
    assert pipe.config.default_guidance_scale == pytest.approx(1.4) and pipe.num_labels == 3
    assert pipe.vae.config.scaling_factor == pytest.approx(0.18215)
    pipe.set_progress_bar_config(disable=True)
    img = pipe(batch_size=2, class_labels=[0, 2], num_inference_steps=2, output_type="np").images
    assert img.shape == (2, 16, 16, 3) and np.isfinite(img).all()
    with pytest.raises(ValueError, match="latent channels"):
        bad = build_vae(**{**VAE_TINY, "latent_channels": 3})
        bad.save_pretrained(tmp_path / "vae3")
        over3 = [o if not o.startswith("data.vae=") else f"data.vae={tmp_path / 'vae3'}" for o in over]
        train(load_config(None, [o if not o.startswith("train.run_dir=") else f"train.run_dir={tmp_path / 'r3'}"
                                 for o in over3]))


def test_on_sample_returns_its_grid_for_the_trackers(tmp_path):
    """The loop shows the file `on_sample` returns in the trackers: a pixel run's grid, one image per class."""
    task = ClassConditionalTask(load_config(None, _pixels(tmp_path, tmp_path)))
    path = task.on_sample(task.build_model().eval(), 7, tmp_path)
    assert path == tmp_path / "samples" / "step_0000007.png" and path.is_file()


def test_validation_holds_out_whole_images_and_feeds_their_labels(tmp_path):
    """Features hold every image as is and flipped: both are held out together. A held-out example is scored with
    its own label (no dropout to the null class) on a latent drawn from its moments by its own generator."""
    root = make_imagenet(tmp_path / "imagenet")
    torch.manual_seed(0)
    vae = build_vae(scaling_factor=0.18215, **VAE_TINY).eval()
    feats = extract_features(root, tmp_path / "features", vae, resolution=16, num_classes=3, batch_size=4,
                             num_workers=0, device="cpu")
    cfg = load_config(None, _pixels(tmp_path / "run", feats, **{
        "model.in_chans": 4, "model.num_classes": 4, "data.source": "features", "data.random_flip": False,
        "data.p_uncond": 0.15, "data.val_fraction": 0.34, "train.val_every": 2, "train.val_timesteps": 1,
        "diffusion.schedule": "discrete", "diffusion.beta_schedule": "scaled_linear", "diffusion.beta_start": 0.00085,
        "diffusion.beta_end": 0.012}))
    task = ClassConditionalTask(cfg)
    trained, held = task.build_dataset(), task.validation_set()
    image = np.arange(18) % 9  # item j is image j % 9
    assert len(held) == 6 and len(trained) == 12 and set(image[held.indices]).isdisjoint(image[trained.indices])
    assert [image[j] for j in held.indices[::2]] == [image[j] for j in held.indices[1::2]]  # as is, then flipped
    spy = SpyDenoiser("class_labels")
    items = [held[i] for i in range(6)]
    batch = {"x": torch.stack([it["x"] for it in items]), "label": torch.stack([it["label"] for it in items])}
    task.validation_losses(spy, batch, torch.arange(6))
    x_t, n, labels = spy.calls[0]
    assert torch.equal(labels, batch["label"]) and (labels < 3).all()
    g = torch.Generator().manual_seed(VALIDATION_SEED + 4)
    mean, logvar = batch["x"][4].chunk(2)
    z0 = 0.18215 * (mean + torch.exp(0.5 * logvar.clamp(-30, 20)) * torch.randn(4, 8, 8, generator=g))
    u, eps = torch.rand(1, generator=g), torch.randn(4, 8, 8, generator=g)
    t = int(u * 1000)
    abar = task.noise.alphas_cumprod[t].float()
    assert n[4] == t + 1
    torch.testing.assert_close(x_t[4], abar.sqrt() * z0 + (1 - abar).sqrt() * eps, rtol=1e-5, atol=1e-5)
