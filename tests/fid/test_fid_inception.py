"""Weights files that are not the FID Inception network."""

import pickle

import pytest
import torch
from fid_testutils import smooth_images
from PIL import Image

from uvic.fid import InceptionExtractor


@pytest.mark.parametrize("content, cause", [
    (b"\x00garbage that is not a checkpoint" * 100, "UnpicklingError"),
    ("state dict of another network", "RuntimeError"),
])  # fmt: skip
def test_garbage_weights_with_the_sha_check_off_are_a_clear_error(tmp_path, content, cause):
    f = tmp_path / "weights.pth"
    if isinstance(content, bytes):
        f.write_bytes(content)
        with pytest.raises(pickle.UnpicklingError):  # what torch.load raises by itself
            torch.load(f, weights_only=True)
    else:
        torch.save({"fc.weight": torch.zeros(2, 2)}, f)
    with pytest.raises(ValueError, match=rf"^cannot load the FID Inception weights '{f}' \({cause}: .*\); the file is "
                                         rf"corrupt or not pt_inception-2015-12-05-6726825d.pth \(its SHA-256 check "
                                         rf"was skipped\)$"):
        InceptionExtractor(f, sha256=None)


def test_cli_reports_garbage_weights_in_one_line(tmp_path, capsys):
    from uvic.fid.__main__ import main

    folder = tmp_path / "images"
    folder.mkdir()
    for i, im in enumerate(smooth_images(3, size=8)):
        Image.fromarray(im).save(folder / f"{i}.png")
    (tmp_path / "w.pth").write_bytes(b"\x00not weights" * 100)
    with pytest.raises(SystemExit) as e:
        main(["stats", str(folder), "--out", str(tmp_path / "o.npz"), "--weights", str(tmp_path / "w.pth"),
              "--weights-sha256", "none", "--device", "cpu"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: cannot load the FID Inception weights '{tmp_path / 'w.pth'}' (UnpicklingError")
