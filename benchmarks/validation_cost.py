"""What validation costs a run: training steps, one validation and the attention probe, timed side by side.

    python benchmarks/validation_cost.py configs/demo_digits.yaml
    python benchmarks/validation_cost.py configs/demo_digits.yaml model.patch_size=2     # 17 tokens instead of 5
    python benchmarks/validation_cost.py configs/lm_mqar.yaml --rounds 5

For a config (and overrides), on this machine's CPU with the config's `train.cpu_threads`: the median time of a
training step (the task's loss, backward, clipping, AdamW and the EMA update, as `uvic.training.loop` runs them,
at `train.batch_size`), of one validation loss over the held-out set (`train.val_examples`, without the probe) and
of one attention probe (`train.val_probe_examples`, `uvic.attention_probe`). The three run in interleaved rounds, so
that load from other processes hits them alike. It prints them and the share of a run's time that its validations
take: validations x (validation + probe) / (train.max_steps x step), where a run validates every `train.val_every`
steps and at the last step.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils.data import default_collate


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's uvic, installed or not


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(config: str, overrides: list[str], rounds: int, steps: int) -> dict[str, float]:
    """{"step", "validation", "probe"} median seconds, and the run's `validations` and `share` (see the module
    docstring)."""
    from uvic.config import load_config
    from uvic.training.ema import EMA
    from uvic.training.rng import ShardedRNG
    from uvic.training.tasks import build_task
    from uvic.training.validation import Validator

    cfg = load_config(config, overrides)
    tc = cfg.train
    if tc.cpu_threads > 0:
        torch.set_num_threads(tc.cpu_threads)
    torch.manual_seed(tc.seed)
    task = build_task(cfg)
    model = task.build_model()
    ema = EMA(model, tc.ema_decay) if tc.ema_decay > 0 else None
    optimizer = torch.optim.AdamW(task.param_groups(model, tc.weight_decay), lr=tc.lr, betas=tc.betas)
    dataset = task.build_dataset()
    rng = ShardedRNG(tc.seed, 0, 1, "cpu")
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(tc.seed)).tolist()
    batches = [default_collate([dataset[i] for i in order[k * tc.batch_size : (k + 1) * tc.batch_size]])
               for k in range(min(steps, len(dataset) // tc.batch_size))]
    state = SimpleNamespace(device=torch.device("cpu"), process_index=0, num_processes=1, autocast=nullcontext)
    validator = Validator(cfg, task, state)
    sampling = ema.model if ema is not None else model

    def train_steps() -> None:
        model.train()
        for batch in batches:
            loss = task.loss(model, batch, rng)
            loss.backward()
            if tc.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if ema is not None:
                ema.update(model)

    def validate() -> None:
        sampling.eval()
        validator.combine(validator.local_values(sampling))

    def probe() -> None:
        sampling.eval()
        validator.attention_shares(sampling)

    jobs = {"step": train_steps, "validation": validate, "probe": probe}
    for fn in jobs.values():  # warm-up: one-time compilation and allocation
        fn()
    times: dict[str, list[float]] = {name: [] for name in jobs}
    for r in range(rounds):
        for name in list(jobs)[r % 3 :] + list(jobs)[: r % 3]:
            times[name].append(_timed(jobs[name]))
    out = {name: statistics.median(t) for name, t in times.items()}
    out["step"] /= len(batches)
    validations = tc.max_steps // tc.val_every + (tc.max_steps % tc.val_every != 0) if tc.val_every else 0
    out["validations"] = validations
    out["share"] = validations * (out["validation"] + out["probe"]) / (tc.max_steps * out["step"])
    out["probe_share"] = validations * out["probe"] / (tc.max_steps * out["step"])
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="dotted key=value, as train.py takes them")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the medians are printed")
    p.add_argument("--steps", type=int, default=20, help="training steps per round")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    r = measure(args.config, args.overrides, args.rounds, args.steps)
    print(f"training step {1e3 * r['step']:.1f} ms, validation {r['validation']:.3f} s, attention probe "
          f"{r['probe']:.3f} s (medians of {args.rounds} rounds)")
    if math.isfinite(r["share"]) and r["validations"]:
        print(f"{r['validations']} validations take {100 * r['share']:.2f}% of the training time "
              f"(the probe {100 * r['probe_share']:.2f}%)")


if __name__ == "__main__":
    main()
