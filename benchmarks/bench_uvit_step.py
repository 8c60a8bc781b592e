"""What a user of U-ViC feels against U-ViT: one training step and sampling, timed side by side.

    python benchmarks/bench_uvit_step.py --device cuda                  # the official rows on one GPU
    python benchmarks/bench_uvit_step.py --device cuda --budget-s 200   # stop starting rows after 200 s
    python benchmarks/bench_uvit_step.py                                # CPU: the tiny presets, fp32
    python benchmarks/bench_uvit_step.py --presets s2-cifar10 --batch 8 --rounds 5   # the S/2 model on CPU

Training rows: one step (forward under autocast, the epsilon-MSE loss, backward, AdamW, the EMA update; a
GradScaler under fp16), with the optimiser and EMA settings of `uvic.config.TrainConfig`, at the official per-GPU
batch of each preset (`OFFICIAL_BATCH`: S/2 CIFAR-10 128, S/2 MS-COCO 64 with its 77 context tokens, H/2 ImageNet
256 latents 32 with gradient checkpointing), under each autocast dtype, eager and `torch.compile`d. Sampling rows:
images per second of `UViCPipeline` with 50 DPM-Solver steps on a batch of 500 CIFAR-10 images (`--sample-*`).

U-ViT and U-ViC differ only in the attention of their Cog blocks (same weights, same data): softmax attention
is SDPA (flash on a GPU), Cog runs on the backend that `uvic.attention` picks, printed per row ("triton", or
"torch" with the reason the kernel refuses, e.g. a head dim outside its envelope). The two models run in
interleaved rounds (the order alternating each round), so that load from other processes and clock changes hit
both alike; each row prints the median time of each and the median of the per-round ratios U-ViC / U-ViT. Rows run
in the order modes x dtypes x (training presets, then sampling); `--budget-s` stops starting new rows once that
many seconds have passed (the first row always runs) and lists the rows it skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's uvic, installed or not


# preset -> (per-GPU batch of the official recipe, gradient checkpointing)
OFFICIAL_BATCH = {"s2-cifar10": (128, False), "s2-mscoco": (64, False), "h2-imagenet256": (32, True)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULTS = {  # per device: presets, dtypes, modes, the sampling preset and batch
    "cuda": {"presets": list(OFFICIAL_BATCH), "dtypes": ["bf16", "fp16"], "modes": ["eager", "compile"],
             "sample_preset": "s2-cifar10", "sample_batch": 500},
    "cpu": {"presets": ["tiny-cifar", "tiny-t2i", "tiny-class"], "dtypes": ["fp32"], "modes": ["eager"],
            "sample_preset": "tiny-cifar", "sample_batch": 16},
}


@dataclass
class Row:
    """One line of the report: what was timed, each model's median, the per-round ratios."""

    what: str
    backend: str
    unit: str  # "ms/step" or "images/s"
    uvit: float
    uvic: float
    ratio: float  # median over rounds of time(U-ViC) / time(U-ViT)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _models(preset: str, device: torch.device, checkpointing: bool) -> dict[str, torch.nn.Module]:
    """U-ViT and U-ViC of `preset` with the same weights, on `device`."""
    from uvic.models import build_preset

    torch.manual_seed(0)
    with torch.device(device):
        uvit = build_preset(f"uvit-{preset}")
        uvic = build_preset(f"uvic-{preset}")
    uvic.load_state_dict(uvit.state_dict())
    models = {"U-ViT": uvit, "U-ViC": uvic}
    if checkpointing:
        for m in models.values():
            m.enable_gradient_checkpointing()
    return models


def cog_backend(model: torch.nn.Module, batch: int, device: torch.device, dtype: torch.dtype) -> str:
    """The backend `cog_attention(backend="auto")` gives the Cog blocks of `model` (at its token count), in words."""
    from uvic.attention import unsupported_reason

    cfg = model.config
    tokens = (cfg.img_size // cfg.patch_size) ** 2 + model.extras
    q = torch.empty(batch, cfg.num_heads, tokens, cfg.embed_dim // cfg.num_heads, device=device, dtype=dtype)
    if not q.is_cuda or dtype == torch.float32:
        return "torch"
    why = unsupported_reason(q, q, q, backend="triton")
    return "triton" if why is None else f"torch ({why})"


def _inputs(model: torch.nn.Module, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(x_t, timestep, conditioning kwargs) of the right shapes for `model`; values do not affect the timing."""
    cfg = model.config
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(batch, cfg.in_chans, cfg.img_size, cfg.img_size, device=device, generator=g)
    t = torch.randint(1, 1000, (batch,), device=device, generator=g)
    cond = {}
    if cfg.num_classes > 0:
        cond["class_labels"] = torch.randint(0, cfg.num_classes, (batch,), device=device, generator=g)
    elif cfg.clip_dim is not None:
        cond["encoder_hidden_states"] = torch.randn(batch, cfg.num_clip_token, cfg.clip_dim, device=device,
                                                    generator=g)
    return x, t, cond


def train_step(model: torch.nn.Module, batch: int, device: torch.device, dtype: torch.dtype,
               compile: bool) -> Callable[[], None]:
    """A closure running one training step of `model` as `uvic.training` runs it (see the module docstring)."""
    from uvic.config import TrainConfig
    from uvic.training.ema import EMA

    tc = TrainConfig()
    x, t, cond = _inputs(model, batch, device)
    eps = torch.randn_like(x)
    opt = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tc.betas, eps=tc.adam_eps,
                            weight_decay=tc.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ema = EMA(model, tc.ema_decay)
    forward = torch.compile(model) if compile else model
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = F.mse_loss(forward(x, t, **cond).sample.float(), eps)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        ema.update(model)

    return step


def sampler(model: torch.nn.Module, batch: int, steps: int, device: torch.device, dtype: torch.dtype,
            compile: bool) -> Callable[[], None]:
    """A closure drawing `batch` images with `UViCPipeline` and `steps` DPM-Solver steps (VP-SDE, as CIFAR-10)."""
    from uvic.config import DiffusionConfig
    from uvic.pipelines import UViCPipeline
    from uvic.schedulers import build_scheduler

    pipe = UViCPipeline(transformer=model.eval(), scheduler=build_scheduler("dpm_solver", DiffusionConfig()))
    pipe.set_progress_bar_config(disable=True)
    if compile:  # as diffusers' documentation compiles a pipeline's denoiser
        pipe.transformer = torch.compile(pipe.transformer)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def sample() -> None:
        with autocast:
            pipe(batch_size=batch, num_inference_steps=steps, generator=torch.Generator(device).manual_seed(0),
                 output_type="pt")

    return sample


def interleaved(fns: dict[str, Callable[[], None]], device: torch.device, rounds: int, repeat: int,
                warmup: int) -> tuple[dict[str, float], float]:
    """Median seconds per call of each of the two functions, timed `repeat` calls at a time in `rounds` rounds
    whose order alternates, and the median over rounds of the ratio second / first."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(repeat):
                fns[name]()
            _sync(device)
            times[name].append((time.perf_counter() - t0) / repeat)
    ratio = statistics.median(b / a for a, b in zip(times[names[0]], times[names[1]]))
    return {name: statistics.median(ts) for name, ts in times.items()}, ratio


def run(args: argparse.Namespace, device: torch.device, out: Callable[[str], None] = print) -> list[Row]:
    """Every row of the report (see the module docstring), printed as it is measured."""
    plan = []
    for mode in args.modes:
        for dtype_name in args.dtypes:
            plan += [("train", preset, dtype_name, mode) for preset in args.presets]
            if args.sample_steps > 0:
                plan.append(("sample", args.sample_preset, dtype_name, mode))
    out(f"{'row':<50}{'U-ViT':>10}{'U-ViC':>10}  {'unit':<9}{'time U-ViC/U-ViT':>17}  cog backend")
    rows, start = [], time.perf_counter()
    for i, (kind, preset, dtype_name, mode) in enumerate(plan):
        if args.budget_s and rows and time.perf_counter() - start > args.budget_s:
            skipped = ", ".join(" ".join(p) for p in plan[i:])
            out(f"skipped after {args.budget_s:.0f} s (time budget): {skipped}")
            break
        dtype = DTYPES[dtype_name]
        batch, ckpt = OFFICIAL_BATCH.get(preset, (8, False)) if kind == "train" else (args.sample_batch, False)
        batch = args.batch or batch if kind == "train" else batch
        if kind == "train":
            what = f"train {preset} batch {batch}{' ckpt' if ckpt else ''} {dtype_name} {mode}"
        else:
            what = f"sample {preset} batch {batch} {args.sample_steps} steps {dtype_name} {mode}"
        try:
            rows.append(_row(kind, what, preset, batch, ckpt, dtype, mode == "compile", device, args))
        except Exception as e:  # one failing row (out of memory, a compile error) does not stop the others
            rows.append(Row(what, f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}", "", 0, 0, 0))
            out(f"{what:<50}  {rows[-1].backend}")
        else:
            row = rows[-1]
            out(f"{row.what:<50}{row.uvit:>10.1f}{row.uvic:>10.1f}  {row.unit:<9}{row.ratio:>17.3f}  {row.backend}")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    return rows


def _row(kind: str, what: str, preset: str, batch: int, ckpt: bool, dtype: torch.dtype, compile: bool,
         device: torch.device, args: argparse.Namespace) -> Row:
    """Build both models of `preset` and time one training or sampling row."""
    models = _models(preset, device, ckpt)
    backend = cog_backend(models["U-ViC"], batch, device, dtype)
    if kind == "train":
        fns = {name: train_step(m, batch, device, dtype, compile) for name, m in models.items()}
        secs, ratio = interleaved(fns, device, args.rounds, args.repeat, warmup=2)
        return Row(what, backend, "ms/step", 1e3 * secs["U-ViT"], 1e3 * secs["U-ViC"], ratio)
    fns = {name: sampler(m, batch, args.sample_steps, device, dtype, compile) for name, m in models.items()}
    secs, ratio = interleaved(fns, device, max(1, args.rounds // 2), 1, warmup=1)
    return Row(what, backend, "images/s", batch / secs["U-ViT"], batch / secs["U-ViC"], ratio)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--presets", nargs="+", help="base preset names (uvic.presets), timed as uvit-NAME / uvic-NAME")
    p.add_argument("--batch", type=int, default=0, help="training batch for every preset (default: OFFICIAL_BATCH, "
                   "else 8)")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), help="autocast dtypes (fp32: no autocast)")
    p.add_argument("--modes", nargs="+", choices=["eager", "compile"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeat", type=int, default=3, help="training steps per model per round")
    p.add_argument("--sample-preset")
    p.add_argument("--sample-batch", type=int)
    p.add_argument("--sample-steps", type=int, default=50, help="DPM-Solver steps; 0 skips the sampling rows")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no row after this many seconds (0: no limit)")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (CPU); 0 keeps the default")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    for key, value in DEFAULTS["cuda" if device.type == "cuda" else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    versions = f"torch={torch.__version__}"
    with contextlib.suppress(ImportError):
        import triton

        versions += f" triton={triton.__version__}"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu threads={torch.get_num_threads()}"
    print(f"device={device} ({name}) {versions} rounds={args.rounds} repeat={args.repeat}")
    rows = run(args, device)
    failed = [row.what for row in rows if not row.unit]
    if failed:
        raise SystemExit(f"error: {len(failed)} row(s) failed: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
