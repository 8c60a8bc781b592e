"""Config errors are config errors: every check that needs no data runs before the run dir is touched, and
train.py reports it in one line with exit status 2, leaving nothing behind (no run dir, no config.yaml, no lock).

Each case goes through train.py (conftest's `run_script`): a config no run can use, from every part that checks
one (the config's ranges and choices, the trackers, the task, the model, FID while training)."""

import math

import pytest

from uvic.config import load_config
from uvic.errors import ConfigError


_HEADS = "config section model: embed_dim=16 is not divisible by num_heads=3"
_NO_REFERENCE = ("train.eval_every needs train.eval_reference (FID statistics .npz, an image folder or a dataset spec "
                 "such as cifar10-train:DIR)")
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
])
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
])
def test_class_conditional_mismatches_exit_2_and_write_nothing(tmp_path, run_script, extra, message):
    config = tmp_path / "class_cond.yaml"
    config.write_text("task: class_cond\n")
    run = tmp_path / "run"
    overrides = {
        "model.img_size": 8, "model.patch_size": 2, "model.embed_dim": 16, "model.depth": 2, "model.num_heads": 2,
        "data.root": str(tmp_path / "imagenet"), "data.image_size": 8, "data.num_classes": 3,
        "train.run_dir": str(run), "train.log_with": "none", **extra,
    }
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


# ---------------------------------------------------------------------------------------------------------
# A resume continues the same run (issue 38, section 2)
# ---------------------------------------------------------------------------------------------------------


def _tree(root):
    """{relative path: bytes} of every file under `root`: what a refused start must leave exactly as it was."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def cog_run(tmp_path, image_dir, tiny_overrides, run_script):
    """A finished 2-step tiny U-ViC run (Cog attention) and its overrides."""
    run = tmp_path / "run"
    overrides = tiny_overrides(run, image_dir, **{"train.max_steps": 2})
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *overrides)
    assert code == 0, err[-2000:]
    return run, overrides


@pytest.mark.parametrize("change, key, new, old", [
    ("model.attention=softmax", "model.attention", "'softmax'", "'cog'"),
    ("model.mlp_ratio=2", "model.mlp_ratio", "2.0", "4.0"),
    ("diffusion.beta_max=15", "diffusion.beta_max", "15.0", "20.0"),
    ("data.random_flip=false", "data.random_flip", "False", "True"),
    ("train.seed=7", "train.seed", "7", "1234"),
    ("train.lr=0.01", "train.lr", "0.01", "0.001"),
    ("sample.sampler=ddim", "sample.sampler", "'ddim'", "'uvit_dpm_solver'"),
])
def test_a_resume_that_changes_what_the_run_is_exits_2_and_writes_nothing(cog_run, run_script, change, key, new,
                                                                          old):
    run, overrides = cog_run
    before = _tree(run)
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *overrides, "train.max_steps=4", change,
                              "--resume")
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1].startswith(
        f"train.py: error: config key {key} is {new} here but {old} in {run / 'config.yaml'}: a resumed run "
        "continues the same model")
    assert _tree(run) == before  # config.yaml not rewritten, no checkpoint, no lock, no metrics line
    # The run dir standing for its own config: the same refusal.
    code, _, err = run_script("train.py", run, change, "--resume")
    assert code == 2 and f"config key {key} is {new} here" in err.strip().splitlines()[-1]
    assert _tree(run) == before


def test_a_resume_may_extend_and_watch_the_run(cog_run, run_script):
    run, overrides = cog_run
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *overrides, "train.max_steps=3",
                              "train.log_every=2", "train.save_every=3", "train.keep_checkpoints=2",
                              "train.cpu_threads=2", "train.val_every=0", "data.num_workers=0", "--resume")
    assert code == 0, err[-2000:]
    from uvic.training.checkpoint import list_checkpoints

    assert [s for s, _ in list_checkpoints(run)] == [2, 3]


def test_a_resume_checks_the_checkpoint_config_when_the_run_has_none(cog_run, run_script):
    """The weights were trained under the checkpoint's config: it is compared too (here the run's config.yaml is
    gone), and a checkpoint of another run resumed into a new run dir is compared with its own."""
    run, overrides = cog_run
    (run / "config.yaml").unlink()
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *overrides, "model.attention=softmax",
                              "--resume")
    ckpt = run / "checkpoints" / "step_000000002"
    assert code == 2 and err.strip().splitlines()[-1].startswith(
        f"train.py: error: config key model.attention is 'softmax' here but 'cog' in {ckpt / 'config.yaml'}")
    other = run.parent / "other"
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *overrides, f"train.run_dir={other}",
                              "model.attention=softmax", "--resume", ckpt)
    assert code == 2 and f"in {ckpt / 'config.yaml'}" in err.strip().splitlines()[-1]
    assert not other.exists()


def test_an_older_saved_config_is_accepted_when_equal(cog_run, run_script):
    """A config.yaml written by an older uvic lacks keys added since (they take their defaults, as the resuming
    config's do): equal is equal."""
    import yaml

    run, overrides = cog_run
    for path in (run / "config.yaml", run / "checkpoints" / "step_000000002" / "config.yaml"):
        saved = yaml.safe_load(path.read_text())
        del saved["train"]["val_probe_examples"], saved["sample"]["seed"], saved["diffusion"]
        path.write_text(yaml.safe_dump(saved, sort_keys=False))
    # (the checkpoint's meta.json hashes its config.yaml: refresh it so that the checkpoint verifies)
    import json

    from uvic.io import sha256_file

    ckpt = run / "checkpoints" / "step_000000002"
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["sha256"]["config.yaml"] = sha256_file(ckpt / "config.yaml")
    (ckpt / "meta.json").write_text(json.dumps(meta))
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *overrides, "train.max_steps=3",
                              "--resume")
    assert code == 0, err[-2000:]


def test_every_key_a_resume_may_change_is_a_config_key():
    from uvic.config import Config, LMRunConfig
    from uvic.training.preflight import RESUME_MAY_CHANGE, may_change_on_resume

    def keys(cfg, prefix=""):
        import dataclasses

        out = set()
        for f in dataclasses.fields(cfg):
            value = getattr(cfg, f.name)
            out |= keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else {prefix + f.name}
        return out

    known = keys(Config()) | keys(LMRunConfig())
    assert set(RESUME_MAY_CHANGE) <= known
    assert not may_change_on_resume("model.attention") and not may_change_on_resume("train.max_steps_x")
    assert may_change_on_resume("train.max_steps")


def test_an_ema_too_slow_for_the_run_is_warned(caplog):
    from uvic.training.preflight import warn_short_ema

    with caplog.at_level("WARNING", logger="uvic.training.preflight"):
        share = warn_short_ema(0.999, 2000)
    assert share == pytest.approx(math.exp(2000 * math.log1p(-0.001)))  # e^(2000 ln 0.999) = 0.13520
    # The suggested decay d is the largest 4-decimal one with d^2000 <= 1%: 0.9977^2000 = 0.0100 - , 0.9978^2000 > 1%.
    assert 0.9977**2000 <= 0.01 < 0.9978**2000
    assert caplog.messages == [
        "train.ema_decay=0.999 over train.max_steps=2000 leaves 13.5% of the initial weights (random unless the run "
        "starts from trained ones) in the EMA, the sampling weights; for a run this short use train.ema_decay <= "
        "0.9977 (under 1%), or 0 (no EMA)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="uvic.training.preflight"):
        # U-ViT's recipe (0.9999 over 500k steps), the demo (0.995 over 3,200), no EMA, and an EMA frozen at the init
        assert warn_short_ema(0.9999, 500_000) < 1e-20 and warn_short_ema(0.995, 3200) < 1e-6
        assert warn_short_ema(0.0, 10) == 0.0
    assert caplog.messages == []
    with caplog.at_level("WARNING", logger="uvic.training.preflight"):
        assert warn_short_ema(1.0, 10) == 1.0
    assert "leaves 100.0% of the initial weights" in caplog.messages[0]


def test_every_shipped_config_keeps_under_1_percent_of_the_init_in_its_ema():
    from pathlib import Path

    from uvic.training.preflight import EMA_INIT_SHARE

    checked = []
    for path in sorted(Path("configs").glob("*.yaml")):
        cfg = load_config(path)
        train = getattr(cfg, "train", None)
        if train is None or not getattr(train, "ema_decay", 0):
            continue
        assert train.ema_decay**train.max_steps <= EMA_INIT_SHARE, path.name
        checked.append(path.name)
    # the short CPU configs (where the EMA matters) are among those checked, and so are the official recipes
    assert {"demo_digits.yaml", "compare_digits.yaml", "fashion_mnist_uvic.yaml"} <= set(checked)
    assert len(checked) >= 10, checked
