"""FID while training: `train.eval_every` steps, a FID of the sampling (EMA) weights, the best checkpoint.

Each evaluation generates `train.eval_num_images` images with the harness's protocol (`sample.py --out-dir`:
image i from seed `sample.seed + i` with the conditions the task gives it, `Task.image_conditions("fid")`: class
i % num_classes, or for t2i a random caption of the stored validation features), split across processes, and
scores them with `uvic.fid.compute_fid` against `train.eval_reference`.
The number is a training monitor (U-ViT's fid10k with the training sampler), not a paper's FID-50k.

On disk, in the run dir:

    eval.jsonl   one line per evaluated step: {"step", "fid", "num_images", "dims", "sampler", "steps", "checkpoint"}
    best.json    the evaluated checkpoint with the lowest FID: {"step", "fid", "checkpoint"}

"checkpoint" is relative to the run dir (checkpoints/step_000001000), so a run dir can be moved.

Both are rewritten whole and renamed into place, so a kill never leaves a partial or duplicated line, and
checkpoint rotation never deletes the checkpoint `best.json` names (`best_checkpoint`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from uvic.errors import ConfigError
from uvic.io import atomic_write


logger = logging.getLogger(__name__)

__all__ = ["EVAL_LOG", "BEST", "Evaluator", "best_checkpoint", "read_evaluations", "record_evaluation"]

EVAL_LOG = "eval.jsonl"
BEST = "best.json"


def read_evaluations(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of `run_dir/eval.jsonl` by step (a line that does not parse, e.g. one written by another tool and
    cut short, is skipped)."""
    path = Path(run_dir) / EVAL_LOG
    by_step: dict[int, dict[str, Any]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                by_step[int(rec["step"])] = rec
            except (ValueError, KeyError, TypeError):
                continue
    return [by_step[s] for s in sorted(by_step)]


def _write_evaluations(run_dir: Path, records: list[dict[str, Any]]) -> None:
    """Rewrite eval.jsonl with `records` and best.json with the lowest FID among them (removed if none)."""
    with atomic_write(run_dir / EVAL_LOG, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    if not records:
        (run_dir / BEST).unlink(missing_ok=True)
        return
    best = min(records, key=lambda r: r["fid"])
    with atomic_write(run_dir / BEST, "w") as f:
        json.dump({"step": best["step"], "fid": best["fid"], "checkpoint": best["checkpoint"]}, f)


def record_evaluation(run_dir: str | os.PathLike, record: dict[str, Any]) -> None:
    """Add (or replace, for a step evaluated again after a resume) the record of `record["step"]` and update
    best.json. Main process only."""
    run_dir = Path(run_dir)
    records = [r for r in read_evaluations(run_dir) if r["step"] != record["step"]]
    _write_evaluations(run_dir, sorted([*records, record], key=lambda r: r["step"]))


def abandon_evaluations_after(run_dir: str | os.PathLike, step: int, dest: str | os.PathLike) -> None:
    """A run resumed from `step` abandons the newer checkpoints: their records move to `dest` (a JSON-lines file
    next to the abandoned checkpoints), and best.json is chosen among the remaining ones."""
    run_dir = Path(run_dir)
    records = read_evaluations(run_dir)
    newer = [r for r in records if r["step"] > step]
    if newer:
        with open(dest, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in newer)
        _write_evaluations(run_dir, [r for r in records if r["step"] <= step])


def best_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint dir best.json names, or None without one (no evaluation yet, or FID while training off)."""
    path = Path(run_dir) / BEST
    if not path.is_file():
        return None
    try:
        return Path(run_dir) / json.loads(path.read_text())["checkpoint"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a best-checkpoint record ({type(e).__name__}: {e})") from None


class Evaluator:
    """FID of the sampling weights at `train.eval_every` steps; built at start-up, before any training, so that a
    missing reference, a reference of another resolution or feature size, or missing Inception weights stop the
    run at once with one line.

    Args:
        cfg: the run config (`train.eval_*`, `sample.*`).
        task: the run's task: its autoencoder, its pipeline and the conditions of each image.
        state: the run's `Accelerator` (processes, device).
    Raises:
        ConfigError: FID for a task without images, no `train.eval_reference`, or a latent model without its
            autoencoder.
        FileNotFoundError / ValueError: the reference or the weights cannot be used (the message says why).
    """

    def __init__(self, cfg: Any, task: Any, state: Any) -> None:
        from uvic.fid import compute_stats, load_extractor, load_stats, open_source
        from uvic.fid.inception import DIMS
        from uvic.fid.stats import is_stats_file

        tc = cfg.train
        if not task.makes_images:
            raise ConfigError(f"train.eval_every: a {cfg.task!r} run makes no images to compute a FID of")
        if not tc.eval_reference:
            raise ConfigError("train.eval_every needs train.eval_reference (FID statistics .npz, an image folder or "
                              "a dataset spec such as cifar10-train:DIR)")
        self.cfg, self.task, self.state = cfg, task, state
        if tc.eval_fid_dims not in DIMS:
            raise ConfigError(f"config key train.eval_fid_dims: {tc.eval_fid_dims} is not one of {list(DIMS)} (the "
                              "FID-Inception feature layers)")
        self.num_images, self.dims = tc.eval_num_images, tc.eval_fid_dims
        self.sampler = tc.eval_sampler or cfg.sample.sampler
        self.steps = tc.eval_steps or cfg.sample.num_inference_steps
        try:
            self.vae = task.load_vae()
        except ValueError as e:
            raise ConfigError(f"train.eval_every: {e}") from None
        # The reference first (cheap), then the weights, then the reference's statistics.
        ref, dims = tc.eval_reference, self.dims
        reference = None
        if str(ref).endswith(".npz") and not os.path.isfile(ref):
            raise FileNotFoundError(f"train.eval_reference {ref!r} does not exist")
        if is_stats_file(ref):
            reference = load_stats(ref)
            if reference.dims != dims:
                raise ValueError(f"train.eval_reference {ref!r} holds {reference.dims}-d features, the FID network "
                                 f"gives {dims}-d")
        else:
            try:
                images = open_source(ref)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"train.eval_reference: {e}") from None
            (h, w, _), size = self.image_shape, tuple(images[0].shape[-2:])
            if size != (h, w):
                raise ValueError(f"train.eval_reference {ref!r} holds {size[1]}x{size[0]} images, the model makes "
                                 f"{w}x{h} ones")
        sha = tc.eval_fid_weights_sha256
        sha_kw = {} if sha == "" else {"sha256": None if sha.lower() == "none" else sha}
        self.extractor = load_extractor(weights=tc.eval_fid_weights or None, dims=dims, device=state.device,
                                        sha256_option="train.eval_fid_weights_sha256=none", **sha_kw)
        self.reference = reference or compute_stats(images, extractor=self.extractor, progress=False)
        self.conditions = task.image_conditions("fid", self.num_images)
        logger.info("FID%s: fid%d (%d-d features), sampler %s with %d steps, reference %s",
                    f" every {tc.eval_every} steps" if tc.eval_every else "", self.num_images, self.dims, self.sampler,
                    self.steps, ref)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of the generated images (the VAE's decoded size for latent models)."""
        m = self.cfg.model
        if self.vae is None:
            return m.img_size, m.img_size, m.in_chans
        side = m.img_size * 2 ** (len(self.vae.config.block_out_channels) - 1)
        return side, side, self.vae.config.out_channels

    @staticmethod
    def recorded(run_dir: str | os.PathLike, step: int) -> bool:
        """Whether eval.jsonl holds the evaluation of `step` (False for a resumed checkpoint whose evaluation a kill
        interrupted)."""
        return any(r["step"] == step for r in read_evaluations(run_dir))

    def fid(self, model: nn.Module, first_seed: int | None = None, step: int | None = None) -> float:
        """The FID of `model` (eval mode; every process calls this) over images i < N from seeds `first_seed + i`
        (default `sample.seed`, the protocol's), with the conditions of image i. The global RNG states are left as
        they were."""
        from uvic.fid import compute_fid

        devices = [self.state.device] if self.state.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            result = compute_fid(self._batches(model, step, first_seed), self.reference, num_samples=self.num_images,
                                 extractor=self.extractor, batch_size=self.cfg.sample.batch_size, progress=False)
        return result.fid

    def evaluate(self, model: nn.Module, step: int, run_dir: str | os.PathLike, checkpoint: str) -> float:
        """The FID of `model` (the sampling weights, eval mode; every process calls this); the main process records
        it in eval.jsonl / best.json with `checkpoint` (relative to `run_dir`). The global RNG states are left as
        they were, so a run that evaluates continues exactly as a resumed one."""
        fid = self.fid(model, step=step)
        record = {"step": step, "fid": fid, "num_images": self.num_images, "dims": self.dims,
                  "sampler": self.sampler, "steps": self.steps, "checkpoint": checkpoint}
        if self.state.is_main_process:
            record_evaluation(run_dir, record)
        logger.info("step=%07d fid%d=%.4f (%s, %d steps)", step, self.num_images, fid, self.sampler, self.steps)
        return fid

    def _batches(self, model: nn.Module, step: int | None = None,
                 first_seed: int | None = None) -> Iterator[torch.Tensor]:
        """This process's images as (B, H, W, 3) uint8 batches: images [rank * per, (rank + 1) * per), per =
        ceil(N / processes), image i from seed `first_seed + i` (default `sample.seed`); the gather keeps the first
        N, so the set does not depend on the process count. `step` only names the progress bar."""
        from tqdm.auto import tqdm

        from uvic.pipelines.sampling import generate

        s, n = self.cfg.sample, self.num_images
        seed0 = s.seed if first_seed is None else first_seed
        per = math.ceil(n / self.state.num_processes)
        first = self.state.process_index * per
        pipe = self.task.pipeline(model, vae=self.vae, sampler=self.sampler)
        pipe.to(self.state.device)
        pipe.set_progress_bar_config(disable=True)
        desc = f"fid{n}" if step is None else f"fid{n} at step {step}"
        with tqdm(total=per, unit="img", desc=desc, leave=False,
                  disable=not self.state.is_local_main_process) as bar:  # fmt: skip
            for k in range(first, first + per, s.batch_size):
                idx = list(range(k, min(k + s.batch_size, first + per)))
                images = generate(pipe, [seed0 + i for i in idx], batch_size=s.batch_size,
                                  num_inference_steps=self.steps, progress=bar, **self.conditions.kwargs(idx))
                if images.shape[-1] == 1:  # grey images: the FID network takes RGB
                    images = images.repeat(3, axis=-1)
                yield torch.from_numpy(images)
