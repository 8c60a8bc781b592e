"""sample.py and the folder writer with bad input: every case is one clear line and a
non-zero exit before any sampling starts; a damaged file already in --out-dir is not counted as done."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_t2i_config

import uvic.pipelines.sampling as sampling
from uvic.config import DiffusionConfig
from uvic.data.images import check_image
from uvic.models import UViTModel
from uvic.pipelines import UViCPipeline
from uvic.pipelines.sampling import check_output, sample_to_folder
from uvic.schedulers import build_scheduler


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pipe_dir(tmp_path_factory):
    """A tiny unconditional UViCPipeline saved to disk."""
    torch.manual_seed(0)
    model = UViTModel(img_size=8, patch_size=2, in_chans=3, embed_dim=16, depth=2, num_heads=2)
    path = tmp_path_factory.mktemp("pipe") / "pipe"
    UViCPipeline(model.eval(), build_scheduler("dpm_solver", DiffusionConfig())).save_pretrained(path)
    return path


@pytest.fixture
def no_sampling(monkeypatch):
    """Make any sampling fail loudly: validation must stop the CLI first."""

    def refuse(*args, **kwargs):
        raise AssertionError("sampling started before the input was validated")

    monkeypatch.setattr(sampling, "generate", refuse)
    monkeypatch.setattr(sampling, "sample_to_folder", refuse)


def _sample_cli(monkeypatch, capsys, *args):
    """Run sample.py in this process; returns (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["sample.py", *map(str, args)])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "sample.py"), run_name="__main__")
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--num-images", "--steps", "--batch-size"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_counts_below_one_are_refused(pipe_dir, tmp_path, monkeypatch, capsys, no_sampling, flag, value):
    code, err = _sample_cli(monkeypatch, capsys, pipe_dir, "--grid", tmp_path / "g.png", flag, value)
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"sample.py: error: argument {flag}: must be >= 1, got {int(value)}")


def test_unknown_grid_extension_is_refused_before_sampling(pipe_dir, tmp_path, monkeypatch, capsys, no_sampling):
    code, err = _sample_cli(monkeypatch, capsys, pipe_dir, "--grid", tmp_path / "grid.pgn")
    assert code == 2
    assert err.strip().splitlines()[-1].startswith(
        "sample.py: error: cannot write a grid as 'grid.pgn': unknown image extension '.pgn'; use one of ")
    assert ".png" in err.strip().splitlines()[-1]


@pytest.mark.parametrize("mode", ["--grid", "--out-dir"])
def test_unwritable_output_is_refused_before_sampling(pipe_dir, tmp_path, monkeypatch, capsys, no_sampling, mode):
    blocker = tmp_path / "a_file"
    blocker.write_text("in the way")
    # The grid's folder is the file itself; the out-dir would be inside the file.
    target, folder, reason = ((blocker / "grid.png", blocker, "a file is in the way") if mode == "--grid" else
                              (blocker / "samples", blocker / "samples", "not a directory"))
    code, err = _sample_cli(monkeypatch, capsys, pipe_dir, mode, target)
    assert code == 2
    assert err.strip().splitlines()[-1].startswith(f"sample.py: error: cannot write to {folder}: {reason}")


def test_a_grid_path_that_is_a_directory_is_refused_before_sampling(pipe_dir, tmp_path, monkeypatch, capsys,
                                                                   no_sampling):
    (tmp_path / "grid.png").mkdir()
    code, err = _sample_cli(monkeypatch, capsys, pipe_dir, "--grid", tmp_path / "grid.png")
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"sample.py: error: cannot write the grid to {tmp_path / 'grid.png'}: it is a directory")


@pytest.mark.parametrize("kind", ["directory", "binary", "missing"])
def test_an_unreadable_prompts_file_is_refused_before_sampling(pipe_dir, tmp_path, monkeypatch, capsys, no_sampling,
                                                               kind):
    f = tmp_path / "prompts.txt"
    if kind == "directory":
        f.mkdir()
    elif kind == "binary":
        f.write_bytes(b"\xff\xfe\x00not text")
    reason = {"directory": f"is a directory (Is a directory: '{f}')", "binary": "not UTF-8 text (",
              "missing": f"no such file or directory (No such file or directory: '{f}')"}[kind]
    code, err = _sample_cli(monkeypatch, capsys, pipe_dir, "--grid", tmp_path / "g.png", "--prompts-file", f)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"sample.py: error: cannot read --prompts-file {f}: {reason}")


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_guidance_scale_is_refused(pipe_dir, tmp_path, monkeypatch, capsys, no_sampling, value):
    code, err = _sample_cli(monkeypatch, capsys, pipe_dir, "--grid", tmp_path / "g.png", "--guidance-scale", value)
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"sample.py: error: argument --guidance-scale: must be a finite number, got {value}")


def test_read_only_output_is_refused_before_sampling(pipe_dir, tmp_path, monkeypatch, capsys, no_sampling):
    import errno

    def read_only(self, data):
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "write_bytes", read_only)
    code, err = _sample_cli(monkeypatch, capsys, pipe_dir, "--out-dir", tmp_path / "out")
    assert code == 2 and f"error: cannot write to {tmp_path / 'out'}: read-only file system" in err


def test_prompt_for_an_unconditional_pipeline_is_refused(pipe_dir, tmp_path, monkeypatch, capsys, no_sampling):
    code, err = _sample_cli(monkeypatch, capsys, pipe_dir, "--grid", tmp_path / "g.png", "--prompt", "a cat")
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"sample.py: error: {pipe_dir} is not a text-to-image pipeline; --prompt/--prompts-file/--features do not "
        f"apply")


@pytest.mark.parametrize("damage", ["truncated weights", "broken model_index.json"])
def test_corrupt_pipeline_dir_is_one_line(pipe_dir, tmp_path, damage):
    import shutil

    broken = tmp_path / "pipe"
    shutil.copytree(pipe_dir, broken)
    if damage == "truncated weights":  # found before loading, when the weights' shapes are read from the header
        (weights,) = (broken / "transformer").glob("*.safetensors")
        weights.write_bytes(weights.read_bytes()[:-100])
        expected = f"sample.py: error: the transformer of {broken}: cannot load {weights}: SafetensorError"
    else:
        (broken / "model_index.json").write_text('{"_class_name": "UViCPipeline", ')
        expected = f"sample.py: error: {broken / 'model_index.json'} is unreadable (JSONDecodeError"
    # A real process: the whole stderr is checked for a traceback.
    r = subprocess.run([sys.executable, "sample.py", str(broken), "--grid", str(tmp_path / "g.png")], cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(expected)
    assert not (tmp_path / "g.png").exists()


def test_check_output_accepts_good_paths(tmp_path):
    check_output(grid=tmp_path / "new" / "grid.JPG")
    check_output(out_dir=tmp_path / "samples")
    assert (tmp_path / "new").is_dir() and sorted(os.listdir(tmp_path / "samples")) == []


# 9. Files already in --out-dir.


def test_damaged_files_are_generated_again_and_stale_temporaries_removed(pipe_dir, tmp_path, monkeypatch):
    pipe = UViCPipeline.from_pretrained(pipe_dir)
    pipe.set_progress_bar_config(disable=True)
    out = tmp_path / "out"
    kw = {"seed": 3, "batch_size": 1, "num_inference_steps": 2}  # batch 1: the same computation on a re-run
    assert sample_to_folder(pipe, out, 4, **kw) == 4
    first = {p.name: p.read_bytes() for p in sorted(out.glob("*.png"))}
    data = (out / "000001.png").read_bytes()
    (out / "000001.png").write_bytes(data[: len(data) // 2])  # truncated
    (out / "000002.png").write_bytes(b"")  # 0 bytes
    inode0 = (out / "000000.png").stat().st_ino
    (out / ".000003.png.tmp99999").write_bytes(b"half")  # left by a killed run
    (out / ".000009.png.tmp99999").write_bytes(b"half")  # not an image of this job: left alone
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(f"replace {Path(b).name}"), real_replace(a, b))[1])
    assert sample_to_folder(pipe, out, 4, **kw) == 2
    # The two damaged files were generated again (identical to the first run), the others untouched.
    assert {p.name: p.read_bytes() for p in sorted(out.glob("*.png"))} == first
    assert (out / "000000.png").stat().st_ino == inode0
    assert not (out / ".000003.png.tmp99999").exists() and (out / ".000009.png.tmp99999").exists()
    # Each file reached the disk before its rename: fsync, replace, per file, then the folder's fsync.
    assert events == ["fsync", "replace 000001.png", "fsync", "fsync", "replace 000002.png", "fsync"]


def test_folder_writer_checks_its_counts(pipe_dir, tmp_path):
    pipe = UViCPipeline.from_pretrained(pipe_dir)
    with pytest.raises(ValueError, match="num_images must be >= 1, got 0"):
        sample_to_folder(pipe, tmp_path / "o", 0)
    with pytest.raises(ValueError, match="num_inference_steps must be >= 1, got 4 and 0"):
        sample_to_folder(pipe, tmp_path / "o", 2, batch_size=4, num_inference_steps=0)
    assert not list((tmp_path / "o").glob("*.png"))


# A write that fails while sampling (disk full): one line, no partial file, and --out-dir resumes.


@pytest.fixture
def disk_full_on_save(monkeypatch):
    """PIL's save fails with ENOSPC from its `n`-th call on (set `.n`), after writing a few bytes."""
    import errno

    from PIL import Image

    real_save, state = Image.Image.save, {"calls": 0, "n": 1}

    def save(self, fp, *args, **kwargs):
        state["calls"] += 1
        if state["calls"] >= state["n"]:  # a partial file, as a full disk leaves it
            if isinstance(fp, (str, os.PathLike)):
                Path(fp).write_bytes(b"\x89PNG\r\n")
            else:
                fp.write(b"\x89PNG\r\n")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, fp, *args, **kwargs)

    monkeypatch.setattr(Image.Image, "save", save)
    return state


def test_disk_full_in_out_dir_is_one_line_and_a_rerun_finishes(pipe_dir, tmp_path, monkeypatch, capsys,
                                                                disk_full_on_save):
    out = tmp_path / "out"
    args = (pipe_dir, "--out-dir", out, "--num-images", 4, "--steps", 1, "--batch-size", 2)
    disk_full_on_save["n"] = 3  # images 0 and 1 are written, image 2 fails
    code, err = _sample_cli(monkeypatch, capsys, *args)
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"error: sampling stopped: disk full (No space left on device); the images already in {out} are complete: "
        f"run the same command again to finish")
    assert sorted(os.listdir(out)) == ["000000.png", "000001.png"]  # no partial file or temporary
    inodes = [(out / f"00000{i}.png").stat().st_ino for i in range(2)]
    disk_full_on_save["n"] = 10**9
    monkeypatch.setattr(sys, "argv", ["sample.py", *map(str, args)])
    runpy.run_path(str(ROOT / "sample.py"), run_name="__main__")
    assert sorted(os.listdir(out)) == [f"{i:06d}.png" for i in range(4)]
    assert [(out / f"00000{i}.png").stat().st_ino for i in range(2)] == inodes  # kept, not generated again
    assert all(check_image(out / f"{i:06d}.png") is None for i in range(4))


def test_disk_full_while_writing_the_grid_leaves_no_partial_grid(pipe_dir, tmp_path, monkeypatch, capsys,
                                                                 disk_full_on_save):
    code, err = _sample_cli(monkeypatch, capsys, pipe_dir, "--grid", tmp_path / "g.png", "--num-images", 2,
                            "--steps", 1)
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "error: sampling stopped: disk full (No space left on device)"
    assert os.listdir(tmp_path) == []


# Arguments that can only fail late are checked before any sampling.


def test_a_grid_too_large_to_open_is_refused_before_sampling(pipe_dir, tmp_path, monkeypatch, capsys, no_sampling):
    code, err = _sample_cli(monkeypatch, capsys, pipe_dir, "--grid", tmp_path / "g.png", "--grid-scale", 100000)
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    # 64 images of 8x8 in an 8 x 8 grid, each enlarged 100000 times, with 2-pixel padding.
    side = 8 * (8 * 100000 + 2) + 2
    assert last.startswith(f"sample.py: error: a grid of 64 images at scale 100000 would be {side} x {side} pixels")
    assert last.endswith("lower --grid-scale or --num-images")
    assert not (tmp_path / "g.png").exists()


@pytest.mark.parametrize("seed, n, message", [
    (2**64 - 1, 64, f"--seed {2**64 - 1} + --num-images 64 exceeds the largest seed, 2**64 - 1"),
    (2**64 - 4, 5, f"--seed {2**64 - 4} + --num-images 5 exceeds the largest seed, 2**64 - 1"),
    (-1, 4, "argument --seed: must be >= 0, got -1"),
])
def test_seeds_past_the_generator_range_are_refused_before_sampling(pipe_dir, tmp_path, monkeypatch, capsys,
                                                                    no_sampling, seed, n, message):
    code, err = _sample_cli(monkeypatch, capsys, pipe_dir, "--out-dir", tmp_path / "o", "--seed", seed,
                            "--num-images", n)
    assert code == 2 and err.strip().splitlines()[-1] == f"sample.py: error: {message}"


def test_the_largest_seed_itself_samples(pipe_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["sample.py", str(pipe_dir), "--grid", str(tmp_path / "g.png"), "--seed",
                                      str(2**64 - 2), "--num-images", "2", "--steps", "1", "--quiet"])
    runpy.run_path(str(ROOT / "sample.py"), run_name="__main__")
    assert capsys.readouterr().out.strip() == str(tmp_path / "g.png")


def test_an_image_name_taken_by_a_directory_is_named_before_sampling(pipe_dir, tmp_path, monkeypatch, capsys,
                                                                     no_sampling):
    out = tmp_path / "out"
    (out / "000002.png").mkdir(parents=True)
    code, err = _sample_cli(monkeypatch, capsys, pipe_dir, "--out-dir", out, "--num-images", 4)
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"sample.py: error: cannot write image 2 to {out / '000002.png'}: it is a directory; move it out of the way")


def test_the_folder_writer_names_a_directory_in_the_way(pipe_dir, tmp_path):
    pipe = UViCPipeline.from_pretrained(pipe_dir)
    (tmp_path / "o" / "000001.png").mkdir(parents=True)
    with pytest.raises(OSError, match=r"cannot write image 1 to .*000001\.png: it is a directory"):
        sample_to_folder(pipe, tmp_path / "o", 2, num_inference_steps=1)
    assert list((tmp_path / "o").iterdir()) == [tmp_path / "o" / "000001.png"]  # refused before sampling


# Progress on stderr.


def _bar_updates(stderr):
    """The progress-bar states written to stderr, e.g. "sampling: 60%|###   | 3/5 [00:01<00:00, 2.9img/s]"."""
    return [u for u in stderr.replace("\r", "\n").splitlines() if "img/s" in u or "s/img" in u]


def _check_counts(updates, n, every_batch=True):
    # Images done / total (after each batch of 2 when tqdm draws every update), the rate and the time left ("<00:00").
    done = [u.split("|")[-1].split()[0] for u in updates]
    assert done[0] == f"0/{n}" and done[-1] == f"{n}/{n}", updates
    assert not every_batch or f"2/{n}" in done, updates
    assert all("<" in u for u in updates)


def test_the_out_dir_progress_bar_is_on_stderr_and_log_lines_stay_off_it(pipe_dir, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "sample.py", str(pipe_dir), "--out-dir", str(out), "--num-images", "5",
                        "--batch-size", "2", "--steps", "1"], cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "TQDM_MININTERVAL": "0"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    updates = _bar_updates(r.stderr)
    _check_counts(updates, 5)
    assert "/5" not in r.stdout
    assert "the first batch includes one-time compilation" in r.stderr
    # The log line after the bar starts a line of its own.
    assert any(line.endswith(f"process 0 wrote 5 images to {out}") and " INFO " in line and "img/s" not in line
               for line in r.stderr.splitlines())


@pytest.mark.parametrize("quiet", [False, True])
def test_the_grid_progress_bar_and_quiet(pipe_dir, tmp_path, monkeypatch, capsys, quiet):
    from diffusers.utils import logging as diffusers_logging

    monkeypatch.setattr(diffusers_logging, "_tqdm_active", True)  # --quiet turns diffusers' bars off: restored after
    monkeypatch.setattr(sys, "argv", ["sample.py", str(pipe_dir), "--grid", str(tmp_path / "g.png"), "--num-images",
                                      "4", "--batch-size", "2", "--steps", "1", *(["--quiet"] if quiet else [])])
    runpy.run_path(str(ROOT / "sample.py"), run_name="__main__")
    out, err = capsys.readouterr()
    assert out.strip() == str(tmp_path / "g.png")
    if quiet:
        assert _bar_updates(err) == [] and "/4" not in err
        assert "Loading pipeline components" not in err  # diffusers' own bar, while the pipeline loads
    else:
        _check_counts(_bar_updates(err), 4, every_batch=False)
        assert "Loading pipeline components" in err


# The text-to-image export carries its text encoder: prompts work offline without --clip.


@pytest.fixture(scope="module")
def t2i_export(tmp_path_factory, make_tiny_coco):
    """A 1-step t2i run on tiny features whose export carries the features' (tiny) text encoder."""
    from uvic.training import train

    tmp = tmp_path_factory.mktemp("t2i")
    root, vae, te = make_tiny_coco(tmp, 4, splits=("train",))
    vae.save_pretrained(tmp / "vae")
    te.save_pretrained(tmp / "te")
    train(tiny_t2i_config(root, tmp / "run", tmp / "vae", data={"text_encoder": str(tmp / "te")}))
    return tmp / "run" / "pipeline", te


def test_the_t2i_export_samples_prompts_offline_without_clip(t2i_export, tmp_path, monkeypatch, capsys):
    import socket

    from PIL import Image

    from uvic.pipelines import UViCText2ImagePipeline

    pipeline, te = t2i_export
    assert (pipeline / "text_encoder").is_dir()
    exported = UViCText2ImagePipeline.from_pretrained(pipeline).text_encoder
    torch.testing.assert_close(exported.encode_text(["photo 1"]), te.encode_text(["photo 1"]), rtol=0, atol=0)

    def refuse(self, address, *args, **kwargs):
        raise RuntimeError(f"network access attempted: connect({address!r})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    # Two prompts and no --num-images: one image each.
    monkeypatch.setattr(sys, "argv", ["sample.py", str(pipeline), "--grid", str(tmp_path / "g.png"), "--prompt",
                                      "a cat", "--prompt", "a dog", "--steps", "1", "--quiet"])
    runpy.run_path(str(ROOT / "sample.py"), run_name="__main__")
    assert capsys.readouterr().out.strip() == str(tmp_path / "g.png")
    from uvic.pipelines.sampling import grid_shape, image_shape

    h, w, _ = grid_shape(2, *image_shape(UViCText2ImagePipeline.from_pretrained(pipeline)))
    assert Image.open(tmp_path / "g.png").size == (w, h)


def test_fewer_prompts_than_images_is_said_in_one_line(t2i_export, tmp_path, run_script, no_network):
    pipeline, _ = t2i_export
    code, _, err = run_script("sample.py", pipeline, "--grid", tmp_path / "g.png", "--prompt", "a cat", "--prompt",
                              "a dog", "--num-images", "3", "--steps", "1", "--quiet")
    assert code == 0, err
    assert [line for line in err.splitlines() if "prompts for" in line][0].endswith(
        "2 prompts for 3 images: image i uses prompt i % 2")


def test_prompts_make_an_out_dir_too(t2i_export, tmp_path, run_script, no_network):
    """--prompt in --out-dir mode: image i from prompt i % n and seed i, as the library's `generate` makes it, and
    captions.json says which prompt each file used."""
    import json

    import numpy as np
    from PIL import Image

    from uvic.pipelines.sampling import generate, load_pretrained

    pipeline, _ = t2i_export
    out = tmp_path / "samples"
    code, _, err = run_script("sample.py", pipeline, "--out-dir", out, "--prompt", "a cat", "--prompt", "a dog",
                              "--num-images", "3", "--steps", "1", "--quiet")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["000000.png", "000001.png", "000002.png", "captions.json"]
    assert json.loads((out / "captions.json").read_text()) == ["a cat", "a dog", "a cat"]
    pipe = load_pretrained(pipeline)
    pipe.set_progress_bar_config(disable=True)
    expect = generate(pipe, [0, 1, 2], num_inference_steps=1, prompts=["a cat", "a dog", "a cat"])
    for i in range(3):
        assert np.abs(np.asarray(Image.open(out / f"{i:06d}.png")).astype(int) - expect[i].astype(int)).max() <= 1


@pytest.mark.parametrize("mode", ["--out-dir", "--grid"])
def test_features_with_prompts_are_refused(t2i_export, tmp_path, run_script, no_network, mode):
    pipeline, _ = t2i_export
    target = tmp_path / ("samples" if mode == "--out-dir" else "g.png")
    code, _, err = run_script("sample.py", pipeline, mode, target, "--features", tmp_path / "feat", "--prompt",
                              "a cat", "--steps", "1")
    assert code == 2 and err.strip().splitlines()[-1] == (
        "sample.py: error: --features (random captions) and --prompt/--prompts-file both choose the captions; pass one")
    assert not list(tmp_path.rglob("*.png"))


# Components of another class than the pipeline takes, and --clip dirs that hold no text encoder.


def _swap_component(pipeline, tmp_path, component, module, library):
    """A copy of `pipeline` whose `component` is `module`, saved by its own class and named in model_index.json as
    [library, class], as a hand-edited pipeline dir would have it."""
    import json
    import shutil

    broken = tmp_path / "pipe"
    shutil.copytree(pipeline, broken)
    shutil.rmtree(broken / component)
    module.save_pretrained(broken / component)
    index = json.loads((broken / "model_index.json").read_text())
    index[component] = [library, type(module).__name__]
    (broken / "model_index.json").write_text(json.dumps(index))
    return broken


def _stock_unet():
    from diffusers import UNet2DModel

    return UNet2DModel(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8,), layers_per_block=1,
                       down_block_types=("DownBlock2D",), up_block_types=("UpBlock2D",), norm_num_groups=4)


def test_a_stock_diffusers_class_as_the_transformer_is_refused_before_loading(pipe_dir, tmp_path, monkeypatch,
                                                                               capsys, no_sampling):
    broken = _swap_component(pipe_dir, tmp_path, "transformer", _stock_unet(), "diffusers")
    code, err = _sample_cli(monkeypatch, capsys, broken, "--grid", tmp_path / "g.png", "--steps", "1")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"sample.py: error: {broken / 'model_index.json'} names "
                                            "diffusers.UNet2DModel as the transformer; a UViCPipeline takes a "
                                            "UViTModel")


def test_a_component_of_another_class_is_refused_after_loading(pipe_dir, tmp_path, monkeypatch):
    """Whatever route diffusers takes to a component, the loaded pipeline holds the classes it takes: the check
    before loading is bypassed here to show the one after it."""
    from uvic.pipelines.sampling import load_pretrained

    broken = _swap_component(pipe_dir, tmp_path, "transformer", _stock_unet(), "diffusers")
    monkeypatch.setattr(sampling, "_component_class", lambda *args: UViTModel)
    monkeypatch.setattr(sampling, "check_model_dir", lambda *args: None)
    with pytest.raises(ValueError) as e:
        load_pretrained(broken)
    assert str(e.value) == (f"the transformer of the pipeline in {broken} is a UNet2DModel; a UViCPipeline takes a "
                            "UViTModel")


def test_a_transformers_clip_as_the_text_encoder_is_refused(t2i_export, tmp_path, run_script, no_network):
    from transformers import CLIPTextConfig, CLIPTextModel

    clip = CLIPTextModel(CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, max_position_embeddings=5))
    broken = _swap_component(t2i_export[0], tmp_path, "text_encoder", clip, "transformers")
    code, _, err = run_script("sample.py", broken, "--grid", tmp_path / "g.png", "--prompt", "a cat", "--steps", "1")
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"sample.py: error: {broken / 'model_index.json'} names "
                                            "transformers.CLIPTextModel as the text_encoder; a UViCText2ImagePipeline "
                                            "takes a CLIPTextEncoder")


@pytest.mark.parametrize("damage", ["empty dir", "truncated safetensors", "pickled .bin", "larger config"])
def test_a_clip_dir_without_a_loadable_text_encoder_is_one_line(t2i_export, tmp_path, run_script, no_network,
                                                                  damage):
    import json
    import shutil

    pipeline, te = t2i_export
    bare = tmp_path / "pipe"  # the export without its text encoder, as a training export of an older run
    shutil.copytree(pipeline, bare)
    shutil.rmtree(bare / "text_encoder")
    index = json.loads((bare / "model_index.json").read_text())
    (bare / "model_index.json").write_text(json.dumps({**index, "text_encoder": [None, None]}))
    clip = tmp_path / "clip"
    clip.mkdir()
    weights = clip / "diffusion_pytorch_model.safetensors"
    if damage != "empty dir":
        te.save_pretrained(clip)
    if damage == "truncated safetensors":
        weights.write_bytes(weights.read_bytes()[:100])
        expected = f"the CLIP text encoder {clip}: cannot load {weights}: SafetensorError"
    elif damage == "pickled .bin":
        marker = tmp_path / "MARKER"
        weights.unlink()
        torch.save({"x": _Payload(marker)}, clip / "diffusion_pytorch_model.bin")
        expected = (f"the CLIP text encoder {clip}: weights file {clip / 'diffusion_pytorch_model.bin'} holds objects "
                    "other than tensors")
    elif damage == "larger config":
        config = json.loads((clip / "config.json").read_text())
        (clip / "config.json").write_text(json.dumps({**config, "width": 1000000}))
        expected = f"the CLIP text encoder {clip}: its config describes a model whose "
    else:
        expected = f"cannot load the CLIP text encoder {clip}, a file in it is missing or damaged (OSError"
    code, _, err = run_script("sample.py", bare, "--grid", tmp_path / "g.png", "--prompt", "a cat", "--steps", "1",
                              "--clip", clip)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"sample.py: error: {expected}"), err.strip().splitlines()[-1]
    assert not (tmp_path / "MARKER").exists()
    assert not (tmp_path / "g.png").exists()


class _Payload:
    """Unpickled in full, runs `touch marker` (as tests/test_security.py's)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)
