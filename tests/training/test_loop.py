import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from uvic.config import load_config
from uvic.pipelines import UViCPipeline
from uvic.training import train
from uvic.training.checkpoint import latest_checkpoint, list_checkpoints
from uvic.training.ema import EMA
from uvic.training.logs import read_metrics
from uvic.training.loop import lr_lambda, resume_checkpoint
from uvic.training.tasks.diffusion import DiffusionTask


def _weights(ckpt):
    return load_file(str(ckpt / "model.safetensors")), load_file(str(ckpt / "ema.safetensors"))


def test_train_writes_config_checkpoints_samples_and_pipeline(tmp_path, image_dir, tiny_overrides):
    run = tmp_path / "run"
    cfg = load_config(None, tiny_overrides(run, image_dir, **{"train.sample_every": 4, "train.log_with": "tensorboard",
                                                            "train.keep_checkpoints": 1}))
    train(cfg)
    assert load_config(run / "config.yaml") == cfg  # the resolved config, reloadable
    ckpts = list_checkpoints(run)
    assert [s for s, _ in ckpts] == [4]  # rotated to keep_checkpoints=1
    assert load_config(ckpts[0][1] / "config.yaml") == cfg
    meta = json.loads((ckpts[0][1] / "meta.json").read_text())
    assert meta["step"] == 4
    # Every other file of the checkpoint is recorded with its SHA-256 (hashlib, computed here independently).
    files = sorted(p.name for p in ckpts[0][1].iterdir() if p.name != "meta.json")
    assert sorted(meta["sha256"]) == files and "ema.safetensors" in files and "optimizer.bin" in files
    assert all(meta["sha256"][f] == hashlib.sha256((ckpts[0][1] / f).read_bytes()).hexdigest() for f in files)
    assert (run / "samples" / "step_0000004.png").is_file() and (run / "loss_curve.png").is_file()
    assert list(run.glob("train/events.out.tfevents*"))  # tensorboard tracker
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    pipe = UViCPipeline.from_pretrained(run / "pipeline")
    assert pipe.transformer.config.attention == "cog" and pipe.transformer.config.img_size == 8
    # the exported transformer holds the EMA weights of the last checkpoint
    _, ema = _weights(ckpts[0][1])
    for k, v in pipe.transformer.state_dict().items():
        torch.testing.assert_close(v, ema[k], rtol=0, atol=0)


def test_lr_schedule():
    f = lr_lambda(2500, "constant", 10_000, 0.0)
    assert [f(0), f(1250), f(2500), f(9999)] == [0.0, 0.5, 1.0, 1.0]  # U-ViT: min(s / 2500, 1)
    g = lr_lambda(10, "cosine", 110, 0.1)
    assert g(5) == 0.5 and g(10) == pytest.approx(1.0) and g(60) == pytest.approx(0.55) and g(110) == pytest.approx(0.1)


@pytest.mark.parametrize("accum, ema_decay", [(1, 0.9), (2, 0.9), (2, 0.0)])
def test_resume_is_exact(tmp_path, image_dir, tiny_overrides, accum, ema_decay):
    extra = {"train.grad_accum_steps": accum, "train.max_steps": 5, "train.save_every": 3,
             "train.ema_decay": ema_decay}
    full = tmp_path / "full"
    train(load_config(None, tiny_overrides(full, image_dir, **extra)))
    part = tmp_path / "part"
    train(load_config(None, tiny_overrides(part, image_dir, **{**extra, "train.max_steps": 3})))
    train(load_config(None, tiny_overrides(part, image_dir, **extra, **{"train.resume": "latest"})))
    # 5 steps x 4 images over 2-batch epochs: the resume at step 3 starts in the middle of an epoch.
    a_model, a_ema = _weights(list_checkpoints(full)[-1][1])
    b_model, b_ema = _weights(list_checkpoints(part)[-1][1])
    for k in a_model:
        torch.testing.assert_close(a_model[k], b_model[k], rtol=0, atol=0)
        torch.testing.assert_close(a_ema[k], b_ema[k], rtol=0, atol=0)
    a_opt = torch.load(list_checkpoints(full)[-1][1] / "optimizer.bin", weights_only=True)
    b_opt = torch.load(list_checkpoints(part)[-1][1] / "optimizer.bin", weights_only=True)
    for i, st in a_opt["state"].items():
        torch.testing.assert_close(st["exp_avg_sq"], b_opt["state"][i]["exp_avg_sq"], rtol=0, atol=0)


def test_no_ema_model_when_the_decay_is_0(tmp_path, image_dir, tiny_overrides, monkeypatch):
    import uvic.training.loop as loop

    built = []
    monkeypatch.setattr(loop, "EMA", lambda *args: built.append(args) or EMA(*args))
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.ema_decay": 0.0, "train.sample_every": 4})))
    assert built == []
    # The sampling weights are the model's own: in the checkpoint, in the sample grid's run and in the export.
    model, ema = _weights(list_checkpoints(run)[-1][1])
    assert model.keys() == ema.keys()
    pipe = UViCPipeline.from_pretrained(run / "pipeline")
    for k, v in model.items():
        torch.testing.assert_close(ema[k], v, rtol=0, atol=0)
        torch.testing.assert_close(pipe.transformer.state_dict()[k], v, rtol=0, atol=0)
    assert (run / "samples" / "step_0000004.png").is_file()
    # A decay > 0 builds one, and its weights differ from the model's.
    train(load_config(None, tiny_overrides(tmp_path / "run2", image_dir)))
    assert [args[1] for args in built] == [0.9]
    model, ema = _weights(list_checkpoints(tmp_path / "run2")[-1][1])
    assert any(not torch.equal(model[k], ema[k]) for k in model)


def test_refuses_to_overwrite_a_run_without_resume(tmp_path, image_dir, tiny_overrides):
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.max_steps": 2})))
    with pytest.raises(ValueError, match="already has checkpoints.*--resume"):
        train(load_config(None, tiny_overrides(run, image_dir, **{"train.max_steps": 2})))


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, image_dir, tiny_overrides, monkeypatch):
    import uvic.training.checkpoint as ckpt_mod

    run = tmp_path / "run"
    real_save_file, calls = ckpt_mod.save_file, []

    def crashing_save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second checkpoint dies half-written
            raise KeyboardInterrupt("simulated crash")
        return real_save_file(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod, "save_file", crashing_save_file)
    with pytest.raises(KeyboardInterrupt):
        train(load_config(None, tiny_overrides(run, image_dir)))
    assert [s for s, _ in list_checkpoints(run)] == [2]
    (partial,) = (run / "checkpoints").glob(".tmp-step_000000004-*")  # the partial one (per-process name), ignored
    monkeypatch.setattr(ckpt_mod, "save_file", real_save_file)
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.resume": "latest"})))
    assert [s for s, _ in list_checkpoints(run)] == [2, 4]
    assert not partial.exists()


@pytest.mark.parametrize("log_every, stops_at", [(1, 3), (100, 4)])
def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, image_dir, tiny_overrides, monkeypatch,
                                                          log_every, stops_at):
    # The loss turns NaN at step 3. Logging every step stops there; logging rarely, the check before the step-4
    # save still stops the run: the NaN check does not depend on log_every.
    real_loss, calls = DiffusionTask.loss, []

    def loss(self, model, batch, rng):
        calls.append(1)
        out = real_loss(self, model, batch, rng)
        return out * float("nan") if len(calls) == 3 else out

    monkeypatch.setattr(DiffusionTask, "loss", loss)
    run = tmp_path / "run"
    with pytest.raises(FloatingPointError, match=rf"NaN or Inf at or before step {stops_at}.*step_000000002"):
        train(load_config(None, tiny_overrides(run, image_dir, **{"train.log_every": log_every})))
    assert [s for s, _ in list_checkpoints(run)] == [2]
    assert not (run / "pipeline").exists()


def test_unreadable_checkpoint_is_a_clear_error(tmp_path, image_dir, tiny_overrides):
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.max_steps": 2})))
    ckpt = list_checkpoints(run)[-1][1]
    # A file whose recorded hash matches (so the checkpoint verifies) but which is not a safetensors file.
    bad = b"not a safetensors file"
    (ckpt / "model.safetensors").write_bytes(bad)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["sha256"]["model.safetensors"] = hashlib.sha256(bad).hexdigest()
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="step_000000002 is unreadable or does not match this run"):
        train(load_config(None, tiny_overrides(run, image_dir, **{"train.resume": "latest"})))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(load_config(None, tiny_overrides(tmp_path / "r2", image_dir, **{"train.resume": str(tmp_path)})))


def test_model_and_data_shape_mismatch_is_a_clear_error(tmp_path, image_dir, tiny_overrides):
    cfg = load_config(None, tiny_overrides(tmp_path / "run", image_dir, **{"model.in_chans": 1}))
    with pytest.raises(ValueError, match=r"images of shape \(3, 8, 8\).*\(1, 8, 8\)"):
        train(cfg)


def test_resume_from_an_older_checkpoint_moves_the_newer_ones_aside(tmp_path, image_dir, tiny_overrides):
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.save_every": 1})))
    assert [s for s, _ in list_checkpoints(run)] == [2, 3, 4]
    stale_step_3 = _weights(run / "checkpoints" / "step_000000003")[0]
    # Branch from step 2 (e.g. before a divergence) for one step, keeping 2 checkpoints.
    branch = {"train.save_every": 1, "train.max_steps": 3, "train.keep_checkpoints": 2,
              "train.resume": str(run / "checkpoints" / "step_000000002")}
    train(load_config(None, tiny_overrides(run, image_dir, **branch)))
    # Only the new branch is rotated: the stale step 4 is not "latest", and step 2 is kept.
    assert [s for s, _ in list_checkpoints(run)] == [2, 3]
    assert resume_checkpoint(run, "latest") == latest_checkpoint(run) == run / "checkpoints" / "step_000000003"
    (abandoned,) = (run / "checkpoints" / "abandoned").iterdir()
    assert abandoned.name.startswith("after_step_000000002_")
    assert sorted(p.name for p in abandoned.iterdir()) == ["metrics.jsonl", "step_000000003", "step_000000004"]
    # Nothing is lost: the abandoned step 3 is the old one, byte for byte; the metrics split the same way.
    for k, v in _weights(abandoned / "step_000000003")[0].items():
        torch.testing.assert_close(v, stale_step_3[k], rtol=0, atol=0)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    assert [r["step"] for r in read_metrics(abandoned / "metrics.jsonl")] == [3, 4]


@pytest.mark.parametrize("sampler, scheduler_cls", [("ddpm", "DDPMScheduler"), ("dpm_solver", "DPMSolverMultistepScheduler")])
def test_discrete_schedule_trains_and_samples_with_stock_diffusers_schedulers(tmp_path, image_dir, tiny_overrides,
                                                                            sampler, scheduler_cls):
    from uvic.pipelines.sampling import generate
    from uvic.training.runs import load_pipeline

    run = tmp_path / "run"
    extra = {"diffusion.schedule": "discrete", "diffusion.beta_schedule": "scaled_linear",
             "diffusion.beta_start": 0.00085, "diffusion.beta_end": 0.012, "sample.sampler": sampler}
    train(load_config(None, tiny_overrides(run, image_dir, **extra)))
    # The export carries the configured stock scheduler on the training betas.
    pipe = UViCPipeline.from_pretrained(run / "pipeline")
    assert type(pipe.scheduler).__name__ == scheduler_cls
    c = pipe.scheduler.config
    assert (c.beta_schedule, c.beta_start, c.beta_end, c.num_train_timesteps) == ("scaled_linear", 0.00085, 0.012, 1000)
    # And it samples, from the export and from the run dir (the EMA weights of the last checkpoint).
    pipe.set_progress_bar_config(disable=True)
    images = generate(pipe, [0, 1, 2], batch_size=2, num_inference_steps=3)
    assert images.shape == (3, 8, 8, 3) and images.dtype == np.uint8 and np.unique(images).size > 2
    from_run = load_pipeline(run, sampler=sampler)
    from_run.set_progress_bar_config(disable=True)
    assert type(from_run.scheduler).__name__ == scheduler_cls
    np.testing.assert_array_equal(generate(from_run, [0, 1, 2], batch_size=2, num_inference_steps=3), images)


def test_a_config_built_in_python_is_range_checked_by_train(tmp_path, image_dir, tiny_overrides):
    import dataclasses

    from uvic.errors import ConfigError

    cfg = load_config(None, tiny_overrides(tmp_path / "run", image_dir))
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=0))
    with pytest.raises(ConfigError, match=r"^config key train.max_steps: must be >= 1, got 0$"):
        train(cfg)
    assert not (tmp_path / "run").exists()
