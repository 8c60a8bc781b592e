"""Feature extraction over a source (gathered across accelerate processes) and FID statistics I/O.

Statistics are U-ViT / pytorch-fid `.npz` files: ``mu`` (d,) and ``sigma`` (d, d) float64, plus metadata keys
(``mode``, ``n``, ``meta`` as JSON) that ``np.load(f)['mu']`` readers ignore. Files without ``mode`` (U-ViT's
``fid_stats_*.npz``) load as legacy stats with a warning.

mu and sigma come from the full (N, d) feature matrix in source order (float64 mean and ``np.cov``, as
pytorch-fid), so neither the batch size nor the number of processes changes the result.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset
from tqdm.auto import tqdm

from uvic.errors import DataError
from uvic.io import atomic_write, read_npz

from .inception import (
    DEFAULT_DIMS,
    DEFAULT_MODE,
    SHA256_OPTION,
    WEIGHTS_SHA256_PREFIX,
    InceptionExtractor,
    Mode,
    check_mode,
)
from .inputs import DEFAULT_VALUE_RANGE, GeneratorSource, Source, ValueRange, open_source


logger = logging.getLogger(__name__)


@dataclass
class FIDStats:
    """Gaussian statistics of Inception features.

    Attributes:
        mu: (d,) float64 mean.
        sigma: (d, d) float64 covariance.
        n: number of images (None for legacy files).
        mode: "pytorch-fid" or "tf" (None for legacy files).
        name: where the stats came from (file path or source name); used in result labels.
        meta: provenance (dims, weights SHA-256, versions, world size...).
    """

    mu: np.ndarray
    sigma: np.ndarray
    n: int | None = None
    mode: str | None = None
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def dims(self) -> int:
        return int(self.mu.shape[0])


@dataclass
class Features:
    """Inception features of N images: `features` (N, d) float32, `logits` (N, 1008) float32 or None."""

    features: torch.Tensor
    logits: torch.Tensor | None
    mode: str
    name: str
    meta: dict[str, Any]

    @property
    def n(self) -> int:
        return int(self.features.shape[0])

    def stats(self) -> FIDStats:
        """The FID statistics of these features, labelled with their mode, name and provenance."""
        return stats_from_features(self.features, mode=self.mode, name=self.name, meta=self.meta)


def validate_stats(mu: np.ndarray, sigma: np.ndarray, name: str = "stats") -> None:
    """Raise ValueError unless mu is (d,), sigma is (d, d), both finite, and sigma symmetric."""
    if mu.ndim != 1:
        raise ValueError(f"{name}: mu must be 1-D, got shape {mu.shape}")
    if sigma.shape != (mu.shape[0], mu.shape[0]):
        raise ValueError(f"{name}: sigma must be ({mu.shape[0]}, {mu.shape[0]}) to match mu, got {sigma.shape}")
    if not (np.isfinite(mu).all() and np.isfinite(sigma).all()):
        raise ValueError(f"{name}: mu or sigma contains NaN or Inf (fp16 features or a broken stats file?)")
    asym = float(np.abs(sigma - sigma.T).max(initial=0.0))
    if asym > 1e-6 * max(float(np.abs(sigma).max(initial=0.0)), 1e-12):
        raise ValueError(f"{name}: sigma is not symmetric (max |sigma - sigma.T| = {asym:.3g})")


def stats_from_features(features: torch.Tensor | np.ndarray, **kwargs: Any) -> FIDStats:
    """float64 mean and covariance (``np.cov(rowvar=False)``) of (N, d) features; kwargs go to `FIDStats`."""
    x = np.asarray(features.cpu() if torch.is_tensor(features) else features, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"features must be (N, d), got shape {x.shape}")
    n, d = x.shape
    if n < 2:
        raise ValueError(f"need at least 2 images for a covariance, got N={n}")
    if not np.isfinite(x).all():
        raise ValueError("features contain NaN or Inf")
    if n <= d:
        warnings.warn(f"N={n} <= feature dim {d}: the covariance is rank-deficient and FID is biased upwards; "
                      "published numbers use 10k-50k images", stacklevel=2)
    return FIDStats(mu=x.mean(axis=0), sigma=np.cov(x, rowvar=False), n=n, **kwargs)


def save_stats(stats: FIDStats, path: str | os.PathLike) -> None:
    """Write `stats` as an `.npz` that pytorch-fid / U-ViT can read (``mu``, ``sigma``) plus metadata."""
    validate_stats(stats.mu, stats.sigma, str(path))
    extra = {} if stats.n is None else {"n": np.int64(stats.n)}
    if stats.mode is not None:
        extra["mode"] = np.str_(stats.mode)
    with atomic_write(path) as f:  # a kill or a full disk never leaves a truncated .npz under `path`
        np.savez(f, mu=stats.mu.astype(np.float64), sigma=stats.sigma.astype(np.float64),
                 meta=np.str_(json.dumps({**stats.meta, "name": stats.name})), **extra)


def is_stats_file(path: str | os.PathLike) -> bool:
    """True if `path` is an existing ``.npz`` holding ``mu`` and ``sigma``."""
    if not str(path).endswith(".npz") or not os.path.isfile(path):
        return False
    return {"mu", "sigma"} <= set(read_npz(path, (), what="FID file")["__keys__"])


def load_stats(path: str | os.PathLike) -> FIDStats:
    """Read stats written by `save_stats`, pytorch-fid or U-ViT (``fid_stats_*.npz``: legacy, warns)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"FID statistics file {str(path)!r} does not exist")
    f = read_npz(path, ("mu", "sigma", "n", "mode", "meta"), what="FID statistics file")
    keys = set(f["__keys__"])
    if not {"mu", "sigma"} <= keys:
        raise ValueError(f"{str(path)!r} is not a FID statistics file: needs arrays 'mu' and 'sigma', "
                         f"has {sorted(keys)}")
    mu, sigma = f["mu"].astype(np.float64), f["sigma"].astype(np.float64)
    n = int(f["n"]) if "n" in keys else None
    mode = str(f["mode"]) if "mode" in keys else None
    meta = json.loads(str(f["meta"])) if "meta" in keys else {}
    validate_stats(mu, sigma, str(path))
    if mode is None:
        warnings.warn(f"{str(path)!r} has no 'mode' metadata (legacy pytorch-fid / U-ViT file); it cannot be "
                      "checked against the sample pipeline. U-ViT's fid_stats_*.npz were made with pytorch-fid: "
                      "compare them with mode='pytorch-fid' only", stacklevel=2)
    else:
        check_mode(mode)
    if n is not None and n <= mu.shape[0]:
        warnings.warn(f"{str(path)!r}: N={n} <= feature dim {mu.shape[0]}, FID against it is biased upwards",
                      stacklevel=2)
    meta.pop("name", None)
    return FIDStats(mu=mu, sigma=sigma, n=n, mode=mode, name=str(path), meta=meta)


def _provenance(extractor: InceptionExtractor, world_size: int) -> dict[str, Any]:
    import scipy
    import torch_fidelity

    space = getattr(extractor, "feature_space", None)  # a classifier's (uvic.fid.classifier); Inception: none
    return {
        **({"features": space} if space else {}),
        "dims": extractor.dims,
        "weights_sha256": extractor.weights_sha256,
        "world_size": world_size,
        "versions": {"torch": torch.__version__, "torch_fidelity": torch_fidelity.__version__,
                     "numpy": np.__version__, "scipy": scipy.__version__},
    }


def process_state() -> Any:
    """accelerate's `PartialState` (multi-CPU too when launched with ``accelerate launch --cpu``)."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    # PartialState only sets up CPU process groups when told it runs on CPU; Accelerator reads this flag itself.
    return PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))


def _gather_rows(local: torch.Tensor, state: Any) -> torch.Tensor:
    """Concatenate (n_r, k) tensors of all processes in rank order (accelerate's gather with padding)."""
    from accelerate.utils import gather

    if state.num_processes == 1:
        return local
    counts = gather(torch.tensor([local.shape[0]], device=state.device)).tolist()
    padded = torch.zeros(max(counts), *local.shape[1:], dtype=local.dtype, device=state.device)
    padded[: local.shape[0]] = local.to(state.device)
    rows = gather(padded).reshape(len(counts), max(counts), *local.shape[1:])
    return torch.cat([rows[r, :c] for r, c in enumerate(counts)]).cpu()


# Images per forward pass per process by default (pytorch-fid's); the features do not depend on it.
BATCH_SIZE = 50


def extract_features(
    source: Source,
    extractor: InceptionExtractor,
    *,
    num_samples: int | None = None,
    batch_size: int = BATCH_SIZE,
    num_workers: int = 0,
    value_range: ValueRange = DEFAULT_VALUE_RANGE,
    progress: bool = True,
    name: str | None = None,
) -> Features:
    """Inception features of every image of `source`, split across accelerate processes and gathered.

    Map-style sources are split into contiguous per-process shards; a `GeneratorSource` runs on every process
    (give each its own seed) and takes ``ceil(num_samples / world_size)`` images per process, truncated to
    `num_samples` after the gather (U-ViT's ``sample2dir``).

    Args:
        source: anything `open_source` accepts.
        extractor: the feature network (its device is the compute device).
        num_samples: use only the first `num_samples` images (None: all; required for a callable).
        batch_size: images per forward pass per process; does not change the result.
        num_workers: DataLoader workers for decoding map-style sources.
        value_range: range of float images.
        progress: show a tqdm bar on the local main process.
        name: label for the stats (default: the source's name).
    Returns:
        `Features` with (N, dims) features (and (N, 1008) logits if the extractor provides them), identical on
        every process.
    """
    state = process_state()
    src = open_source(source, value_range=value_range, num_samples=num_samples)
    name = name or getattr(src, "name", type(src).__name__)
    world, rank = state.num_processes, state.process_index

    if isinstance(src, GeneratorSource):
        total = num_samples if num_samples is not None else src.num_samples
        local_n = None if total is None else min(math.ceil(total / world), total)
        batches = src.batches(local_n, batch_size)
    else:
        total = len(src) if num_samples is None else num_samples
        if total > len(src):
            raise ValueError(f"num_samples={total} but {name} has only {len(src)} images")
        per = math.ceil(total / world)
        shard: Dataset = Subset(src, range(min(rank * per, total), min((rank + 1) * per, total)))
        local_n = len(shard)
        batches = DataLoader(shard, batch_size=batch_size, num_workers=num_workers, shuffle=False,
                             pin_memory=torch.cuda.is_available())

    feats, logits = [], []
    space = getattr(extractor, "feature_space", "Inception")
    with tqdm(total=local_n, unit="img", desc=f"{space} features ({extractor.mode})",
              disable=not (progress and state.is_local_main_process)) as bar, _worker_errors():
        for batch in batches:
            out = extractor(batch)
            feats.append(out["features"].cpu())
            if "logits" in out:
                logits.append(out["logits"].cpu())
            bar.update(len(batch))
    # A process may hold an empty shard (N < world size); it still has to join the gather.
    f_local = torch.cat(feats) if feats else torch.zeros(0, extractor.dims)
    f_all = _gather_rows(f_local, state)
    l_all = None
    if extractor.with_logits:
        l_all = _gather_rows(torch.cat(logits) if logits else torch.zeros(0, 1008), state)
    if len(f_all) == 0:
        raise ValueError(f"{name} produced no images")
    if total is not None:
        f_all = f_all[:total]
        l_all = None if l_all is None else l_all[:total]
    return Features(f_all, l_all, extractor.mode, name, _provenance(extractor, world))


@contextlib.contextmanager
def _worker_errors() -> Iterator[None]:
    """A bad-input error raised in a DataLoader worker comes back with the worker's traceback in its message
    ("Caught DataError in DataLoader worker process 0. Original Traceback ..."); keep only the original message."""
    try:
        yield
    except (DataError, ValueError, FileNotFoundError) as e:
        text = str(e)
        if not (text.startswith("Caught ") and "Original Traceback" in text):
            raise
        last = [line for line in text.splitlines() if line.strip()][-1]
        name, _, original = last.partition(": ")  # "uvic.errors.DataError: <message>"
        raise DataError(original if name.rpartition(".")[2] == type(e).__name__ else last) from e


def compute_stats(
    source: Source,
    *,
    extractor: InceptionExtractor | None = None,
    mode: Mode = DEFAULT_MODE,
    dims: int = DEFAULT_DIMS,
    weights: str | os.PathLike | None = None,
    weights_sha256: str | None = WEIGHTS_SHA256_PREFIX,
    allow_download: bool = False,
    device: torch.device | str | None = None,
    **kwargs: Any,
) -> FIDStats:
    """FID statistics of an image source (folder, `.npz`, generator, ``cifar10-train:ROOT``, COCO...).

    Args:
        source: see `uvic.fid.inputs.open_source`.
        extractor: a loaded `InceptionExtractor` (reuse it for periodic FID); otherwise one is built from
            `mode`, `dims`, `weights`, `weights_sha256`, `allow_download` on `device` (default: accelerate's).
        **kwargs: passed to `extract_features` (num_samples, batch_size, num_workers, value_range, progress, name).
    Returns:
        `FIDStats` with (dims,) mu, (dims, dims) sigma, n, mode and provenance.
    """
    if extractor is None:
        extractor = load_extractor(mode=mode, dims=dims, weights=weights, sha256=weights_sha256,
                                   allow_download=allow_download, device=device,
                                   sha256_option="weights_sha256=None")
    return extract_features(source, extractor, **kwargs).stats()


def load_extractor(
    *,
    mode: Mode = DEFAULT_MODE,
    dims: int = DEFAULT_DIMS,
    with_logits: bool = False,
    weights: str | os.PathLike | None = None,
    sha256: str | None = WEIGHTS_SHA256_PREFIX,
    allow_download: bool = False,
    device: torch.device | str | None = None,
    sha256_option: str = SHA256_OPTION,
) -> InceptionExtractor:
    """Build an `InceptionExtractor` on `device` (default: the accelerate process's device); `sha256_option` names
    the caller's way to skip the checksum in its error (`resolve_weights`). `weights` of a feature classifier
    (`.safetensors`, `uvic.fid.classifier`) give its `ClassifierExtractor` instead: its mode and width are its own
    (`mode`, `dims` and `with_logits` do not apply), its SHA-256 is checked against `sha256` unless that is None or
    the Inception weights' default."""
    from .classifier import ClassifierExtractor, is_classifier_file

    if device is None:
        device = process_state().device
    if is_classifier_file(weights):
        if with_logits:
            raise ValueError("the Inception Score needs the Inception network's logits, not a feature classifier")
        return ClassifierExtractor(weights, sha256=None if sha256 == WEIGHTS_SHA256_PREFIX else sha256).to(device)
    ext = InceptionExtractor(weights, mode=mode, dims=dims, with_logits=with_logits, sha256=sha256,
                             allow_download=allow_download, sha256_option=sha256_option)
    return ext.to(device)
