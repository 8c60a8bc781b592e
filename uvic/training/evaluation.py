"""FID while training: `train.eval_every` steps, a FID of the sampling (EMA) weights, the best checkpoint.

Each evaluation generates `train.eval_num_images` images with the harness's protocol (`sample.py --out-dir`:
image i from seed `sample.seed + i` with the conditions the task gives it, `Task.image_conditions("fid")`: class
i % num_classes, or for t2i a random caption of the stored validation features), split across processes, and
scores them with `uvic.fid.compute_fid` against `train.eval_reference` in the FID mode `train.eval_fid_mode`.
The number is a training monitor (U-ViT's fid10k with the training sampler), not a paper's FID-50k.

On disk, in the run dir:

    eval.jsonl   one line per evaluated step: {"step", "fid", "num_images", "dims", "sampler", "steps", "checkpoint",
                 and the FID network: "weights" (file name), "weights_sha256", "standard_weights", "trained", "mode"}
    best.json    the evaluated checkpoint with the lowest FID among those that exist: {"step", "fid", "checkpoint"}
    eval_reference.npz   the statistics of an image reference (a folder or a dataset spec), computed once and
                 reused while the images, the FID network, its layer and mode stay the same

"checkpoint" is relative to the run dir (checkpoints/step_000001000), so a run dir can be moved.

Both records are rewritten whole and renamed into place, so a kill never leaves a partial or duplicated line, and
checkpoint rotation never deletes the checkpoint `best.json` names (`best_checkpoint`). Every reader checks every
record (`read_evaluations`, `read_best`): an integer step, a finite FID, a checkpoint path inside the run dir, the
types of the other fields; anything else (a hand edit, another tool's line, bytes that are not text) is a
`RunRecordError` naming the file and the line, which a run reports at start-up, before it trains.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator

import torch
from torch import nn

from uvic.errors import ConfigError, RunRecordError
from uvic.io import atomic_write
from uvic.training.checkpoint import META


logger = logging.getLogger(__name__)

__all__ = ["EVAL_LOG", "BEST", "REFERENCE_CACHE", "Evaluator", "best_checkpoint", "check_fid_config",
           "read_agreed_best", "read_best", "read_evaluations", "record_evaluation", "refresh_best"]

EVAL_LOG = "eval.jsonl"
BEST = "best.json"
REFERENCE_CACHE = "eval_reference.npz"


# ---------------------------------------------------------------------------------------------------------
# The records: eval.jsonl and best.json
# ---------------------------------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# What each field of a record must be: (test, description). best.json holds the first three.
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step": (lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    "fid": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
            "a finite number"),
    "checkpoint": (lambda v: isinstance(v, str), "a path relative to the run dir"),
    "num_images": (_is_int, "an integer"),
    "dims": (_is_int, "an integer"),
    "sampler": (lambda v: isinstance(v, str), "a string"),
    "steps": (_is_int, "an integer"),
    "weights": (lambda v: isinstance(v, str), "a string"),
    "weights_sha256": (lambda v: isinstance(v, str), "a string"),
    "standard_weights": (lambda v: isinstance(v, bool), "true or false"),
    "trained": (lambda v: isinstance(v, bool), "true or false"),
    "mode": (lambda v: isinstance(v, str), "a string"),
}
_BEST_FIELDS = ("step", "fid", "checkpoint")


def _problem(record: Any, run_dir: Path) -> str | None:
    """What is wrong with an eval.jsonl / best.json record, or None."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    missing = [k for k in _BEST_FIELDS if k not in record]
    if missing:
        return f"no {', '.join(map(repr, missing))}"
    for key, value in record.items():
        test, text = _FIELDS.get(key, (lambda v: True, ""))
        if not test(value):
            return f"{key!r} is {json.dumps(value)}, not {text}"
    rel = PurePosixPath(record["checkpoint"])
    inside = (str(rel) not in ("", ".") and not rel.is_absolute() and ".." not in rel.parts
              and run_dir.resolve() in (run_dir / rel).resolve().parents)
    if not inside:
        return f"'checkpoint' is {json.dumps(record['checkpoint'])}, which is not a path inside the run dir"
    return None


def read_evaluations(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of `run_dir/eval.jsonl` by step (a step evaluated twice keeps its later record).

    Raises:
        RunRecordError: a line that is not a record as the run writes it (the file and line are named).
    """
    run_dir = Path(run_dir)
    path = run_dir / EVAL_LOG
    by_step: dict[int, dict[str, Any]] = {}
    if not path.is_file():
        return []
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunRecordError(f"{path} is not UTF-8 text (byte {e.start}: {e.reason}); it is this run's record of "
                             f"its FID evaluations: restore it or remove it") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            problem = f"not JSON ({e})"
        else:
            problem = _problem(record, run_dir)
        if problem is not None:
            raise RunRecordError(f"{path} line {n} is not an evaluation record: {problem}; correct or delete the "
                                 f"line")
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def read_best(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The record of `run_dir/best.json` ({"step", "fid", "checkpoint"}), or None without one.

    Raises:
        RunRecordError: best.json is not such a record, or names a checkpoint outside the run dir.
    """
    run_dir = Path(run_dir)
    path = run_dir / BEST
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_bytes().decode("utf-8"))
        problem = _problem(record, run_dir)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        problem = f"not JSON ({e})"
    if problem is None and set(record) != set(_BEST_FIELDS):
        problem = f"keys {sorted(record)}, expected {sorted(_BEST_FIELDS)}"
    if problem is not None:
        raise RunRecordError(f"{path} is not a best-checkpoint record: {problem}; delete it and the run writes it "
                             f"again from {EVAL_LOG} when it starts")
    return record


def read_agreed_best(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    """`read_best`, checked against eval.jsonl: best.json must name the lowest FID of eval.jsonl among the
    checkpoints that exist, as the run writes it (`train.py --export best` exports only that).

    Raises:
        RunRecordError: see `read_best` and `read_evaluations`; or a best.json that eval.jsonl does not back (one
            written or edited by hand, or naming a checkpoint removed since), saying what eval.jsonl holds.
    """
    best = read_best(run_dir)
    if best is None:
        return None
    run_dir = Path(run_dir)
    records = read_evaluations(run_dir)
    expected = _best(run_dir, records)
    if best == expected:
        return best
    said = f"{run_dir / BEST} names {best['checkpoint']} (step {best['step']}, FID {best['fid']:.4f})"
    if not any({k: r[k] for k in _BEST_FIELDS} == best for r in records):
        why = f"{EVAL_LOG} holds no such evaluation" + ("" if records else " (it holds none)")
    elif not _exists(run_dir, best):
        why = "that checkpoint no longer exists"
    else:
        why = "that is not the lowest FID of " + EVAL_LOG
    now = (f"; the lowest FID of {EVAL_LOG} among the checkpoints that exist is {expected['checkpoint']} (step "
           f"{expected['step']}, FID {expected['fid']:.4f})" if expected is not None else "")
    raise RunRecordError(f"{said}, but {why}{now}: export a checkpoint by its path, or resume the run, which writes "
                         f"{BEST} again from {EVAL_LOG}")


def best_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The checkpoint dir best.json names, or None without one (no evaluation yet, or FID while training off).

    Raises:
        RunRecordError: see `read_best`.
    """
    best = read_best(run_dir)
    return None if best is None else Path(run_dir) / best["checkpoint"]


def _exists(run_dir: Path, record: dict[str, Any]) -> bool:
    """Whether the checkpoint a record names is complete on disk (its meta.json is written last)."""
    return (run_dir / record["checkpoint"] / META).is_file()


def _best(run_dir: Path, records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The best.json record of `records`: the lowest FID among the checkpoints that exist (None if none does)."""
    best = min((r for r in records if _exists(run_dir, r)), key=lambda r: r["fid"], default=None)
    return None if best is None else {k: best[k] for k in _BEST_FIELDS}


def _write_best(run_dir: Path, best: dict[str, Any] | None) -> None:
    if best is None:
        (run_dir / BEST).unlink(missing_ok=True)
        return
    with atomic_write(run_dir / BEST, "w") as f:
        json.dump(best, f)


def _write_evaluations(run_dir: Path, records: list[dict[str, Any]]) -> None:
    """Rewrite eval.jsonl with `records` and best.json from them (removed if no evaluated checkpoint exists)."""
    with atomic_write(run_dir / EVAL_LOG, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    _write_best(run_dir, _best(run_dir, records))


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


def refresh_best(run_dir: str | os.PathLike) -> None:
    """Make best.json name the lowest FID of eval.jsonl among the checkpoints that exist, saying why it changes (a
    best checkpoint deleted by hand). A run calls this when it starts (main process), after `read_best` and
    `read_evaluations` have checked both files."""
    run_dir = Path(run_dir)
    old, new = read_best(run_dir), _best(run_dir, read_evaluations(run_dir))
    if old == new:
        return
    now = (f"it now names {new['checkpoint']} (step {new['step']}, FID {new['fid']:.4f}), the lowest FID among the "
           f"evaluated checkpoints that exist" if new is not None else "no evaluated checkpoint exists, so it is removed")
    if old is None:
        logger.info("%s: %s", run_dir / BEST, now)
    elif not _exists(run_dir, old):
        logger.warning("%s named %s (step %d, FID %.4f), which no longer exists (deleted by hand?); %s",
                       run_dir / BEST, old["checkpoint"], old["step"], old["fid"], now)
    else:
        logger.warning("%s named %s (step %d, FID %.4f), which is not the lowest FID of %s; %s", run_dir / BEST,
                       old["checkpoint"], old["step"], old["fid"], EVAL_LOG, now)
    _write_best(run_dir, new)


# ---------------------------------------------------------------------------------------------------------
# The evaluator
# ---------------------------------------------------------------------------------------------------------


def check_fid_config(cfg: Any, task: Any) -> Any:
    """What FID while training can check with no run dir and no FID network: a task that makes images, a
    reference, and a statistics reference's feature layer and FID mode (`train.eval_fid_dims`, `eval_fid_mode`).

    Returns:
        The reference's `FIDStats` for a statistics `.npz`, None for images (a folder, an image `.npz`, a dataset
        spec), whose statistics `Evaluator` computes (or finds in the run dir's cache).
    Raises:
        ConfigError: FID for a task without images, or no `train.eval_reference`.
        FileNotFoundError / ValueError: a `.npz` reference that does not exist, or of another layer or mode.
    """
    from uvic.fid import load_stats
    from uvic.fid.stats import is_stats_file

    tc = cfg.train
    if not task.makes_images:
        raise ConfigError(f"train.eval_every: a {cfg.task!r} run makes no images to compute a FID of")
    if not tc.eval_reference:
        raise ConfigError("train.eval_every needs train.eval_reference (FID statistics .npz, an image folder or "
                          "a dataset spec such as cifar10-train:DIR)")
    ref = tc.eval_reference
    if ref.endswith(".npz") and not os.path.isfile(ref):
        raise FileNotFoundError(f"train.eval_reference {ref!r} does not exist")
    if not is_stats_file(ref):
        return None
    stats = load_stats(ref)
    if _classifier_weights(tc):  # a feature classifier's space: its SHA-256 is checked against the reference's
        return _check_classifier_reference(tc, stats)
    if stats.mode == "classifier":
        raise ValueError(f"train.eval_reference {ref!r} holds statistics in a classifier's features (SHA-256 "
                         f"{stats.meta.get('weights_sha256')}): set train.eval_fid_weights to that .safetensors file")
    if stats.dims != tc.eval_fid_dims:
        raise ValueError(f"train.eval_reference {ref!r} holds {stats.dims}-d features, the FID network gives "
                         f"{tc.eval_fid_dims}-d (train.eval_fid_dims)")
    if stats.mode is not None and stats.mode != tc.eval_fid_mode:
        raise ValueError(f"train.eval_reference {ref!r} holds statistics of FID mode {stats.mode!r}, and "
                         f"train.eval_fid_mode is {tc.eval_fid_mode!r}: set train.eval_fid_mode={stats.mode} to "
                         f"score in that mode, or use a reference of mode {tc.eval_fid_mode!r}")
    return stats


def _classifier_weights(tc: Any) -> bool:
    """Whether `train.eval_fid_weights` names a feature classifier (`uvic.fid.classifier`: FD, not FID)."""
    from uvic.fid.classifier import is_classifier_file

    return is_classifier_file(tc.eval_fid_weights or None)


def _check_classifier_reference(tc: Any, stats: Any) -> Any:
    """The reference statistics of a classifier feature space, if made with the weights of train.eval_fid_weights.

    Raises:
        ValueError: statistics of another feature space or of other weights (both SHA-256 named).
    """
    from uvic.fid.classifier import check_same_features, read_classifier_meta
    from uvic.io import sha256_file

    meta = read_classifier_meta(tc.eval_fid_weights)
    mine = {"features": meta["uvic_features"], "weights_sha256": sha256_file(tc.eval_fid_weights)}
    check_same_features(mine, stats.meta, f"train.eval_fid_weights {tc.eval_fid_weights!r}",
                        f"train.eval_reference {tc.eval_reference!r}")
    return stats


def _fingerprint(ref: str) -> list[tuple[str, int, int]]:
    """(path, size, mtime in ns) of every file under what a reference spec reads: the folder or file it names, or
    the path after a dataset prefix (`cifar10-train:DIR`); [] for a spec that reads no file (`digits:8`)."""
    _, sep, after = ref.partition(":")
    for path in [Path(ref)] + ([Path(after)] if sep else []):
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
        else:
            continue
        return [(str(p.resolve()), (st := p.stat()).st_size, st.st_mtime_ns) for p in files]
    return []


class Evaluator:
    """FID of the sampling weights at `train.eval_every` steps; built at start-up, before any training, so that a
    missing reference, a reference of another resolution, feature size or mode, or missing Inception weights stop
    the run at once with one line.

    The statistics of an image reference are computed here (with a progress bar) and cached in
    `run_dir/eval_reference.npz`, keyed by the reference's files (names, sizes, modification times), the FID
    network's weights, layer and mode: a resumed or relaunched run reads them back in a moment.

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
        from uvic.fid import load_extractor

        tc = cfg.train
        reference = check_fid_config(cfg, task)
        self.cfg, self.task, self.state = cfg, task, state
        self.num_images, self.dims, self.mode = tc.eval_num_images, tc.eval_fid_dims, tc.eval_fid_mode
        self.sampler = tc.eval_sampler or cfg.sample.sampler
        self.steps = tc.eval_steps or cfg.sample.num_inference_steps
        try:
            self.vae = task.load_vae()
        except ValueError as e:
            raise ConfigError(f"train.eval_every: {e}") from None
        sha = tc.eval_fid_weights_sha256
        sha_kw = {} if sha == "" else {"sha256": None if sha.lower() == "none" else sha}
        self.extractor = load_extractor(weights=tc.eval_fid_weights or None, dims=self.dims, mode=self.mode,
                                        device=state.device, sha256_option="train.eval_fid_weights_sha256=none",
                                        **sha_kw)
        self.dims = self.extractor.dims
        self.mode = self.extractor.mode  # a feature classifier's own ("classifier"); else train.eval_fid_mode
        self.title = "FID" if self.mode != "classifier" else self.extractor.title
        self.reference = reference or self._image_reference()
        self.conditions = task.image_conditions("fid", self.num_images)
        logger.info("FID%s: fid%d (%d-d features, mode %s), sampler %s with %d steps, reference %s",
                    f" every {tc.eval_every} steps" if tc.eval_every else "", self.num_images, self.dims, self.mode,
                    self.sampler, self.steps, tc.eval_reference)

    def _image_reference(self) -> Any:
        """The statistics of the reference images: from the run dir's cache when it was made from the same files
        with the same network, else computed (every file checked, with a progress bar) and cached (main process)."""
        from uvic.fid import compute_stats, load_stats, open_source, save_stats
        from uvic.fid.stats import is_stats_file

        tc, ref = self.cfg.train, self.cfg.train.eval_reference
        h, w, _ = self.image_shape
        key = hashlib.sha256(json.dumps({
            "reference": ref, "files": _fingerprint(ref), "dims": self.dims, "mode": self.mode,
            "weights_sha256": self.extractor.weights_sha256,
        }).encode()).hexdigest()
        cache = Path(tc.run_dir) / REFERENCE_CACHE
        try:
            stats = load_stats(cache) if is_stats_file(cache) else None
        except (OSError, ValueError) as e:  # a cache, made again: never a reason to stop
            logger.warning("%s cannot be read (%s): computing the reference statistics again", cache, e)
            stats = None
        if stats is not None and stats.meta.get("reference_key") == key:
            size = tuple(stats.meta["image_size"])
            logger.info("train.eval_reference %s: its statistics from %s (the same files and FID network)", ref, cache)
        else:
            try:
                images = open_source(ref)
            except FileNotFoundError as e:
                raise FileNotFoundError(f"train.eval_reference: {e}") from None
            size = tuple(images[0].shape[-2:])
            if size == (h, w):
                logger.info("train.eval_reference %s: computing the statistics of its %d images, once (they are "
                            "cached in %s for the next start of this run; a statistics .npz from `python -m uvic.fid "
                            "stats` skips this step)", ref, len(images), cache)
                stats = compute_stats(images, extractor=self.extractor, progress=True)
                stats.meta.update(reference_key=key, image_size=list(size))
                if self.state.is_main_process:
                    save_stats(stats, cache)
        if size != (h, w):
            raise ValueError(f"train.eval_reference {ref!r} holds {size[1]}x{size[0]} images, the model makes "
                             f"{w}x{h} ones")
        return stats

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(H, W, C) of the generated images (the VAE's decoded size for latent models)."""
        from uvic.pipelines.sampling import decoded_shape

        return decoded_shape(self.cfg.model.img_size, self.cfg.model.in_chans, self.vae)

    def features(self) -> dict[str, Any]:
        """The FID network of this evaluator, as its records name it: {"weights", "weights_sha256",
        "standard_weights", "trained", "mode"} (`InceptionExtractor.provenance`; the dims are recorded beside)."""
        return {k: v for k, v in self.extractor.provenance().items() if k != "dims"}

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
                                 extractor=self.extractor, mode=self.mode, batch_size=self.cfg.sample.batch_size,
                                 progress=False)
        return result.fid

    def evaluate(self, model: nn.Module, step: int, run_dir: str | os.PathLike, checkpoint: str) -> float:
        """The FID of `model` (the sampling weights, eval mode; every process calls this); the main process records
        it in eval.jsonl / best.json with `checkpoint` (relative to `run_dir`). The global RNG states are left as
        they were, so a run that evaluates continues exactly as a resumed one."""
        fid = self.fid(model, step=step)
        record = {"step": step, "fid": fid, "num_images": self.num_images, "dims": self.dims,
                  "sampler": self.sampler, "steps": self.steps, "checkpoint": checkpoint, **self.features()}
        if self.state.is_main_process:
            record_evaluation(run_dir, record)
        logger.info("step=%07d %s%d=%.4f (%s%s, %d steps)", step, "fid" if self.title == "FID" else "fd",
                    self.num_images, fid, "" if self.title == "FID" else f"{self.title}, ", self.sampler, self.steps)
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
        stem = "fid" if getattr(self, "title", "FID") == "FID" else "fd"
        desc = f"{stem}{n}" if step is None else f"{stem}{n} at step {step}"
        with tqdm(total=per, unit="img", desc=desc, leave=False,
                  disable=not self.state.is_local_main_process) as bar:
            for k in range(first, first + per, s.batch_size):
                idx = list(range(k, min(k + s.batch_size, first + per)))
                images = generate(pipe, [seed0 + i for i in idx], batch_size=s.batch_size,
                                  num_inference_steps=self.steps, progress=bar, **self.conditions.kwargs(idx))
                if images.shape[-1] == 1:  # grey images: the FID network takes RGB
                    images = images.repeat(3, axis=-1)
                yield torch.from_numpy(images)
