"""Benchmark of the fused kernel on CUDA: Cog vs the same kernel's softmax mode vs SDPA's flash backend.

TFLOP/s for forward, backward and forward+backward, bf16, head dims 64 and 128, L from 256 to 16384, causal and
not, as `triton.testing.perf_report` tables (FLOPs as the Triton tutorial counts them: 4 B nh L^2 hd for the
forward, halved when causal; backward 2.5x the forward). Needs a CUDA GPU and pandas (`perf_report` builds its
tables with it): pip install "uvic[bench]", or pip install -e ".[bench]" in a checkout. uvic never imports
this module.

    python benchmarks/bench_triton.py                 # all tables to stdout
    python benchmarks/bench_triton.py --save-path out # also CSV + PNG per table
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
import torch.nn.functional as F
import triton
import triton.testing

from uvic.attention import ATTENTIONS
from uvic.kernels.ops import fused_attention


PROVIDERS = [*ATTENTIONS, "sdpa-flash"]  # the kernel in each of its modes, then SDPA's flash backend
LENGTHS = [2**i for i in range(8, 15)]  # 256 .. 16384
TOKENS = 16384  # B * L is kept at this, so short sequences still fill the GPU


def _configs() -> list[triton.testing.Benchmark]:
    configs = []
    for hd in (64, 128):
        for causal in (False, True):
            for mode in ("fwd", "bwd", "fwd+bwd"):
                configs.append(
                    triton.testing.Benchmark(
                        x_names=["L"],
                        x_vals=LENGTHS,
                        line_arg="provider",
                        line_vals=PROVIDERS,
                        line_names=PROVIDERS,
                        styles=[("red", "-"), ("blue", "-"), ("green", "-")],
                        ylabel="TFLOP/s",
                        plot_name=f"attention-bf16-hd{hd}-{'causal' if causal else 'full'}-{mode}",
                        args={"hd": hd, "causal": causal, "mode": mode, "nh": 2048 // hd},
                    )
                )
    return configs


def _attention(provider: str):
    if provider in ATTENTIONS:  # the fused kernel (unchecked, as the op calls it) in Cog or softmax mode
        cog = provider == "cog"
        return lambda q, k, v, causal: fused_attention(q, k, v, causal=causal, cog=cog)

    def sdpa(q, k, v, causal):
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return sdpa


@triton.testing.perf_report(_configs())
def bench(L: int, hd: int, nh: int, causal: bool, mode: str, provider: str, *, fn=None, device: str = "cuda",
          tokens: int = TOKENS, do_bench=triton.testing.do_bench) -> float:
    """TFLOP/s of one (length, head dim, causal, mode, provider) point.

    `fn(q, k, v, causal)` is the attention timed (default: `provider`'s), on `device`, with B * L = `tokens`, timed
    by `do_bench(run, grad_to_none=...)`; the keyword arguments let tests run the wiring on CPU.
    """
    B = max(1, tokens // L)
    shape = (B, nh, L, hd)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fn = _attention(provider) if fn is None else fn
    if mode == "fwd":
        run = lambda: fn(q, k, v, causal)
    else:
        o = fn(q, k, v, causal)
        do = torch.randn_like(o)
        if mode == "bwd":
            run = lambda: o.backward(do, retain_graph=True)
        else:
            run = lambda: fn(q, k, v, causal).backward(do)
    # Backward accumulates into q/k/v.grad; do_bench resets them before each run, so no accumulation is timed.
    ms = do_bench(run, grad_to_none=[q, k, v])
    flops = 4.0 * B * nh * L * L * hd * (0.5 if causal else 1.0)
    flops *= {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]
    return flops * 1e-12 / (ms * 1e-3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--save-path", default="", help="folder for CSV/PNG files (default: print only)")
    args = parser.parse_args(argv)
    # perf_report's run() imports pandas unconditionally: name the extra rather than fail in triton's code.
    if importlib.util.find_spec("pandas") is None:
        raise SystemExit('bench_triton needs pandas for its tables: pip install "uvic[bench]" (from a checkout: '
                         'pip install -e ".[bench]")')  # fmt: skip
    if not torch.cuda.is_available():
        raise SystemExit("bench_triton needs a CUDA GPU (torch.cuda.is_available() is False)")
    bench.run(print_data=True, save_path=args.save_path)


if __name__ == "__main__":
    main()
