"""Host time per call of the fused attention op: the Python and launch work around its kernels, for small calls.

    python benchmarks/bench_dispatch.py                  # CPU: the kernel launches stubbed, no GPU needed
    python benchmarks/bench_dispatch.py --device cuda    # a GPU: real launches, Cog against SDPA

A small call (a U-ViT attention layer: B=8 nh=8 L=257) runs for tens of microseconds on a GPU, so the host work
of launching it decides its speed. Every number is measured side by side in one run: the implementations run
round-robin (one batch of calls each per round) and the median over rounds is reported.

CPU (`--device cpu`): nothing can launch, so `stubbed_launches()` stands in for the GPU. It installs a triton
driver whose compiled kernels' launcher (the C call that would enqueue the kernel) is a no-op, and every Python
step before it runs unchanged: `uvic.kernels.ops.fused_attention`, the autograd Function, the launchers of
`uvic.kernels.attention`, and on a first call triton's autotuner and JIT (compiling is stubbed too). Rows:

    floor            an empty autograd.Function (forward allocates the output, backward three gradients): what any
                     autograd op costs before its own work
    fused fwd        `fused_attention` under no_grad, one kernel launch
    fused fwd+bwd    `fused_attention` forward + backward (`torch.autograd.grad`), four launches

with the Python function calls each makes (`python_calls`, the count `tests/kernels/test_dispatch.py` bounds).

CUDA (`--device cuda`): bf16 calls of B=1 nh=1 L=16 hd=64, whose GPU time is a few microseconds, enqueued
`--calls` at a time with no synchronisation in between, so the host is what is timed: SDPA (softmax, PyTorch's
flash kernel), `cog_attention` (the public op, its checks included) and `fused_attention` (the op unchecked),
forward and forward + backward, in microseconds per call and as a ratio to SDPA.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's uvic, installed or not


# ---------------------------------------------------------------------------------------------------------
# The stub: triton's launch path on CPU tensors, with the kernel launch itself a no-op
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def stubbed_launches(capability: tuple[int, int] = (9, 0), smem: int = 232448) -> Iterator[list[tuple]]:
    """Run the fused op's GPU launch path on CPU tensors: everything but the launch itself.

    Inside the block, `uvic.kernels.ops.fused_attention` on CPU tensors (TRITON_INTERPRET unset) takes the path it
    takes on a GPU of `capability` with `smem` bytes of opt-in shared memory (an H100 by default): the device query
    answers with these values, triton's driver is a stand-in that reports that GPU, a kernel that triton would
    compile is a `CompiledKernel` (one per specialization, as triton compiles them) whose launcher appends
    (that kernel, grid, kernel arguments) to the yielded list instead of launching, and the autotuner takes its
    first candidate instead of timing them. Nothing computes: the outputs hold whatever `torch.empty` gave. The
    kernel caches (triton's, the autotuners', uvic's launch plans) are fresh inside the block and restored after.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    import uvic.kernels.attention as kattn

    if not all(isinstance(fn, JITFunction) for fn in kattn.KERNEL_FNS.values()):
        raise RuntimeError("stubbed_launches needs triton's JIT kernels: unset TRITON_INTERPRET before importing "
                           "triton")
    launches: list[tuple] = []

    class StubDriver:
        def get_current_device(self):
            return 0

        def set_current_device(self, device):
            pass

        def get_current_stream(self, device):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", capability[0] * 10 + capability[1], 32)

    class StubKernel(CompiledKernel):
        """A compiled kernel that is loaded (so triton does not load a binary) and whose launcher records."""

        def __init__(self, name: str):  # no binary: CompiledKernel.__init__ reads one from triton's cache
            self.name, self.src, self.hash = name, None, name
            self.module, self.function, self.packed_metadata = object(), 0, ()

            def launch(grid_0, grid_1, grid_2, stream, function, metadata, launch_metadata, enter, exit, *args):
                launches.append((self, (grid_0, grid_1, grid_2), args))

            self._run = launch

        def __del__(self):
            pass

    def compile_stub(self, key, *args, **kwargs):
        kernel = StubKernel(self.__name__)
        self.device_caches[StubDriver().get_current_device()][0][key] = kernel
        return kernel

    def first_candidate(self, *args, config, **kwargs):
        return [float(self.configs.index(config))] * 3

    with contextlib.ExitStack() as stack:
        patch = lambda *a, **kw: stack.enter_context(mock.patch.object(*a, **kw))
        patch(driver, "_active", StubDriver())
        patch(JITFunction, "_do_compile", compile_stub)
        patch(Autotuner, "_bench", first_candidate)
        patch(kattn, "cuda_device_info", lambda index: (*capability, smem, False))
        patch(kattn, "_AUTOTUNED", {})
        patch(kattn, "_PLANS", {}, create=True)
        for fn in kattn.KERNEL_FNS.values():
            from collections import defaultdict

            patch(fn, "device_caches", defaultdict(fn.create_binder))
        assert triton.runtime.driver.active.get_current_target().arch == capability[0] * 10 + capability[1]
        yield launches


def python_calls(fn: Callable[[], object]) -> int:
    """The Python functions (frames, not C calls) that one call of `fn` enters, counted with sys.setprofile."""
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += event == "call"

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count - 1  # fn itself


# ---------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------


class _Empty(torch.autograd.Function):
    """The floor of an autograd op: allocate the output in forward and three gradients in backward."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, dout):
        return torch.empty_like(dout), torch.empty_like(dout), torch.empty_like(dout)


def calls(device: torch.device, shape: tuple[int, int, int, int]) -> dict[str, Callable[[], object]]:
    """The timed calls, each a no-argument function, on bf16 tensors of `shape` (B, nh, L, hd)."""
    from uvic.attention import cog_attention
    from uvic.kernels.ops import fused_attention

    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def forward(op):
        def run():
            with torch.no_grad():
                return op(q, k, v)

        return run

    def forward_backward(op):
        return lambda: torch.autograd.grad(op(q, k, v), (q, k, v), do)

    if device.type == "cpu":
        return {"floor": forward_backward(_Empty.apply), "fused fwd": forward(fused_attention),
                "fused fwd+bwd": forward_backward(fused_attention)}
    ops = {"sdpa": F.scaled_dot_product_attention, "cog_attention": cog_attention, "fused_attention": fused_attention}
    timed = {f"{name} fwd": forward(op) for name, op in ops.items()}
    timed.update({f"{name} fwd+bwd": forward_backward(op) for name, op in ops.items()})
    return timed


def host_time(timed: dict[str, Callable[[], object]], device: torch.device, n: int, rounds: int) -> dict[str, float]:
    """Median over `rounds` of the microseconds per call of each function, `n` calls per round each, round-robin.
    On CUDA the calls are not synchronised (the GPU work of a small call is shorter than its host work)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in timed.values():  # warm-up: first-call compiles, autotuning, allocator
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(rounds):
        for name, fn in timed.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - t0) / n * 1e6)
    sync()
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--calls", type=int, default=200, help="calls per implementation per round")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    print(f"device={device} torch={torch.__version__} threads={torch.get_num_threads()}")
    if device.type == "cpu":
        with stubbed_launches():
            timed = calls(device, (1, 2, 16, 64))
            res = host_time(timed, device, args.calls, args.rounds)
            counts = {name: python_calls(fn) for name, fn in timed.items()}
        print("host time per call, kernel launches stubbed (bf16, B=1 nh=2 L=16 hd=64)")
        print(f"  {'call':<16}{'us/call':>10}{'x floor':>10}{'python calls':>14}")
        for name, us in res.items():
            print(f"  {name:<16}{us:>10.1f}{us / res['floor']:>10.2f}{counts[name]:>14}")
        return
    import triton

    print(f"triton={triton.__version__} gpu={torch.cuda.get_device_name()}")
    res = host_time(calls(device, (1, 1, 16, 64)), device, args.calls, args.rounds)
    print("host time per call, bf16, B=1 nh=1 L=16 hd=64 (enqueue only)")
    print(f"  {'call':<24}{'us/call':>10}{'x sdpa':>10}")
    for name, us in res.items():
        base = res["sdpa fwd" if name.endswith(" fwd") else "sdpa fwd+bwd"]
        print(f"  {name:<24}{us:>10.1f}{us / base:>10.2f}")


if __name__ == "__main__":
    main()
