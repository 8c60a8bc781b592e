"""FID statistics and scores, comparable with U-ViT (mode pytorch-fid) or TTUR / torch-fidelity (mode tf).

    python -m uvic.fid stats cifar10-train:data/cifar10 --out cifar10_train.npz --weights pt_inception-2015-12-05-6726825d.pth
    python -m uvic.fid score samples/ fid_stats_cifar10_train_pytorch.npz --expect-n 50000
    accelerate launch -m uvic.fid score samples/ ref.npz      # features gathered across processes

SOURCE / SAMPLES: an image folder (RGB or grayscale), an .npz of images (or of stats, for score),
cifar10-train:ROOT, cifar10-test:ROOT, digits:SIZE (scikit-learn's digits as data.name=digits trains on them, e.g.
digits:8 for configs/demo_digits.yaml), coco-val2014-256:VAL2014_DIR.

Fashion-MNIST: a Fréchet distance in the features of a classifier the project trains, "FD (Fashion-MNIST
classifier)", not a FID (uvic.fid.classifier):

    python -m uvic.fid train-features fashion_mnist --out fmnist_cnn.safetensors
    python -m uvic.fid stats fashion_mnist:train --features fmnist_cnn.safetensors --out fmnist_train.npz
    python -m uvic.fid score samples/ fmnist_train.npz --features fmnist_cnn.safetensors

    python -m uvic.fid make-test-weights test_inception.pth    # offline smoke tests only: random weights
    python -m uvic.fid score samples/ ref.npz --weights test_inception.pth --weights-sha256 none
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from uvic.errors import StorageError, check_writable, cli_errors, int_at_least, storage_errors
from uvic.io import atomic_write

from .classifier import CLASSIFIER_MODE, features_of, title_of, train_features
from .classifier import DATASETS as CLASSIFIER_DATASETS
from .inception import (
    DEFAULT_DIMS,
    DEFAULT_MODE,
    DIMS,
    MODES,
    WEIGHTS_ENV,
    WEIGHTS_NAME,
    WEIGHTS_SHA256_PREFIX,
    make_test_weights,
)
from .inputs import DEFAULT_VALUE_RANGE, open_source
from .metric import compute_fid, fid_from_stats
from .stats import BATCH_SIZE, compute_stats, is_stats_file, load_extractor, load_stats, process_state, save_stats


def _value_range(text: str) -> tuple[float, float]:
    """LOW,HIGH: the float range mapped to [0, 255]; an empty or reversed range would score nonsense silently."""
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be LOW,HIGH (two numbers), got {text!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise argparse.ArgumentTypeError(f"must be LOW,HIGH with finite LOW < HIGH (e.g. -1,1), got {text!r}")
    return lo, hi


def _device(text: str) -> str:
    """--device: a torch device this machine has (a CUDA device without a GPU, or a name torch does not know,
    failed with a RuntimeError traceback once the network was moved there)."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device ({e}); e.g. cpu, cuda, cuda:1") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has no CUDA GPU that torch can use; use "
                                             f"--device cpu, or leave --device out")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA GPU(s), cuda:0 to "
                                             f"cuda:{count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text!r}: MPS is not available on this machine; use --device cpu")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"{text!r}: a {device.type} device is not supported here; use cpu or cuda")
    return text


def _joined_value_range(argv: Sequence[str]) -> list[str]:
    """`argv` with `--value-range LOW,HIGH` joined into `--value-range=LOW,HIGH` when LOW is negative: argparse takes
    "-1,1" for an option (it is not a plain negative number) and stops with "expected one argument"."""
    out, args, i = [], list(argv), 0
    while i < len(args):
        if args[i] == "--value-range" and i + 1 < len(args) and re.match(r"-[\d.]", args[i + 1]):
            out.append(f"--value-range={args[i + 1]}")
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


def _check_n(n: int | None, expected: int) -> None:
    if n != expected:
        raise ValueError(f"expected {expected} sample images, got {n}")


def default_num_workers() -> int:
    """Image-decoding workers: one per CPU core this process may use, less one for the main process, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, min(8, cores - 1))


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--mode", choices=MODES, default=DEFAULT_MODE,
                        help="pytorch-fid: U-ViT-comparable (default); tf: torch-fidelity / TTUR pipeline")
    common.add_argument("--dims", type=int, choices=DIMS, default=None,
                        help=f"Inception feature layer (default: the reference statistics' layer, else {DEFAULT_DIMS})")
    common.add_argument("--weights", help=f"path to {WEIGHTS_NAME} (default: ${WEIGHTS_ENV}, then the torch.hub cache)")
    common.add_argument("--weights-sha256", default=WEIGHTS_SHA256_PREFIX,
                        help="expected SHA-256 (prefix) of the weights; 'none' skips the check")
    common.add_argument("--download", action="store_true", help="allow downloading the weights if not found")
    common.add_argument("--batch-size", type=int_at_least(1), default=BATCH_SIZE)
    common.add_argument("--num-workers", type=int_at_least(0), default=None,
                        help="image decoding workers (default: one per usable CPU core but one, at most 8)")
    common.add_argument("--num-samples", type=int_at_least(1), help="use only the first N images")
    common.add_argument("--value-range", type=_value_range, default=DEFAULT_VALUE_RANGE,
                        help="range of float .npz images, e.g. -1,1 (default 0,1); values outside it are clamped, with a "
                             "warning giving their share")
    common.add_argument("--recursive", action="store_true", help="read image sub-folders too")
    common.add_argument("--md5-check", action="store_true", help="check the md5 of the CIFAR-10 batch files")
    common.add_argument("--device", type=_device, help="torch device (default: accelerate's)")
    common.add_argument("--features", help="a feature classifier's .safetensors (train-features) instead of Inception: "
                                           "the distance is then e.g. 'FD (Fashion-MNIST classifier)', not a FID")
    common.add_argument("--no-progress", action="store_true")
    p = argparse.ArgumentParser(prog="python -m uvic.fid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stats", parents=[common], help="compute reference statistics (.npz)")
    s.add_argument("source")
    s.add_argument("--out", required=True, help="output .npz (mu, sigma + metadata)")
    c = sub.add_parser("score", parents=[common], help="FID of samples against reference stats or images")
    c.add_argument("samples")
    c.add_argument("reference")
    c.add_argument("--expect-n", type=int_at_least(1), help="fail unless the samples hold exactly N images (50000, 30000)")
    c.add_argument("--isc", action="store_true", help="also the Inception Score")
    c.add_argument("--isc-splits", type=int_at_least(1), default=10)
    c.add_argument("--kid", action="store_true", help="also KID (reference must be images)")
    c.add_argument("--kid-subsets", type=int_at_least(1), default=100)
    c.add_argument("--kid-subset-size", type=int_at_least(1), default=1000)
    c.add_argument("--prc", action="store_true", help="also precision/recall on Inception features")
    c.add_argument("--json", help="write the result as JSON to this file")
    f = sub.add_parser("train-features", help="train a dataset's feature classifier (a small CNN, a few CPU minutes)")
    f.add_argument("dataset", choices=sorted(CLASSIFIER_DATASETS))
    f.add_argument("--out", required=True, help="output .safetensors")
    f.add_argument("--root", help="the dataset's folder (default: the Debian package's)")
    f.add_argument("--seed", type=int_at_least(0), default=0)
    f.add_argument("--epochs", type=int_at_least(1), default=4)
    f.add_argument("--threads", type=int_at_least(1), default=1, help="torch threads (the weights depend on it)")
    t = sub.add_parser("make-test-weights", help="write random-init FID-Inception weights for offline smoke tests "
                                                 "(NOT the FID network: the scores are not FIDs to report)")
    t.add_argument("out", help="output .pth")
    t.add_argument("--seed", type=int_at_least(0), default=0)
    return p


def _run(args: argparse.Namespace) -> str:
    if args.command == "make-test-weights":
        out = Path(args.out)
        if out.is_dir():
            raise StorageError(f"cannot write {out}: it is a directory")
        check_writable(out.parent, str(out))
        make_test_weights(out, seed=args.seed)
        return (f"wrote {out}: random-init FID-Inception weights (seed {args.seed}) for offline smoke tests. They are "
                "NOT the FID Inception network: scores computed with them are not FIDs to report. Use them with "
                f"--weights {out} --weights-sha256 none (train.py: train.eval_fid_weights={out} "
                "train.eval_fid_weights_sha256=none)")
    if args.command == "train-features":
        return _train_features(args)
    if args.features is not None:
        if args.weights is not None:
            raise ValueError("--features and --weights name two feature networks; pass one")
        if not args.features.endswith(".safetensors"):
            raise ValueError(f"--features {args.features}: expected the .safetensors file of train-features")
        args.weights, args.mode = args.features, CLASSIFIER_MODE
    sha = None if args.weights_sha256.lower() == "none" else args.weights_sha256
    if args.num_workers is None:
        args.num_workers = default_num_workers()
    weights = {"weights": args.weights, "sha256": sha, "allow_download": args.download, "device": args.device,
               "sha256_option": "--weights-sha256 none"}
    opts = {"batch_size": args.batch_size, "num_workers": args.num_workers, "value_range": args.value_range,
            "progress": not args.no_progress}

    def source(spec: str):
        return open_source(spec, value_range=args.value_range, recursive=args.recursive, md5_check=args.md5_check)

    for out in (getattr(args, "out", None), getattr(args, "json", None)):
        if out is not None:  # before anything is computed
            if Path(out).is_dir():
                raise StorageError(f"cannot write {out}: it is a directory")
            check_writable(Path(out).parent, str(out))
    if args.command == "stats":
        src = source(args.source)  # checks every image before the network is loaded
        ext = load_extractor(mode=args.mode, dims=args.dims or DEFAULT_DIMS, **weights)
        stats = compute_stats(src, extractor=ext, num_samples=args.num_samples, **opts)
        save_stats(stats, args.out)
        return f"wrote {args.out}: n={stats.n} dims={stats.dims} mode={stats.mode} source={stats.name}"

    for path in (args.samples, args.reference):
        if path.endswith(".npz") and not os.path.isfile(path):
            raise FileNotFoundError(f"{path!r} does not exist")
    if is_stats_file(args.samples):
        if not is_stats_file(args.reference):
            raise ValueError("samples given as statistics need reference statistics too")
        if args.isc or args.kid or args.prc:
            raise ValueError("--isc/--kid/--prc need sample images, not statistics")
        result = fid_from_stats(load_stats(args.samples), load_stats(args.reference))
    else:
        ref = load_stats(args.reference) if is_stats_file(args.reference) else source(args.reference)
        if args.features is not None and getattr(ref, "mode", CLASSIFIER_MODE) != CLASSIFIER_MODE:
            raise ValueError(f"reference {ref.name!r} holds statistics in the {features_of(ref.meta)} feature space, "
                             f"not a classifier's: a Fréchet distance across feature spaces means nothing; compute "
                             f"the reference with --features {args.features}")
        if getattr(ref, "mode", None) == CLASSIFIER_MODE and args.features is None:
            raise ValueError(f"reference {ref.name!r} holds {title_of(ref.meta)} statistics: pass --features with the "
                             f"weights they were computed with (SHA-256 {ref.meta.get('weights_sha256')})")
        if getattr(ref, "mode", None) not in (None, args.mode):  # before loading the network
            raise ValueError(f"reference {ref.name!r} was computed with mode={ref.mode!r}; pass --mode {ref.mode}")
        samples = source(args.samples)
        if args.expect_n is not None and hasattr(samples, "__len__"):
            _check_n(min(len(samples), args.num_samples or len(samples)), args.expect_n)
        dims = getattr(ref, "dims", None) or args.dims or DEFAULT_DIMS
        if args.dims is not None and dims != args.dims:  # before loading the network
            raise ValueError(f"reference {ref.name!r} holds {dims}-dim statistics, so --dims {args.dims} cannot be "
                             f"compared with it; drop --dims, or compute the reference with --dims {args.dims}")
        ext = load_extractor(mode=args.mode, dims=dims, with_logits=args.isc, **weights)
        result = compute_fid(samples, ref, num_samples=args.num_samples, extractor=ext, mode=args.mode,
                             isc=args.isc, kid=args.kid, prc=args.prc, isc_splits=args.isc_splits,
                             kid_subsets=args.kid_subsets, kid_subset_size=args.kid_subset_size, **opts)
    if args.expect_n is not None:
        _check_n(result.n, args.expect_n)
    if args.json and process_state().is_main_process:
        with atomic_write(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=2)
    return str(result)


def _train_features(args: argparse.Namespace) -> str:
    import torch

    out = Path(args.out)
    if out.is_dir():
        raise StorageError(f"cannot write {out}: it is a directory")
    if out.suffix != ".safetensors":
        raise ValueError(f"--out {out}: the weights are written as .safetensors")
    check_writable(out.parent, str(out))
    torch.set_num_threads(args.threads)
    acc, sha = train_features(args.dataset, out, root=args.root, seed=args.seed, epochs=args.epochs)
    return f"wrote {out}: {args.dataset} classifier, test accuracy {acc:.4f}, sha256 {sha}"


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point (``uvic-fid``)."""
    parser = _parser()
    args = parser.parse_args(_joined_value_range(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with cli_errors(status=2), storage_errors("stopped"):  # bad input or a failed write: one line, no traceback
        line = _run(args)
    if process_state().is_main_process:
        print(line, file=sys.stdout)


if __name__ == "__main__":
    main()
