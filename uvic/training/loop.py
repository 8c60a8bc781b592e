"""`train(cfg)`: the one training loop (accelerate: DDP, fp16/bf16, gradient accumulation), for any `Task`.

Structure follows DiT's `main()`: setup, model/EMA/optimizer, data, prepare, resume, loop, end. What is trained
comes from the task (`uvic.training.tasks`); everything here is task-agnostic.
"""

from __future__ import annotations

import math
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import GradientAccumulationPlugin, set_seed
from tqdm.auto import tqdm

from uvic.config import RunConfig, validate_ranges
from uvic.errors import StorageError, UvicError, describe_os_error
from uvic.training.checkpoint import (
    abandon_newer_checkpoints,
    agree,
    latest_checkpoint,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    sweep_leftovers,
    write_dir_atomically,
)
from uvic.training.data import ShardedBatchSampler, build_loader
from uvic.training.ema import EMA
from uvic.training.lock import hold_run_dir
from uvic.training.logs import append_metrics, move_metrics_after, plot_loss_curve
from uvic.training.rng import ShardedRNG
from uvic.training.tasks import build_task


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


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten a nested config for tensorboard's hparams (which takes scalars and strings only)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)
    return out


def train(cfg: RunConfig) -> Path:
    """Train `cfg.task` as configured; returns the run dir.

    The run dir is locked for the life of the run (`uvic.training.lock`), and leftovers of interrupted saves are
    swept before anything is read from it.

    Raises:
        ConfigError: a config value out of range (`uvic.config.validate_ranges`).
        RunLockedError: another run holds the run dir.
        StorageError: a write failed (disk full, read-only, not a directory); names the last complete checkpoint.
        CheckpointError: the checkpoint to resume fails verification.
        FloatingPointError: the loss became NaN/Inf.
    """
    validate_ranges(cfg)  # configs built in Python skip load_config's check
    run_dir = Path(cfg.train.run_dir)
    try:
        with ExitStack() as stack:  # holds the run-dir lock, taken by _train once the accelerator exists
            return _train(cfg, stack)
    except OSError as e:
        if isinstance(e, UvicError) or e.errno is None:  # already clear, or a message of ours (FileNotFoundError)
            raise
        raise StorageError(f"training stopped: {describe_os_error(e)}. The last complete checkpoint is "
                           f"{latest_checkpoint(run_dir) or 'none'}") from e


def _train(cfg: RunConfig, stack: ExitStack) -> Path:
    tc = cfg.train
    run_dir = Path(tc.run_dir)

    # 1. Setup: accelerator, the run-dir lock (and a sweep of what interrupted saves left), seeds, resolved config.
    accelerator = Accelerator(
        mixed_precision=tc.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=tc.grad_accum_steps, sync_with_dataloader=False
        ),
        log_with=None if tc.log_with == "none" else tc.log_with,
        project_dir=str(run_dir),
    )
    stack.enter_context(hold_run_dir(run_dir, accelerator))
    if accelerator.is_main_process:
        sweep_leftovers(run_dir)
    accelerator.wait_for_everyone()
    world = accelerator.num_processes
    if tc.batch_size % (world * tc.grad_accum_steps):
        raise ValueError(
            f"train.batch_size={tc.batch_size} must be divisible by processes x grad_accum_steps = "
            f"{world} x {tc.grad_accum_steps}"
        )
    local_batch = tc.batch_size // (world * tc.grad_accum_steps)
    resume = resume_checkpoint(run_dir, tc.resume)
    set_seed(tc.seed, device_specific=True)
    torch.backends.cuda.matmul.allow_tf32 = tc.allow_tf32
    torch.backends.cudnn.allow_tf32 = tc.allow_tf32
    if tc.cpu_threads > 0:
        torch.set_num_threads(tc.cpu_threads)
    config = cfg.to_dict()
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(cfg.to_yaml())
    task = build_task(cfg)

    # 2. Model, EMA, optimizer, LR schedule. The EMA is copied before `prepare`, which patches the model's
    # forward for mixed precision (a deepcopy would share that patch).
    model = task.build_model()
    if tc.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    ema = EMA(model, tc.ema_decay)
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
                f"grad_accum={tc.grad_accum_steps} mixed_precision={accelerator.mixed_precision}")

    # 3. Data: a sharded, epoch-seeded sampler, so the order resumes exactly and does not depend on world size.
    dataset = task.build_dataset()
    sampler = ShardedBatchSampler(len(dataset), local_batch, tc.seed, accelerator.process_index, world)
    loader = build_loader(dataset, sampler, cfg.data.num_workers)

    # 4. Prepare. The EMA restarts from the weights DDP broadcast from rank 0, an exact copy on every process.
    # The run's generator and the LR schedule are checkpointed with the accelerator state, the EMA separately.
    model, optimizer = accelerator.prepare(model, optimizer)
    ema.model.load_state_dict(accelerator.unwrap_model(model).state_dict())
    ema.to(accelerator.device)
    rng = ShardedRNG(tc.seed, accelerator.process_index, world, accelerator.device)
    accelerator.register_for_checkpointing(lr_scheduler, rng)

    # 5. Resume. From an older checkpoint than the newest, the newer ones (and their metrics) move to
    # checkpoints/abandoned/: this run is a new branch, which rotation and a later --resume must only see.
    step = load_checkpoint(accelerator, resume, {"ema": ema.model}) if resume else 0
    metrics_path = run_dir / "metrics.jsonl"
    if resume and accelerator.is_main_process:
        abandoned = abandon_newer_checkpoints(run_dir, step)
        if abandoned is not None:
            move_metrics_after(metrics_path, step, abandoned / "metrics.jsonl")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process and tc.log_with != "none":
        accelerator.init_trackers("train", config=_flat(config))

    # 6. The loop. Micro-batches consumed so far fix the epoch and the position inside it.
    epoch, skip = divmod(step * tc.grad_accum_steps, sampler.batches_per_epoch)
    pbar = tqdm(total=tc.max_steps, initial=step, disable=not accelerator.is_local_main_process, desc="train")
    loss_sum = torch.zeros((), device=accelerator.device)
    nonfinite = torch.zeros((), device=accelerator.device, dtype=torch.bool)
    n_micro, t0, last_good = 0, time.time(), latest_checkpoint(run_dir)

    def check_finite() -> None:
        # A reduce is a sync point, so this runs only on steps that log, sample or save (never every step).
        if accelerator.reduce(nonfinite.float(), "sum").item() > 0:
            accelerator.end_training()
            raise FloatingPointError(
                f"the loss became NaN or Inf at or before step {step}; training stopped without saving. "
                f"Last good checkpoint: {last_good or 'none'} (resume with train.resume=latest, e.g. a lower "
                f"train.lr or mixed_precision=bf16)."
            )

    while step < tc.max_steps:
        sampler.set_epoch(epoch, skip)
        for batch in loader:
            batch = {k: v.to(accelerator.device, non_blocking=True) for k, v in batch.items()}
            with accelerator.accumulate(model):
                loss = task.loss(model, batch, rng)
                accelerator.backward(loss)
                if accelerator.sync_gradients and tc.grad_clip > 0:
                    accelerator.clip_grad_norm_(model.parameters(), tc.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loss = loss.detach()
            nonfinite |= ~torch.isfinite(loss)
            loss_sum += loss
            n_micro += 1
            if not accelerator.sync_gradients:
                continue
            lr_scheduler.step()
            ema.update(accelerator.unwrap_model(model))
            step += 1
            pbar.update(1)

            # 7. Log, sample and checkpoint at intervals. The NaN/Inf check comes first on any of these steps, so
            # nothing is logged, drawn or saved from a diverged model, whatever the intervals are.
            log_now = step % tc.log_every == 0 or step == tc.max_steps
            sample_now = tc.sample_every > 0 and (step % tc.sample_every == 0 or step == tc.max_steps)
            save_now = (tc.save_every > 0 and step % tc.save_every == 0) or step == tc.max_steps
            if log_now or sample_now or save_now:
                check_finite()
            if log_now:
                mean_loss = (accelerator.reduce(loss_sum, "mean") / n_micro).item()
                steps_per_s = n_micro / tc.grad_accum_steps / (time.time() - t0)
                lr = optimizer.param_groups[0]["lr"]
                accelerator.log({"loss": mean_loss, "lr": lr, "steps_per_s": steps_per_s}, step=step)
                if accelerator.is_main_process:
                    append_metrics(metrics_path, {"step": step, "loss": mean_loss, "lr": lr})
                logger.info(f"step={step:07d} loss={mean_loss:.4f} lr={lr:.2e} steps/s={steps_per_s:.2f}")
                loss_sum.zero_()
                n_micro, t0 = 0, time.time()
            if sample_now:
                if accelerator.is_main_process:
                    task.on_sample(ema.model, step, run_dir)
                accelerator.wait_for_everyone()
            if save_now:
                last_good = save_checkpoint(accelerator, run_dir, step, config, {"ema": ema.model},
                                            tc.keep_checkpoints)
            if step >= tc.max_steps:
                break
        epoch, skip = epoch + 1, 0
    pbar.close()

    # 8. Export the EMA model and the loss curve; end. The export is renamed into place when complete; a failed
    # write stops every process (a collective) with the last checkpoint, which `train.py --export` can export.
    failure = None
    if accelerator.is_main_process:
        try:
            write_dir_atomically(run_dir / "pipeline", lambda tmp: task.export(ema.model, tmp))
            plot_loss_curve(metrics_path, run_dir / "loss_curve.png", title=f"{cfg.task}: {run_dir.name}")
        except OSError as e:
            failure = str(e) if isinstance(e, StorageError) else describe_os_error(e)
    failure = agree(accelerator, failure)
    if failure is not None:
        raise StorageError(f"training finished, but {failure}. The last complete checkpoint is {last_good} "
                           f"(export it with train.py CONFIG --export {last_good})")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return run_dir


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
        return latest_checkpoint(run_dir)
    return resolve_checkpoint(resume, verify=False)  # load_checkpoint verifies it
