"""FID harness whose numbers compare with published ones (``uvic.fid``).

Two pipelines, recorded in every stats file and result and never mixed:

* ``mode="pytorch-fid"`` (default): pytorch-fid / U-ViT preprocessing on the FID-Inception network; compare with
  U-ViT's ``fid_stats_*.npz`` and the U-ViT / U-ViC papers.
* ``mode="tf"``: torch-fidelity's TensorFlow-exact pipeline; compare with TTUR / torch-fidelity numbers.

Library use (e.g. periodic FID in training)::

    from uvic.fid import compute_fid, load_extractor
    ext = load_extractor(weights="pt_inception-2015-12-05-6726825d.pth")      # once
    result = compute_fid(lambda n: sample_images(n), "fid_stats_cifar10_train_pytorch.npz",
                         num_samples=10_000, extractor=ext)                     # float [0, 1] or uint8 batches
    print(result.label, result.fid)                                             # fid10000 3.42

CLI: ``python -m uvic.fid stats SOURCE --out ref.npz`` and ``python -m uvic.fid score SAMPLES REF``.
"""

from .inception import MODES, WEIGHTS_ENV, WEIGHTS_NAME, WEIGHTS_URL, InceptionExtractor, resolve_weights
from .inputs import CocoVal2014, GeneratorSource, ImageArray, ImageFolder, cifar10, digits, open_source, to_uint8
from .metric import (
    FIDResult,
    compute_fid,
    fid_from_stats,
    frechet_distance,
    inception_score,
    kernel_inception_distance,
    precision_recall,
)
from .stats import Features, FIDStats, compute_stats, extract_features, load_extractor, load_stats, save_stats


__all__ = [
    "MODES",
    "WEIGHTS_ENV",
    "WEIGHTS_NAME",
    "WEIGHTS_URL",
    "CocoVal2014",
    "FIDResult",
    "FIDStats",
    "Features",
    "GeneratorSource",
    "ImageArray",
    "ImageFolder",
    "InceptionExtractor",
    "cifar10",
    "compute_fid",
    "compute_stats",
    "digits",
    "extract_features",
    "fid_from_stats",
    "frechet_distance",
    "inception_score",
    "kernel_inception_distance",
    "load_extractor",
    "load_stats",
    "open_source",
    "precision_recall",
    "resolve_weights",
    "save_stats",
    "to_uint8",
]
