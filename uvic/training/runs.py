"""From what training leaves on disk to something that samples: run dir / checkpoint dir / pipeline dir.

    pipe = load_pipeline("runs/cifar10_uvic_s2")              # EMA weights of the latest checkpoint
    pipe = load_pipeline("runs/cifar10_uvic_s2/pipeline")     # an exported (or any saved) pipeline
    export("runs/cifar10_uvic_s2", "runs/cifar10_uvic_s2/pipeline")

A run dir is `train.run_dir` (`config.yaml`, `checkpoints/step_*/`); a checkpoint dir holds the model, EMA and
the resolved config. The task named in that config rebuilds the model and turns it into a pipeline, so these
functions work for every registered task (`uvic.training.tasks`). `sample.py` and `train.py --export` call them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from diffusers import DiffusionPipeline
from torch import nn

from uvic.config import Config, config_from_dict
from uvic.io import check_weights_fit, weight_shapes
from uvic.pipelines.sampling import attach_text_encoder, is_pipeline_dir, load_pretrained
from uvic.training.checkpoint import (
    META,
    load_model_weights,
    read_checkpoint,
    read_checkpoint_config,
    unverifiable_checkpoints,
    write_dir_atomically,
)
from uvic.training.evaluation import read_agreed_best
from uvic.training.tasks import build_task


__all__ = ["export", "export_source", "load_pipeline", "task_from_checkpoint"]

logger = logging.getLogger(__name__)


def task_from_checkpoint(path: str | os.PathLike, weights: str = "ema") -> tuple[Any, nn.Module, Config]:
    """(task, model with the checkpoint's `weights` in eval mode, config) from a checkpoint dir or a run dir (its
    latest checkpoint). `weights` is "ema" or "model"."""
    return _read_checkpoint(path, weights)[:3]


def _read_checkpoint(path: str | os.PathLike, weights: str) -> tuple[Any, nn.Module, Config, Path, int]:
    """`task_from_checkpoint`, and the checkpoint dir it read with its step."""

    def read(ckpt: Path) -> tuple[Any, nn.Module, Config, Path, int]:
        cfg = config_from_dict(read_checkpoint_config(ckpt))
        task = build_task(cfg)
        # A config that describes another model than the weights is refused before anything is allocated.
        check_weights_fit(task.build_model, weight_shapes(ckpt / f"{weights}.safetensors"), f"checkpoint {ckpt}")
        model = load_model_weights(task.build_model(), ckpt, weights).eval()
        return task, model, cfg, ckpt, json.loads((ckpt / META).read_text())["step"]  # verified by read_checkpoint

    return read_checkpoint(path, read)  # retries when a live run rotates the chosen checkpoint away


def load_pipeline(
    source: str | os.PathLike, sampler: str | None = None, text_encoder: str | None = None
) -> DiffusionPipeline:
    """A pipeline from a pipeline dir (`model_index.json`), a training run dir or a checkpoint dir.

    From a run or checkpoint the EMA weights of the (latest) checkpoint are used, with the run's sampler.

    Args:
        source: the directory.
        sampler: switch the scheduler (`uvic.schedulers.sampler_names()`); None keeps the saved / configured one.
        text_encoder: see `uvic.pipelines.sampling.load_pretrained` (text prompts with a pipeline that has none).
    Raises:
        FileNotFoundError: `source` is neither kind of directory. ValueError: the run's task has no pipeline.
    """
    source = Path(source)
    if is_pipeline_dir(source):
        return load_pretrained(source, sampler, text_encoder)
    if not source.is_dir():
        raise FileNotFoundError(f"{source} is neither a pipeline dir (model_index.json) nor a run/checkpoint dir")
    task, model, _ = task_from_checkpoint(source)
    return attach_text_encoder(task.pipeline(model, sampler=sampler), text_encoder)


def export_source(run_dir: str | os.PathLike, which: str) -> tuple[Path, str]:
    """The checkpoint `train.py --export WHICH` means, and a few words on why it is the one: "latest" (the run dir:
    its newest checkpoint), "best" (the checkpoint `run_dir/best.json` names, a checked path inside the run dir),
    else WHICH itself (a checkpoint or run dir).

    Raises:
        FileNotFoundError: "best" without a best.json. RunRecordError: a best.json that is not a record as the run
            writes it, names a checkpoint outside the run dir, or is not backed by eval.jsonl (`read_agreed_best`).
    """
    if which == "latest":
        return Path(run_dir), "the latest checkpoint"
    if which != "best":
        return Path(which), "the checkpoint given"
    best = read_agreed_best(run_dir)  # a best.json that eval.jsonl does not back is refused
    if best is None:
        raise FileNotFoundError(f"{run_dir} has no best.json: no FID was computed while training (train.eval_every)")
    return Path(run_dir) / best["checkpoint"], f"FID {best['fid']:.4f}, the lowest FID while training (best.json)"


def export(source: str | os.PathLike, out_dir: str | os.PathLike, why: str = "") -> Path:
    """Export the EMA weights of a checkpoint (or a run's latest) with its task's `export`; returns `out_dir`.

    The export is written next to `out_dir` and renamed into place when complete: a failed write (disk full,
    read-only) raises `StorageError` and leaves an existing `out_dir` as it was. One log line names the checkpoint
    and its step (and `why`, e.g. `export_source`'s words).
    """
    task, model, _, ckpt, step = _read_checkpoint(source, "ema")
    out = write_dir_atomically(out_dir, lambda tmp: task.export(model, tmp))
    logger.info("exported step %d (%s%s%s) to %s", step, ckpt, f"; {why}" if why else "", _passed_over(source, step),
                out)
    return out


def _passed_over(source: str | os.PathLike, step: int) -> str:
    """A run dir's newer checkpoint dirs without meta.json that its latest checkpoint (`step`) passed over, in
    words for the export's log line ("" for a checkpoint dir, or none)."""
    if (Path(source) / META).is_file():
        return ""
    newer = [str(p) for s, p in unverifiable_checkpoints(source) if s > step]
    return f"; passed over the newer {', '.join(newer)}, which has no {META}" if newer else ""
