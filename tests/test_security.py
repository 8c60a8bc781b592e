"""Nothing loaded from a file a user is handed runs code (docs/security.md).

Every loader a user can reach gets a file whose pickle payload would create a marker file when unpickled in full
(`os.system("touch MARKER")`, a `__reduce__` payload). Each test asserts a clean one-line error and that the marker
does not exist. `test_the_payload_runs_when_unpickled_in_full` shows the payload is live, so a loader that
unpickled it would create the marker.
"""

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from uvic.config import load_config
from uvic.errors import CheckpointError
from uvic.io import UnsafeFileError
from uvic.training import train
from uvic.training.checkpoint import list_checkpoints


ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class Payload:
    """Unpickled in full, runs `touch marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "the payload ran"


def _one_line(message):
    assert "\n" not in str(message), message
    return str(message)


def _rehash(ckpt):
    """Record the current SHA-256 of every file in `meta.json`, as the author of a hostile checkpoint would."""
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["sha256"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                      for p in sorted(ckpt.iterdir()) if p.is_file() and p.name != "meta.json"}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def test_the_payload_runs_when_unpickled_in_full(tmp_path):
    target = tmp_path / "ran"
    pickle.loads(pickle.dumps({"x": Payload(target)}))
    assert target.exists()
    target.unlink()
    torch.save({"x": Payload(target)}, tmp_path / "f.pt")
    torch.load(tmp_path / "f.pt", weights_only=False)
    assert target.exists()


# Training checkpoints: resume, export, sampling from a run or checkpoint dir.


_TRAINED = {}


@pytest.fixture
def trained(tmp_path_factory, tiny_overrides):
    """(run dir, image dir, tiny_overrides) of a 2-step tiny run with one checkpoint, trained once per session
    (tests copy it)."""
    from PIL import Image

    if not _TRAINED:
        root = tmp_path_factory.mktemp("trained")
        images = root / "images"
        images.mkdir()
        rng = np.random.default_rng(0)
        for i in range(8):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(images / f"{i}.png")
        train(load_config(None, tiny_overrides(root / "run", images, **{"train.max_steps": 2})))
        _TRAINED.update(run=root / "run", images=images)
    return _TRAINED["run"], _TRAINED["images"], tiny_overrides


@pytest.fixture
def hostile_run(trained, tmp_path):
    """(run dir, its checkpoint, overrides to resume it to step 4) of a copy of the trained run."""
    run = tmp_path / "run"
    shutil.copytree(trained[0], run)
    ((_, ckpt),) = list_checkpoints(run)
    return run, ckpt, trained[2](run, trained[1], **{"train.max_steps": 4})


@pytest.mark.parametrize("name", ["training_state.pt", "optimizer.bin", "random_states_0.pt",
                                  "custom_checkpoint_0.pkl", "random_states_0.pkl"])
def test_resume_never_unpickles(hostile_run, marker, name):
    run, ckpt, overrides = hostile_run
    if name.endswith(".pkl"):  # the files accelerate's load_state unpickles
        with open(ckpt / name, "wb") as f:
            pickle.dump({"state": Payload(marker)}, f)
    else:
        torch.save({"state": Payload(marker)}, ckpt / name)
    _rehash(ckpt)
    if name.endswith(".pkl"):  # never read: the run resumes from the data-only files
        train(load_config(None, [*overrides, f"train.resume={ckpt}"]))
        assert list_checkpoints(run)[-1][0] == 4
        return
    with pytest.raises(CheckpointError) as e:
        train(load_config(None, [*overrides, f"train.resume={ckpt}"]))
    assert _one_line(e.value).startswith(f"checkpoint {ckpt} is unreadable or does not match this run: ")
    assert "never loaded because unpickling them can run code" in str(e.value) and name in str(e.value)


def test_resume_cli_is_one_line(hostile_run, marker, run_script):
    run, ckpt, overrides = hostile_run
    torch.save({"state": Payload(marker)}, ckpt / "training_state.pt")
    _rehash(ckpt)
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *overrides, "--resume", ckpt)
    assert code == 1 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint {ckpt} is unreadable") and "GLOBAL posix.system" in last


@pytest.mark.parametrize("how", ["export", "load_pipeline run", "load_pipeline checkpoint"])
def test_weights_in_a_checkpoint_are_never_unpickled(hostile_run, marker, how):
    from uvic.training.runs import export, load_pipeline

    run, ckpt, _ = hostile_run
    torch.save({"pos_embed": Payload(marker)}, ckpt / "ema.safetensors")  # a pickle under a safetensors name
    _rehash(ckpt)
    with pytest.raises(ValueError) as e:
        if how == "export":
            export(ckpt, run / "exported")
        else:
            load_pipeline(run if how.endswith("run") else ckpt)
    assert _one_line(e.value).startswith(f"cannot load {ckpt / 'ema.safetensors'}: SafetensorError")


def test_a_python_tag_in_a_checkpoint_config_is_refused(hostile_run, marker):
    from uvic.training.runs import export

    run, ckpt, _ = hostile_run
    (ckpt / "config.yaml").write_text(f"task: !!python/object/apply:os.system ['touch {marker}']\n")
    _rehash(ckpt)
    with pytest.raises(ValueError) as e:
        export(ckpt, run / "exported")
    assert _one_line(e.value).startswith(f"cannot read the config of checkpoint {ckpt}: could not determine a "
                                         f"constructor for the tag")


def test_sample_cli_on_a_hostile_checkpoint_is_one_line(hostile_run, marker, run_script):
    run, ckpt, _ = hostile_run
    torch.save({"pos_embed": Payload(marker)}, ckpt / "ema.safetensors")
    _rehash(ckpt)
    code, _, err = run_script("sample.py", run, "--grid", run / "g.png", "--num-images", "1", "--steps", "1")
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"sample.py: error: cannot load {ckpt / 'ema.safetensors'}")


def test_pickled_weights_in_a_pipeline_dir_are_refused(trained, tmp_path, marker):
    from uvic.pipelines.sampling import load_pretrained

    pipe = tmp_path / "pipeline"
    shutil.copytree(trained[0] / "pipeline", pipe)
    (weights,) = (pipe / "transformer").glob("*.safetensors")
    weights.unlink()  # diffusers then reads the .bin with torch.load(weights_only=True)
    torch.save({"pos_embed": Payload(marker)}, pipe / "transformer" / "diffusion_pytorch_model.bin")
    with pytest.raises(UnsafeFileError) as e:
        load_pretrained(pipe)
    bin_file = pipe / "transformer" / "diffusion_pytorch_model.bin"
    assert _one_line(e.value).startswith(f"the transformer of {pipe}: weights file {bin_file} holds objects other "
                                         "than tensors")


def test_a_run_is_readable_by_whoever_can_read_its_config(trained):
    """Every file of a run has the mode of its config.yaml (0666 less the umask), the safetensors files included
    (safetensors writes 0600), so a colleague who can read the run can sample from it."""
    run = trained[0]
    mode = (run / "config.yaml").stat().st_mode & 0o777
    weights = sorted(run.rglob("*.safetensors"))
    assert {p.relative_to(run).as_posix() for p in weights} >= {"pipeline/transformer/diffusion_pytorch_model.safetensors"}
    assert any(p.parent.parent.name == "checkpoints" for p in weights)
    assert {p.relative_to(run).as_posix(): oct(p.stat().st_mode & 0o777) for p in run.rglob("*") if p.is_file()} == {
        p.relative_to(run).as_posix(): oct(mode) for p in run.rglob("*") if p.is_file()}


# Configs that describe another (far larger) model than their weights: refused before anything is allocated.


def _refused_quickly(call, message):
    """`call()` raises a one-line ValueError starting with `message`, well within a second (the model is built on
    the meta device and its construction stops early, so nothing of its size is ever allocated)."""
    import time

    start = time.perf_counter()
    with pytest.raises(ValueError) as e:
        call()
    assert time.perf_counter() - start < 5
    assert _one_line(e.value).startswith(message), e.value
    return str(e.value)


@pytest.mark.parametrize("how", ["export", "load_pipeline run", "load_pipeline checkpoint"])
def test_a_checkpoint_config_describing_a_far_larger_model_is_refused(hostile_run, how):
    from uvic.training.runs import export, load_pipeline

    run, ckpt, _ = hostile_run
    config = (ckpt / "config.yaml").read_text()
    assert "  embed_dim: 16\n" in config
    (ckpt / "config.yaml").write_text(config.replace("  embed_dim: 16\n", "  embed_dim: 1000000\n"))
    _rehash(ckpt)  # the hostile author recomputes the hashes
    call = (lambda: export(ckpt, run / "exported")) if how == "export" else (
        lambda: load_pipeline(run if how.endswith("run") else ckpt))
    message = _refused_quickly(call, f"checkpoint {ckpt}: its config describes a model whose ")
    assert message.endswith("but its weights hold (1, 17, 16); the config does not belong to these weights")
    assert not (run / "exported").exists()


def test_a_checkpoint_config_describing_a_million_layers_is_refused(hostile_run, run_script):
    run, ckpt, _ = hostile_run
    config = (ckpt / "config.yaml").read_text()
    (ckpt / "config.yaml").write_text(config.replace("  depth: 2\n", "  depth: 1000000\n"))
    _rehash(ckpt)
    code, _, err = run_script("sample.py", run, "--grid", run / "g.png", "--num-images", "1", "--steps", "1")
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"sample.py: error: checkpoint {ckpt}: its config describes a "
                                                   "model of more than ")


@pytest.mark.parametrize("key,value", [("embed_dim", 1000000), ("depth", 1000000)])
def test_a_pipeline_config_describing_a_far_larger_model_is_refused(trained, tmp_path, key, value):
    from uvic.pipelines.sampling import load_pretrained

    pipe = tmp_path / "pipeline"
    shutil.copytree(trained[0] / "pipeline", pipe)
    config = json.loads((pipe / "transformer" / "config.json").read_text())
    (pipe / "transformer" / "config.json").write_text(json.dumps({**config, key: value}))
    _refused_quickly(lambda: load_pretrained(pipe), f"the transformer of {pipe}: its config describes a model ")


# FID weights, with and without a checksum.


@pytest.mark.parametrize("checked", [False, True])
def test_fid_weights_are_never_unpickled(tmp_path, marker, checked):
    from uvic.fid import InceptionExtractor

    weights = tmp_path / "pt_inception.pth"
    torch.save({"fc.weight": Payload(marker)}, weights)
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()  # a checksum that passes: the file's own
    with pytest.raises(UnsafeFileError) as e:
        InceptionExtractor(weights, sha256=digest if checked else None)
    assert _one_line(e.value).startswith(f"FID Inception weights {weights} holds objects other than tensors")


def test_fid_cli_hostile_weights_one_line(tmp_path, marker):
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(2):
        Image.fromarray(np.full((8, 8, 3), i * 50, dtype=np.uint8)).save(folder / f"{i}.png")
    torch.save({"fc.weight": Payload(marker)}, tmp_path / "w.pth")
    r = subprocess.run([sys.executable, "-m", "uvic.fid", "stats", str(folder), "--out", str(tmp_path / "o.npz"),
                        "--weights", str(tmp_path / "w.pth"), "--weights-sha256", "none", "--device", "cpu"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: FID Inception weights {tmp_path / 'w.pth'} holds")


# CIFAR-10 batches, in training and in FID.


def _hostile_cifar(root, marker):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 1], b"x": Payload(marker)}, f,
                        protocol=2)
    return folder


def test_cifar10_for_training_refuses_a_payload(tmp_path, marker):
    from uvic.data import Cifar10

    folder = _hostile_cifar(tmp_path, marker)
    with pytest.raises(UnsafeFileError) as e:
        Cifar10(tmp_path, download=False)
    assert _one_line(e.value) == (f"CIFAR-10 batch {folder / 'data_batch_1'} holds objects other than plain data "
                                  f"(refused global posix.system); it was not loaded, because unpickling them could "
                                  f"run code")


def test_cifar10_for_fid_refuses_a_payload(tmp_path, marker):
    folder = _hostile_cifar(tmp_path, marker)
    r = subprocess.run([sys.executable, "-m", "uvic.fid", "stats", f"cifar10-test:{tmp_path}", "--out",
                        str(tmp_path / "o.npz"), "--weights", str(tmp_path / "none.pth"), "--device", "cpu"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: CIFAR-10 batch {folder / 'test_batch'} holds objects other than plain data (refused global "
        f"posix.system); it was not loaded, because unpickling them could run code")


# Official checkpoint loaders.


def test_official_uvit_checkpoint_refuses_a_payload(tmp_path, marker):
    from uvic.models.uvit import uvit_from_official

    torch.save({"pos_embed": Payload(marker)}, tmp_path / "nnet_ema.pth")
    config = {"name": "uvit", "img_size": 8, "patch_size": 2, "embed_dim": 16, "depth": 2, "num_heads": 2}
    with pytest.raises(UnsafeFileError) as e:
        uvit_from_official(config, tmp_path / "nnet_ema.pth")
    assert _one_line(e.value).startswith(f"checkpoint {tmp_path / 'nnet_ema.pth'} holds objects other than tensors")


def test_official_cogformer_checkpoint_refuses_a_payload(tmp_path, marker):
    from uvic.lm.official import cogformer_from_official

    torch.save({"model_cfg": {}, "model": {"x": Payload(marker)}}, tmp_path / "ckpt.pt")
    with pytest.raises(UnsafeFileError) as e:
        cogformer_from_official(tmp_path / "ckpt.pt")
    assert _one_line(e.value).endswith("load it with cogformer_from_official(path, trust_pickle=True)")


def test_official_autoencoder_refuses_a_payload(tmp_path, marker):
    from uvic.models.autoencoder import load_ldm_autoencoder

    torch.save({"state_dict": {"x": Payload(marker)}}, tmp_path / "autoencoder_kl.pth")
    with pytest.raises(UnsafeFileError) as e:
        load_ldm_autoencoder(tmp_path / "autoencoder_kl.pth")
    assert _one_line(e.value).startswith(f"autoencoder weights {tmp_path / 'autoencoder_kl.pth'} holds objects")


def test_clip_checkpoint_refuses_a_payload(tmp_path, marker):
    from uvic.models.text_encoder import load_clip_state_dict

    torch.save({"x": Payload(marker)}, tmp_path / "clip.pt")
    with pytest.raises(UnsafeFileError) as e:
        load_clip_state_dict(tmp_path / "clip.pt")
    assert _one_line(e.value).startswith(f"CLIP checkpoint {tmp_path / 'clip.pt'} holds objects other than tensors")
