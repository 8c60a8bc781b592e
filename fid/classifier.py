"""A feature space for 28x28 grayscale images: the penultimate layer of a small Fashion-MNIST classifier the project
trains, beside the FID-Inception network (as MNIST papers use a LeNet's features).

    python -m uvic.fid train-features fashion_mnist --out W.safetensors      # a few CPU minutes, prints accuracy
    python -m uvic.fid stats fashion_mnist:train --features W.safetensors --out ref.npz
    python -m uvic.fid score samples/ ref.npz --features W.safetensors

The Fréchet distance in these features is labelled "FD (Fashion-MNIST classifier)" (`TITLES`), never "FID": it is
not comparable with any Inception number. The weights' SHA-256 goes into every statistics file and result
(`meta["weights_sha256"]`, with `meta["features"]` naming the space), and statistics of other features (Inception,
or a classifier with other weights) are refused (`check_same_features`).

Weights are a `.safetensors` file (no code runs when loading it) whose metadata names the feature space
(`FEATURES_KEY`), its width and the test accuracy measured when it was trained. The extractor takes what every FID
source yields, (B, 3, H, W) uint8 (a grayscale image's channel repeated), takes the mean of the three channels
(a gray image's value), maps it to [-1, 1] as training does (`p / 127.5 - 1`) and centre-crops a padded image (32x32) to 28x28.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from uvic.errors import DataError
from uvic.io import sha256_file


logger = logging.getLogger(__name__)

# The FID "mode" of a classifier feature space: its preprocessing is fixed (the one above), so no choice remains.
CLASSIFIER_MODE = "classifier"
FEATURES_KEY = "uvic_features"
INFO_KEY = "uvic"
# Feature space -> the name its Fréchet distances carry in every output.
TITLES = {"fashion_mnist-classifier": "FD (Fashion-MNIST classifier)"}
INCEPTION = "inception"
SIDE = 28
FEATURE_DIMS = 128


class FashionCNN(nn.Module):
    """conv3x3(32) - ReLU - maxpool2 - conv3x3(64) - ReLU - maxpool2 - linear(128) - ReLU [features] - linear(10).

    Input (B, 1, 28, 28) float in [-1, 1]; `forward` returns (B, 10) logits, `features` (B, 128).
    """

    def __init__(self, num_classes: int = 10, dims: int = FEATURE_DIMS) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc = nn.Linear(64 * 7 * 7, dims)
        self.head = nn.Linear(dims, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return F.relu(self.fc(x.flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def accuracy(model: FashionCNN, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> float:
    """Top-1 accuracy of `model` on (N, 1, 28, 28) images in [-1, 1] and (N,) labels."""
    model.eval()
    with torch.inference_mode():
        right = sum(int((model(x[i : i + batch_size]).argmax(1) == y[i : i + batch_size]).sum())
                    for i in range(0, len(x), batch_size))
    return right / len(x)


def train_classifier(train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor], *,
                     seed: int = 0, epochs: int = 4, batch_size: int = 128, lr: float = 1e-3,
                     log_every: int = 100) -> tuple[FashionCNN, float]:
    """Train `FashionCNN` with Adam (`lr` decayed to 0 along a cosine over all steps: 3 epochs at a constant 1e-3
    reached 89.9% on Fashion-MNIST's test set) on (N, 1, 28, 28) images in [-1, 1] and (N,) labels; deterministic
    from `seed`
    at a fixed `torch.get_num_threads()` (the initial weights and the order of the batches come from it).

    Returns:
        (the model in eval mode, its top-1 accuracy on `test`).
    """
    torch.manual_seed(seed)
    model = FashionCNN()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    x, y = train
    step, t0, total = 0, time.monotonic(), epochs * math.ceil(len(x) / batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), batch_size):
            idx = order[i : i + batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if log_every and step % log_every == 0:
                logger.info("epoch %d step %d loss %.4f (%.0f s)", epoch + 1, step, loss.item(), time.monotonic() - t0)
        logger.info("epoch %d: test accuracy %.4f", epoch + 1, acc := accuracy(model, *test))
    return model.eval(), acc


def save_classifier(model: FashionCNN, path: str | os.PathLike, *, features: str, meta: dict[str, Any]) -> str:
    """Write the weights as safetensors with the feature space's name and `meta` in the header; returns the
    file's SHA-256, the same for the same weights and `meta` (the header's metadata is one key, `INFO_KEY`, holding
    sorted JSON: safetensors writes a metadata map in no fixed order)."""
    from safetensors.torch import save_file

    info = {FEATURES_KEY: features, "dims": model.fc.out_features, **meta}
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={INFO_KEY: json.dumps(info, sort_keys=True)})
    return sha256_file(path)


def read_classifier_meta(path: str | os.PathLike) -> dict[str, str]:
    """The header metadata of a classifier weights file (no tensor is read).

    Raises:
        FileNotFoundError: no such file. DataError: not a safetensors file, or one without `FEATURES_KEY`.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"feature classifier weights {path} do not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(INFO_KEY, "{}"))
    except Exception as e:  # noqa: BLE001 - safetensors reports damage in its own types
        raise DataError(f"{path} is not a safetensors file ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        meta = {}
    if meta.get(FEATURES_KEY) not in TITLES:
        raise DataError(f"{path} holds no feature classifier (its metadata has no {FEATURES_KEY} of "
                        f"{sorted(TITLES)}); make one with `python -m uvic.fid train-features fashion_mnist --out "
                        f"{path.name}`")
    return {k: str(v) for k, v in meta.items()}


def is_classifier_file(path: str | os.PathLike | None) -> bool:
    """Whether `path` names a classifier weights file by its suffix (`.safetensors`); Inception weights are .pth."""
    return path is not None and str(path).endswith(".safetensors")


class ClassifierExtractor(nn.Module):
    """The features of a trained `FashionCNN`, with the interface of `InceptionExtractor` (`mode`, `dims`,
    `with_logits`, `weights_sha256`, `__call__`), so that every FID entry point takes it.

    Args:
        weights: the `.safetensors` file of `train-features`.
        sha256: expected SHA-256 (a prefix is enough) of the file; None: no check.
    Raises:
        FileNotFoundError / DataError: see `read_classifier_meta`; ValueError: the checksum differs.
    """

    with_logits = False
    mode = CLASSIFIER_MODE

    def __init__(self, weights: str | os.PathLike, sha256: str | None = None) -> None:
        from safetensors.torch import load_file

        super().__init__()
        meta = read_classifier_meta(weights)
        self.weights_path = str(weights)
        self.weights_sha256 = sha256_file(weights)
        if sha256 and not self.weights_sha256.startswith(sha256.lower()):
            raise ValueError(f"{weights}: SHA-256 {self.weights_sha256} does not start with the expected {sha256}")
        self.feature_space, self.dims = meta[FEATURES_KEY], int(meta["dims"])
        self.title = TITLES[self.feature_space]
        self.net = FashionCNN(dims=self.dims)
        try:
            self.net.load_state_dict(load_file(str(weights)))
        except RuntimeError as e:
            raise DataError(f"{weights}: not the weights of the {self.feature_space} network ({e})") from None
        self.net.eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.net.fc.weight.device

    def provenance(self) -> dict[str, Any]:
        """What the features come from, as `InceptionExtractor.provenance` says it: {"weights", "weights_sha256",
        "standard_weights": False (not the FID Inception network), "trained": True, "mode", "dims", "title": what
        the distance is called}."""
        from pathlib import Path

        return {"weights": Path(self.weights_path).name, "weights_sha256": self.weights_sha256,
                "standard_weights": False, "trained": True, "mode": self.mode, "dims": self.dims,
                "title": self.title}

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, 3, H, W) or (B, 1, H, W) uint8, H = W >= 28 (centre-cropped to 28) -> {"features": (B, dims) float32}."""
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] not in (1, 3):
            raise ValueError(f"the classifier takes (B, 3, H, W) uint8 images, got {images.dtype} "
                             f"{tuple(images.shape)}")
        h, w = images.shape[-2:]
        if h < SIDE or w < SIDE:
            raise ValueError(f"the {self.feature_space} network takes 28x28 images (or larger, centre-cropped), got "
                             f"{w}x{h}")
        top, left = (h - SIDE) // 2, (w - SIDE) // 2
        x = images[..., top : top + SIDE, left : left + SIDE].to(self.device, torch.float32).mean(1, keepdim=True)
        return {"features": self.net.features(x / 127.5 - 1.0).float()}


def features_of(meta: dict[str, Any]) -> str:
    """The feature space a statistics file's or result's provenance names (`INCEPTION` when none: every file made
    before classifier features existed, and U-ViT's)."""
    return str(meta.get("features") or INCEPTION)


def title_of(meta: dict[str, Any]) -> str:
    """What a Fréchet distance in the space of `meta` is called: "FID", or the classifier's `TITLES` entry."""
    return TITLES.get(features_of(meta), "FID")


def check_same_features(a: dict[str, Any], b: dict[str, Any], a_name: str = "samples",
                        b_name: str = "reference") -> None:
    """Refuse two provenances (`meta`) of different feature spaces, or of one classifier space with weights of
    different SHA-256 (Inception weights differing only warn, in `check_compatible`).

    Raises:
        ValueError: naming both spaces or both checksums.
    """
    fa, fb = features_of(a), features_of(b)
    if fa != fb:
        raise ValueError(f"{a_name} are in the {fa} feature space, {b_name} in the {fb} one: a Fréchet distance "
                         f"across feature spaces means nothing; compute both with the same network")
    if fa in TITLES:
        wa, wb = a.get("weights_sha256"), b.get("weights_sha256")
        if wa != wb:
            raise ValueError(f"{a_name} come from {fa} weights of SHA-256 {str(wa)[:16]}, {b_name} from weights of "
                             f"SHA-256 {str(wb)[:16]}: a distance across two networks' features is refused; compute "
                             f"both with the same weights file")


# ---------------------------------------------------------------------------------------------------------
# train-features: the datasets a classifier can be trained on
# ---------------------------------------------------------------------------------------------------------


def _fashion_mnist(root: str | None) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    from uvic.data.fashion_mnist import load_fashion_mnist, to_model_range

    out = []
    for split in ("train", "test"):
        images, labels = load_fashion_mnist(root, split)
        out.append((to_model_range(images), torch.from_numpy(labels)))
    return out[0], out[1]


DATASETS = {"fashion_mnist": ("fashion_mnist-classifier", _fashion_mnist)}


def train_features(dataset: str, out: str | os.PathLike, *, root: str | None = None, seed: int = 0,
                   epochs: int = 4) -> tuple[float, str]:
    """Train the classifier of `dataset` (`DATASETS`) and write it to `out`; returns (test accuracy, SHA-256)."""
    if dataset not in DATASETS:
        raise ValueError(f"no feature classifier for dataset {dataset!r}; choose one of {sorted(DATASETS)}")
    features, load = DATASETS[dataset]
    train, test = load(root)
    t0 = time.monotonic()
    model, acc = train_classifier(train, test, seed=seed, epochs=epochs)
    meta = {"dataset": dataset, "seed": seed, "epochs": epochs, "test_accuracy": round(acc, 4),
            "train_images": len(train[0]), "test_images": len(test[0]), "threads": torch.get_num_threads()}
    sha = save_classifier(model, out, features=features, meta=meta)
    logger.info("trained in %.0f s", time.monotonic() - t0)
    return acc, sha
