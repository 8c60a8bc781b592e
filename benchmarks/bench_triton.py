"""Benchmark of the fused kernel on CUDA: Cog vs the same kernel's softmax mode vs SDPA's flash backend.

TFLOP/s for forward, backward and forward+backward, bf16, by head dim, L and mask, as `triton.testing.perf_report`
tables (FLOPs as the Triton tutorial counts them: 4 B nh L^2 hd for the forward, halved when causal; backward
2.5x the forward), each followed by the time ratios cog / softmax mode and cog / SDPA flash measured in the same
run. A head dim the kernel refuses (`uvic.attention.unsupported_reason`) gets NaN for the kernel's rows. Needs a
CUDA GPU and pandas (`perf_report` builds its tables with it): pip install "uvic[bench]", or pip install -e
".[bench]" in a checkout. uvic never imports this module.

    python benchmarks/bench_triton.py                   # head dims 64 and 128, L 256 .. 16384, both masks
    python benchmarks/bench_triton.py --head-dims 64 72 96 128 --lengths 4096 16384 --causal no
    python benchmarks/bench_triton.py --save-path out   # also CSV + PNG per table
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's uvic, installed or not
from uvic.attention import ATTENTIONS, unsupported_reason  # noqa: E402
from uvic.kernels.ops import fused_attention  # noqa: E402


PROVIDERS = [*ATTENTIONS, "sdpa-flash"]  # the kernel in each of its modes, then SDPA's flash backend
HEAD_DIMS = [64, 128]
LENGTHS = [2**i for i in range(8, 15)]  # 256 .. 16384
MODES = ["fwd", "bwd", "fwd+bwd"]
TOKENS = 16384  # B * L is kept at this, so short sequences still fill the GPU
WIDTH = 2048  # nh * hd is about this (nh = WIDTH // hd)


def _configs(head_dims=HEAD_DIMS, lengths=LENGTHS, causals=(False, True), modes=MODES) -> list:
    """One `triton.testing.Benchmark` (table) per head dim, mask and mode; L on the x axis."""
    configs = []
    for hd in head_dims:
        for causal in causals:
            for mode in modes:
                configs.append(
                    triton.testing.Benchmark(
                        x_names=["L"],
                        x_vals=list(lengths),
                        line_arg="provider",
                        line_vals=PROVIDERS,
                        line_names=PROVIDERS,
                        styles=[("red", "-"), ("blue", "-"), ("green", "-")],
                        ylabel="TFLOP/s",
                        plot_name=f"attention-bf16-hd{hd}-{'causal' if causal else 'full'}-{mode}",
                        args={"hd": hd, "causal": causal, "mode": mode, "nh": WIDTH // hd},
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


def bench(L: int, hd: int, nh: int, causal: bool, mode: str, provider: str, *, fn=None, device: str = "cuda",
          tokens: int = TOKENS, do_bench=triton.testing.do_bench) -> float:
    """TFLOP/s of one (length, head dim, causal, mode, provider) point.

    `fn(q, k, v, causal)` is the attention timed (default: `provider`'s), on `device`, with B * L = `tokens`, timed
    by `do_bench(run, grad_to_none=...)`; the keyword arguments let tests run the wiring on CPU.
    """
    B = max(1, tokens // L)
    shape = (B, nh, L, hd)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    if fn is None and provider in ATTENTIONS and unsupported_reason(q, k, v, backend="triton") is not None:
        return float("nan")  # a head dim (or GPU) outside the kernel's envelope
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


def time_ratios(table: dict[str, list[float]]) -> dict[str, list[float]]:
    """A perf_report table (column -> values: L, then TFLOP/s per provider) with the time ratios cog / softmax mode
    and cog / sdpa-flash of each row added (the inverse ratios of TFLOP/s)."""
    cog, softmax, sdpa = PROVIDERS
    ratio = lambda other: [o / c for c, o in zip(table[cog], table[other])]
    return {**table, f"{cog}/{softmax} time": ratio(softmax), f"{cog}/{sdpa} time": ratio(sdpa)}


def format_table(name: str, table: dict[str, list[float]]) -> str:
    """`name:` and the table's columns, right-aligned, numbers with 3 decimals (L as an integer)."""
    cell = lambda col, x: f"{x:.0f}" if col == "L" else f"{x:.3f}"
    widths = {col: max(len(col), *(len(cell(col, x)) for x in xs)) for col, xs in table.items()}
    lines = ["  ".join(col.rjust(w) for col, w in widths.items())]
    for i in range(len(next(iter(table.values())))):
        lines.append("  ".join(cell(col, table[col][i]).rjust(w) for col, w in widths.items()))
    return f"{name}:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", type=int, nargs="+", default=HEAD_DIMS)
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--save-path", default="", help="folder for CSV/PNG files (default: print only)")
    args = parser.parse_args(argv)
    # perf_report's run() imports pandas unconditionally: name the extra rather than fail in triton's code.
    if importlib.util.find_spec("pandas") is None:
        raise SystemExit('bench_triton needs pandas for its tables: pip install "uvic[bench]" (from a checkout: '
                         'pip install -e ".[bench]")')
    if not torch.cuda.is_available():
        raise SystemExit("bench_triton needs a CUDA GPU (torch.cuda.is_available() is False)")
    causals = {"no": (False,), "yes": (True,), "both": (False, True)}[args.causal]
    configs = _configs(args.head_dims, args.lengths, causals, args.modes)
    dfs = triton.testing.perf_report(configs)(bench).run(save_path=args.save_path, return_df=True)
    print(f"torch={torch.__version__} triton={triton.__version__} gpu={torch.cuda.get_device_name()}")
    for config, df in zip(configs, dfs):
        print(format_table(config.plot_name, time_ratios(df.to_dict("list"))))


if __name__ == "__main__":
    main()
