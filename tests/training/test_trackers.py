"""train.log_with: tensorboard, wandb (offline), none and lists; samples shown as images or text."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from uvic.errors import ConfigError
from uvic.training.trackers import log_samples, tracker_names


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value, names", [
    ("none", []), ("tensorboard", ["tensorboard"]), ("wandb", ["wandb"]),
    (("tensorboard", "wandb"), ["tensorboard", "wandb"]), (("wandb", "wandb"), ["wandb"]),
])  # fmt: skip
def test_tracker_names(value, names):
    if "wandb" in names:
        pytest.importorskip("wandb")
    assert tracker_names(value) == names


@pytest.mark.parametrize("value", ["mlflow", ("tensorboard", "none"), ("comet",)])
def test_unknown_trackers_are_refused(value):
    with pytest.raises(ConfigError, match=r"config key train.log_with: \['(mlflow|none|comet)'\] not in"):
        tracker_names(value)


def test_a_text_sample_is_logged_as_text(tmp_path):
    from accelerate import Accelerator
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = Accelerator(log_with="tensorboard", project_dir=str(tmp_path), cpu=True)
    accelerator.init_trackers("train")
    sample = tmp_path / "step_0000003.txt"
    sample.write_text("The cat sat on the mat", encoding="utf-8")
    log_samples(accelerator, sample, step=3)
    accelerator.end_training()
    (events,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("samples/text_summary")
    assert event.step == 3 and event.tensor_proto.string_val == [b"The cat sat on the mat"]


def test_wandb_offline_run_gets_the_sample_grids(tmp_path, tiny_overrides, image_dir):
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    overrides = tiny_overrides(run, image_dir, **{"train.log_with": "[tensorboard, wandb]", "train.sample_every": 2,
                                                  "train.max_steps": 2})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    r = subprocess.run([sys.executable, "train.py", "configs/cifar10_uvic_s2.yaml", *overrides], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (offline,) = (run / "wandb").glob("offline-run-*")
    assert [p.stat().st_size > 0 for p in offline.glob("run-*.wandb")] == [True]
    # wandb keeps logged images as files: the step-2 grid, tagged `samples`.
    assert list((offline / "files" / "media" / "images").glob("samples_2_*.png"))
    assert list((run / "train").rglob("events.out.tfevents.*"))  # and tensorboard next to it
