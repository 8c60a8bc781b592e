"""uvic.training.runs: a run dir, a checkpoint dir or a pipeline dir becomes a pipeline; export writes the EMA."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from uvic.config import load_config
from uvic.pipelines import UViCPipeline
from uvic.training import train
from uvic.training.runs import export, load_pipeline, task_from_checkpoint
from uvic.training.tasks.diffusion import DiffusionTask


ROOT = Path(__file__).resolve().parents[2]


def test_run_checkpoint_and_pipeline_dirs_give_the_same_ema_pipeline(tmp_path, image_dir, tiny_overrides):
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir, **{"sample.sampler": "euler_maruyama"})))
    ckpt = run / "checkpoints" / "step_000000004"
    ema = load_file(str(ckpt / "ema.safetensors"))

    task, model, cfg = task_from_checkpoint(run)  # a run dir means its latest checkpoint
    assert isinstance(task, DiffusionTask) and cfg.train.max_steps == 4 and not model.training
    for source in (run, ckpt, run / "pipeline"):
        pipe = load_pipeline(source)
        assert type(pipe) is UViCPipeline and type(pipe.scheduler).__name__ == "VPSDEEulerMaruyamaScheduler"
        for k, v in pipe.transformer.state_dict().items():
            torch.testing.assert_close(v, ema[k], rtol=0, atol=0)
    # The sampler switch works from every kind of source.
    assert type(load_pipeline(ckpt, sampler="dpm_solver").scheduler).__name__ == "VPSDEDPMSolverScheduler"
    assert type(load_pipeline(run / "pipeline", sampler="dpm_solver").scheduler).__name__ == "VPSDEDPMSolverScheduler"

    # export: an older checkpoint's EMA as a pipeline directory.
    older = run / "checkpoints" / "step_000000002"
    out = export(older, tmp_path / "exported")
    exported = UViCPipeline.from_pretrained(out).transformer.state_dict()
    for k, v in load_file(str(older / "ema.safetensors")).items():
        torch.testing.assert_close(exported[k], v, rtol=0, atol=0)

    with pytest.raises(FileNotFoundError, match="neither a pipeline dir"):
        load_pipeline(tmp_path / "nothing")


def test_a_language_model_run_has_no_image_pipeline(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    run = tmp_path / "lm"
    overrides = [f"data.path={text}", "data.block_size=16", f"train.run_dir={run}", "train.batch_size=4",
                 "train.max_steps=1", "train.save_every=1", "train.sample_every=0", "train.log_with=none",
                 "train.cpu_threads=1"]
    train(load_config(ROOT / "configs" / "lm_tiny.yaml", overrides))
    with pytest.raises(ValueError, match="an 'lm' run has no image pipeline"):
        load_pipeline(run)
