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
])
def test_tracker_names(value, names):
    if "wandb" in names:
        pytest.importorskip("wandb")
    assert tracker_names(value) == names


@pytest.mark.parametrize("value, message", [
    ("mlflow", "'mlflow' is not a tracker uvic starts; use one of ['tensorboard', 'wandb'], a list of them, or 'none'"),
    (("comet_ml",), "'comet_ml' is not a tracker uvic starts; use one of ['tensorboard', 'wandb'], a list of them, "
                    "or 'none'"),
    # Not "['none'] not in ['none', ...]": 'none' is a valid value, only not inside a list of trackers.
    (("none", "tensorboard"), "['none', 'tensorboard'] lists 'none' with other trackers; 'none' alone means no "
                              "tracker, else list trackers of ['tensorboard', 'wandb']"),
])
def test_unknown_trackers_are_refused(value, message):
    with pytest.raises(ConfigError) as e:
        tracker_names(value)
    assert str(e.value) == f"config key train.log_with: {message}"


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


def test_wandb_without_an_account_is_one_line(tmp_path, monkeypatch, no_network):
    """No `wandb login`, no WANDB_API_KEY and no WANDB_MODE: wandb cannot log anywhere, and says so in a UsageError
    traceback; the run says it in one line, with the two ways out."""
    pytest.importorskip("wandb")
    from accelerate import Accelerator

    from uvic.training.trackers import start_trackers

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED", "WANDB_SILENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no stored credentials
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    accelerator = Accelerator(log_with="wandb", project_dir=str(tmp_path / "run"), cpu=True)
    with pytest.raises(ConfigError) as e:
        start_trackers(accelerator, ["wandb"], tmp_path / "run", {"lr": 1e-3})
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("train.log_with names wandb, which has no account to log to (UsageError: ")
    assert message.endswith(f"run `wandb login`, or set WANDB_MODE=offline to log to {tmp_path / 'run' / 'wandb'} "
                            "without an account")


def test_a_tensorboard_write_that_fails_in_its_thread_is_one_error(tmp_path, tiny_overrides, image_dir, monkeypatch):
    """TensorBoard writes from a thread: a write that fails there (a read-only file system) stops the run with one
    StorageError from the main thread, and the thread's traceback is not printed before it."""
    import errno
    import threading

    from tensorboard.compat.tensorflow_stub.io import gfile

    from uvic.config import load_config
    from uvic.errors import StorageError
    from uvic.training import train

    def read_only(self, filename, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), filename)

    monkeypatch.setattr(gfile.LocalFileSystem, "_write", read_only)  # the writer thread's only way to the disk
    printed = []
    monkeypatch.setattr(threading, "excepthook", printed.append)  # what Python would print for a dying thread
    cfg = load_config(None, tiny_overrides(tmp_path / "run", image_dir, **{"train.log_with": "tensorboard"}))
    with pytest.raises(StorageError, match=r"^training stopped: read-only file system"):
        train(cfg)
    assert printed == []


def test_an_unwritable_tensorboard_dir_is_named_before_training(tmp_path, tiny_overrides, image_dir):
    from uvic.config import load_config
    from uvic.errors import StorageError
    from uvic.training import train

    run = tmp_path / "run"
    run.mkdir()
    (run / "train").write_text("a file where the TensorBoard folder goes")
    cfg = load_config(None, tiny_overrides(run, image_dir, **{"train.log_with": "tensorboard"}))
    with pytest.raises(StorageError, match=rf"^cannot write the TensorBoard logs to {run / 'train'}: "):
        train(cfg)
    assert not (run / "checkpoints").exists()
