"""Config errors are config errors: every check that needs no data runs before the run dir is touched, and
train.py reports it in one line with exit status 2, leaving nothing behind (no run dir, no config.yaml, no lock).

Each case goes through train.py (conftest's `run_script`): a config no run can use, from every part that checks
one (the config's ranges and choices, the trackers, the task, the model, FID while training)."""

import pytest

from uvic.config import load_config
from uvic.errors import ConfigError


_HEADS = "config section model: embed_dim=16 is not divisible by num_heads=3"
_NO_REFERENCE = ("train.eval_every needs train.eval_reference (FID statistics .npz, an image folder or a dataset spec "
                 "such as cifar10-train:DIR)")  # fmt: skip
_TRACKER = "is not a tracker uvic starts; use one of ['tensorboard', 'wandb'], a list of them, or 'none'"


@pytest.mark.parametrize("extra, message", [
    ({"train.eval_fid_dims": 100}, "config key train.eval_fid_dims: 100 is not one of [64, 192, 768, 2048]"),
    ({"train.eval_fid_mode": "tensorflow"}, "config key train.eval_fid_mode: 'tensorflow' is not one of "
                                            "['pytorch-fid', 'tf']"),
    ({"train.eval_every": 2}, _NO_REFERENCE),
    ({"train.log_with": "foo"}, f"config key train.log_with: 'foo' {_TRACKER}"),
    ({"train.log_with": "comet_ml"}, f"config key train.log_with: 'comet_ml' {_TRACKER}"),
    ({"train.log_with": "[none, tensorboard]"}, "config key train.log_with: ['none', 'tensorboard'] lists 'none' "
                                                "with other trackers"),
    ({"model.num_heads": 3}, _HEADS),
    ({"model.img_size": 6, "model.patch_size": 4}, "config section model: img_size=6 is not divisible by "
                                                   "patch_size=4"),
    ({"train.batch_size": 3, "train.grad_accum_steps": 2}, "config key train.batch_size: 3 must be divisible by "
                                                           "processes x train.grad_accum_steps = 1 x 2"),
])  # fmt: skip
def test_image_run_config_errors_exit_2_and_write_nothing(tmp_path, image_dir, tiny_overrides, run_script, extra,
                                                          message):
    run = tmp_path / "run"
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *tiny_overrides(run, image_dir, **extra))
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(f"train.py: error: {message}")
    assert not run.exists()


def test_fid_on_a_language_model_exits_2_and_writes_nothing(tmp_path, run_script):
    text = tmp_path / "my.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    run = tmp_path / "run"
    code, _, err = run_script("train.py", "configs/lm_tiny.yaml", f"data.path={text}", f"train.run_dir={run}",
                              "train.eval_every=10", "train.max_steps=10", "train.log_with=none")
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "train.py: error: train.eval_every: a 'lm' run makes no images to compute a FID of"
    assert not run.exists()


@pytest.mark.parametrize("extra, message", [
    ({"model.num_classes": 5}, "model.num_classes=5 must be data.num_classes (3, no null class) or "
                               "data.num_classes + 1 (4, the last id is the null class)"),
    ({"model.num_classes": 3, "data.p_uncond": 0.1}, "data.p_uncond=0.1 drops labels to the null class, but the model "
                                                     "has none: set model.num_classes=4"),
    ({"model.num_classes": 3, "sample.guidance_scale": 1.4}, "sample.guidance_scale=1.4 needs a null class, and the "
                                                             "model has none"),
    ({"sample.guidance_scale": 1.4}, "sample.guidance_scale=1.4 needs a null class, and the model has none: set "
                                     "sample.guidance_scale=1, or data.p_uncond > 0 to train one"),
])  # fmt: skip
def test_class_conditional_mismatches_exit_2_and_write_nothing(tmp_path, run_script, extra, message):
    config = tmp_path / "class_cond.yaml"
    config.write_text("task: class_cond\n")
    run = tmp_path / "run"
    overrides = {
        "model.img_size": 8, "model.patch_size": 2, "model.embed_dim": 16, "model.depth": 2, "model.num_heads": 2,
        "data.root": str(tmp_path / "imagenet"), "data.image_size": 8, "data.num_classes": 3,
        "train.run_dir": str(run), "train.log_with": "none", **extra,
    }  # fmt: skip
    code, _, err = run_script("train.py", config, *(f"{k}={v}" for k, v in overrides.items()))
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(f"train.py: error: {message}")
    assert not run.exists()


def test_wandb_without_an_account_exits_2_and_writes_nothing(tmp_path, image_dir, tiny_overrides, run_script,
                                                             monkeypatch, no_network):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED", "WANDB_SILENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no stored credentials
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    run = tmp_path / "run"
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml",
                              *tiny_overrides(run, image_dir, **{"train.log_with": "wandb"}))
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        "train.py: error: train.log_with names wandb, which has no account to log to (no `wandb login`, no "
        f"WANDB_API_KEY): run `wandb login`, or set WANDB_MODE=offline to log to {run / 'wandb'} without an account")
    assert not run.exists()
    # Offline, the same config passes the check (wandb then logs to run_dir/wandb).
    from uvic.training.preflight import check_run_config

    monkeypatch.setenv("WANDB_MODE", "offline")
    check_run_config(load_config("configs/cifar10_uvic_s2.yaml", tiny_overrides(run, image_dir,
                                                                                **{"train.log_with": "wandb"})))


def test_train_in_python_checks_before_the_run_dir_is_touched(tmp_path, image_dir, tiny_overrides):
    """`train(cfg)` runs the same checks first, for configs built in Python (which skip load_config's)."""
    import dataclasses

    from uvic.training import train

    cfg = load_config("configs/cifar10_uvic_s2.yaml", tiny_overrides(tmp_path / "run", image_dir))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_heads=3))
    with pytest.raises(ConfigError, match=_HEADS):
        train(cfg)
    assert not (tmp_path / "run").exists()
