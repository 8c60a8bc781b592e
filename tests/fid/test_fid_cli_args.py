"""python -m uvic.fid with bad arguments or an output it cannot write: one line and exit 2, before any image is read
or the network is loaded (the weights path below does not exist, so reaching it would give another message)."""

import errno

import pytest
from fid_testutils import smooth_images
from PIL import Image

from uvic.fid.__main__ import main


def write_pngs(folder, images):
    folder.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(images):
        Image.fromarray(im).save(folder / f"{i}.png")
    return folder


def _cli(capsys, *args):
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("command, flag, value, minimum", [
    ("stats", "--batch-size", "0", 1), ("stats", "--num-samples", "-1", 1), ("stats", "--num-workers", "-2", 0),
    ("score", "--isc-splits", "0", 1), ("score", "--kid-subsets", "0", 1), ("score", "--kid-subset-size", "-5", 1),
    ("score", "--expect-n", "0", 1),
])  # fmt: skip
def test_counts_out_of_range_are_refused(tmp_path, capsys, command, flag, value, minimum):
    positional = ["src", "--out", tmp_path / "o.npz"] if command == "stats" else ["samples", "ref.npz"]
    code, err = _cli(capsys, command, *positional, flag, value)
    assert code == 2 and err.strip().splitlines()[-1] == (
        f"python -m uvic.fid {command}: error: argument {flag}: must be >= {minimum}, got {int(value)}")


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
