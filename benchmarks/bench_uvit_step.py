"""Time one training step (forward, backward, AdamW) of U-ViT vs U-ViC and print the ratio U-ViC / U-ViT.

    python benchmarks/bench_uvit_step.py                         # S/2 CIFAR-10 presets, batch 8, CPU
    python benchmarks/bench_uvit_step.py --preset tiny-cifar --rounds 3

The two models differ only in the attention of 11 of their 13 blocks (same weights, same data). Rounds are
interleaved (and the order alternates each round) so that load from other processes hits both models alike;
the median over rounds is reported. Target: U-ViC at most 1.05x U-ViT.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from uvic.models import build_preset


def make_step(model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, noise: torch.Tensor):
    """A closure running one epsilon-MSE training step with the official CIFAR-10 AdamW settings."""
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.03, betas=(0.99, 0.999))

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x, t).sample, noise)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def bench(
    preset: str, batch: int, rounds: int, backend: str, uvic_backend: str | None = None, seed: int = 0
) -> dict[str, list[float]]:
    """Seconds per step for `uvit-<preset>` and `uvic-<preset>`, one entry per round."""
    torch.manual_seed(seed)
    uvit = build_preset(f"uvit-{preset}", attention_backend=backend)
    uvic = build_preset(f"uvic-{preset}", attention_backend=uvic_backend or backend)
    uvic.load_state_dict(uvit.state_dict())
    cfg = uvit.config
    x = torch.randn(batch, cfg.in_chans, cfg.img_size, cfg.img_size)
    t = torch.rand(batch) * 999
    noise = torch.randn_like(x)
    steps = {"uvit": make_step(uvit, x, t, noise), "uvic": make_step(uvic, x, t, noise)}
    for step in steps.values():  # warm-up: allocator, thread pool, AdamW state
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in ("uvit", "uvic") if r % 2 == 0 else ("uvic", "uvit"):
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="s2-cifar10", help="preset name without the uvit-/uvic- prefix")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--backend", default="auto", help="uvic.attention backend of both models")
    p.add_argument("--uvic-backend", default=None, help="a different backend for the U-ViC model only")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    times = bench(args.preset, args.batch, args.rounds, args.backend, args.uvic_backend)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    backends = f"backend={args.backend} uvic_backend={args.uvic_backend or args.backend}"
    print(f"preset={args.preset} batch={args.batch} rounds={args.rounds} {backends} threads={torch.get_num_threads()}")
    for name, ts in times.items():
        print(f"{name}: median {med[name] * 1e3:.1f} ms/step  (rounds: {', '.join(f'{t * 1e3:.0f}' for t in ts)})")
    print(f"ratio U-ViC / U-ViT = {med['uvic'] / med['uvit']:.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main()
