"""configs/imagenet*_{uvit,uvic}_*.yaml carry U-ViT's ImageNet recipes (baofff/U-ViT configs/imagenet*_uvit_*.py)."""

from pathlib import Path

import pytest

from uvic.config import ClassCondRunConfig, load_config
from uvic.pipelines.pipeline_uvic import OFFICIAL_IMAGENET
from uvic.training.tasks.class_cond import ClassConditionalTask


ROOT = Path(__file__).resolve().parents[1]

# name -> (official config, n_steps, lr) as the official files give them (the rest is in OFFICIAL_IMAGENET).
RECIPES = {
    "imagenet64_{}_m4": ("imagenet64_uvit_mid", 300_000, 3e-4),
    "imagenet64_{}_l4": ("imagenet64_uvit_large", 300_000, 3e-4),
    "imagenet256_{}_l2": ("imagenet256_uvit_large", 300_000, 2e-4),
    "imagenet256_{}_h2": ("imagenet256_uvit_huge", 500_000, 2e-4),
    "imagenet512_{}_l4": ("imagenet512_uvit_large", 500_000, 2e-4),
    "imagenet512_{}_h4": ("imagenet512_uvit_huge", 500_000, 2e-4),
}


@pytest.mark.parametrize("flavour, attention", [("uvit", "softmax"), ("uvic", "cog")])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_official_imagenet_recipe(name, flavour, attention):
    official, steps, lr = RECIPES[name]
    spec = OFFICIAL_IMAGENET[official]
    cfg = load_config(ROOT / "configs" / f"{name.format(flavour)}.yaml")
    assert isinstance(cfg, ClassCondRunConfig) and cfg.task == "class_cond"
    nnet = spec["nnet"]
    m = cfg.model
    for key in ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "num_classes"):
        assert getattr(m, key) == nnet[key], key
    assert m.conv == nnet.get("conv", True) and m.attention == attention and not m.qkv_bias and not m.mlp_time_embed
    assert cfg.diffusion.schedule == spec["schedule"]
    if spec["schedule"] == "discrete":
        d = cfg.diffusion
        assert (d.beta_schedule, d.beta_start, d.beta_end, d.num_train_timesteps) == ("scaled_linear", 0.00085,
                                                                                      0.012, 1000)
    latent = nnet["in_chans"] == 4
    assert cfg.data.source == ("features" if latent else "pixels") and cfg.data.num_classes == 1000
    assert cfg.data.p_uncond == spec["p_uncond"] and cfg.data.random_flip is not latent
    if latent:
        assert cfg.data.latent_scale == 0.18215
        assert cfg.data.vae.endswith("autoencoder_kl_ema.pth" if "huge" in official else "autoencoder_kl.pth")
    else:
        assert cfg.data.image_size == 64
    t = cfg.train
    assert (t.max_steps, t.batch_size, t.lr, t.weight_decay, t.betas, t.warmup_steps) == (
        steps, 1024, lr, 0.03, (0.99, 0.99), 5000)
    assert (t.ema_decay, t.grad_clip, t.lr_schedule, t.gradient_checkpointing) == (0.9999, 0.0, "constant", True)
    s = cfg.sample
    assert (s.sampler, s.num_inference_steps) == ("uvit_dpm_solver", 50)
    assert s.guidance_scale == pytest.approx(1 + spec["scale"])
    task = ClassConditionalTask(cfg)  # the task's own checks (classes, null class, guidance) pass
    assert task.null_class is latent
