"""FID-Inception feature extractor in two pipelines, and the offline weights policy.

The network is torch-fidelity's `FeatureExtractorInceptionV3` (the TF `inception-2015-12-05` graph with the
FID patches; same 566 state-dict keys as pytorch-fid's `pt_inception-2015-12-05-6726825d.pth`). Only the
preprocessing differs between the two modes:

* ``"pytorch-fid"`` (default, comparable with U-ViT / pytorch-fid numbers): uint8 -> float32 ``/255`` ->
  ``F.interpolate(299, bilinear, align_corners=False)`` -> ``2x - 1`` -> torch-fidelity's layers. This is
  pytorch-fid's ``InceptionV3(resize_input=True, normalize_input=True)`` input path.
* ``"tf"`` (comparable with TTUR / torch-fidelity numbers): torch-fidelity's own ``forward`` (uint8 input,
  TF1.x-exact bilinear resize, ``(x - 128) / 128``), i.e. what ``torch_fidelity.calculate_metrics`` runs.

Both run in fp32 with TF32 and autocast off. Shapes: images (B, 3, H, W) uint8; features (B, dims) float32.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Literal

import torch
import torch.nn.functional as F
from torch import nn

from uvic.io import UnsafeFileError, load_torch_data, sha256_file


logger = logging.getLogger(__name__)

Mode = Literal["pytorch-fid", "tf"]
MODES: tuple[str, ...] = ("pytorch-fid", "tf")
# The defaults of every entry point (the extractor, `compute_stats`, `compute_fid`, the CLI): the U-ViT-comparable
# pipeline and pool3, the feature layer of the standard FID.
DEFAULT_MODE: Mode = "pytorch-fid"
DEFAULT_DIMS = 2048
# Feature layers the FID-Inception provides (pytorch-fid's --dims); "logits_unbiased" is for the Inception Score.
DIMS: tuple[int, ...] = (64, 192, 768, 2048)

WEIGHTS_ENV = "UVIC_FID_WEIGHTS"
WEIGHTS_NAME = "pt_inception-2015-12-05-6726825d.pth"
WEIGHTS_URL = "https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/" + WEIGHTS_NAME
# torch-fidelity ships the same TF graph converted to the same layout under this name.
TORCH_FIDELITY_WEIGHTS_NAME = "weights-inception-2015-12-05-6726825d.pth"
# torch.hub naming convention: the suffix of the file name is the start of the file's SHA-256.
WEIGHTS_SHA256_PREFIX = "6726825d"
# How a caller of `resolve_weights`, `InceptionExtractor` or `load_extractor` skips the checksum, as the checksum
# error names it; callers that spell it otherwise pass their own (`sha256_option`).
SHA256_OPTION = "sha256=None"

_INPUT_SIZE = 299
_TRUNK = (
    "Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "MaxPool_1",
    "Conv2d_3b_1x1", "Conv2d_4a_3x3", "MaxPool_2",
    "Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d", "Mixed_6e",
    "Mixed_7a", "Mixed_7b", "Mixed_7c",
)
# Trunk stage after which each pooled feature layer is read (pytorch-fid's BLOCK_INDEX_BY_DIM).
_LAYER_AFTER = {64: "MaxPool_1", 192: "MaxPool_2", 768: "Mixed_6e", 2048: "Mixed_7c"}


def check_mode(mode: str) -> str:
    """Return `mode` if it is a known pipeline, else raise ValueError naming the choices."""
    if mode not in MODES and mode != "classifier":  # uvic.fid.classifier.CLASSIFIER_MODE: its fixed preprocessing
        raise ValueError(f"unknown FID mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


def _hub_candidates() -> list[Path]:
    ckpt = Path(torch.hub.get_dir()) / "checkpoints"
    return [ckpt / WEIGHTS_NAME, ckpt / TORCH_FIDELITY_WEIGHTS_NAME]


def resolve_weights(
    weights: str | os.PathLike | None = None,
    *,
    sha256: str | None = WEIGHTS_SHA256_PREFIX,
    allow_download: bool = False,
    sha256_option: str = SHA256_OPTION,
) -> tuple[Path, str]:
    """Find the FID-Inception weights file and check its SHA-256.

    Looks, in order, at `weights`, the ``UVIC_FID_WEIGHTS`` environment variable, and the torch.hub cache
    (``$TORCH_HOME/hub/checkpoints/pt_inception-2015-12-05-6726825d.pth`` or torch-fidelity's
    ``weights-inception-2015-12-05-6726825d.pth``). Downloads from pytorch-fid's release only when
    `allow_download` is True.

    Args:
        weights: explicit path to the weights file.
        sha256: expected SHA-256 (a prefix is enough, as in torch.hub); None skips the check (e.g. for
            self-converted weights).
        allow_download: fetch ``WEIGHTS_URL`` into the torch.hub cache if no local file is found.
        sha256_option: how the caller's user skips the check, named in the checksum error (the CLI:
            "--weights-sha256 none"; training: "train.eval_fid_weights_sha256=none").
    Returns:
        (path, full hex SHA-256 of the file).
    """
    explicit = weights if weights is not None else os.environ.get(WEIGHTS_ENV) or None
    if explicit is not None:
        path = Path(explicit).expanduser()
        if not path.is_file():
            origin = "weights argument" if weights is not None else f"${WEIGHTS_ENV}"
            raise FileNotFoundError(
                f"FID Inception weights not found at {str(path)!r} (from the {origin}). Expected the file "
                f"{WEIGHTS_NAME} (pytorch-fid) or {TORCH_FIDELITY_WEIGHTS_NAME} (torch-fidelity); get it from "
                f"{WEIGHTS_URL}"
            )
    else:
        path = next((p for p in _hub_candidates() if p.is_file()), None)
        if path is None:
            if not allow_download:
                raise FileNotFoundError(
                    f"FID Inception weights {WEIGHTS_NAME} not found. Download it from {WEIGHTS_URL} and pass its "
                    f"path with --weights / the {WEIGHTS_ENV} environment variable, or put it at "
                    f"{_hub_candidates()[0]}; or allow a download (--download / allow_download=True)."
                )
            path = _hub_candidates()[0]
            path.parent.mkdir(parents=True, exist_ok=True)
            logger.info("downloading %s to %s", WEIGHTS_URL, path)
            # torch.hub removes the partial file and raises if the hash prefix does not match.
            try:
                torch.hub.download_url_to_file(WEIGHTS_URL, str(path), hash_prefix=WEIGHTS_SHA256_PREFIX)
            except (OSError, RuntimeError) as e:  # offline: URLError (an OSError); a bad download: RuntimeError
                raise FileNotFoundError(
                    f"FID Inception weights {WEIGHTS_NAME} could not be downloaded ({type(e).__name__}: "
                    f"{' '.join(str(e).split())[:200]}). On a machine that is online, download {WEIGHTS_URL}; then "
                    f"pass its path with --weights or the {WEIGHTS_ENV} environment variable, or put it at {path}"
                ) from e
    digest = sha256_file(path)
    if sha256 is not None and not digest.startswith(sha256.lower()):
        raise ValueError(
            f"SHA-256 of {str(path)!r} is {digest}, expected it to start with {sha256!r} ({WEIGHTS_NAME}). "
            f"The file is corrupt or not the FID Inception weights; pass {sha256_option} only for weights you "
            "converted yourself (or made with `python -m uvic.fid make-test-weights`, for smoke tests)."
        )
    return path, digest


def is_standard_weights(sha256: str | None) -> bool:
    """Whether a weights file of SHA-256 `sha256` (full hex) is the FID Inception network, `WEIGHTS_NAME` (or
    torch-fidelity's copy): the check `resolve_weights` makes by default, the start of its SHA-256."""
    return isinstance(sha256, str) and sha256.lower().startswith(WEIGHTS_SHA256_PREFIX)


def make_test_weights(path: str | os.PathLike, seed: int = 0) -> Path:
    """Write random-init weights in the FID-Inception layout (torchvision `Inception3(1008)`, the 566 keys of
    `WEIGHTS_NAME`, ~96 MB) to `path`, for offline smoke tests of the FID code paths: convolutions He-normal,
    the classifier 1/sqrt(fan-in), batch norms the identity (running mean 0, variance 1), biases 0.

    They are NOT the FID Inception network: scores computed with them compare with nothing and are not FIDs to
    report. Their SHA-256 is not `WEIGHTS_SHA256_PREFIX`, so using them needs the checksum off
    (`--weights-sha256 none`), and an `InceptionExtractor` warns that they were never trained.

    Returns:
        `path` (written atomically: a failed write leaves no partial file).
    """
    import math

    import torchvision

    from uvic.io import atomic_write

    g = torch.Generator().manual_seed(seed)
    model = torchvision.models.inception.Inception3(num_classes=1008, aux_logits=False, init_weights=False)

    def init(key: str, v: torch.Tensor) -> torch.Tensor:
        if key.endswith("conv.weight"):
            return torch.randn(v.shape, generator=g) * math.sqrt(2 / v[0].numel())
        if key.endswith(("bn.weight", "running_var")):
            return torch.ones_like(v)
        if key == "fc.weight":
            return torch.randn(v.shape, generator=g) / math.sqrt(v.shape[1])
        return torch.zeros_like(v) if v.is_floating_point() else v.clone()

    state = {k: init(k, v) for k, v in model.state_dict().items()}
    with atomic_write(path) as f:
        torch.save(state, f)
    return Path(path)


def _untrained(state: dict[str, torch.Tensor]) -> bool:
    """Whether the batch norms of a FID-Inception state dict hold their initial statistics (as `make_test_weights`
    writes them): the trained network's running means and variances are not all 0 and 1."""
    means = [v for k, v in state.items() if k.endswith("running_mean")]
    variances = [v for k, v in state.items() if k.endswith("running_var")]
    return bool(means) and all(bool((m == 0).all()) for m in means) and all(bool((v == 1).all()) for v in variances)


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """Turn TF32 off for convolutions and matmuls (restored on exit); the FID network must run in true fp32."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):  # torch >= 2.9 precision API
        matmul = torch.backends.cuda.matmul
        saved = (conv.fp32_precision, matmul.fp32_precision)
        conv.fp32_precision, matmul.fp32_precision = "ieee", "ieee"
        try:
            yield
        finally:
            conv.fp32_precision, matmul.fp32_precision = saved
        return
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


class InceptionExtractor(nn.Module):
    """FID-Inception features of uint8 images, in the pipeline given by `mode`.

    Args:
        weights: path to the FID-Inception weights (see `resolve_weights` for the search order).
        mode: ``"pytorch-fid"`` or ``"tf"`` (module docstring).
        dims: pooled feature layer, one of 64, 192, 768, 2048 (2048 = pool3, the standard FID).
        with_logits: also return the 1008 unbiased logits (needed for the Inception Score).
        sha256: expected SHA-256 prefix of the weights file, None to skip the check.
        allow_download, sha256_option: see `resolve_weights`.
    """

    def __init__(
        self,
        weights: str | os.PathLike | None = None,
        *,
        mode: Mode = DEFAULT_MODE,
        dims: int = DEFAULT_DIMS,
        with_logits: bool = False,
        sha256: str | None = WEIGHTS_SHA256_PREFIX,
        allow_download: bool = False,
        sha256_option: str = SHA256_OPTION,
    ) -> None:
        super().__init__()
        from torch_fidelity import FeatureExtractorInceptionV3

        self.mode = check_mode(mode)
        if dims not in DIMS:
            raise ValueError(f"dims must be one of {DIMS}, got {dims!r}")
        self.dims, self.with_logits = dims, with_logits
        path, self.weights_sha256 = resolve_weights(weights, sha256=sha256, allow_download=allow_download,
                                                    sha256_option=sha256_option)
        self.weights_path = str(path)
        self.trained = True  # False for weights that were never trained (`_untrained`), set below
        features = [str(dims)] + (["logits_unbiased"] if with_logits else [])
        # The weights are read here with torch.load(weights_only=True), whatever the checksum setting, and handed
        # to torch-fidelity (which would unpickle a path in full) as an in-memory copy of plain tensors.
        try:
            state = load_torch_data(path, what="FID Inception weights")
            if not (isinstance(state, dict) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items())):
                raise TypeError(f"a {type(state).__name__}, not a state dict of tensors")
            self.trained = not _untrained(state)
            if not self.trained:
                logger.warning("the FID Inception weights %s were never trained (every batch-norm running mean is 0 "
                               "and every variance 1), e.g. `python -m uvic.fid make-test-weights`: the scores they "
                               "give are for smoke tests only, not FIDs to report", path)
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
            self.net = FeatureExtractorInceptionV3("inception-v3-compat", features,
                                                   feature_extractor_weights_path=buffer)
        except UnsafeFileError:
            raise
        except Exception as e:  # noqa: BLE001 - torch.load / load_state_dict: UnpicklingError, RuntimeError, ...
            cause = e.__cause__ if e.__cause__ is not None else e
            checked = "was skipped" if sha256 is None else "passed"
            raise ValueError(
                f"cannot load the FID Inception weights {str(path)!r} ({type(cause).__name__}: "
                f"{' '.join(str(cause).split())[:200]}); the file is corrupt or not {WEIGHTS_NAME} (its SHA-256 "
                f"check {checked})"
            ) from e

    def provenance(self) -> dict[str, Any]:
        """What the features come from, as a run's FID records name it: {"weights": the weights file's name,
        "weights_sha256": its full SHA-256, "standard_weights": whether it is the FID Inception network (its SHA-256
        starts with `WEIGHTS_SHA256_PREFIX`, the check `resolve_weights` makes by default), "trained": False for
        never-trained weights such as `make_test_weights`', "mode", "dims"}."""
        return {"weights": Path(self.weights_path).name, "weights_sha256": self.weights_sha256,
                "standard_weights": is_standard_weights(self.weights_sha256), "trained": self.trained,
                "mode": self.mode, "dims": self.dims}

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """
        Args:
            images: (B, 3, H, W) uint8 RGB, any H, W.
        Returns:
            {"features": (B, dims) float32} plus {"logits": (B, 1008) float32} when `with_logits`.
        """
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"expected (B, 3, H, W) uint8 images, got {tuple(images.shape)} {images.dtype}")
        images = images.to(next(self.net.parameters()).device)
        with exact_fp32(), torch.autocast(images.device.type, enabled=False):
            if self.mode == "tf":
                out = self.net(images)
            else:
                out = self._forward_pytorch_fid(images)
        result = {"features": out[0].float()}
        if self.with_logits:
            result["logits"] = out[1].float()
        return result

    def _forward_pytorch_fid(self, images: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # pytorch-fid input path: ToTensor ([0, 1]) -> bilinear 299 (half-pixel centres) -> [-1, 1].
        x = images.float() / 255
        x = F.interpolate(x, size=(_INPUT_SIZE, _INPUT_SIZE), mode="bilinear", align_corners=False)
        x = 2 * x - 1
        # The FID-Inception body, in torch-fidelity's layer order; pooled features read as pytorch-fid does.
        stop = _LAYER_AFTER[2048 if self.with_logits else self.dims]
        feats = None
        for name in _TRUNK:
            x = getattr(self.net, name)(x)
            if name == _LAYER_AFTER[self.dims]:
                feats = F.adaptive_avg_pool2d(x, output_size=(1, 1)).flatten(1)
            if name == stop:
                break
        if not self.with_logits:
            return (feats,)
        pool3 = self.net.AvgPool(x).flatten(1)
        logits = pool3.mm(self.net.fc.weight.T)  # torch-fidelity's "logits_unbiased": no bias.
        return feats, logits
