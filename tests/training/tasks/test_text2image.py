"""The t2i task: the epsilon loss with CFG context dropout on stored latents, the n = t + 1 convention, the
validation loss on held-out captions, and the task in the training loop."""

import json

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from tiny_models import SpyDenoiser, tiny_t2i_config

from uvic.models import build_preset
from uvic.schedulers.timesteps import network_timestep
from uvic.training.losses import DiscreteNoise, drop_context, text_to_image_loss
from uvic.training.rng import ShardedRNG
from uvic.training.tasks.text2image import Text2ImageTask
from uvic.training.validation import VALIDATION_SEED


def _abar():
    return DDPMScheduler(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012,
                         beta_schedule="scaled_linear").alphas_cumprod


def _noise():
    return DiscreteNoise(1000, "scaled_linear", 0.00085, 0.012)


def _rng(seed=0):
    return ShardedRNG(seed, 0, 1, "cpu")


def test_drop_context_replaces_whole_context():
    ctx, empty = torch.randn(6, 3, 5), torch.randn(3, 5)
    drop = torch.tensor([True, False, False, True, False, False])
    out = drop_context(ctx, empty, drop)
    assert (out[drop] == empty).all() and (out[~drop] == ctx[~drop]).all()


def test_loss_feeds_t_plus_one_noised_latents_and_drops_context():
    spy, abar = SpyDenoiser("encoder_hidden_states"), _abar()
    B = 2000
    moments = torch.zeros(B, 8, 16, 16)
    moments[:, 4:] = -30.0  # (almost) deterministic latent: z0 = scale * mean = 0
    ctx, empty = torch.randn(B, 3, 5), torch.zeros(3, 5)
    loss = text_to_image_loss(spy, moments, ctx, empty, _noise(), 0.2301, _rng(), p_uncond=0.1)
    x_t, n, c = spy.calls[0]
    # Network time n = t + 1 in 1..1000, uniform.
    assert n.dtype == torch.int64 and n.min() == 1 and n.max() == 1000 and abs(n.float().mean() - 500.5) < 20
    assert network_timestep(torch.tensor(999), "discrete") == 1000
    # z0 = 0 so x_t = sqrt(1 - abar[n - 1]) * eps: per-sample RMS follows the schedule at index n - 1.
    rms = x_t.flatten(1).pow(2).mean(1).sqrt()
    expected = (1 - abar[n - 1]).sqrt()
    assert (rms - expected).abs().max() < 0.15 and (rms - expected).abs().mean() < 0.03
    # Whole-context dropout with p = 0.1, to the empty-caption features.
    dropped = (c == empty).all(dim=(1, 2))
    assert ((c == ctx).all(dim=(1, 2)) | dropped).all() and 0.08 < dropped.float().mean() < 0.12
    # A zero prediction gives loss = E[eps^2] = 1.
    assert abs(loss.item() - 1.0) < 0.02
    with pytest.raises(ValueError, match="p_uncond"):
        text_to_image_loss(spy, moments, ctx, empty, _noise(), 0.2301, _rng(), p_uncond=1.5)


def test_a_few_training_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = build_preset("uvit-tiny-t2i", attention_backend="torch")  # 4x8x8 latents, 5 context tokens of 16
    noise = _noise()
    g = torch.Generator().manual_seed(1)
    moments = torch.cat([torch.randn(8, 4, 8, 8, generator=g) * 2, torch.full((8, 4, 8, 8), -4.0)], dim=1)
    ctx, empty = torch.randn(8, 5, 16, generator=g), torch.zeros(5, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.03, betas=(0.9, 0.9))

    def eval_loss():
        with torch.no_grad():
            return text_to_image_loss(model, moments.repeat(4, 1, 1, 1), ctx.repeat(4, 1, 1), empty, noise, 0.2301,
                                      _rng(123)).item()

    before, rng = eval_loss(), _rng(1)
    for _ in range(20):
        loss = text_to_image_loss(model, moments, ctx, empty, noise, 0.2301, rng, p_uncond=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = eval_loss()
    assert np.isfinite(after) and after < 0.8 * before


def test_text2image_task_in_the_training_loop(tmp_path, make_tiny_coco):
    """`train(cfg)` with the t2i task from the task table: trains, writes a sample grid and checkpoints, and
    exports a t2i pipeline that carries the config's latent scale and sampler."""
    from uvic.pipelines.pipeline_uvic_t2i import UViCText2ImagePipeline
    from uvic.training.loop import train
    from uvic.training.tasks import task_class

    assert task_class("t2i") is Text2ImageTask
    root, vae, _ = make_tiny_coco(tmp_path, 8, splits=("train", "val"))
    vae_dir = tmp_path / "vae"
    vae.save_pretrained(vae_dir)
    cfg = tiny_t2i_config(
        root, tmp_path / "run", vae_dir,
        model={"embed_dim": 32, "depth": 4, "attention": "cog", "attention_backend": "torch"},
        train={"max_steps": 3, "batch_size": 4, "betas": (0.9, 0.9), "warmup_steps": 2, "sample_every": 3,
               "save_every": 3},
        sample={"num_inference_steps": 3, "num_images": 4},
    )
    train(cfg)
    run = tmp_path / "run"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and np.isfinite(losses).all()
    assert (run / "samples" / "step_0000003.png").is_file()
    pipe = UViCText2ImagePipeline.from_pretrained(run / "pipeline")
    assert type(pipe.scheduler).__name__ == "UViTDPMSolverScheduler"
    assert pipe.vae.config.scaling_factor == pytest.approx(0.2301)
    assert pipe.transformer.config.attention == "cog"


@pytest.mark.parametrize("splits", [("train", "val"), ("train",)])
def test_validation_uses_the_val_split_or_holds_out_whole_images(tmp_path, make_tiny_coco, splits):
    """The held-out set is the extracted val split, else `data.val_fraction` of the train images with all their
    captions; each example's value is recomputed here from its own draws: a latent from its moments, then stratified
    DDPM steps t (network time t + 1) with noise, and its own caption's features (never the empty caption's)."""
    root, vae, _ = make_tiny_coco(tmp_path, 10, splits=splits)
    cfg = tiny_t2i_config(root, tmp_path / "run", "", train={"val_every": 2, "val_timesteps": 2},
                          data={"val_fraction": 0.2})
    task = Text2ImageTask(cfg)
    trained, held = task.build_dataset(), task.validation_set()
    if splits == ("train", "val"):
        assert held.split == "val" and trained.split == "train" and len(trained) == 20  # 10 images x 2 captions
    else:
        images = task._data().caption_image
        assert len(held) == 4 and len(trained) == 16  # 2 of the 10 images, with both captions
        assert set(images[held.indices]).isdisjoint(images[trained.indices])
    spy = SpyDenoiser("encoder_hidden_states")
    index = torch.tensor([3, 1])
    items = [held[int(i)] for i in index]
    batch = {k: torch.stack([it[k] for it in items]) for k in ("x", "context")}
    got = task.validation_losses(spy, batch, index)["val_loss"]
    abar = _abar()
    for b, i in enumerate(index.tolist()):
        g = torch.Generator().manual_seed(VALIDATION_SEED + i)
        mean, logvar = batch["x"][b].chunk(2)
        z0 = 0.2301 * (mean + torch.exp(0.5 * logvar.clamp(-30, 20)) * torch.randn(4, 8, 8, generator=g))
        u, eps = torch.rand(2, generator=g), torch.randn(2, 4, 8, 8, generator=g)
        t = ((torch.arange(2) + u) / 2 * 1000).floor().long()
        x_t = abar[t].sqrt()[:, None, None, None] * z0 + (1 - abar[t]).sqrt()[:, None, None, None] * eps
        for k in range(2):
            seen_x, seen_n, seen_c = spy.calls[k]
            torch.testing.assert_close(seen_x[b], x_t[k].float(), rtol=1e-5, atol=1e-5)
            assert seen_n[b] == t[k] + 1 and torch.equal(seen_c[b], batch["context"][b])
        # The spy predicts zero noise: the loss is the mean square of the noise.
        torch.testing.assert_close(got[b], eps.pow(2).mean(), rtol=1e-5, atol=1e-6)
