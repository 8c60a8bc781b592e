"""Fréchet distance with pytorch-fid's numerics, mode-checked comparisons, IS/KID/PRC extras, `compute_fid`.

`frechet_distance` follows pytorch-fid / U-ViT (``scipy.linalg.sqrtm`` of sigma1 @ sigma2, an eps retry on the
diagonals if that is not finite, and an error if the diagonal's imaginary part exceeds `atol`), without SciPy's
deprecated ``disp`` argument. The extras (Inception Score, KID, precision/recall) are torch-fidelity's functions
applied to the same features the FID uses.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import scipy.linalg

from .classifier import check_same_features, title_of
from .inception import DEFAULT_DIMS, DEFAULT_MODE, WEIGHTS_SHA256_PREFIX, InceptionExtractor, Mode, check_mode
from .inputs import DEFAULT_VALUE_RANGE, Source, ValueRange
from .stats import (
    BATCH_SIZE,
    Features,
    FIDStats,
    extract_features,
    is_stats_file,
    load_extractor,
    load_stats,
    validate_stats,
)


logger = logging.getLogger(__name__)


def frechet_distance(mu1: np.ndarray, sigma1: np.ndarray, mu2: np.ndarray, sigma2: np.ndarray, *,
                     eps: float = 1e-6, atol: float = 1e-3) -> float:
    """Fréchet distance ``|mu1 - mu2|^2 + tr(S1 + S2 - 2 (S1 S2)^(1/2))`` between two Gaussians.

    Args:
        mu1, mu2: (d,) means.
        sigma1, sigma2: (d, d) symmetric covariances.
        eps: diagonal offset for the retry when ``sqrtm(S1 S2)`` is not finite (pytorch-fid's 1e-6).
        atol: largest tolerated imaginary part on the diagonal of the square root (pytorch-fid's 1e-3).
    Returns:
        The distance as a Python float (tiny negative round-off clamped to 0).
    """
    mu1, mu2 = np.atleast_1d(np.asarray(mu1, np.float64)), np.atleast_1d(np.asarray(mu2, np.float64))
    sigma1, sigma2 = np.atleast_2d(np.asarray(sigma1, np.float64)), np.atleast_2d(np.asarray(sigma2, np.float64))
    validate_stats(mu1, sigma1, "first stats")
    validate_stats(mu2, sigma2, "second stats")
    if mu1.shape != mu2.shape:
        raise ValueError(f"feature dims differ: first stats are {mu1.shape[0]}-d, second are {mu2.shape[0]}-d "
                         "(computed from different Inception layers?)")
    diff = mu1 - mu2
    covmean = scipy.linalg.sqrtm(sigma1 @ sigma2)
    if not np.isfinite(covmean).all():
        logger.warning("sqrtm(sigma1 @ sigma2) is not finite (singular product); retrying with %g on the diagonals", eps)
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = scipy.linalg.sqrtm((sigma1 + offset) @ (sigma2 + offset))
    if np.iscomplexobj(covmean):
        imag = float(np.abs(np.diagonal(covmean).imag).max())
        if imag > atol:
            raise ValueError(f"sqrtm(sigma1 @ sigma2) has an imaginary component of magnitude {imag:.3g} on its "
                             f"diagonal (> {atol}); the covariances are ill-conditioned (too few images?)")
        covmean = covmean.real
    tr1, tr2 = float(np.trace(sigma1)), float(np.trace(sigma2))
    fid = float(diff @ diff + tr1 + tr2 - 2 * np.trace(covmean))
    if fid < 0:
        # Identical stats give -1e-10-level round-off; anything larger means the square root is inaccurate.
        if fid < -1e-8 * max(tr1 + tr2, 1.0):
            logger.warning("negative Fréchet distance %.3g: the matrix square root is inaccurate", fid)
        else:
            fid = 0.0
    return fid


@dataclass
class FIDResult:
    """A FID number with what it was computed from.

    Attributes:
        fid: the Fréchet distance.
        n: number of sample images (the label is ``fid{n}``, as U-ViT logs ``fid10000``).
        reference: name of the reference stats (file path or source).
        mode: preprocessing pipeline shared by both sides.
        extras: Inception Score / KID / precision-recall values, when requested.
        meta: provenance of the sample stats (dims, weights SHA-256, versions, world size).
    """

    fid: float
    n: int | None
    reference: str
    mode: str
    extras: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def title(self) -> str:
        """"FID", or the name of a classifier feature space's distance ("FD (Fashion-MNIST classifier)")."""
        return title_of(self.meta)

    @property
    def label(self) -> str:
        """``fid{n}``; ``fd{n}`` in a classifier's features (`title` names which)."""
        stem = "fid" if self.title == "FID" else "fd"
        return f"{stem}{self.n}" if self.n is not None else stem

    def to_dict(self) -> dict[str, Any]:
        return {self.label: self.fid, "title": self.title, **asdict(self)}

    def __str__(self) -> str:
        extras = "".join(f" {k}={v:.6g}" for k, v in self.extras.items())
        if self.title != "FID":
            return (f"{self.title}: {self.label}={self.fid:.4f} (reference={self.reference}, features sha256="
                    f"{self.meta.get('weights_sha256')}){extras}")
        return f"{self.label}={self.fid:.4f} (mode={self.mode}, reference={self.reference}){extras}"


def check_compatible(a: FIDStats, b: FIDStats) -> str:
    """Refuse to compare stats of different pipelines, layers or feature spaces (`check_same_features`: Inception
    vs a classifier, or two classifiers' weights); return the common mode (None if neither knows)."""
    check_same_features(a.meta, b.meta, a.name or "first", b.name or "second")
    if a.mode is not None and b.mode is not None and a.mode != b.mode:
        raise ValueError(f"FID stats from different pipelines: {a.name or 'first'} is mode={a.mode!r}, "
                         f"{b.name or 'second'} is mode={b.mode!r}; recompute one of them in the other mode")
    if a.dims != b.dims:
        raise ValueError(f"feature dims differ: {a.name or 'first'} has {a.dims}, {b.name or 'second'} has {b.dims}")
    wa, wb = a.meta.get("weights_sha256"), b.meta.get("weights_sha256")
    if wa and wb and wa != wb:
        warnings.warn(f"the two stats were computed with different Inception weights ({wa[:12]} vs {wb[:12]})",
                      stacklevel=3)
    return a.mode or b.mode


def fid_from_stats(samples: FIDStats, reference: FIDStats) -> FIDResult:
    """FID between sample stats and reference stats, labelled ``fid{N}`` with N = number of samples."""
    mode = check_compatible(samples, reference)
    fid = frechet_distance(samples.mu, samples.sigma, reference.mu, reference.sigma)
    return FIDResult(fid=fid, n=samples.n, reference=reference.name, mode=mode, meta=samples.meta)


def inception_score(logits: Any, *, splits: int = 10, seed: int = 2020) -> dict[str, float]:
    """Inception Score (torch-fidelity's ``isc_features_to_metric``) of (N, 1008) unbiased logits."""
    from torch_fidelity.metric_isc import isc_features_to_metric

    if logits is None:
        raise ValueError("Inception Score needs logits: build the extractor with with_logits=True")
    if len(logits) < splits:
        raise ValueError(f"Inception Score with {splits} splits needs at least {splits} images, got {len(logits)}")
    return isc_features_to_metric(logits, splits=splits, shuffle=True, rng_seed=seed)


def kernel_inception_distance(f1: Any, f2: Any, *, subsets: int = 100, subset_size: int = 1000,
                              seed: int = 2020) -> dict[str, float]:
    """KID (torch-fidelity's ``kid_features_to_metric``, cubic polynomial kernel) of (N1, d) vs (N2, d) features."""
    from torch_fidelity.metric_kid import kid_features_to_metric

    if subset_size > min(len(f1), len(f2)):
        raise ValueError(f"KID subset size {subset_size} is larger than the number of images (samples: {len(f1)}, "
                         f"reference: {len(f2)}); pass a kid_subset_size <= {min(len(f1), len(f2))}")
    return kid_features_to_metric(f1, f2, kid_subsets=subsets, kid_subset_size=subset_size, rng_seed=seed,
                                  verbose=False)


def precision_recall(f1: Any, f2: Any, *, neighborhood: int = 3) -> dict[str, float]:
    """Improved precision/recall (torch-fidelity's ``prc_features_to_metric``, k=`neighborhood`).

    Computed on the FID-Inception features, the extractor available offline; published PRC numbers usually use
    VGG16 features, so these are not comparable with them.
    """
    from torch_fidelity.metric_prc import prc_features_to_metric

    if min(len(f1), len(f2)) <= neighborhood:
        raise ValueError(f"precision/recall with k={neighborhood} needs more than {neighborhood} images per side")
    out = prc_features_to_metric(f1, f2, prc_neighborhood=neighborhood, prc_batch_size=10000, save_cpu_ram=False,
                                 verbose=False)
    return {f"{k}_inception": v for k, v in out.items()}


def compute_fid(
    source: Source,
    reference: FIDStats | Source,
    *,
    num_samples: int | None = None,
    extractor: InceptionExtractor | None = None,
    mode: Mode = DEFAULT_MODE,
    dims: int = DEFAULT_DIMS,
    weights: str | os.PathLike | None = None,
    weights_sha256: str | None = WEIGHTS_SHA256_PREFIX,
    allow_download: bool = False,
    batch_size: int = BATCH_SIZE,
    num_workers: int = 0,
    value_range: ValueRange = DEFAULT_VALUE_RANGE,
    isc: bool = False,
    kid: bool = False,
    prc: bool = False,
    isc_splits: int = 10,
    kid_subsets: int = 100,
    kid_subset_size: int = 1000,
    seed: int = 2020,
    progress: bool = True,
    device: Any = None,
) -> FIDResult:
    """FID of `source` against `reference`, e.g. periodic FID from an in-memory generator during training.

    Args:
        source: images to score: a callable ``fn(n) -> (n, 3, H, W)`` batch (uint8, or float in `value_range`),
            an iterable of batches, a folder, an ``.npz`` of images, or a Dataset of (3, H, W) uint8.
        reference: `FIDStats`, a stats ``.npz`` path, or an image source (needed for KID / precision-recall).
        num_samples: images to use from `source` (required for a callable; 10_000 for U-ViT's training FID).
        extractor: a loaded `InceptionExtractor` to reuse across calls; else built from mode / dims / weights.
        mode: "pytorch-fid" (U-ViT-comparable) or "tf"; must match the reference stats' mode.
        isc, kid, prc: also compute the Inception Score, KID, precision/recall on the same features.
        isc_splits, kid_subsets, kid_subset_size: IS / KID settings (torch-fidelity's defaults).
        seed: RNG seed of the IS split shuffle and the KID subsets.
    Returns:
        `FIDResult` labelled ``fid{N}`` with the reference's name and the mode.
    """
    check_mode(mode)
    if kid and num_samples is not None and kid_subset_size > num_samples:  # fail before the expensive pass
        raise ValueError(f"KID subset size {kid_subset_size} is larger than num_samples={num_samples}; "
                         f"pass a kid_subset_size <= {num_samples}")
    ref_stats, ref_feats = None, None
    if isinstance(reference, FIDStats):
        ref_stats = reference
    elif isinstance(reference, (str, os.PathLike)) and str(reference).endswith(".npz"):
        if not os.path.isfile(reference):
            raise FileNotFoundError(f"reference {str(reference)!r} does not exist")
        ref_stats = load_stats(reference) if is_stats_file(reference) else None
    if ref_stats is not None:
        if ref_stats.mode == "classifier" and (extractor is None or extractor.mode != "classifier") and not (
                weights is not None and str(weights).endswith(".safetensors")):
            raise ValueError(f"reference {ref_stats.name!r} holds {title_of(ref_stats.meta)} statistics: score with "
                             f"the same classifier's weights (its SHA-256 is {ref_stats.meta.get('weights_sha256')})")
        if kid or prc:
            raise ValueError("KID and precision/recall need reference images, not statistics; pass the reference "
                             "image source instead of a stats file")
        if ref_stats.mode is not None and ref_stats.mode != mode and ref_stats.mode != "classifier":
            raise ValueError(f"reference {ref_stats.name!r} was computed with mode={ref_stats.mode!r}, samples would "
                             f"use mode={mode!r}; pass mode={ref_stats.mode!r}")
        dims = ref_stats.dims if extractor is None else dims
    if extractor is None:
        extractor = load_extractor(mode=mode, dims=dims, with_logits=isc, weights=weights, sha256=weights_sha256,
                                   allow_download=allow_download, device=device,
                                   sha256_option="weights_sha256=None")
    if ref_stats is not None:  # before the expensive pass: statistics of other features are refused
        check_same_features(_space(extractor), ref_stats.meta, "the samples' features", repr(ref_stats.name))
    if extractor.mode != mode and extractor.mode == "classifier":
        mode = extractor.mode  # a feature classifier's preprocessing is its own
    elif extractor.mode != mode:
        raise ValueError(f"extractor runs mode={extractor.mode!r} but mode={mode!r} was requested")
    if ref_stats is not None and extractor.dims != ref_stats.dims:
        raise ValueError(f"reference {ref_stats.name!r} has {ref_stats.dims}-d features, the extractor gives "
                         f"{extractor.dims}-d")
    if isc and not extractor.with_logits:
        raise ValueError("the Inception Score needs an extractor built with with_logits=True")
    opts = {"batch_size": batch_size, "num_workers": num_workers, "value_range": value_range, "progress": progress}
    feats = extract_features(source, extractor, num_samples=num_samples, **opts)
    samples = feats.stats()
    if ref_stats is None:
        ref_feats = extract_features(reference, extractor, **opts)
        ref_stats = ref_feats.stats()
    result = fid_from_stats(samples, ref_stats)
    result.extras.update(_extras(feats, ref_feats, isc, kid, prc, isc_splits, kid_subsets, kid_subset_size, seed))
    logger.debug("%s", result)  # the caller reports it (the CLI prints it once)
    return result


def _space(extractor: Any) -> dict[str, Any]:
    """The provenance keys of an extractor's feature space (`features`, `weights_sha256`) as stats record them."""
    space = getattr(extractor, "feature_space", None)
    return {**({"features": space} if space else {}), "weights_sha256": extractor.weights_sha256}


def _extras(feats: Features, ref: Features | None, isc: bool, kid: bool, prc: bool, isc_splits: int,
            kid_subsets: int, kid_subset_size: int, seed: int) -> dict[str, float]:
    out: dict[str, float] = {}
    if isc:
        out.update(inception_score(feats.logits, splits=isc_splits, seed=seed))
    if kid:
        out.update(kernel_inception_distance(feats.features, ref.features, subsets=kid_subsets,
                                             subset_size=kid_subset_size, seed=seed))
    if prc:
        out.update(precision_recall(feats.features, ref.features))
    return out
