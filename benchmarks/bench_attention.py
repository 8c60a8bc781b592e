"""Side-by-side benchmark of Cog attention against softmax attention (a script, not a test).

    python benchmarks/bench_attention.py                      # time + memory, on CUDA if present else CPU
    python benchmarks/bench_attention.py --what time --rounds 30
    python benchmarks/bench_attention.py --what memory
    python benchmarks/bench_attention.py --what generate      # one decode step of a Cogformer, 2048-token cache

Every number is a ratio measured in the same run: the implementations run round-robin (one call each per round)
and the reported ratio is the median over rounds of time(impl) / time(softmax) within the round, which stays
stable on a shared machine where absolute times drift.

Implementations (forward + backward):
    softmax          `softmax_attention(backend="auto")`: `F.scaled_dot_product_attention` (flash on CUDA)
    softmax[triton]  CUDA only: the fused kernel's softmax mode (the like-for-like baseline for cog)
    cog              `cog_attention(backend="auto")`: the "torch" backend on CPU (its tile math compiled by
                     torch.compile at these sizes), the Triton kernel on CUDA
    cog[eager]       CPU only: the "torch" backend with UVIC_ATTENTION_COMPILE=0 (plain eager PyTorch)
    cog[torch]       `cog_attention(backend="torch")` (CUDA only; it is "cog" on CPU)
    cog[reference]   `cog_attention(backend="reference")`: the dense formula, upcast to float32
    official         the unfused formula of the official U-ViC / Cogformer code, in the input dtype

Shapes: U-ViT (B=8, nh=8, L=257 and 334, hd=64), LM (B=1, nh=12, L=2048, hd=64, causal) and the same with
Mistral-style local attention over the last 512 tokens (window=(511, 0)). Generate: one `generate()` decode step
(forward of one new token, no grad) of the paper's 141M Cogformer with a 2048-token KV cache, against the same
model (same weights) with softmax attention in every layer; the ratio is per round, as above. Memory: the peak
extra memory of one forward + backward at L=4096 (CUDA: the allocator's peak; CPU: the process's peak RSS above its RSS before the call (Linux VmHWM after a
reset), each implementation in a fresh subprocess).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's uvic, installed or not
from uvic.attention import ATTENTIONS, cog_attention, softmax_attention  # noqa: E402


SHAPES = {
    # name: (B, nh, L, hd, causal)
    "uvit-cifar10 (L=257)": (8, 8, 257, 64, False),
    "uvit-mscoco (L=334)": (8, 8, 334, 64, False),
    "lm (L=2048, causal)": (1, 12, 2048, 64, True),
    "lm (L=2048, causal, window 512)": (1, 12, 2048, 64, (511, 0)),
}
MEMORY_SHAPE = (1, 8, 4096, 64, False)


def official_formula(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal=False) -> torch.Tensor:
    """The official code's attention (CogAttn: U-ViC/libs/uvit_t2i.py, Cogformer/attention.py), unfused.
    `causal` may be a (left, 0) window, as in `implementations`."""
    p = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    abs_p = torch.abs(p)
    if causal:
        L = q.shape[2]
        mask = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        if isinstance(causal, tuple):
            mask &= torch.ones_like(mask).triu(-causal[0])
        abs_p = abs_p.masked_fill(~mask, float("-inf"))
    attn = torch.sign(p) * F.softmax(abs_p, dim=-1)
    return attn @ v


def _mask_kw(c) -> dict:
    """A shape's mask entry as op arguments: False / True (causal) or a (left, 0) causal window."""
    return {"causal": True, "window": c} if isinstance(c, tuple) else {"causal": c}


def implementations(device: torch.device) -> dict[str, Callable]:
    impls = {
        "softmax": lambda q, k, v, c: softmax_attention(q, k, v, **_mask_kw(c)),
        "cog": lambda q, k, v, c: cog_attention(q, k, v, **_mask_kw(c)),
    }
    if device.type == "cpu":
        impls["cog[eager]"] = lambda q, k, v, c: _eager(cog_attention, q, k, v, **_mask_kw(c))
    if device.type == "cuda":
        impls["cog[torch]"] = lambda q, k, v, c: cog_attention(q, k, v, backend="torch", **_mask_kw(c))
        impls["softmax[triton]"] = lambda q, k, v, c: softmax_attention(q, k, v, backend="triton", **_mask_kw(c))
    impls["cog[reference]"] = lambda q, k, v, c: cog_attention(q, k, v, backend="reference", **_mask_kw(c))
    impls["official"] = lambda q, k, v, c: official_formula(q, k, v, causal=c)
    return impls


def _eager(fn, *args, **kwargs):
    """Call `fn` with the "torch" backend's torch.compile path switched off (UVIC_ATTENTION_COMPILE=0)."""
    old = os.environ.get("UVIC_ATTENTION_COMPILE")
    os.environ["UVIC_ATTENTION_COMPILE"] = "0"
    try:
        return fn(*args, **kwargs)
    finally:
        if old is None:
            del os.environ["UVIC_ATTENTION_COMPILE"]
        else:
            os.environ["UVIC_ATTENTION_COMPILE"] = old


def _inputs(shape, device, dtype, seed=0):
    B, nh, L, hd, _ = shape
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v, do = (torch.randn(B, nh, L, hd, device=device, dtype=dtype, generator=g) for _ in range(4))
    return [t.requires_grad_(i < 3) for i, t in enumerate((q, k, v))] + [do]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_fwd_bwd(shape, device, dtype, rounds: int, warmup: int = 2) -> dict[str, dict[str, float]]:
    """Median ms and median per-round ratio to softmax, forward + backward."""
    q, k, v, do = _inputs(shape, device, dtype)
    causal = shape[4]
    impls = implementations(device)
    times: dict[str, list[float]] = {name: [] for name in impls}
    for r in range(warmup + rounds):
        for name, fn in impls.items():
            q.grad = k.grad = v.grad = None
            _sync(device)
            t0 = time.perf_counter()
            fn(q, k, v, causal).backward(do)
            _sync(device)
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    base = times["softmax"]
    B, nh, L, hd, _ = shape
    kept = min(1.0, (causal[0] + 1) / L) if isinstance(causal, tuple) else (0.5 if causal else 1.0)
    flops = 4 * B * nh * L * L * hd * 3.5 * kept  # fwd 2 matmuls + bwd 5 (2.5x fwd)
    return {
        name: {
            "ms": 1e3 * statistics.median(t),
            "ratio": statistics.median(a / b for a, b in zip(t, base)),
            "tflops": flops / statistics.median(t) / 1e12,
        }
        for name, t in times.items()
    }


def time_generate_step(device, dtype, rounds: int, cache_len: int = 2048, warmup: int = 2) -> dict[str, float]:
    """Median ms of one decode step (one new token, no grad) with a `cache_len`-token KV cache: the paper's 141M
    Cogformer (Cog in all but the first and last layer) and the same weights with softmax attention everywhere,
    round-robin; returns {"cog ms", "softmax ms", "ratio"} (median of per-round ratios)."""
    from uvic.models.cogformer import CogformerConfig, CogformerForCausalLM

    torch.manual_seed(0)
    models = {}
    for attention in ATTENTIONS:  # one model per kind, all with the first one's weights
        model = CogformerForCausalLM(CogformerConfig(attention=attention)).to(device=device, dtype=dtype).eval()
        if models:
            model.load_state_dict(next(iter(models.values())).state_dict())
        models[attention] = model
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, models["cog"].config.vocab_size, (1, cache_len), generator=g).to(device)
    token = torch.randint(0, models["cog"].config.vocab_size, (1, 1), generator=g).to(device)
    caches = {}
    with torch.no_grad():
        for name, model in models.items():  # prefill once; every timed step adds one token and crops it again
            caches[name] = model(input_ids=prompt, use_cache=True).past_key_values  # a DynamicCache
        times: dict[str, list[float]] = {name: [] for name in models}
        for r in range(warmup + rounds):
            for name, model in models.items():
                _sync(device)
                t0 = time.perf_counter()
                model(input_ids=token, past_key_values=caches[name], use_cache=True)
                _sync(device)
                if r >= warmup:
                    times[name].append(time.perf_counter() - t0)
                caches[name].crop(-1)
    return {
        "cog ms": 1e3 * statistics.median(times["cog"]),
        "softmax ms": 1e3 * statistics.median(times["softmax"]),
        "ratio": statistics.median(a / b for a, b in zip(times["cog"], times["softmax"])),
    }


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_memory_child(name: str, device_type: str) -> None:
    """Run in a fresh process: print the peak extra memory (bytes) of one forward + backward of `name`."""
    device = torch.device(device_type)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fn = implementations(device)[name]
    # Warm up on one head of the same length, so one-time code loading (and, for the "torch" backend, the
    # torch.compile of its tiles, which have the same shapes) is not counted.
    small = (1, 1, MEMORY_SHAPE[2], MEMORY_SHAPE[3], MEMORY_SHAPE[4])
    q, k, v, do = _inputs(small, device, dtype)
    fn(q, k, v, small[4]).backward(do)
    q, k, v, do = _inputs(MEMORY_SHAPE, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn(q, k, v, MEMORY_SHAPE[4]).backward(do)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        # Linux: reset the process's peak RSS (VmHWM) to its current RSS, then read the peak after the call.
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc_status_kib("VmRSS")
        fn(q, k, v, MEMORY_SHAPE[4]).backward(do)
        peak = (_proc_status_kib("VmHWM") - before) * 1024
    print(json.dumps({"name": name, "peak_bytes": peak}))


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak extra MiB per implementation at MEMORY_SHAPE, each in its own subprocess."""
    out = {}
    for name in implementations(device):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--memory-child", name, "--device", device.type]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])["peak_bytes"] / 2**20
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--what", choices=["all", "time", "memory", "generate"], default="all")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), help=f"subset of {list(SHAPES)}")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (CPU); 0 keeps the default")
    p.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_child:
        _peak_memory_child(args.memory_child, args.device)
        return
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"device={device} dtype={dtype} torch={torch.__version__} threads={torch.get_num_threads()}")
    if args.what in ("all", "time"):
        for shape_name in args.shapes:
            shape = SHAPES[shape_name]
            res = time_fwd_bwd(shape, device, dtype, args.rounds)
            print(f"\nforward+backward, {shape_name}: B={shape[0]} nh={shape[1]} L={shape[2]} hd={shape[3]}")
            print(f"  {'impl':<16}{'median ms':>12}{'x softmax':>12}" + (f"{'TFLOP/s':>10}" if device.type == "cuda" else ""))
            for name, r in res.items():
                extra = f"{r['tflops']:>10.1f}" if device.type == "cuda" else ""
                print(f"  {name:<16}{r['ms']:>12.2f}{r['ratio']:>12.2f}{extra}")
    if args.what in ("all", "generate"):
        res = time_generate_step(device, dtype, args.rounds)
        print("\ngenerate() decode step, Cogformer 141M, 2048-token KV cache, no grad")
        print(f"  {'impl':<16}{'median ms':>12}{'x softmax':>12}")
        print(f"  {'softmax':<16}{res['softmax ms']:>12.2f}{1.0:>12.2f}")
        print(f"  {'cog':<16}{res['cog ms']:>12.2f}{res['ratio']:>12.2f}")
    if args.what in ("all", "memory"):
        mem = peak_memory(device)
        B, nh, L, hd, _ = MEMORY_SHAPE
        print(f"\npeak extra memory of forward+backward, B={B} nh={nh} L={L} hd={hd}")
        print(f"  {'impl':<16}{'MiB':>10}{'x cog[reference]':>18}")
        for name, mib in mem.items():
            print(f"  {name:<16}{mib:>10.1f}{mib / mem['cog[reference]']:>18.3f}")


if __name__ == "__main__":
    main()
