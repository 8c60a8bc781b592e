"""python -m uvic.fid with bad arguments or an output it cannot write: one line and exit 2, before any image is read
or the network is loaded (the weights path below does not exist, so reaching it would give another message)."""

import errno

import numpy as np
import pytest
from fid_testutils import smooth_images, write_pngs

from uvic.fid.__main__ import main


def _cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("command, flag, value, minimum", [
    ("stats", "--batch-size", "0", 1), ("stats", "--num-samples", "-1", 1), ("stats", "--num-workers", "-2", 0),
    ("score", "--isc-splits", "0", 1), ("score", "--kid-subsets", "0", 1), ("score", "--kid-subset-size", "-5", 1),
    ("score", "--expect-n", "0", 1),
])
def test_counts_out_of_range_are_refused(tmp_path, capsys, command, flag, value, minimum):
    positional = ["src", "--out", tmp_path / "o.npz"] if command == "stats" else ["samples", "ref.npz"]
    code, err = _cli(capsys, command, *positional, flag, value)
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"python -m uvic.fid {command}: error: argument {flag}: must be >= {minimum}, got {int(value)}")


@pytest.mark.parametrize("command", ["stats", "score"])
@pytest.mark.parametrize("value, problem", [
    ("1,0", "with finite LOW < HIGH (e.g. -1,1)"), ("0,0", "with finite LOW < HIGH (e.g. -1,1)"),
    ("nan,1", "with finite LOW < HIGH (e.g. -1,1)"), ("-1,inf", "with finite LOW < HIGH (e.g. -1,1)"),
    ("0", "(two numbers)"), ("a,b", "(two numbers)"),
])
def test_an_empty_or_reversed_value_range_is_refused(tmp_path, capsys, command, value, problem):
    """A reversed range maps images to negative pixels and an empty one divides by zero: both scored silently."""
    positional = ["src", "--out", tmp_path / "o.npz"] if command == "stats" else ["samples", "ref.npz"]
    code, err = _cli(capsys, command, *positional, f"--value-range={value}")
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"python -m uvic.fid {command}: error: argument --value-range: must be LOW,HIGH {problem}, got {value!r}")


@pytest.mark.parametrize("where", ["out-in-file", "out-is-dir", "json-in-file"])
def test_an_output_that_cannot_be_written_is_refused_first(tmp_path, capsys, where):
    folder = write_pngs(tmp_path / "s", smooth_images(2, size=8))
    blocker = tmp_path / "a_file"
    blocker.write_text("in the way")
    missing_weights = ["--weights", tmp_path / "no_weights.pth"]
    if where == "out-in-file":
        args, target = ["stats", folder, "--out", blocker / "o.npz"], blocker / "o.npz"
        reason = f"a file is in the way (File exists: '{blocker}')"
    elif where == "out-is-dir":
        args, target, reason = ["stats", folder, "--out", tmp_path], tmp_path, "it is a directory"
    else:
        args, target = ["score", folder, folder, "--json", blocker / "r.json"], blocker / "r.json"
        reason = f"a file is in the way (File exists: '{blocker}')"
    code, err = _cli(capsys, *args, *missing_weights)
    assert code == 2 and err == f"error: cannot write {target}: {reason}\n"


def test_a_failed_write_after_computing_is_one_line(tmp_path, capsys, monkeypatch):
    import uvic.fid.__main__ as cli

    def disk_full(stats, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(cli, "load_extractor", lambda **kw: None)
    monkeypatch.setattr(cli, "compute_stats", lambda *a, **kw: None)
    monkeypatch.setattr(cli, "save_stats", disk_full)
    folder = write_pngs(tmp_path / "s", smooth_images(2, size=8))
    code, err = _cli(capsys, "stats", folder, "--out", tmp_path / "o.npz")
    assert code == 2 and err == f"error: stopped: disk full (No space left on device: '{tmp_path / 'o.npz'}')\n"


# Reference files that cannot be used, and what the CLI picks by itself.


def _stats_npz(path, dims):
    from uvic.fid.stats import FIDStats, save_stats

    save_stats(FIDStats(mu=np.zeros(dims), sigma=np.eye(dims), n=dims + 1, mode="pytorch-fid"), path)
    return path


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_an_empty_or_truncated_reference_is_one_line(tmp_path, capsys, damage):
    folder = write_pngs(tmp_path / "s", smooth_images(2, size=8))
    ref = _stats_npz(tmp_path / "ref.npz", 64)
    data = ref.read_bytes()
    ref.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    code, err = _cli(capsys, "score", folder, ref, "--weights", tmp_path / "no_weights.pth")
    reason = "it is empty" if damage == "empty" else "BadZipFile: File is not a zip file"
    assert code == 2 and err == (f"error: FID file {ref} is not a readable .npz archive ({reason}); it may be "
                                 f"truncated by an interrupted copy\n")


def test_statistics_without_mu_are_named_as_such(tmp_path, capsys):
    folder = write_pngs(tmp_path / "s", smooth_images(2, size=8))
    np.savez(tmp_path / "ref.npz", sigma=np.eye(4))
    code, err = _cli(capsys, "score", folder, tmp_path / "ref.npz", "--weights", tmp_path / "no_weights.pth")
    assert code == 2 and err == (f"error: '{tmp_path / 'ref.npz'}' looks like FID statistics but has no 'mu' array "
                                 f"(it has ['sigma']); a statistics file needs both 'mu' and 'sigma'\n")


def test_dims_that_disagree_with_the_reference_are_refused(tmp_path, capsys):
    folder = write_pngs(tmp_path / "s", smooth_images(2, size=8))
    ref = _stats_npz(tmp_path / "ref.npz", 192)
    code, err = _cli(capsys, "score", folder, ref, "--dims", "64", "--weights", tmp_path / "no_weights.pth")
    assert code == 2 and err == (f"error: reference '{ref}' holds 192-dim statistics, so --dims 64 cannot be compared "
                                 f"with it; drop --dims, or compute the reference with --dims 64\n")


def test_nan_images_in_a_worker_are_one_line(tmp_path, capsys, weights_file):
    images = np.random.default_rng(0).uniform(size=(4, 8, 8, 3)).astype(np.float32)
    images[2, 0, 0, 0] = np.nan
    np.savez(tmp_path / "imgs.npz", images)
    code, err = _cli(capsys, "stats", tmp_path / "imgs.npz", "--out", tmp_path / "o.npz", "--weights", weights_file,
                     "--weights-sha256", "none", "--device", "cpu", "--num-workers", "1", "--no-progress")
    assert code == 2 and err == f"error: {tmp_path / 'imgs.npz'}: image 2: images contain NaN or Inf\n"


def test_workers_follow_the_usable_cores(monkeypatch):
    import os

    from uvic.fid.__main__ import default_num_workers

    for cores, workers in [(1, 0), (2, 1), (5, 4), (64, 8)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert default_num_workers() == workers


def test_the_result_is_printed_once(tmp_path, capsys, caplog, weights_file):
    import logging

    a = write_pngs(tmp_path / "a", smooth_images(4, size=8, seed=1))
    b = write_pngs(tmp_path / "b", smooth_images(4, size=8, seed=2))
    with caplog.at_level(logging.INFO):
        main(["score", str(a), str(b), "--weights", str(weights_file), "--weights-sha256", "none", "--device", "cpu",
              "--num-workers", "0", "--no-progress", "--dims", "64"])
    out = capsys.readouterr().out
    assert out.count("fid4=") == 1 and out.startswith("fid4=")
    assert not [r for r in caplog.records if "fid4=" in r.getMessage()]


def test_stats_of_grayscale_samples_and_of_the_digits(tmp_path, capsys, weights_file):
    """The digits demo's journey: `sample.py --out-dir` writes 1-channel PNGs, and their statistics are those of the
    same images in RGB; `digits:8` is a reference source."""
    from PIL import Image

    images = smooth_images(3, size=8)
    gray, rgb = tmp_path / "gray", tmp_path / "rgb"
    gray.mkdir()
    for i, im in enumerate(images):
        Image.fromarray(im[..., 0]).save(gray / f"{i}.png")  # mode "L", as sample.py saves a 1-channel image
    write_pngs(rgb, np.repeat(images[..., :1], 3, axis=-1))
    common = ["--weights", weights_file, "--weights-sha256", "none", "--device", "cpu", "--num-workers", "0",
              "--no-progress", "--dims", "64"]
    for source in (gray, rgb):
        main([str(a) for a in ("stats", source, "--out", tmp_path / f"{source.name}.npz", *common)])
    a, b = np.load(tmp_path / "gray.npz"), np.load(tmp_path / "rgb.npz")
    assert np.array_equal(a["mu"], b["mu"]) and np.array_equal(a["sigma"], b["sigma"])
    main([str(a) for a in ("stats", "digits:8", "--num-samples", 3, "--out", tmp_path / "d.npz", *common)])
    assert np.load(tmp_path / "d.npz")["mu"].shape == (64,)


def test_a_negative_value_range_may_follow_its_option_as_the_help_writes_it():
    """`--value-range -1,1` (the help's own example) failed with "expected one argument": argparse took "-1,1" for
    an option. Both spellings parse to the same range; a negative number elsewhere is left to argparse."""
    from uvic.fid.__main__ import _joined_value_range, _parser

    parser = _parser()
    for spelling in (["--value-range", "-1,1"], ["--value-range=-1,1"], ["--value-range", "-.5,1"]):
        args = parser.parse_args(_joined_value_range(["score", "s", "r.npz", *spelling]))
        assert args.value_range == ((-0.5, 1.0) if "-.5,1" in spelling else (-1.0, 1.0))
    assert _joined_value_range(["score", "--value-range", "0,1", "--num-samples", "-1"]) == [
        "score", "--value-range", "0,1", "--num-samples", "-1"]


def test_stats_of_float_images_with_a_spaced_negative_value_range(tmp_path, capsys, weights_file):
    """End to end through main(): float images in [-1, 1] with `--value-range -1,1` give the statistics of the same
    images quantised by hand (x -> (x + 1) / 2 -> uint8(255 x + 0.5), torchvision's save_image) and saved as PNGs."""
    from uvic.fid import load_stats

    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (3, 8, 8, 3)).astype(np.float32)
    np.savez(tmp_path / "f.npz", x)
    by_hand = np.clip(np.floor((x + 1) / 2 * 255 + 0.5), 0, 255).astype(np.uint8)
    folder = write_pngs(tmp_path / "png", by_hand)
    common = ["--dims", "64", "--weights", weights_file, "--weights-sha256", "none", "--no-progress",
              "--num-workers", "0", "--device", "cpu"]
    main(["stats", str(tmp_path / "f.npz"), "--out", str(tmp_path / "a.npz"), "--value-range", "-1,1",
          *map(str, common)])
    main(["stats", str(folder), "--out", str(tmp_path / "b.npz"), *map(str, common)])
    a, b = load_stats(tmp_path / "a.npz"), load_stats(tmp_path / "b.npz")
    assert np.array_equal(a.mu, b.mu) and np.array_equal(a.sigma, b.sigma)


@pytest.mark.parametrize("device, problem", [
    ("foo", "'foo' is not a torch device ("),
    ("cuda", "'cuda': this machine has no CUDA GPU that torch can use; use --device cpu, or leave --device out"),
    ("cuda:1", "'cuda:1': this machine has no CUDA GPU that torch can use"),
])
def test_a_device_this_machine_lacks_is_one_line(capsys, monkeypatch, device, problem):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU
    code, err = _cli(capsys, "score", "samples", "ref.npz", "--device", device)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"python -m uvic.fid score: error: argument --device: {problem}")
