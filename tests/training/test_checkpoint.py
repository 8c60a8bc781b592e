"""Faults that could lose or corrupt a run: a second launch on the run dir, corrupted checkpoints, interrupted
deletions and failed writes. Each asserts the exact outcome and that nothing is lost."""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

import uvic.training.checkpoint as ckpt_mod
from uvic.config import load_config
from uvic.errors import CheckpointError, RunLockedError, StorageError
from uvic.training import train
from uvic.training.checkpoint import list_checkpoints, save_checkpoint, sweep_leftovers, verify_checkpoint
from uvic.training.lock import RunDirLock


ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _steps(run):
    return [s for s, _ in list_checkpoints(run)]


def _assert_same_weights(a, b):
    for name in ("model", "ema"):
        x, y = load_file(str(a / f"{name}.safetensors")), load_file(str(b / f"{name}.safetensors"))
        assert x.keys() == y.keys()
        for k in x:
            torch.testing.assert_close(x[k], y[k], rtol=0, atol=0)


@pytest.fixture
def reference_run(tmp_path, image_dir, tiny_overrides):
    """An uninterrupted 4-step run (checkpoints at 2 and 4): what a resumed run must reproduce bit for bit."""
    run = tmp_path / "reference"
    train(load_config(None, tiny_overrides(run, image_dir)))
    return run


# 1. Two launches on one run dir.


def test_second_launch_on_a_locked_run_dir_fails_naming_the_holder(tmp_path, image_dir, tiny_overrides, run_script):
    run = tmp_path / "run"
    long = tiny_overrides(run, image_dir, **{"train.max_steps": 100_000, "train.save_every": 3,
                                             "train.keep_checkpoints": 2, "train.log_every": 1})
    first = subprocess.Popen([sys.executable, "train.py", "configs/cifar10_uvic_s2.yaml", *long], cwd=ROOT, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while len(_steps(run)) < 1 and first.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert first.poll() is None and (run / ".lock").read_text().strip() == str(first.pid)
        other_seed = tiny_overrides(run, image_dir, **{"train.seed": 7, "train.max_steps": 6})
        code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *other_seed)  # this process
        assert first.poll() is None  # the first run was still training when the second gave up
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        f"error: {run} is in use by another training run (PID {first.pid}); wait for it to finish, or choose "
        f"another train.run_dir")
    assert "Traceback" not in err
    # Nothing of the second launch reached the run dir: the first run's config, checkpoints and metrics are intact.
    assert load_config(run / "config.yaml").train.seed == 1234
    ckpts = list_checkpoints(run)
    assert ckpts and all(verify_checkpoint(p) == s for s, p in ckpts)
    steps = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:  # the kill may cut the last line short
            pass
    assert steps == list(range(1, len(steps) + 1))  # one run's records, each step once
    # kill -9 leaves no stale lock: the kernel dropped it with the process, so the run resumes.
    last = ckpts[-1][0]
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.max_steps": last + 1, "train.resume": "latest",
                                                              "train.save_every": 100})))
    assert _steps(run)[-1] == last + 1


def test_lock_is_exclusive_and_released(tmp_path, image_dir, tiny_overrides):
    lock = RunDirLock(tmp_path / "run")
    lock.acquire()
    with pytest.raises(RunLockedError, match=rf"in use by another training run \(PID {os.getpid()}\)"):
        train(load_config(None, tiny_overrides(tmp_path / "run", image_dir, **{"train.max_steps": 2})))
    assert not (tmp_path / "run" / "checkpoints").exists()
    lock.release()
    train(load_config(None, tiny_overrides(tmp_path / "run", image_dir, **{"train.max_steps": 2})))
    assert _steps(tmp_path / "run") == [2]
    RunDirLock(tmp_path / "run").acquire()  # train() released it on return


# 2. Corrupted checkpoints are refused, naming the file and the newest checkpoint that verifies.


def test_corrupted_weights_are_refused_and_the_good_checkpoint_resumes_exactly(tmp_path, image_dir, tiny_overrides,
                                                                                reference_run):
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir)))
    step2, step4 = (p for _, p in list_checkpoints(run))
    # Overwrite 4 KB of the weights with valid floats: the file still loads, with wrong values.
    f = step4 / "model.safetensors"
    data = bytearray(f.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header : header + 4096] = np.full(1024, 0.5, dtype=np.float32).tobytes()
    f.write_bytes(bytes(data))
    assert load_file(str(f))  # still a valid safetensors file
    resume = tiny_overrides(run, image_dir, **{"train.resume": "latest"})
    with pytest.raises(CheckpointError) as e:
        train(load_config(None, resume))
    assert str(e.value) == (
        f"checkpoint {step4} failed verification: {f} is corrupted (its SHA-256 differs from the one recorded when "
        f"it was saved); the newest checkpoint of this run that verifies is {step2} (use that path instead, e.g. "
        f"with --resume)")
    # The named checkpoint resumes to the uninterrupted run's weights, bit for bit.
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.resume": str(step2)})))
    _assert_same_weights(run / "checkpoints" / "step_000000004", reference_run / "checkpoints" / "step_000000004")


def test_a_step_that_disagrees_with_its_directory_is_refused(tmp_path, image_dir, tiny_overrides):
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.max_steps": 6})))
    step6 = run / "checkpoints" / "step_000000006"
    meta = json.loads((step6 / "meta.json").read_text())
    (step6 / "meta.json").write_text(json.dumps({**meta, "step": 5}))
    with pytest.raises(CheckpointError, match=rf"{step6 / 'meta.json'} records step 5, but the directory is "
                                              rf"step_000000006; the newest checkpoint of this run that verifies is "
                                              rf"{run / 'checkpoints' / 'step_000000004'}"):
        train(load_config(None, tiny_overrides(run, image_dir, **{"train.resume": "latest", "train.max_steps": 8})))
    (step6 / "meta.json").write_text(json.dumps(meta))
    assert verify_checkpoint(step6) == 6
    (step6 / "optimizer.bin").unlink()
    with pytest.raises(CheckpointError, match=r"optimizer.bin is missing"):
        verify_checkpoint(step6)


def test_export_refuses_a_corrupted_checkpoint(tmp_path, image_dir, tiny_overrides, run_script):
    from uvic.training.runs import export

    run = tmp_path / "run"
    overrides = tiny_overrides(run, image_dir)
    train(load_config(None, overrides))
    step2, step4 = (p for _, p in list_checkpoints(run))
    shutil.rmtree(run / "pipeline")
    ema = step4 / "ema.safetensors"
    ema.write_bytes(ema.read_bytes()[:-8] + bytes(8))  # the last float changed
    message = (f"checkpoint {step4} failed verification: {ema} is corrupted (its SHA-256 differs from the one "
               f"recorded when it was saved); the newest checkpoint of this run that verifies is {step2}")
    with pytest.raises(CheckpointError, match=f"^{re.escape(message)}"):
        export(run, run / "pipeline")
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *overrides, "--export")
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: {message}")
    assert not (run / "pipeline").exists()
    assert export(step2, run / "pipeline") == run / "pipeline"  # the named one exports


# 3. A kill while a checkpoint is being deleted.


def _kill_rmtree_midway(monkeypatch, first):
    """Make `shutil.rmtree` of a checkpoint dir die (KeyboardInterrupt, as a kill) after deleting its file `first`;
    returns the function that puts the real rmtree back."""
    real_rmtree = shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        if (Path(path) / "meta.json").is_file():
            (Path(path) / first).unlink()
            raise KeyboardInterrupt("simulated kill")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    return lambda: monkeypatch.setattr(shutil, "rmtree", real_rmtree)


def test_kill_during_rotation_leaves_no_half_deleted_checkpoint(tmp_path, image_dir, tiny_overrides, monkeypatch,
                                                                reference_run):
    run = tmp_path / "run"
    restore = _kill_rmtree_midway(monkeypatch, "model.safetensors")  # weights first: meta.json survives
    with pytest.raises(KeyboardInterrupt):
        train(load_config(None, tiny_overrides(run, image_dir, **{"train.keep_checkpoints": 1})))
    restore()
    # step 2 was renamed before its deletion began: no step_* dir is half-deleted, step 4 is complete.
    assert _steps(run) == [4] and verify_checkpoint(run / "checkpoints" / "step_000000004") == 4
    (leftover,) = (run / "checkpoints").glob(".deleting-step_000000002-*")
    # Leftovers of interrupted runs: a re-save of step 4 killed between its two renames (the complete old copy is
    # aside as .old-step_*, a partial new one). A step dir without meta.json is no leftover (uvic never leaves one):
    # it is kept (test_a_checkpoint_without_meta_json_is_named_kept_and_passed_over).
    ckpts = run / "checkpoints"
    shutil.copytree(ckpts / "step_000000004", ckpts / "step_000000001")
    (ckpts / "step_000000001" / "meta.json").unlink()
    os.replace(ckpts / "step_000000004", ckpts / ".old-step_000000004")
    (ckpts / ".tmp-step_000000004-99999").mkdir()
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.resume": "latest", "train.max_steps": 4})))
    assert not leftover.exists()
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000000001", "step_000000004"]
    _assert_same_weights(ckpts / "step_000000004", reference_run / "checkpoints" / "step_000000004")


def test_resaving_a_step_is_atomic(tmp_path, monkeypatch):
    """A kill while replacing step N (e.g. the final save after a periodic one) leaves a complete step N."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    save_checkpoint(accelerator, tmp_path, 5, {"save": 1})
    restore = _kill_rmtree_midway(monkeypatch, "meta.json")
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(accelerator, tmp_path, 5, {"save": 2})
    restore()
    # The new copy was in place before the old one was deleted.
    assert _steps(tmp_path) == [5]
    assert yaml.safe_load((tmp_path / "checkpoints" / "step_000000005" / "config.yaml").read_text()) == {"save": 2}
    # The half-deleted old copy was renamed before the deletion began, so only a `.deleting-` name is left, which
    # the sweep at the start of the next run removes.
    leftover = f".deleting-.old-step_000000005-{os.getpid()}"
    assert [p.name for p in (tmp_path / "checkpoints").glob(".deleting-*")] == [leftover]
    assert sweep_leftovers(tmp_path) == [leftover]
    save_checkpoint(accelerator, tmp_path, 5, {"save": 3})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000000005"]


def test_sweep_restores_the_old_copy_of_an_interrupted_resave(tmp_path):
    ckpts = tmp_path / "checkpoints"
    (ckpts / ".old-step_000000003").mkdir(parents=True)
    (ckpts / ".old-step_000000003" / "meta.json").write_text('{"step": 3}')
    (ckpts / ".old-step_000000005").mkdir()  # step 5 exists: this old copy is just a leftover
    (ckpts / "step_000000005").mkdir()
    (ckpts / "step_000000005" / "meta.json").write_text('{"step": 5}')
    assert sweep_leftovers(tmp_path) == [".old-step_000000003", ".old-step_000000005"]
    assert _steps(tmp_path) == [3, 5]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000000003", "step_000000005"]


# 4. Failed writes: disk full, read-only, a file in the way.


def _raised_while_handling(inner, outer):
    """`outer` raised while `inner` was being handled, so that only its context names the cause. torch.save on a
    full disk does this (seen on a full tmpfs): its zip writer's __exit__ fails on an assertion while the
    "basic_ios::clear" write error is on its way out."""
    try:
        try:
            raise inner
        except type(inner):
            raise outer  # noqa: B904 - the implicit context is what is being reproduced
    except type(outer) as e:
        return e


@pytest.mark.parametrize("failure, reason", [
    (OSError(errno.ENOSPC, "No space left on device"), "disk full (No space left on device"),
    (OSError(errno.EROFS, "Read-only file system"), "read-only file system (Read-only file system"),
    (RuntimeError("basic_ios::clear: iostream error"), "write failed (RuntimeError: basic_ios::clear"),
    (RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),
     "disk full (RuntimeError: Error while serializing: I/O error: No space left on device (os error 28);"),
    (_raised_while_handling(RuntimeError("basic_ios::clear: iostream error"), RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 193408 vs 193300")),
     "write failed (RuntimeError: basic_ios::clear: iostream error;"),
    (_raised_while_handling(OSError(errno.EROFS, "Read-only file system"), RuntimeError("serializer failed")),
     "read-only file system (Read-only file system)"),
])
def test_failed_checkpoint_write_removes_the_partial_checkpoint(tmp_path, image_dir, tiny_overrides, monkeypatch,
                                                                reference_run, failure, reason):
    run = tmp_path / "run"
    real_save_file, calls = ckpt_mod.save_file, []

    def failing_save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the EMA weights of the second checkpoint
            raise failure
        return real_save_file(*args, **kwargs)

    monkeypatch.setattr(ckpt_mod, "save_file", failing_save_file)
    with pytest.raises(StorageError) as e:
        train(load_config(None, tiny_overrides(run, image_dir)))
    step2 = run / "checkpoints" / "step_000000002"
    assert str(e.value).startswith(f"could not save checkpoint {run / 'checkpoints' / 'step_000000004'}: {reason}")
    assert str(e.value).endswith(f"The partial checkpoint was removed; the last complete checkpoint is {step2}")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000000002"]
    assert verify_checkpoint(step2) == 2 and not (run / "pipeline").exists()
    monkeypatch.setattr(ckpt_mod, "save_file", real_save_file)
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.resume": "latest"})))
    _assert_same_weights(run / "checkpoints" / "step_000000004", reference_run / "checkpoints" / "step_000000004")


def test_a_real_file_in_the_way_is_one_clear_line(tmp_path, image_dir, tiny_overrides, run_script):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file")
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *tiny_overrides(blocker / "run", image_dir))
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(
        f"error: cannot use {blocker / 'run'} as the run dir: not a directory (a file is in the way)"), err[-2000:]
    with pytest.raises(StorageError, match=rf"^cannot use {blocker} as the run dir: a file is in the way"):
        train(load_config(None, tiny_overrides(blocker, image_dir)))
    # A real checkpoints/ path blocked by a file: the save itself fails, and the run stops with the reason.
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("a file")
    with pytest.raises(StorageError, match=r"could not save checkpoint .*step_000000002: a file is in the way.*"
                                           r"the last complete checkpoint is none"):
        train(load_config(None, tiny_overrides(run, image_dir)))


def test_a_failed_write_outside_checkpoints_names_the_last_complete_checkpoint(tmp_path, image_dir, tiny_overrides,
                                                                               monkeypatch):
    import uvic.training.loop as loop_mod

    real_append, calls = loop_mod.append_metrics, []

    def append_on_a_full_disk(path, record):
        calls.append(1)
        if len(calls) == 3:  # the metrics line of step 3
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_append(path, record)

    monkeypatch.setattr(loop_mod, "append_metrics", append_on_a_full_disk)
    run = tmp_path / "run"
    with pytest.raises(StorageError) as e:
        train(load_config(None, tiny_overrides(run, image_dir)))
    assert str(e.value) == (f"training stopped: disk full (No space left on device: '{run / 'metrics.jsonl'}'). "
                            f"The last complete checkpoint is {run / 'checkpoints' / 'step_000000002'}")
    assert _steps(run) == [2] and verify_checkpoint(run / "checkpoints" / "step_000000002") == 2


def _export_on_a_full_disk(self, model, out_dir):
    """A task export that dies with ENOSPC after writing part of the pipeline."""
    (Path(out_dir) / "transformer").mkdir(parents=True)
    (Path(out_dir) / "transformer" / "config.json").write_text("{")
    raise OSError(errno.ENOSPC, "No space left on device", str(Path(out_dir) / "transformer" / "weights"))


def test_a_failed_final_export_names_the_checkpoint_and_leaves_no_partial_pipeline(tmp_path, image_dir,
                                                                                  tiny_overrides, monkeypatch):
    from uvic.training.runs import export
    from uvic.training.tasks.diffusion import DiffusionTask

    run = tmp_path / "run"
    real_export = DiffusionTask.export
    monkeypatch.setattr(DiffusionTask, "export", _export_on_a_full_disk)
    with pytest.raises(StorageError) as e:
        train(load_config(None, tiny_overrides(run, image_dir)))
    step4 = run / "checkpoints" / "step_000000004"
    assert str(e.value) == (
        f"training finished, but could not write the pipeline to {run / 'pipeline'}: disk full (No space left on "
        f"device: '{run / f'.tmp-pipeline-{os.getpid()}' / 'transformer' / 'weights'}'); the partial copy was "
        f"removed and {run / 'pipeline'} is not written. The last complete checkpoint is {step4} (export it with "
        f"train.py CONFIG --export {step4})")
    assert sorted(p.name for p in run.iterdir() if "pipeline" in p.name) == []
    assert verify_checkpoint(step4) == 4
    # Exporting again on a full disk leaves the existing pipeline as it was; with space, the export replaces it.
    monkeypatch.setattr(DiffusionTask, "export", real_export)
    export(step4, run / "pipeline")
    before = {p.relative_to(run): p.read_bytes() for p in (run / "pipeline").rglob("*") if p.is_file()}
    monkeypatch.setattr(DiffusionTask, "export", _export_on_a_full_disk)
    with pytest.raises(StorageError, match=r"; the partial copy was removed and .*/pipeline is left as it was$"):
        export(run / "checkpoints" / "step_000000002", run / "pipeline")
    assert {p.relative_to(run): p.read_bytes() for p in (run / "pipeline").rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in run.iterdir() if "pipeline" in p.name) == ["pipeline"]
    monkeypatch.setattr(DiffusionTask, "export", real_export)
    export(run / "checkpoints" / "step_000000002", run / "pipeline")
    after = {p.relative_to(run): p.read_bytes() for p in (run / "pipeline").rglob("*") if p.is_file()}
    assert after.keys() == before.keys() and after != before  # step 2's EMA weights, not step 4's


def test_export_onto_a_file_is_refused_and_the_file_kept(tmp_path, image_dir, tiny_overrides):
    from uvic.training.runs import export

    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.max_steps": 2})))
    (tmp_path / "out").write_text("not a pipeline")
    with pytest.raises(StorageError) as e:
        export(run, tmp_path / "out")
    assert str(e.value) == (f"could not write the pipeline to {tmp_path / 'out'}: a file is in the way (it is not a "
                            f"directory); nothing was written")
    assert (tmp_path / "out").read_text() == "not a pipeline"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "out", "run"]


# 5. Symlinks in checkpoints/ and checkpoints without hashes.


def test_rotation_and_sweep_unlink_symlinks_and_never_follow_them(tmp_path, image_dir, tiny_overrides):
    elsewhere = tmp_path / "someone_elses"
    elsewhere.mkdir()
    (elsewhere / "meta.json").write_text('{"step": 1}')
    (elsewhere / "precious.bin").write_bytes(b"keep me")
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.max_steps": 2})))
    ckpts = run / "checkpoints"
    (ckpts / "step_000000001").symlink_to(elsewhere, target_is_directory=True)  # a listed checkpoint, rotated out
    (ckpts / ".deleting-step_000000000-123").symlink_to(elsewhere, target_is_directory=True)  # swept at start-up
    train(load_config(None, tiny_overrides(run, image_dir, **{"train.keep_checkpoints": 1, "train.resume": "latest",
                                                              "train.max_steps": 4})))
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000000004"]
    assert sorted(p.name for p in elsewhere.iterdir()) == ["meta.json", "precious.bin"]
    assert (elsewhere / "precious.bin").read_bytes() == b"keep me"


def test_a_checkpoint_without_hashes_is_refused(tmp_path, image_dir, tiny_overrides):
    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir)))
    step2, step4 = (p for _, p in list_checkpoints(run))
    (step4 / "meta.json").write_text(json.dumps({"step": 4}))
    with pytest.raises(CheckpointError) as e:
        train(load_config(None, tiny_overrides(run, image_dir, **{"train.resume": "latest", "train.max_steps": 6})))
    assert str(e.value) == (f"checkpoint {step4} failed verification: {step4 / 'meta.json'} records no SHA-256 "
                            f"hashes, so its files cannot be checked; the newest checkpoint of this run that verifies "
                            f"is {step2} (use that path instead, e.g. with --resume)")


def test_sampling_a_run_retries_when_the_live_run_rotates_the_chosen_checkpoint(tmp_path, image_dir, tiny_overrides,
                                                                              monkeypatch):
    from uvic.training import runs
    from uvic.training.checkpoint import remove_dir

    run = tmp_path / "run"
    train(load_config(None, tiny_overrides(run, image_dir)))
    step2, step4 = (p for _, p in list_checkpoints(run))
    real_load, calls = runs.load_model_weights, []

    def rotated_while_loading(model, ckpt, name):
        calls.append(ckpt)
        if len(calls) == 1:
            remove_dir(ckpt)  # what the live run's rotation does between the choice and the read
        return real_load(model, ckpt, name)

    monkeypatch.setattr(runs, "load_model_weights", rotated_while_loading)
    pipe = runs.load_pipeline(run)
    assert calls == [step4, step2]
    ema = load_file(str(step2 / "ema.safetensors"))
    for k, v in pipe.transformer.state_dict().items():
        torch.testing.assert_close(v, ema[k], rtol=0, atol=0)


def test_every_piece_of_training_state_round_trips_through_data_only_files(tmp_path):
    """Model, optimizer, LR schedule, the run's generator, the loss scaler, accelerate's step counter and the global
    Python / NumPy / torch generators come back exactly, and every state file loads with weights_only=True."""
    import random

    from accelerate import Accelerator

    from uvic.training.checkpoint import TrainingState, load_checkpoint
    from uvic.training.rng import ShardedRNG

    def build():
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model, opt = accelerator.prepare(model, opt)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        rng = ShardedRNG(7, 0, 1, "cpu")
        return accelerator, TrainingState(model, opt, {"lr_scheduler": sched, "rng": rng})

    accelerator, state = build()
    for _ in range(3):
        state.model(torch.randn(4, 3)).sum().backward()
        state.optimizer.step()
        state.objects["lr_scheduler"].step()
    state.objects["rng"].randn(5)
    accelerator.scaler.scale(torch.ones(1))  # the scale exists once used
    accelerator.scaler.update(2.0**6)
    accelerator.step = 3
    ckpt = save_checkpoint(accelerator, tmp_path, 3, {"c": 1}, state=state)
    for name in ("optimizer.bin", "training_state.pt", "random_states_0.pt"):
        torch.load(ckpt / name, weights_only=True)
    expected = (torch.rand(3), np.random.rand(3), random.random(), state.objects["rng"].rand(4),
                {k: v.clone() for k, v in state.model.state_dict().items()})

    accelerator2, state2 = build()  # fresh objects, other global generator states
    random.seed(99)
    np.random.seed(99)
    assert load_checkpoint(accelerator2, ckpt, state=state2) == 3
    assert accelerator2.step == 3 and accelerator2.scaler.get_scale() == 2.0**6
    assert state2.objects["lr_scheduler"].last_epoch == 3
    assert state2.optimizer.state_dict()["state"][0]["step"] == 3
    got = (torch.rand(3), np.random.rand(3), random.random(), state2.objects["rng"].rand(4), state2.model.state_dict())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]
    assert torch.equal(got[3], expected[3])
    for k, v in expected[4].items():
        assert torch.equal(got[4][k], v)


def test_a_checkpoint_without_meta_json_is_named_kept_and_passed_over(tmp_path, image_dir, tiny_overrides,
                                                                      run_script):
    """A step dir whose meta.json is lost cannot be verified, so it is never resumed or exported; it is never
    deleted either (it was swept as a "leftover"): the export names the step it took and the newer one it passed
    over, a resume names it and moves it aside with the rest of the abandoned branch, and a save of its step sets
    it aside instead of replacing it."""
    run = tmp_path / "run"
    overrides = tiny_overrides(run, image_dir, **{"train.max_steps": 4})
    train(load_config(None, overrides))
    ckpts = run / "checkpoints"
    lost = ckpts / "step_000000004"
    (lost / "meta.json").unlink()
    kept = {p.name: p.read_bytes() for p in lost.iterdir()}
    step2 = ckpts / "step_000000002"

    assert sweep_leftovers(run) == [] and lost.is_dir()
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *overrides, "--export")
    assert code == 0, err[-2000:]
    assert f"{lost} has no meta.json (lost or removed?): it cannot be verified, so it is skipped, and kept; " \
           f"using {step2}" in err
    assert (f"exported step 2 ({step2}; the latest checkpoint; passed over the newer {lost}, which has no "
            f"meta.json) to {run / 'pipeline'}") in err
    assert {p.name: p.read_bytes() for p in lost.iterdir()} == kept

    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *overrides, "--resume")
    assert code == 0, err[-2000:]
    assert f"{lost} has no meta.json (lost or removed?)" in err
    (aside,) = (ckpts / "abandoned").iterdir()
    assert aside.name.startswith("after_step_000000002_")
    assert {p.name: p.read_bytes() for p in (aside / "step_000000004").iterdir()} == kept
    assert verify_checkpoint(lost) == 4  # trained again from step 2: a complete step 4

    # A save of a step whose dir has no meta.json (there without a resume past it) sets that dir aside.
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    other = tmp_path / "other"
    (other / "checkpoints" / "step_000000005").mkdir(parents=True)
    (other / "checkpoints" / "step_000000005" / "precious.bin").write_bytes(b"keep me")
    save_checkpoint(accelerator, other, 5, {"save": 1})
    assert verify_checkpoint(other / "checkpoints" / "step_000000005") == 5
    (aside,) = (other / "checkpoints" / "abandoned").iterdir()
    assert (aside / "step_000000005" / "precious.bin").read_bytes() == b"keep me"
