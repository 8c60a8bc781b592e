"""`train(cfg)`: the one training loop (accelerate: DDP, fp16/bf16, gradient accumulation), for any `Task`.

`_train` reads top to bottom like DiT's `main()`: `_setup` (accelerator, run-dir lock, seeds, resolved config),
`_build` (model, EMA, optimizer, data, `accelerator.prepare`), `_resume`, then `_train_step` per micro-batch and
`_periodic_work` after each optimizer step (log, sample, checkpoint), and `_finish` (export, loss curve). What is
trained comes from the task (`uvic.training.tasks`); everything here is task-agnostic. Periodic work is one
`_due` test and one function per job (log, sample, validate, save, evaluate): a new job is one line in
`_periodic_work` plus its function.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import GradientAccumulationPlugin, set_seed
from torch import nn
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from uvic.config import RunConfig, TrainConfig
from uvic.errors import ConfigError, StorageError, UvicError, describe_os_error
from uvic.training.checkpoint import (
    TrainingState,
    abandon_newer_checkpoints,
    agree,
    checkpoint_dir,
    choose_latest,
    latest_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    sweep_leftovers,
    write_dir_atomically,
)
from uvic.training.data import ShardedBatchSampler, build_loader
from uvic.training.ema import EMA
from uvic.training.evaluation import (
    Evaluator,
    abandon_evaluations_after,
    best_checkpoint,
    read_best,
    read_evaluations,
    refresh_best,
)
from uvic.training.lock import hold_run_dir
from uvic.training.logs import append_metrics, check_metrics, move_metrics_after, plot_loss_curve
from uvic.training.preflight import check_resume_config, check_run_config
from uvic.training.rng import ShardedRNG
from uvic.training.tasks import Task, build_task
from uvic.training.trackers import log_samples, start_trackers, tracker_names
from uvic.training.validation import Validator, tracker_values


logger = get_logger(__name__)


def lr_lambda(warmup_steps: int, schedule: str, max_steps: int, min_ratio: float):
    """LR multiplier at optimizer step s: linear warm-up from 0 (U-ViT: min(s / warmup, 1)), then constant or cosine."""

    def f(s: int) -> float:
        if warmup_steps > 0 and s < warmup_steps:
            return s / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (s - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def train(cfg: RunConfig) -> Path:
    """Train `cfg.task` as configured; returns the run dir.

    The run dir is locked for the life of the run (`uvic.training.lock`), and leftovers of interrupted saves are
    swept before anything is read from it.

    Every check of the config that needs no data (`uvic.training.preflight.check_run_config`) runs before the run
    dir is touched, and the run's own records (`eval.jsonl`, `best.json`, `metrics.jsonl`) are checked before
    anything is written into it.

    Raises:
        ConfigError: a config value no run can use (`check_run_config`; the batch size against the process count),
            or a resume that changes a key the run's config fixes (`check_resume_config`).
        RunRecordError: a record of the run dir that is damaged or edited into something the run never writes.
        RunLockedError: another run holds the run dir.
        StorageError: a write failed (disk full, read-only, not a directory); names the last complete checkpoint.
        CheckpointError: the checkpoint to resume fails verification.
        FloatingPointError: the loss became NaN/Inf.
    """
    check_run_config(cfg)  # before the run dir is touched; configs built in Python skip load_config's checks
    check_resume_config(cfg)  # a resume continues the run's own model, data, task and noise schedule
    run_dir = Path(cfg.train.run_dir)
    try:
        with ExitStack() as stack:  # holds the run-dir lock, taken by _setup once the accelerator exists
            return _train(cfg, stack)
    except OSError as e:
        if isinstance(e, UvicError) or e.errno is None:  # already clear, or a message of ours (FileNotFoundError)
            raise
        raise StorageError(f"training stopped: {describe_os_error(e)}. The last complete checkpoint is "
                           f"{latest_checkpoint(run_dir) or 'none'}") from e


def _train(cfg: RunConfig, stack: ExitStack) -> Path:
    accelerator, resume = _setup(cfg, stack)
    run = _build(cfg, accelerator, resume)
    # The held-out set of the validation loss, and FID while training (its reference, weights and sizes): checked
    # now, before any training.
    run.validator = Validator(cfg, run.task, accelerator) if cfg.train.val_every > 0 else None
    if run.validator is not None and accelerator.is_main_process:
        run.validator.record(run.run_dir)  # what each validation line is over (the comparison report says it)
    run.evaluator = Evaluator(cfg, run.task, accelerator) if cfg.train.eval_every > 0 else None
    _resume(run)
    with logging_redirect_tqdm():  # log lines go above the progress bar, never onto it
        if (run.evaluator is not None and run.resume is not None and _due(run.step, run.tc.eval_every, _last(run))
                and not run.evaluator.recorded(run.run_dir, run.step)):
            logger.info(f"the evaluation of step {run.step} did not finish (killed?): evaluating it again")
            _evaluate(run)
        pbar = tqdm(total=run.tc.max_steps, initial=run.step, disable=not accelerator.is_local_main_process,
                    desc="train")
        batches = _batches(run)
        first, t0 = True, time.time()
        while run.step < run.tc.max_steps:
            if first:
                logger.info("the first step includes one-time compilation (torch.compile of the attention on CPU, "
                            "Triton kernels on a GPU) and can take a few minutes")
            if _train_step(run, next(batches)):  # False inside a gradient-accumulation step
                if first:
                    logger.info(f"first step done in {time.time() - t0:.1f} s")
                    first = False
                pbar.update(1)
                _periodic_work(run)
        pbar.close()
        _finish(run)
    return run.run_dir


@dataclass
class _LossMeter:
    """Micro-batch losses since the last log line, kept on the device: reading them is a CPU-GPU sync point, done
    only on steps that log, sample or save."""

    device: torch.device
    total: torch.Tensor = field(init=False)
    nonfinite: torch.Tensor = field(init=False)
    count: int = 0
    since: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.total = torch.zeros((), device=self.device)
        self.nonfinite = torch.zeros((), device=self.device, dtype=torch.bool)

    def add(self, loss: torch.Tensor) -> None:
        self.nonfinite |= ~torch.isfinite(loss)
        self.total += loss
        self.count += 1

    def reset(self) -> None:
        self.total.zero_()
        self.count, self.since = 0, time.time()


@dataclass
class _Run:
    """What the steps of one training run share; `_build` makes it, the steps read and advance it."""

    cfg: RunConfig
    accelerator: Accelerator
    task: Task
    model: nn.Module  # as prepared by accelerate (DDP, mixed precision)
    ema: EMA | None  # None when train.ema_decay is 0: the EMA would be the model itself
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: ShardedBatchSampler
    loader: Any
    rng: ShardedRNG
    meter: _LossMeter
    resume: Path | None
    step: int = 0
    last_good: Path | None = None  # the newest complete checkpoint, named when the run fails
    validator: Validator | None = None  # the held-out validation loss (train.val_every > 0)
    evaluator: Evaluator | None = None  # FID while training (train.eval_every > 0)

    @property
    def tc(self) -> TrainConfig:
        return self.cfg.train

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.train.run_dir)

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def sampling_model(self) -> nn.Module:
        """The weights that sample and are exported: the EMA, or the (unwrapped) model when there is no EMA."""
        return self.ema.model if self.ema is not None else self.accelerator.unwrap_model(self.model)

    def checkpointed_models(self) -> dict[str, nn.Module]:
        """Models saved next to the accelerator state. `ema.safetensors` is always written, so every reader of a
        checkpoint finds the sampling weights under one name (without an EMA they are the model's own)."""
        return {"ema": self.sampling_model}

    @property
    def training_state(self) -> TrainingState:
        """What a checkpoint restores besides the models above (data-only files, `uvic.training.checkpoint`)."""
        return TrainingState(self.model, self.optimizer, {"lr_scheduler": self.lr_scheduler, "rng": self.rng})


def _setup(cfg: RunConfig, stack: ExitStack) -> tuple[Accelerator, Path | None]:
    """The accelerator, the run-dir lock (and a sweep of what interrupted saves left), seeds, threads and the
    resolved config in `run_dir/config.yaml`; returns the accelerator and the checkpoint to resume (or None)."""
    tc = cfg.train
    run_dir = Path(tc.run_dir)
    accelerator = Accelerator(
        mixed_precision=tc.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=tc.grad_accum_steps, sync_with_dataloader=False
        ),
        log_with=tracker_names(tc.log_with) or None,
        project_dir=str(run_dir),
    )
    world = accelerator.num_processes  # known only once the processes are up, so checked here, before the lock
    if tc.batch_size % (world * tc.grad_accum_steps):
        raise ConfigError(
            f"config key train.batch_size: {tc.batch_size} must be divisible by processes x "
            f"train.grad_accum_steps = {world} x {tc.grad_accum_steps}"
        )
    stack.enter_context(hold_run_dir(run_dir, accelerator))
    if accelerator.is_main_process:
        sweep_leftovers(run_dir)
    accelerator.wait_for_everyone()
    # Located and checked before config.yaml is written, so that a refused start leaves the run dir as it was.
    resume = resume_checkpoint(run_dir, tc.resume)
    check_run_records(run_dir)
    set_seed(tc.seed, device_specific=True)
    torch.backends.cuda.matmul.allow_tf32 = tc.allow_tf32
    torch.backends.cudnn.allow_tf32 = tc.allow_tf32
    if tc.cpu_threads > 0:
        torch.set_num_threads(tc.cpu_threads)
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return accelerator, resume


def _build(cfg: RunConfig, accelerator: Accelerator, resume: Path | None) -> _Run:
    """The task's model, the EMA (if `train.ema_decay` > 0), AdamW and the LR schedule, the data, all prepared."""
    tc = cfg.train
    world = accelerator.num_processes
    local_batch = tc.batch_size // (world * tc.grad_accum_steps)
    task = build_task(cfg)

    # Model, EMA, optimizer, LR schedule. The EMA is copied before `prepare`, which patches the model's forward
    # for mixed precision (a deepcopy would share that patch).
    model = task.build_model()
    if tc.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    ema = EMA(model, tc.ema_decay) if tc.ema_decay > 0 else None
    # The task names its weight-decay groups (U-ViT decays everything; the LM exempts norm gains and biases).
    optimizer = torch.optim.AdamW(
        task.param_groups(model, tc.weight_decay), lr=tc.lr, betas=tc.betas, eps=tc.adam_eps
    )
    # Not passed to accelerate.prepare: its wrapper steps the schedule once per process.
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(tc.warmup_steps, tc.lr_schedule, tc.max_steps, tc.min_lr_ratio)
    )
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(f"task={cfg.task} parameters={n_params:,} processes={world} local_batch={local_batch} "
                f"grad_accum={tc.grad_accum_steps} mixed_precision={accelerator.mixed_precision} "
                f"ema={'off' if ema is None else tc.ema_decay}")

    # Data: a sharded, epoch-seeded sampler, so the order resumes exactly and does not depend on world size.
    dataset = task.build_dataset()
    sampler = ShardedBatchSampler(len(dataset), local_batch, tc.seed, accelerator.process_index, world)
    loader = build_loader(dataset, sampler, cfg.data.num_workers)

    # Prepare. The EMA restarts from the weights DDP broadcast from rank 0, an exact copy on every process.
    # The run's generator and the LR schedule are checkpointed with the model (`_Run.training_state`).
    model, optimizer = accelerator.prepare(model, optimizer)
    if ema is not None:
        ema.model.load_state_dict(accelerator.unwrap_model(model).state_dict())
        ema.to(accelerator.device)
    rng = ShardedRNG(tc.seed, accelerator.process_index, world, accelerator.device)
    return _Run(cfg=cfg, accelerator=accelerator, task=task, model=model, ema=ema, optimizer=optimizer,
                lr_scheduler=lr_scheduler, sampler=sampler, loader=loader, rng=rng, resume=resume,
                meter=_LossMeter(accelerator.device))


def _resume(run: _Run) -> None:
    """Restore the checkpoint `train.resume` names, if any, and start the trackers.

    From an older checkpoint than the newest, the newer ones (and their metrics) move to checkpoints/abandoned/:
    this run is a new branch, which rotation and a later --resume must only see.
    """
    accelerator = run.accelerator
    if run.resume is not None:
        extra = {"ema": run.ema.model} if run.ema is not None else {}
        run.step = load_checkpoint(accelerator, run.resume, extra, state=run.training_state)
        if accelerator.is_main_process:
            abandoned = abandon_newer_checkpoints(run.run_dir, run.step)
            if abandoned is not None:
                move_metrics_after(run.metrics_path, run.step, abandoned / "metrics.jsonl")
                abandon_evaluations_after(run.run_dir, run.step, abandoned / "eval.jsonl")
            else:  # the lines a killed run wrote after its last checkpoint: this run logs those steps again
                move_metrics_after(run.metrics_path, run.step, None)
    if accelerator.is_main_process:
        refresh_best(run.run_dir)  # a best checkpoint deleted by hand is reported; best.json names one that exists
    accelerator.wait_for_everyone()
    run.last_good = latest_checkpoint(run.run_dir)
    if accelerator.is_main_process:
        start_trackers(accelerator, tracker_names(run.tc.log_with), run.run_dir, _flat(run.cfg.to_dict()))
    run.meter.reset()


def _batches(run: _Run) -> Iterator[dict[str, torch.Tensor]]:
    """This process's micro-batches on the device, epoch after epoch. The micro-batches consumed so far fix the
    epoch and the position inside it, so a resumed run continues the same order."""
    epoch, skip = divmod(run.step * run.tc.grad_accum_steps, run.sampler.batches_per_epoch)
    while True:
        run.sampler.set_epoch(epoch, skip)
        for batch in run.loader:
            yield {k: v.to(run.accelerator.device, non_blocking=True) for k, v in batch.items()}
        epoch, skip = epoch + 1, 0


def _train_step(run: _Run, batch: dict[str, torch.Tensor]) -> bool:
    """Forward and backward of one micro-batch; on the last one of an optimizer step also the clipped update,
    the LR schedule, the EMA and the step counter. Returns whether an optimizer step completed."""
    accelerator, model, optimizer = run.accelerator, run.model, run.optimizer
    with accelerator.accumulate(model):
        loss = run.task.loss(model, batch, run.rng)
        accelerator.backward(loss)
        if accelerator.sync_gradients and run.tc.grad_clip > 0:
            accelerator.clip_grad_norm_(model.parameters(), run.tc.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    run.meter.add(loss.detach())
    if not accelerator.sync_gradients:
        return False
    run.lr_scheduler.step()
    if run.ema is not None:
        run.ema.update(accelerator.unwrap_model(model))
    run.step += 1
    return True


def _due(step: int, every: int, last: bool) -> bool:
    """Whether a job run every `every` steps (0 = never) is due at `step`; due at the last step too."""
    return every > 0 and (step % every == 0 or last)


def _last(run: _Run) -> bool:
    """Whether the run is at its last step (`train.max_steps`)."""
    return run.step == run.tc.max_steps


def _periodic_work(run: _Run) -> None:
    """Log, sample and checkpoint when due. The NaN/Inf check comes first on any of these steps, so nothing is
    logged, drawn or saved from a diverged model, whatever the intervals are."""
    tc, step, last = run.tc, run.step, _last(run)
    log_now = _due(step, tc.log_every, last)
    sample_now = _due(step, tc.sample_every, last)
    val_now = run.validator is not None and _due(step, tc.val_every, last)
    eval_now = run.evaluator is not None and _due(step, tc.eval_every, last)
    # The last step is always saved, and so is an evaluated one: best.json names a checkpoint, and a kill during
    # the evaluation resumes from it and evaluates again. A validation comes before the save: a kill during it
    # resumes from an earlier checkpoint, which validates this step again.
    save_now = _due(step, tc.save_every, last) or last or eval_now
    if not (log_now or sample_now or val_now or save_now):
        return
    _check_finite(run)
    if log_now:
        _log(run)
    if sample_now:
        _sample(run)
    if val_now:
        _validate(run)
    if save_now:
        _save(run)
    if eval_now:
        _evaluate(run)


def _check_finite(run: _Run) -> None:
    """Stop every process, saving nothing, if a loss since the last check was NaN or Inf (a collective)."""
    if run.accelerator.reduce(run.meter.nonfinite.float(), "sum").item() > 0:
        run.accelerator.end_training()
        raise FloatingPointError(
            f"the loss became NaN or Inf at or before step {run.step}; training stopped without saving. "
            f"Last good checkpoint: {run.last_good or 'none'} (resume with train.resume=latest, e.g. a lower "
            f"train.lr or mixed_precision=bf16)."
        )


def _log(run: _Run) -> None:
    """The mean loss since the last log line (over processes), the LR and the speed: trackers, metrics.jsonl and
    the console line."""
    accelerator, meter, step = run.accelerator, run.meter, run.step
    mean_loss = (accelerator.reduce(meter.total, "mean") / meter.count).item()
    steps_per_s = meter.count / run.tc.grad_accum_steps / (time.time() - meter.since)
    lr = run.optimizer.param_groups[0]["lr"]
    accelerator.log({"loss": mean_loss, "lr": lr, "steps_per_s": steps_per_s}, step=step)
    if accelerator.is_main_process:
        append_metrics(run.metrics_path, {"step": step, "loss": mean_loss, "lr": lr})
    logger.info(f"step={step:07d} loss={mean_loss:.4f} lr={lr:.2e} steps/s={steps_per_s:.2f}")
    meter.reset()


def _sample(run: _Run) -> None:
    """The task's periodic samples from the sampling weights (main process; the others wait)."""
    if run.accelerator.is_main_process:
        with _eval_mode(run.sampling_model) as model:
            written = run.task.on_sample(model, run.step, run.run_dir)
        log_samples(run.accelerator, written, run.step)  # the grid or text, to the trackers as `samples`
    run.accelerator.wait_for_everyone()


def _validate(run: _Run) -> None:
    """The validation loss of the sampling weights (every process scores its share): trackers, metrics.jsonl and
    the console. Its time is left out of the next `steps/s`."""
    t0 = time.time()
    with _eval_mode(run.sampling_model) as model:
        metrics = run.validator.validate(model)
    values = tracker_values(metrics)  # the per-block attention shares as scalars
    run.accelerator.log(values, step=run.step)
    if run.accelerator.is_main_process:
        append_metrics(run.metrics_path, {"step": run.step, **metrics})
    logger.info(f"step={run.step:07d} " + " ".join(f"{k}={v:.6g}" for k, v in values.items()))
    run.meter.since += time.time() - t0


def _evaluate(run: _Run) -> None:
    """FID of the sampling weights (every process samples its share): eval.jsonl, best.json and `eval/fid`."""
    with _eval_mode(run.sampling_model) as model:
        fid = run.evaluator.evaluate(model, run.step, run.run_dir, checkpoint_dir(".", run.step).as_posix())
    run.accelerator.log({"eval/fid": fid}, step=run.step)
    run.accelerator.wait_for_everyone()


def _save(run: _Run) -> None:
    """A checkpoint of this step (every process takes part), rotated to `train.keep_checkpoints`."""
    # The best FID's checkpoint (best.json, a checked path inside the run dir) survives rotation whatever its age.
    run.last_good = save_checkpoint(run.accelerator, run.run_dir, run.step, run.cfg.to_dict(),
                                    run.checkpointed_models(), run.tc.keep_checkpoints, state=run.training_state,
                                    keep_also=best_checkpoint(run.run_dir))
    logger.info(f"saved checkpoint {run.last_good}")


def _finish(run: _Run) -> None:
    """Export the sampling weights and draw the loss curve; end the trackers.

    The export is renamed into place when complete; a failed write stops every process (a collective) with the
    last checkpoint, which `train.py --export` can export.
    """
    accelerator, run_dir = run.accelerator, run.run_dir
    failure = None
    if accelerator.is_main_process:
        try:
            write_dir_atomically(run_dir / "pipeline", lambda tmp: run.task.export(run.sampling_model, tmp))
            logger.info(f"exported the sampling weights to {run_dir / 'pipeline'}")
            plot_loss_curve(run.metrics_path, run_dir / "loss_curve.png", title=f"{run.cfg.task}: {run_dir.name}")
        except OSError as e:
            failure = str(e) if isinstance(e, StorageError) else describe_os_error(e)
    failure = agree(accelerator, failure)
    if failure is not None:
        raise StorageError(f"training finished, but {failure}. The last complete checkpoint is {run.last_good} "
                           f"(export it with train.py CONFIG --export {run.last_good})")
    accelerator.wait_for_everyone()
    accelerator.end_training()


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """`model` in eval mode for the block, then back in the mode it was in (the EMA copy is always in eval)."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten a nested config for tensorboard's hparams (which takes scalars and strings only)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def check_run_records(run_dir: str | Path) -> None:
    """Check the records a run keeps about itself and reads back (every process, before anything is written).

    Raises:
        RunRecordError: a line of eval.jsonl or metrics.jsonl, or best.json, that is not a record as the run writes
            it (the file and the line are named).
    """
    read_evaluations(run_dir)
    read_best(run_dir)
    check_metrics(Path(run_dir) / "metrics.jsonl")


def resume_checkpoint(run_dir: str | Path, resume: str) -> Path | None:
    """The checkpoint `train.resume` names: "" -> None (and `run_dir` must have no checkpoints), "latest" -> the
    newest one or None, anything else -> that checkpoint dir (checked)."""
    if resume == "":
        if latest_checkpoint(run_dir) is not None:
            raise ValueError(
                f"{run_dir} already has checkpoints; pass --resume (train.resume=latest) to continue it, or choose "
                f"another train.run_dir"
            )
        return None
    if resume == "latest":
        return choose_latest(run_dir)  # a newer checkpoint dir without meta.json is named, and skipped
    return resolve_checkpoint(resume, verify=False)  # load_checkpoint verifies it
