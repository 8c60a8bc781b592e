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
])
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


# `python -m uvic.fid make-test-weights`: random weights for offline smoke tests, and the checksum error.


@pytest.fixture(scope="module")
def test_weights(tmp_path_factory):
    """What the command writes, and its one line."""
    import contextlib
    import io

    from uvic.fid.__main__ import main

    out = tmp_path_factory.mktemp("cli") / "test_inception.pth"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["make-test-weights", str(out)])
    return out, printed.getvalue()


def test_make_test_weights_writes_the_harness_layout_labelled_not_for_reporting(test_weights, weights_file, caplog):
    out, printed = test_weights
    assert printed == (f"wrote {out}: random-init FID-Inception weights (seed 0) for offline smoke tests. They are NOT "
                       "the FID Inception network: scores computed with them are not FIDs to report. Use them with "
                       f"--weights {out} --weights-sha256 none (train.py: train.eval_fid_weights={out} "
                       "train.eval_fid_weights_sha256=none)\n")
    written, fixture = torch.load(out, weights_only=True), torch.load(weights_file, weights_only=True)
    assert len(written) == 566 and written.keys() == fixture.keys()  # the tests' weights are these
    assert all(torch.equal(written[k], fixture[k]) for k in written)
    with caplog.at_level("WARNING", logger="uvic.fid.inception"):
        extractor = InceptionExtractor(out, sha256=None, dims=64)
    assert [r.getMessage() for r in caplog.records] == [
        f"the FID Inception weights {out} were never trained (every batch-norm running mean is 0 and every variance "
        "1), e.g. `python -m uvic.fid make-test-weights`: the scores they give are for smoke tests only, not FIDs to "
        "report"]
    features = extractor(torch.from_numpy(smooth_images(2, size=16)).permute(0, 3, 1, 2).contiguous())["features"]
    assert features.shape == (2, 64) and torch.isfinite(features).all() and features.std() > 0


def test_the_checksum_error_names_the_option_of_the_tool(test_weights, tmp_path, capsys, image_dir, tiny_overrides,
                                                          run_script):
    """The weights fail the default checksum: `python -m uvic.fid` names --weights-sha256, train.py its config key."""
    import numpy as np

    from uvic.fid.__main__ import main

    out, _ = test_weights
    with pytest.raises(SystemExit) as e:
        main(["stats", str(image_dir), "--out", str(tmp_path / "o.npz"), "--weights", str(out), "--device", "cpu"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and line.startswith(f"error: SHA-256 of '{out}' is ")
    assert line.endswith("pass --weights-sha256 none only for weights you converted yourself (or made with "
                         "`python -m uvic.fid make-test-weights`, for smoke tests).")
    ref = tmp_path / "ref.npz"
    np.savez(ref, mu=np.zeros(64), sigma=np.eye(64), mode=np.str_("pytorch-fid"), n=np.int64(100))
    fid = {"train.eval_every": 2, "train.eval_reference": ref, "train.eval_fid_weights": out, "train.eval_fid_dims": 64}
    code, _, err = run_script("train.py", "configs/cifar10_uvic_s2.yaml", *tiny_overrides(tmp_path / "run", image_dir,
                                                                                            **fid))
    line = err.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in err and line.startswith(f"error: SHA-256 of '{out}' is ")
    assert "pass train.eval_fid_weights_sha256=none only for weights you converted yourself" in line


def test_make_test_weights_refuses_a_directory(tmp_path, capsys):
    from uvic.fid.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["make-test-weights", str(tmp_path)])
    assert e.value.code == 2 and capsys.readouterr().err == f"error: cannot write {tmp_path}: it is a directory\n"
