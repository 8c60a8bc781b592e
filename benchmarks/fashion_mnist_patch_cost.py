"""The cost of one training step of configs/fashion_mnist_uvic.yaml's model in 4x4 patches (49 tokens) vs 2x2
(196 tokens): forward, epsilon-MSE-like loss, backward and Adam on a batch of 64 random 1x28x28 images, one thread.

    python benchmarks/fashion_mnist_patch_cost.py                     # the config's size
    python benchmarks/fashion_mnist_patch_cost.py --embed-dim 64 --depth 4

The two models run in interleaved rounds so that load from other processes hits both alike; each prints the
median over the rounds (the first, warm-up, left out) of the CPU time (`time.process_time`, which other processes'
load inflates far less than wall time) and of the wall time.
"""

import argparse
import statistics
import time

import torch

from uvic.config import load_config
from uvic.models.uvit import UViTModel


def build(patch: int, embed_dim: int, depth: int) -> UViTModel:
    cfg = load_config("configs/fashion_mnist_uvic.yaml",
                      [f"model.patch_size={patch}", f"model.embed_dim={embed_dim}", f"model.depth={depth}"])
    m = cfg.model
    keys = ("img_size", "patch_size", "in_chans", "embed_dim", "depth", "num_heads", "attention", "mlp_ratio")
    return UViTModel(**{k: getattr(m, k) for k in keys})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--embed-dim", type=int, default=96)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    nets = {}
    for patch in (4, 2):
        net = build(patch, args.embed_dim, args.depth)
        nets[patch] = (net, torch.optim.Adam(net.parameters(), 1e-3))
    x, t = torch.randn(args.batch, 1, 28, 28), torch.rand(args.batch) * 999
    times: dict[int, tuple[list[float], list[float]]] = {patch: ([], []) for patch in nets}
    for r in range(args.rounds):
        for patch, (net, opt) in nets.items():
            c0, w0 = time.process_time(), time.perf_counter()
            out = net(x, t)
            out = out.sample if hasattr(out, "sample") else out
            loss = (out - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if r:
                times[patch][0].append(time.process_time() - c0)
                times[patch][1].append(time.perf_counter() - w0)
    for patch, (cpu, wall) in times.items():
        n = sum(q.numel() for q in nets[patch][0].parameters())
        print(f"patch {patch} ({(28 // patch) ** 2} tokens), {args.embed_dim} wide, depth {args.depth}, {n:,} "
              f"parameters: CPU {statistics.median(cpu):.3f} s/step, wall {statistics.median(wall):.3f} s/step "
              f"(median of {args.rounds - 1}, batch {args.batch}, 1 thread)")


if __name__ == "__main__":
    main()
