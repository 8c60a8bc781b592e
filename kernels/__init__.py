"""Fused Triton kernels for Cog attention (the "triton" backend of `uvic.attention`).

Importing this package does not import triton: `unsupported_reason` checks for it, and the kernels in
`uvic.kernels.attention` are imported on first use. So `import uvic.kernels` works on any machine.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from uvic.kernels.configs import config_arch


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)

__all__ = ["SUPPORTED_DTYPES", "SUPPORTED_HEAD_DIMS", "fused_attention", "unsupported_reason"]


_CUDA_DEVICE_INFO: dict[int, tuple[int, int, int, bool]] = {}


def cuda_device_info(index: int) -> tuple[int, int, int, bool]:
    """(major, minor, shared memory a block may opt in to in bytes, is ROCm) of CUDA device `index`, cached.

    Marked as `torch.compiler.assume_constant_result` (below): Dynamo runs it at trace time and uses its result
    as a constant instead of tracing the device queries inside, so `unsupported_reason` adds no node and no graph
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


# What `torch.compiler.assume_constant_result` does, set by hand: the decorator imports torch._dynamo, which imports
# triton, and importing this package must not (tests/kernels/test_device.py checks the decorator sets this name).
cuda_device_info._dynamo_marked_constant = True


def unsupported_reason(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None
) -> str | None:
    """Why the fused kernel cannot run on these inputs, or None when it can (the envelope of kernels/attention.py).

    Args:
        q: (B, nh, Lq, hd); k, v: (B, nh, Lk, hd).
        key_padding_mask: (B, Lk) bool or None.
    Returns:
        A short reason, or None.
    """
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    from uvic.attention import input_problem  # the checks every backend shares (shapes, dtypes, devices, mask)

    problem = input_problem(q, k, v, key_padding_mask)
    if problem is not None:
        return problem
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if not (q.is_cuda or (interpret and q.device.type == "cpu")):
        return f"the inputs are on {q.device}; the kernel needs CUDA tensors (or CPU with TRITON_INTERPRET=1)"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not supported (float16, bfloat16, float32)"
    hd = q.shape[-1]
    if hd not in SUPPORTED_HEAD_DIMS:
        return f"head dim {hd} is not supported (one of {SUPPORTED_HEAD_DIMS})"
    B, nh, Lq = q.shape[:3]
    if Lq == 0 or k.shape[2] == 0 or B * nh == 0:
        return "empty input (a zero-sized dimension)"
    if max(Lq, k.shape[2]) * hd >= 2**31:  # offsets inside one (batch, head) slice are 32-bit in the kernels
        return f"L * hd = {max(Lq, k.shape[2]) * hd} elements per (batch, head); the kernel allows fewer than 2**31"
    if B * nh > 65535:
        return f"B * nh = {B * nh} is larger than the kernel grid allows (65535)"
    if q.is_cuda:
        return config_arch(*cuda_device_info(q.device.index))[1]
    return None


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    cog: bool = True,
) -> torch.Tensor:
    """Fused flash-style attention, differentiable; Cog weights (`cog=True`) or softmax weights from the same kernel.

    Args:
        q: (B, nh, Lq, hd) queries; k, v: (B, nh, Lk, hd); any strides, float16/bfloat16/float32.
        causal: mask key j for query i when j > i + Lk - Lq (bottom-right aligned).
        key_padding_mask: (B, Lk) bool, True = the key takes part.
        scale: multiplies q k^T; defaults to hd ** -0.5.
        cog: `sign(p) * softmax(|p|)` if True, `softmax(p)` if False.
    Returns:
        (B, nh, Lq, hd) in the input dtype; rows with no kept key are zeros (zero gradients).
    Raises:
        ValueError: the inputs are outside the kernel's envelope (the message says why).
    """
    why = unsupported_reason(q, k, v, key_padding_mask)
    if why is not None:
        raise ValueError(f"fused_attention cannot run on these inputs: {why}")
    from uvic.kernels.ops import fused_attention_impl

    return fused_attention_impl(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, cog=cog)
