"""configs/mscoco_{uvic,uvit}_s2.yaml carry the official MS-COCO recipe (docs/conventions.md, "Training recipes")."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from uvic.config import Text2ImageRunConfig, load_config
from uvic.models import UVIT_PRESETS


ROOT = Path(__file__).resolve().parents[1]


def _resolve(name):
    path = ROOT / "configs" / name
    return yaml.safe_load(path.read_text()), load_config(path)


@pytest.mark.parametrize("name,attention", [("mscoco_uvic_s2.yaml", "cog"), ("mscoco_uvit_s2.yaml", "softmax")])
def test_official_mscoco_recipe(name, attention):
    raw, cfg = _resolve(name)
    assert raw["task"] == "t2i"
    preset = dict(UVIT_PRESETS[f"{'uvic' if attention == 'cog' else 'uvit'}-s2-mscoco"].items())
    model = dataclasses.asdict(cfg.model)
    assert {k: model[k] for k in preset if k != "attention_backend"} == {
        k: v for k, v in preset.items() if k != "attention_backend"}
    assert cfg.model.attention == attention
    d = cfg.diffusion
    assert (d.schedule, d.num_train_timesteps, d.beta_schedule, d.beta_start, d.beta_end) == (
        "discrete", 1000, "scaled_linear", 0.00085, 0.012)
    t = cfg.train
    assert (t.lr, t.weight_decay, t.betas, t.warmup_steps, t.lr_schedule) == (2e-4, 0.03, (0.9, 0.9), 5000, "constant")
    assert (t.batch_size, t.max_steps, t.ema_decay, t.grad_clip, t.seed) == (256, 1_000_000, 0.9999, 0.0, 1234)
    assert isinstance(cfg, Text2ImageRunConfig) and cfg.sample.num_inference_steps == 50
    d = cfg.data
    assert (d.p_uncond, d.latent_scale, d.vae) == (0.1, 0.2301, "assets/stable-diffusion/autoencoder_kl.pth")
    assert (cfg.sample.sampler, cfg.sample.guidance_scale) == ("uvit_dpm_solver", 2.0)
