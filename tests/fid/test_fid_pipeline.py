"""Full-network checks on a few dozen small images with random-init FID-Inception weights.

* pytorch-fid mode == an independent re-implementation of pytorch-fid's preprocessing fed into torch-fidelity's
  own network forward, and != tf mode;
* tf mode == torch_fidelity.calculate_metrics (FID, KID, IS) to 1e-6;
* folder == .npz == generator stats; batch size does not change them; CLI and library agree.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from fid_testutils import smooth_images, write_pngs

from uvic.fid import compute_fid, compute_stats, extract_features, inception_score, load_stats
from uvic.fid.__main__ import main


pytestmark = pytest.mark.filterwarnings(r"ignore:.*N=\d+ <= feature dim")


def reference_net_features(net, images):
    """torch-fidelity's network forward, with its TF preprocessing replaced by pytorch-fid's (written here)."""
    x = images.float() / 255  # torchvision ToTensor
    x = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)  # pytorch-fid resize_input
    x = 2 * x - 1  # pytorch-fid normalize_input
    hook = net.Conv2d_1a_3x3.register_forward_pre_hook(lambda module, args: (x,))
    try:
        return net(images)
    finally:
        hook.remove()


def test_pytorch_fid_mode_matches_reference_and_differs_from_tf(extractors):
    images = torch.from_numpy(smooth_images(2, size=16, seed=1)).permute(0, 3, 1, 2).contiguous()
    ours = extractors("pytorch-fid", 2048, True)(images)
    tf_ext = extractors("tf", 2048, True)
    ref_pool3, ref_logits = reference_net_features(tf_ext.net, images)
    torch.testing.assert_close(ours["features"], ref_pool3, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours["logits"], ref_logits, rtol=1e-5, atol=1e-6)
    tf = tf_ext(images)["features"]
    assert (tf - ours["features"]).abs().max() > 1e-3 * ours["features"].abs().max()


def test_tf_mode_matches_torch_fidelity_and_pytorch_fid_mode_differs(extractors, weights_file, tmp_path):
    import torch_fidelity

    a = write_pngs(tmp_path / "a", smooth_images(10, size=16, seed=2), digits=3)
    b = write_pngs(tmp_path / "b", smooth_images(10, size=16, seed=3), digits=3)
    ref = torch_fidelity.calculate_metrics(
        input1=str(a), input2=str(b), fid=True, kid=True, kid_subsets=5, kid_subset_size=6, feature_layer_fid="64",
        feature_layer_kid="64", feature_extractor_weights_path=str(weights_file), cuda=False, batch_size=16,
        cache=False, datasets_download=False, verbose=False, save_cpu_ram=True)
    ours = compute_fid(a, b, mode="tf", extractor=extractors("tf", 64), kid=True, kid_subsets=5, kid_subset_size=6,
                       progress=False)
    assert ours.mode == "tf" and ours.label == "fid10" and ours.reference == str(b)
    assert ours.fid == pytest.approx(ref["frechet_inception_distance"], rel=1e-6)
    assert ours.extras["kernel_inception_distance_mean"] == pytest.approx(ref["kernel_inception_distance_mean"],
                                                                          rel=1e-6)
    pt = compute_fid(a, b, extractor=extractors("pytorch-fid", 64), progress=False)
    assert pt.mode == "pytorch-fid"
    assert abs(pt.fid - ours.fid) > 1e-3 * ours.fid  # the two pipelines are different metrics


def test_inception_score_matches_torch_fidelity(extractors, weights_file, tmp_path):
    import torch_fidelity

    folder = write_pngs(tmp_path / "a", smooth_images(3, size=16, seed=4), digits=3)
    ref = torch_fidelity.calculate_metrics(
        input1=str(folder), isc=True, isc_splits=1, feature_extractor_weights_path=str(weights_file), cuda=False,
        cache=False, datasets_download=False, verbose=False, save_cpu_ram=True)
    feats = extract_features(folder, extractors("tf", 2048, True), progress=False)
    ours = inception_score(feats.logits, splits=1)
    assert ours["inception_score_mean"] > 1.0  # not the trivial value of a single-image split
    assert ours["inception_score_mean"] == pytest.approx(ref["inception_score_mean"], rel=1e-6)


def test_folder_npz_generator_agree_and_batch_size_does_not_matter(extractors, tmp_path):
    images = smooth_images(8, size=16, seed=5)
    ext = extractors("pytorch-fid", 64)
    folder = write_pngs(tmp_path / "png", images, digits=3)
    np.savez(tmp_path / "u8.npz", images)
    signed = images.astype(np.float32) / 255 * 2 - 1
    np.savez(tmp_path / "f.npz", signed)
    batches = iter(torch.from_numpy(signed).permute(0, 3, 1, 2).split(3))

    runs = {
        "folder": compute_stats(folder, extractor=ext, batch_size=8, progress=False),
        "folder_b3": compute_stats(folder, extractor=ext, batch_size=3, progress=False),
        "npz_u8": compute_stats(tmp_path / "u8.npz", extractor=ext, batch_size=5, progress=False),
        "npz_float": compute_stats(tmp_path / "f.npz", extractor=ext, value_range=(-1, 1), progress=False),
        "generator": compute_stats(batches, extractor=ext, value_range=(-1, 1), progress=False),
    }
    base = runs["folder"]
    assert base.n == 8 and base.mode == "pytorch-fid" and base.meta["dims"] == 64
    for name, s in runs.items():
        np.testing.assert_array_equal(s.mu, base.mu, err_msg=name)
        np.testing.assert_array_equal(s.sigma, base.sigma, err_msg=name)


def test_cli_and_library_agree(extractors, weights_file, tmp_path, capsys):
    ref_dir = write_pngs(tmp_path / "ref", smooth_images(6, size=16, seed=6), digits=3)
    samples = smooth_images(5, size=16, seed=7)
    np.savez(tmp_path / "samples.npz", samples)
    common = ["--weights", str(weights_file), "--weights-sha256", "none", "--dims", "64", "--num-workers", "0",
              "--no-progress", "--device", "cpu"]
    main(["stats", str(ref_dir), "--out", str(tmp_path / "ref.npz"), *common])
    assert "wrote" in capsys.readouterr().out
    main(["score", str(tmp_path / "samples.npz"), str(tmp_path / "ref.npz"), "--json", str(tmp_path / "r.json"),
          *common])
    line = capsys.readouterr().out.strip()
    ref = load_stats(tmp_path / "ref.npz")
    assert ref.mode == "pytorch-fid" and ref.n == 6
    # Library: periodic-FID style call with an in-memory callable producing float images in [0, 1].
    pool = torch.from_numpy(samples).permute(0, 3, 1, 2).float() / 255
    taken = [0]

    def generate(n):
        out = pool[taken[0] : taken[0] + n]
        taken[0] += n
        return out

    lib = compute_fid(generate, ref, num_samples=5, extractor=extractors("pytorch-fid", 64), batch_size=2,
                      progress=False)
    assert line == str(lib) and line.startswith("fid5=")

    # Mixing pipelines, wrong sample count and missing weights are clean CLI errors.
    for argv, message in [
        (["score", str(tmp_path / "samples.npz"), str(tmp_path / "ref.npz"), "--mode", "tf", *common], "mode="),
        (["score", str(tmp_path / "samples.npz"), str(tmp_path / "ref.npz"), "--expect-n", "50000", *common],
         "expected 50000 sample images, got 5"),
        (["stats", str(ref_dir), "--out", str(tmp_path / "x.npz"), "--weights", str(tmp_path / "none.pth")],
         "pt_inception-2015-12-05-6726825d.pth"),
        (["score", str(tmp_path / "samples.npz"), str(tmp_path / "fid_stats_missing.npz"), *common],
         "fid_stats_missing.npz' does not exist"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_bad_requests_fail_before_extraction(extractors):
    from uvic.fid import FIDStats

    def never(n):
        raise AssertionError("no image should be generated")

    ext = extractors("pytorch-fid", 64)
    ref = FIDStats(np.zeros(64), np.eye(64), n=100, mode="pytorch-fid", name="ref.npz")
    with pytest.raises(ValueError, match="KID subset size 1000 is larger than num_samples=10"):
        compute_fid(never, "unused", num_samples=10, kid=True, extractor=ext)
    with pytest.raises(ValueError, match="KID and precision/recall need reference images"):
        compute_fid(never, ref, num_samples=10, prc=True, extractor=ext)
    with pytest.raises(ValueError, match="'ref.npz' has 2048-d features, the extractor gives 64-d"):
        compute_fid(never, FIDStats(np.zeros(2048), np.eye(2048), mode="pytorch-fid", name="ref.npz"),
                    num_samples=10, extractor=ext)
    with pytest.raises(ValueError, match="with_logits=True"):
        compute_fid(never, ref, num_samples=10, isc=True, extractor=ext)
    with pytest.raises(ValueError, match="computed with mode='pytorch-fid'.*mode='tf'"):
        compute_fid(never, ref, num_samples=10, mode="tf", extractor=extractors("tf", 64))
    with pytest.raises(FileNotFoundError, match="missing.npz' does not exist"):
        compute_fid(never, "missing.npz", num_samples=10, extractor=ext)
