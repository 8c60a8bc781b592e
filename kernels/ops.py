"""torch.library registration of the fused attention kernels (opaque custom ops + fake + autograd).

`torch.compile` traces models that call `uvic::fused_attention_fwd` without graph breaks: the ops are opaque
to Dynamo, their fake implementations give the output shapes, and `register_autograd` wires the backward op
(docs/kernel_math.md, section "torch.library: custom_op, not triton_op"). The kernels themselves live in
`uvic.kernels.attention`.
"""

from __future__ import annotations

import torch

from uvic.kernels import attention as _kernels


# ---------------------------------------------------------------------------------------------------------
# torch.library registration (opaque custom ops + fake + autograd: torch.compile traces them without breaks)
# ---------------------------------------------------------------------------------------------------------


@torch.library.custom_op("uvic::fused_attention_fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    cog: bool,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _kernels.attention_forward(q, k, v, key_padding_mask, causal, scale, cog, window_left, window_right,
                                      softcap)  # fmt: skip


@_fwd_op.register_fake
def _(q, k, v, key_padding_mask, causal, scale, cog, window_left=-1, window_right=-1, softcap=0.0):
    return q.new_empty(q.shape), q.new_empty(_kernels.row_stats_shape(q), dtype=torch.float32)


@torch.library.custom_op("uvic::fused_attention_bwd", mutates_args=())
def _bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    cog: bool,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _kernels.attention_backward(do, q, k, v, out, lse, key_padding_mask, causal, scale, cog, window_left,
                                       window_right, softcap)  # fmt: skip


@_bwd_op.register_fake
def _(do, q, k, v, out, lse, key_padding_mask, causal, scale, cog, window_left=-1, window_right=-1, softcap=0.0):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_context(ctx, inputs: tuple, out: torch.Tensor, lse: torch.Tensor) -> None:
    """What the backward needs of a forward call (`inputs`: the forward's arguments, in order), for both paths."""
    q, k, v, key_padding_mask, causal, scale, cog, window_left, window_right, softcap = inputs
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask)
    ctx.causal, ctx.scale, ctx.cog = causal, scale, cog
    ctx.window, ctx.softcap = (window_left, window_right), softcap


def _gradients(ctx, dout: torch.Tensor, backward) -> tuple:
    """The forward arguments' gradients (dq, dk, dv, then None for the rest) from `backward`: the backward op
    (compiled graphs) or the kernels' own function (eager)."""
    q, k, v, out, lse, key_padding_mask = ctx.saved_tensors
    dq, dk, dv = backward(dout, q, k, v, out, lse, key_padding_mask, ctx.causal, ctx.scale, ctx.cog, *ctx.window,
                          ctx.softcap)  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None


def _setup_context(ctx, inputs, output):
    _save_context(ctx, inputs, *output)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, dout, dlse):
    return _gradients(ctx, dout, _bwd_op)


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerFusedAttention(torch.autograd.Function):
    """The same kernels for eager mode, without the custom ops' dispatcher round trips.

    A call through the registered ops pays their Python dispatch (defaults filled, autocast state saved and
    restored, the backward op dispatched again) on top of the launches: about 0.3 ms of host time per forward +
    backward on a CPU that runs the whole op body in 0.08 ms, which is most of the time of a small U-ViT-sized call
    on a GPU. Dynamo cannot trace this Function (its body launches Triton kernels), so `fused_attention` uses it only
    when not compiling; compiled graphs get the opaque ops above. Forward and backward are the same functions.
    """

    @staticmethod
    def forward(ctx, *inputs):  # the arguments of `_fwd_op`, all given
        out, lse = _kernels.attention_forward(*inputs)
        _save_context(ctx, inputs, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        return _gradients(ctx, dout, _kernels.attention_backward)


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    cog: bool = True,
) -> torch.Tensor:
    """The fused kernel as a differentiable op, unchecked: `uvic::fused_attention_fwd` under torch.compile, the
    same kernels through a plain autograd.Function in eager mode (`_EagerFusedAttention`).

    The inputs must be inside the kernel's envelope: `uvic.attention.cog_attention(..., backend="triton")` (and
    `softmax_attention`) check that with `uvic.attention.unsupported_reason` and then call this.

    Args:
        q: (B, nh, Lq, hd); k, v: (B, nh, Lk, hd); any strides, float16/bfloat16/float32.
        causal, key_padding_mask, scale, window, softcap: as `uvic.attention.cog_attention` (window (left, right),
            -1 = unbounded side; softcap c > 0 or None).
        cog: True for Cog attention (`sign(p) * softmax(|p|)`), False for softmax attention (`softmax(p)`), from
            the same kernels. The kinds' names live in `uvic.attention` (ATTENTIONS), which maps its kind to this
            flag: the kernel package imports nothing from the rest of uvic.
    Returns:
        (B, nh, Lq, hd) in the input dtype.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    cap = 0.0 if softcap is None else float(softcap)
    args = (q, k, v, key_padding_mask, bool(causal), scale, bool(cog), left, right, cap)
    if torch.compiler.is_compiling():
        return _fwd_op(*args)[0]
    return _EagerFusedAttention.apply(*args)
