"""Fused Triton kernels for Cog attention (the "triton" backend of `uvic.attention`).

Importing this package does not import triton: it holds the kernel's envelope (the limits that
`uvic.attention.unsupported_reason` checks) and the device query, so `import uvic.kernels` works on any machine.
The op itself, `fused_attention`, is in `uvic.kernels.ops` (which imports triton). This package imports nothing
from its submodules or from `uvic.attention`, so no import circle runs through it; the checked entry point is
`uvic.attention.cog_attention(..., backend="triton")`. No module of the package imports the rest of uvic (the
benchmarks that compare the kernel with uvic's models live in benchmarks/), except the build tool
`uvic.kernels.aot`, which the op never imports and which writes its files with `uvic.io.atomic_write`
(tests/test_imports.py).
"""

from __future__ import annotations

import torch


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Every multiple of 8 up to 256, as FlashAttention-2 (the kernels split a head dim into power-of-two tiles:
# `uvic.kernels.configs.head_dim_chunks`). Others run on the torch backend.
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256
SUPPORTED_HEAD_DIMS = tuple(range(HEAD_DIM_MULTIPLE, MAX_HEAD_DIM + 1, HEAD_DIM_MULTIPLE))
# Offsets inside one (batch, head) slice are 32-bit in the kernels: L * hd must stay below this.
MAX_SLICE_ELEMENTS = 2**31
# The (batch * head) axis of the launch grid.
MAX_BATCH_HEADS = 65535

__all__ = [
    "HEAD_DIM_MULTIPLE",
    "MAX_BATCH_HEADS",
    "MAX_HEAD_DIM",
    "MAX_SLICE_ELEMENTS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "cuda_device_info",
]


_CUDA_DEVICE_INFO: dict[int, tuple[int, int, int, bool]] = {}


def cuda_device_info(index: int) -> tuple[int, int, int, bool]:
    """(major, minor, shared memory a block may opt in to in bytes, is ROCm) of CUDA device `index`, cached.

    Pass the result to `uvic.kernels.configs.config_arch`, which decides from these four values alone.
    Marked like `torch.compiler.assume_constant_result` (below): Dynamo runs it at trace time and uses its result
    as a constant instead of tracing the device queries inside, so the envelope check adds no node and no graph
    break to a compiled graph. That is sound because a graph is guarded on its tensors' devices (another device
    index gets its own graph) and a device's properties do not change.
    """
    info = _CUDA_DEVICE_INFO.get(index)
    if info is None:
        if torch.version.hip is not None:
            info = (0, 0, 0, True)  # refused whatever its properties (ROCm torch may not report the smem opt-in)
        else:
            props = torch.cuda.get_device_properties(index)
            smem = getattr(props, "shared_memory_per_block_optin", None)
            if smem is None:  # torch 2.4-2.6 lacks it; triton asks the driver for the same attribute
                from triton.runtime import driver

                smem = driver.active.utils.get_device_properties(index)["max_shared_mem"]
            info = (props.major, props.minor, int(smem), False)
        _CUDA_DEVICE_INFO[index] = info
    return info


# What `torch.compiler.assume_constant_result` sets, set by hand: the decorator imports torch._dynamo, which imports
# triton, and importing this package must not.
cuda_device_info._dynamo_marked_constant = True

