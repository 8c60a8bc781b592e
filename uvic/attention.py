"""Cog attention and softmax attention: the one attention op every uvic model calls.

Cog attention (Lv et al., "More Expressive Attention with Negative Weights", ICML 2025, Eq. 3) replaces the
softmax weights with signed ones:

    p = scale * q k^T,    attn = sign(p) * softmax(|p|),    o = attn v

so a query can subtract a value vector as well as add it. The semantics every backend shares (masks, sliding
windows, logit softcaps, empty inputs, rows with no kept key, non-finite values in masked keys) are written out in
docs/attention.md.

Shape letters: B batch, nh heads, Lq / Lk query / key tokens, hd head dim. Every tensor is in the
`F.scaled_dot_product_attention` layout (B, nh, L, hd).

Backends (the same semantics in each, tested against `attention_ref` in float64):
    "reference"  the paper's "faster" formula (Fig. 2), dense, upcast to float32; the ground truth.
    "torch"      `tiled_cog_attention`: memory-efficient PyTorch that works over tiles of queries, saves only
                 q, k, v, the output and two floats per row (row max, row sum) and recomputes the weights in backward.
                 For `softmax_attention` this is `F.scaled_dot_product_attention`.
    "triton"     the fused flash-style kernel in `uvic.kernels` (CUDA only).
    "auto"       cog_attention: "triton" for fp16/bf16 CUDA inputs inside the kernel's envelope, else "torch".
                 softmax_attention: always "torch", i.e. SDPA (FlashAttention / cuDNN / memory-efficient kernels on
                 GPUs), so softmax baselines such as U-ViT get PyTorch's fastest attention; the kernel's softmax
                 mode (backend="triton") is there for like-for-like comparisons with Cog.

`unsupported_reason` is the one place that says why a backend cannot run on given inputs; this module is the only
one in uvic that imports `uvic.kernels`. The attention kinds are `ATTENTIONS`; `attention_op(kind)` is the op of a
kind and `attention_placement` the one rule for which layers of a model keep softmax (U-ViC, Cogformer and the
diffusers / transformers integrations).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import warnings
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F

from uvic.kernels import (
    HEAD_DIM_MULTIPLE,
    MAX_BATCH_HEADS,
    MAX_HEAD_DIM,
    MAX_SLICE_ELEMENTS,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    cuda_device_info,
)
from uvic.kernels.configs import config_arch


Backend = Literal["auto", "reference", "torch", "triton"]
AttentionKind = Literal["cog", "softmax"]
BACKENDS = ("auto", "reference", "torch", "triton")
# The one list of attention kinds (models, configs and the integrations check against it).
ATTENTIONS: tuple[str, ...] = get_args(AttentionKind)

logger = logging.getLogger(__name__)

# Looked up once: `importlib.util.find_spec` searches sys.path on every call (a cost on every attention call) and
# Dynamo refuses to trace it (a graph break, or an error under fullgraph=True, in compiled models).
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None

# Elements of one (rows x keys) score tile in the "torch" backend: 2**20 fp32 scores = 4 MiB, so a tile and its
# few temporaries take tens of MiB whatever the sequence length. Measured on CPU (benchmarks/bench_attention.py):
# smaller tiles lose more to per-op call overhead than they gain in cache hits; a whole U-ViT batch item is one tile.
TILE_ELEMENTS = 2**20


# ---------------------------------------------------------------------------------------------------------
# Attention kinds: which op, and which layers keep softmax
# ---------------------------------------------------------------------------------------------------------


def check_attention_kind(attention: object) -> AttentionKind:
    """`attention` if it is one of ATTENTIONS; else a ValueError naming the kinds."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    return attention


# Set by `uvic.attention_probe.probe_attention` for the length of a probe: (op, kind) -> the op that records its
# calls. None otherwise.
_observer: Callable[[Callable[..., torch.Tensor], AttentionKind], Callable[..., torch.Tensor]] | None = None


def attention_op(attention: AttentionKind) -> Callable[..., torch.Tensor]:
    """The op of an attention kind: `cog_attention` for "cog", `softmax_attention` for "softmax" (same signature).

    The one place a kind becomes an op; every model and integration layer calls the op it returns.

    Raises:
        ValueError: `attention` is not one of ATTENTIONS.
    """
    ops = {"cog": cog_attention, "softmax": softmax_attention}  # a new kind adds its op here
    op = ops[check_attention_kind(attention)]
    # While `uvic.attention_probe.probe_attention` records a model's calls, the op comes wrapped; otherwise this is
    # one `is None` test per layer call and the op itself is returned.
    return op if _observer is None else _observer(op, attention)


def check_softmax_count(value: object, name: str) -> int:
    """`value` if it is a count of layers kept on softmax, an int >= 0; else a ValueError naming `name`.

    The one validation of the placement's counts (`attention_placement`, the models' and the integrations'
    `keep_softmax_first` / `keep_softmax_last`, the old names `renamed_placement` reads, and what the integrations
    read back from a saved config). bool, float (1.0, NaN, inf), str, None and containers are refused.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def attention_placement(
    num_layers: int,
    keep_softmax_first: int = 1,
    keep_softmax_last: int = 1,
    attention: AttentionKind = "cog",
    *,
    allow_overlap: bool = False,
    names: tuple[str, str] = ("keep_softmax_first", "keep_softmax_last"),
) -> list[AttentionKind]:
    """The attention kind of each of `num_layers` layers in execution order: the paper's Cog placement.

    With attention="cog", the first `keep_softmax_first` and the last `keep_softmax_last` layers keep softmax and
    every layer between runs Cog: 1 and 1 is U-ViC (paper Sec. 4.2), k and k a Cogformer (Sec. 4.1), 0 and 0 Cog
    everywhere, 1 and 0 the ablation with softmax in the first layer only. With attention="softmax" every layer is
    softmax. The one statement of the rule: U-ViT / U-ViC blocks, Cogformer layers, and the layers the diffusers
    and transformers integrations switch all come from here.

    Counts that together exceed `num_layers` make the two ends overlap. A model, whose counts describe its own
    layers, refuses that (ValueError); the integrations pass `allow_overlap=True`, since one count applies to every
    stack of a model whatever its length, and a stack no longer than the two ends keeps softmax in every layer.
    Without `allow_overlap`, a Cog placement that leaves no Cog layer (first + last == num_layers) warns; the
    integrations warn themselves when no layer of the whole model is switched.

    Args:
        num_layers: layers (blocks) in the stack, >= 0.
        keep_softmax_first: layers kept on softmax at the start (`check_softmax_count`).
        keep_softmax_last: layers kept on softmax at the end.
        attention: "cog" or "softmax", the model's kind.
        allow_overlap: accept first + last > num_layers (every layer then keeps softmax).
        names: what the error and warning messages call the two counts.
    Returns:
        `num_layers` kinds, "cog" or "softmax".
    Raises:
        ValueError: an unknown `attention`, a count that is not an int >= 0, or (without `allow_overlap`)
            counts that overlap.
    """
    check_attention_kind(attention)
    first = check_softmax_count(keep_softmax_first, names[0])
    last = check_softmax_count(keep_softmax_last, names[1])
    if not allow_overlap and first + last > num_layers:
        raise ValueError(f"{names[0]}={first} and {names[1]}={last} keep softmax in {first + last} layers, more than "
                         f"the {num_layers} there are: the two ends would overlap")
    kinds: list[AttentionKind] = [
        "softmax" if attention == "softmax" or i < first or i >= num_layers - last else "cog" for i in range(num_layers)
    ]
    if not allow_overlap and attention == "cog" and "cog" not in kinds and num_layers:
        warnings.warn(f"attention='cog' with {names[0]}={first} and {names[1]}={last} keeps all {num_layers} layers "
                      "on softmax, so no layer runs Cog attention", stacklevel=2)
    return kinds


def renamed_placement(count: object, first: object = None, last: object = None, *, old: str, where: str,
                      stacklevel: int = 3, warn: bool = True) -> tuple[Any, Any]:
    """(keep_softmax_first, keep_softmax_last) of a placement written with an old name: the one count `count` of
    both ends (Cogformer's `num_softmax_layers`, the integrations' `keep_softmax` and `cog_keep_softmax`), where an
    end given apart (not None) wins; with one FutureWarning naming `where`, the old name and what to write instead.

    `count` None (no old count, only an end written as None, as configs saved with the old names hold) leaves the
    ends as given; the caller drops a None end. `warn=False`: no warning (a caller reading several records of one
    saved model warns once). Raises ValueError (`check_softmax_count`) for a bad count.
    """
    if count is not None:
        count = check_softmax_count(count, old)
        first, last = (count if first is None else first), (count if last is None else last)
    read = ", ".join(f"{name}={value}" for name, value in (("keep_softmax_first", first), ("keep_softmax_last", last))
                     if value is not None) or "the preset's or default counts"
    if warn:
        warnings.warn(f"{where}: {old} is the old name of the softmax placement, read as {read}; "
                      "write keep_softmax_first / keep_softmax_last (counts of layers at each end that keep "
                      "softmax)", FutureWarning, stacklevel=stacklevel)
    return first, last


# ---------------------------------------------------------------------------------------------------------
# Input checks and masks
# ---------------------------------------------------------------------------------------------------------


def unsupported_reason(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    *,
    backend: Backend = "torch",
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
) -> str | None:
    """Why `backend` cannot run on these inputs, in words; None when it can.

    The one home of every input check: `cog_attention` and `softmax_attention` raise a ValueError with this text,
    and "auto" uses it to decide whether the fused kernel takes a call. For "reference", "torch" and "auto" only
    the shapes, dtypes, devices and mask are checked; for "triton" also the kernel's envelope (triton installed,
    CUDA tensors or CPU under TRITON_INTERPRET=1, dtype, head dim, sizes, GPU architecture).

    Args:
        q: (B, nh, Lq, hd); k, v: (B, nh, Lk, hd).
        key_padding_mask: (B, Lk) bool (True = the key takes part) or None.
        backend: "auto", "reference", "torch" or "triton".
        window: (left, right) ints >= -1 (-1 = unbounded) or None, as `cog_attention`.
        softcap: a positive finite float or None, as `cog_attention`.
    Returns:
        A short reason, or None.
    """
    if backend not in BACKENDS:
        return f"unknown attention backend {backend!r}; expected one of {BACKENDS}"
    why = _input_problem(q, k, v, key_padding_mask, window, softcap)
    if why is None and backend == "triton":
        why = _kernel_problem(q, k)
    return why


def _input_problem(q, k, v, key_padding_mask, window, softcap) -> str | None:
    """What every backend needs of the inputs (shapes, dtypes, devices, mask, window, softcap), or None."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return f"{name} must have shape (B, nh, L, hd) (4 dims), got {tuple(t.shape)}"
        if not t.is_floating_point():
            return f"{name} must be a floating-point tensor, got {t.dtype}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not (q.device == k.device == v.device):
        return f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
    if q.is_meta:
        return "q, k, v are meta tensors (shapes only, no data); the attention op needs tensors with values"
    B, nh, Lq, hd = q.shape
    Lk = k.shape[2]
    if k.shape[0] != B or k.shape[1] != nh or k.shape[3] != hd:
        return f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in B, nh or hd"
    if v.shape[:3] != k.shape[:3]:
        return f"v {tuple(v.shape)} must have the (B, nh, Lk) of k {tuple(k.shape)}"
    if v.shape[3] != hd:
        return f"v head dim {v.shape[3]} must equal the q/k head dim {hd}"
    if hd == 0:
        return "head dim is 0; q, k and v need at least one feature per head (the default scale is hd ** -0.5)"
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            got = key_padding_mask.dtype if isinstance(key_padding_mask, torch.Tensor) else type(key_padding_mask)
            return f"key_padding_mask must be a bool tensor (True = key takes part), got {got}"
        if tuple(key_padding_mask.shape) != (B, Lk):
            return f"key_padding_mask must have shape (B, Lk) = {(B, Lk)}, got {tuple(key_padding_mask.shape)}"
        if key_padding_mask.device != q.device:
            return f"key_padding_mask is on {key_padding_mask.device} but q is on {q.device}"
    if (why := _window_problem(window)) is not None:
        return why
    if softcap is not None and not (
        isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and math.isfinite(softcap) and softcap > 0
    ):
        return f"softcap must be a positive finite float or None (no cap), got {softcap!r}"
    return None


def _kernel_problem(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why the fused kernel cannot take inputs that `_input_problem` accepts, or None: its envelope (the header of
    kernels/attention.py)."""
    B, nh, Lq, hd = q.shape
    Lk = k.shape[2]
    if not _TRITON_INSTALLED:
        return "triton is not installed"
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if not (q.is_cuda or (interpret and q.device.type == "cpu")):
        return f"the inputs are on {q.device}; the kernel needs CUDA tensors (or CPU with TRITON_INTERPRET=1)"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} is not supported (float16, bfloat16, float32)"
    if hd not in SUPPORTED_HEAD_DIMS:
        return f"head dim {hd} is not supported (a multiple of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM})"
    if max(Lq, Lk) * hd >= MAX_SLICE_ELEMENTS:  # offsets inside one (batch, head) slice are 32-bit in the kernels
        return f"L * hd = {max(Lq, Lk) * hd} elements per (batch, head); the kernel allows fewer than 2**31"
    if B * nh > MAX_BATCH_HEADS:
        return f"B * nh = {B * nh} is larger than the kernel grid allows ({MAX_BATCH_HEADS})"
    if q.is_cuda:
        return config_arch(*cuda_device_info(q.device.index))[1]
    return None


def _window_problem(window) -> str | None:
    """Why `window` is not a valid sliding window (None or (left, right), ints >= -1), or None."""
    if window is None:
        return None
    ok = (isinstance(window, (tuple, list)) and len(window) == 2
          and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window))
    if not ok:
        return f"window must be None or (left, right) with ints >= -1 (-1 = unbounded), got {window!r}"
    return None


def _band(causal: bool, window: tuple[int, int] | None) -> tuple[int, int]:
    """The kept band as (left, right), -1 = unbounded: query i keeps key j when i + d - left <= j <= i + d + right,
    d = Lk - Lq (bottom-right aligned). `causal` is right = 0 (a window's right side cannot widen it)."""
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    return int(left), int(right)


def _checked_args(q, k, v, key_padding_mask, scale, backend: str, window, softcap):
    """The op's arguments checked (a ValueError that names the problem for anything the op does not accept) and
    returned as the backends take them: (scale, window, softcap), with the default scale hd ** -0.5, the window as
    `_normal_window` and floats."""
    # "auto" checks what every backend needs; it falls back from the kernel rather than fail.
    problem = unsupported_reason(q, k, v, key_padding_mask, backend=backend, window=window, softcap=softcap)
    if problem is not None:
        raise ValueError(problem if backend != "triton" else f"backend='triton' cannot run on these inputs: {problem}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return scale, _normal_window(window, q.shape[2], k.shape[2]), None if softcap is None else float(softcap)


def _band_keep(rows: torch.Tensor, cols: torch.Tensor, d: int, band: tuple[int, int]) -> torch.Tensor | None:
    """(rows, cols) bool: query i keeps key j when i + d - left <= j <= i + d + right (`_band`); None if all do."""
    left, right = band
    keep = None
    if right >= 0:
        keep = cols[None, :] <= rows[:, None] + (d + right)
    if left >= 0:
        lower = cols[None, :] >= rows[:, None] + (d - left)
        keep = lower if keep is None else keep & lower
    return keep


def _keep_mask(
    Lq: int, Lk: int, causal: bool, key_padding_mask: torch.Tensor | None, device: torch.device,
    window: tuple[int, int] | None = None,
) -> torch.Tensor | None:
    """Boolean keep-mask broadcastable to (B, 1, Lq, Lk) (True = the key takes part), or None when all keys do.

    `causal` keeps key j for query i when j <= i + Lk - Lq (bottom-right aligned, as FlashAttention-2); `window`
    (left, right) keeps i + Lk - Lq - left <= j <= i + Lk - Lq + right (-1 = unbounded), FlashAttention's
    `window_size`.
    """
    keep = _band_keep(torch.arange(Lq, device=device), torch.arange(Lk, device=device), Lk - Lq, _band(causal, window))
    if keep is not None:
        keep = keep[None, None]  # (1, 1, Lq, Lk)
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]  # (B, 1, 1, Lk)
        keep = kpm if keep is None else keep & kpm
    return keep


def kept_by_mask(mask: torch.Tensor, removed_at_most: float | None = None) -> torch.Tensor | None:
    """Where another library's attention mask keeps a score (bool, True = attend), or None when it does more than
    remove keys; the integrations read their libraries' masks with it.

    A bool mask keeps where it is True (SDPA's reading). An additive (float) mask keeps where it is 0 and removes
    where it is -inf or at most `removed_at_most` (None: half the dtype's lowest value, as masks built from
    `torch.finfo(dtype).min`); any other entry is a bias on the scores, which no key padding or band can express.

    Args:
        mask: a bool or float mask of any shape.
        removed_at_most: the largest additive entry that still removes its key.
    Returns:
        A bool tensor of `mask`'s shape, or None.
    """
    if mask.dtype == torch.bool:
        return mask
    if removed_at_most is None:
        removed_at_most = torch.finfo(mask.dtype).min / 2
    keep = mask == 0
    return keep if bool((keep | (mask <= removed_at_most)).all()) else None


def _drop_padded_keys(
    k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v (B, nh, Lk, hd) with the rows of padded keys replaced by zeros (selected, not multiplied), so whatever
    a padded row holds (NaN, Inf) reaches no output and no gradient; the padded rows' gradients are zero."""
    if key_padding_mask is None:
        return k, v
    kept = key_padding_mask[:, None, :, None]  # (B, 1, Lk, 1)
    zero = k.new_zeros(())
    return torch.where(kept, k, zero), torch.where(kept, v, zero)


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context in which autocast is off on `device_type`, for the op's own math.

    The op chooses its own compute precision (float32 math on q, k, v as given; the `.to(float32)` copies and the
    `out=` buffers of the torch backend are float32), so autocast must not recast its matrix products: under
    autocast, q, k, v already carry the low-precision dtype, and the output comes back in that dtype. The torch
    backend's backward enters it too: autograd runs a backward in the autocast state of the `.backward()` call.

    In eager mode autocast is switched off only where it is on, since entering `torch.autocast` costs several
    microseconds, a share of a small call. Under torch.compile it is always entered (free in the compiled graph):
    the state at trace time is not the one a graph runs in (Dynamo traces an autograd.Function's backward inside
    the forward's context, where autocast is already off; AOTAutograd then runs it in the caller's).
    """
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Math in float32 for 16/32-bit inputs; float64 stays float64 (gradcheck).
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compute_inputs(q, k, v, key_padding_mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in the compute dtype (views when already in it), the padded keys' rows zeroed (`_drop_padded_keys`):
    what the torch backend's forward and backward multiply."""
    ct = _compute_dtype(q.dtype)
    return (q.to(ct), *_drop_padded_keys(k.to(ct), v.to(ct), key_padding_mask))


# ---------------------------------------------------------------------------------------------------------
# Reference (the ground truth)
# ---------------------------------------------------------------------------------------------------------


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    attention: AttentionKind = "cog",
    upcast: bool = True,
) -> torch.Tensor:
    """Dense attention by the paper's formula; the ground truth every other backend is tested against.

    Cog: `sign(p) * softmax(|p|.masked_fill(~keep, -inf))` (paper Fig. 2, "faster"); softmax: `softmax(p)`. With
    `softcap` c, p is first replaced by `c * tanh(p / c)`.
    Query rows with no kept key return zeros with zero gradients (no NaN). Inputs are not checked (call
    `unsupported_reason` first, as `cog_attention` does).

    Args:
        q: (B, nh, Lq, hd); k, v: (B, nh, Lk, hd).
        causal: bottom-right aligned causal mask.
        key_padding_mask: (B, Lk) bool, True = the key takes part.
        scale: multiplies q k^T; defaults to hd ** -0.5.
        window: (left, right) sliding window, -1 = unbounded (as `cog_attention`).
        softcap: logit softcap c > 0, or None.
        attention: "cog" (signed weights) or "softmax".
        upcast: compute in float32 (float64 stays float64) and cast the result back.
    Returns:
        (B, nh, Lq, hd) in q's dtype.
    """
    dtype = q.dtype
    if upcast:
        ct = _compute_dtype(dtype)
        q, k, v = q.to(ct), k.to(ct), v.to(ct)
    attn = attention_weights(q, k, causal=causal, key_padding_mask=key_padding_mask, scale=scale, window=window,
                             softcap=softcap, attention=attention)
    _, v = _drop_padded_keys(k, v, key_padding_mask)
    return (attn @ v).to(dtype)


def attention_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    attention: AttentionKind = "cog",
) -> torch.Tensor:
    """The attention weights of `attention_ref`, in the dtype of q and k (no upcast: pass float64 for exact ones).

    Cog: `sign(p) * softmax(|p|)` over the kept keys, p = scale * q k^T (paper Eq. 3); softmax: `softmax(p)`.
    Masked keys and rows with no kept key get weight 0. The attention probe (`uvic.attention_probe`) reads them.

    Args:
        q: (B, nh, Lq, hd); k: (B, nh, Lk, hd).
        causal, key_padding_mask, scale, window, softcap, attention: as `attention_ref`.
    Returns:
        (B, nh, Lq, Lk) weights.
    """
    k, _ = _drop_padded_keys(k, k, key_padding_mask)
    Lq, Lk = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p = scale * (q @ k.transpose(-2, -1))  # (B, nh, Lq, Lk)
    if softcap is not None:
        p = softcap * torch.tanh(p / softcap)
    keep = _keep_mask(Lq, Lk, causal, key_padding_mask, q.device, window)
    has_key = None
    if keep is not None:
        has_key = keep.any(-1, keepdim=True)  # (B or 1, 1, Lq, 1)
        # A row with no kept key keeps all keys here and is zeroed below: a finite softmax, so no NaN
        # reaches the gradients through the weights.
        keep = keep | ~has_key
    if attention == "cog":
        scores = p.abs()
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        attn = torch.sign(p) * torch.softmax(scores, dim=-1)
    else:
        scores = p if keep is None else p.masked_fill(~keep, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
    if has_key is not None:
        attn = attn * has_key
    return attn


# ---------------------------------------------------------------------------------------------------------
# "torch" backend: tiled, recompute in backward, O(L * tile) memory
# ---------------------------------------------------------------------------------------------------------


def _ragged(plan: list) -> bool:
    """Whether the tiles of a `_tile_plan` differ in rows or keys."""
    return len({(rs.stop - rs.start, ks.stop - ks.start) for _, _, rs, ks, _ in plan}) > 1


def _tiles(
    B: int, nh: int, Lq: int, Lk: int, tile_elements: int, band: tuple[int, int] = (-1, -1)
) -> list[tuple[slice, slice, slice]]:
    """Split the (B, nh, Lq) rows into tiles of about `tile_elements` scores, as (batch items, heads, query rows).

    A tile holds several whole batch items when one fits (short sequences: few, large matmuls instead of a
    Python loop over batch items), else several whole heads of one batch item, else a block of query rows of
    one head. With a band (causal or a sliding window, `_band`) that does not fit, tiles are blocks of query rows
    of all heads of one item (few Python iterations), sized by the keys a row sees, so that the keys outside the
    band are skipped block by block (`_tile_keys`). A one-item tile is a strided view that bmm reads without a copy
    (also for q, k, v sliced out of a fused qkv projection); the out, dk and dv slices a tile writes are always
    contiguous.
    """
    per_head = Lq * Lk
    if per_head * nh <= tile_elements:
        items = max(1, tile_elements // (per_head * nh))
        return [(slice(b, min(b + items, B)), slice(0, nh), slice(0, Lq)) for b in range(0, B, items)]
    if band != (-1, -1):
        left, right = band
        # Keys one row sees on average: a two-sided window's width, else about half the keys (causal-like).
        seen = min(Lk, left + right + 1) if left >= 0 and right >= 0 else max(1, Lk // 2)
        heads = nh if nh * BAND_MIN_ROWS * seen <= tile_elements else max(1, tile_elements // (BAND_MIN_ROWS * seen))
        heads = -(-nh // -(-nh // heads))  # as many head groups, of even sizes (12 heads by 8: 6 + 6, not 8 + 4)
        rows = min(Lq, max(1, tile_elements // (heads * seen)))
        if rows < Lq and rows > 16:
            rows -= rows % 16  # whole SIMD vectors: key blocks then end on multiples of 16 (no ragged row tails)
        return [(slice(b, b + 1), slice(h, min(h + heads, nh)), slice(r, min(r + rows, Lq)))
                for b in range(B) for h in range(0, nh, heads) for r in range(0, Lq, rows)]
    if per_head <= tile_elements:
        heads = max(1, min(nh, tile_elements // per_head))
        return [(slice(b, b + 1), slice(h, min(h + heads, nh)), slice(0, Lq))
                for b in range(B) for h in range(0, nh, heads)]
    rows = max(1, tile_elements // Lk)
    return [(slice(b, b + 1), slice(h, h + 1), slice(r, min(r + rows, Lq))) for b in range(B) for h in range(nh)
            for r in range(0, Lq, rows)]


# Banded tiles take all heads of an item while that leaves at least this many query rows per tile, else fewer
# heads. dK and dV are products summed over a tile's rows, which BLAS runs well below its peak for short sums, and
# fewer, larger tiles mean fewer per-tile calls (measured on CPU with benchmarks/bench_attention.py: 85-row blocks of
# all 12 heads cost about 0.1-0.2x of SDPA's time more than 160-row blocks of 6 heads at L=2048). The price is the
# masked half of each block's diagonal square: about rows / Lq more scores than a causal triangle.
BAND_MIN_ROWS = 128


def _tile_keys(rs: slice, Lq: int, Lk: int, band: tuple[int, int]) -> slice:
    """The keys a tile of query rows can see: rows i see i + d - left <= j <= i + d + right (d = Lk - Lq), so key
    blocks outside the band are skipped. At least one key is in the slice; rows that see none are masked to zero
    by the keep-mask."""
    left, right = band
    d = Lk - Lq
    lo = max(0, rs.start + d - left) if left >= 0 else 0
    hi = min(Lk, rs.stop + d + right) if right >= 0 else Lk
    lo = min(lo, Lk - 1)
    return slice(lo, max(hi, lo + 1))


def _tile_plan(
    B: int, nh: int, Lq: int, Lk: int, tile_elements: int, band: tuple[int, int], device: torch.device
) -> list[tuple[slice, slice, slice, slice, tuple[torch.Tensor, bool, bool] | None]]:
    """The tiles of a call (`_tiles`) as (items, heads, query rows, keys (`_tile_keys`), band edges).

    The band edges of a tile are None when the band cuts none of its scores, else ([lo, hi], cut_lo, cut_hi) in
    tile coordinates: row r (query rs.start + r) keeps column c (key ks.start + c) when lo <= c - r <= hi, and
    cut_lo / cut_hi say whether that side cuts some row (a side that cuts nothing is left out of the mask). The
    bounds are int64 tensors (2,), rows of one tensor made once per call, not ints: the compiled tile math then
    takes every tile with one graph (it would specialise on ints)."""
    left, right = band
    d = Lk - Lq
    plan, edges = [], []
    for bs, hs, rs in _tiles(B, nh, Lq, Lk, tile_elements, band):
        ks = _tile_keys(rs, Lq, Lk, band)
        rows, keys = rs.stop - rs.start, ks.stop - ks.start
        hi = rs.start + d + right - ks.start if right >= 0 else keys
        lo = rs.start + d - left - ks.start if left >= 0 else -rows
        cuts = (lo > -(rows - 1), hi < keys - 1)  # the first key is outside the last row's band, ...
        plan.append((bs, hs, rs, ks, cuts if any(cuts) else None))
        edges.append((lo, hi))
    if all(cut is None for *_, cut in plan):
        return plan
    bounds = torch.tensor(edges, dtype=torch.int64, device=device)  # (tiles, 2)
    return [(bs, hs, rs, ks, cut if cut is None else (bounds[i], *cut))
            for i, (bs, hs, rs, ks, cut) in enumerate(plan)]


def _tile_keep(bs: slice, hs: slice, ks: slice, kpm: torch.Tensor | None) -> torch.Tensor | None:
    """The key-padding part of a tile's keep-mask over keys `ks`, matching `_flat` of the tile: (1, 1, keys) for
    one batch item, (items * heads, 1, keys) for several; a fresh contiguous tensor, or None without a mask."""
    if kpm is None:
        return None
    keep = kpm[bs, ks]  # (items, keys)
    if keep.shape[0] == 1:
        return keep[:, None, :].contiguous()
    return keep[:, None, None, :].expand(-1, hs.stop - hs.start, 1, -1).reshape(-1, 1, keep.shape[1])


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(items, heads, m, n) -> (items * heads, m, n) for bmm: a view for one-item tiles, else maybe a copy."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _flat_out(x: torch.Tensor) -> torch.Tensor:
    """`_flat` for an output slice that is written in place: always a view (raises rather than copy)."""
    return x.view(-1, x.shape[-2], x.shape[-1])


def _capped(p: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(s, t): the scores p softcapped to s = c * tanh(p / c) when `softcap` is c (else s = p), and t = tanh(p / c)
    (for the softcap's derivative 1 - t^2) or None."""
    if softcap is None:
        return p, None
    t = torch.tanh(p * (1.0 / softcap))
    return t * softcap, t


def _tile_mask(s: torch.Tensor, kpm: torch.Tensor | None, band) -> torch.Tensor | None:
    """The keep-mask of a (G, r, keys) score tile, broadcastable to it, or None when every score is kept: the
    padding mask `kpm` (G | 1, 1, keys) and the band edges of `_tile_plan`. The band part is built from index
    ranges inside the tile math, so compiled it is a compare in the fused loop, not an (r, keys) tensor."""
    keep = kpm
    if band is not None:
        bounds, cut_lo, cut_hi = band
        diff = (torch.arange(s.shape[-1], device=s.device)[None, :]
                - torch.arange(s.shape[-2], device=s.device)[:, None])  # c - r, (r, keys)
        if cut_lo and cut_hi:
            cut = (diff >= bounds[0]) & (diff <= bounds[1])
        else:
            cut = diff >= bounds[0] if cut_lo else diff <= bounds[1]
        keep = cut if keep is None else keep & cut
    return keep


def _tile_weights(
    s: torch.Tensor, keep: torch.Tensor | None, cog: bool, m: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, m): E = exp(score - m) over kept keys (0 elsewhere), m the row max of the score over kept keys (taken
    as given when `m` is passed: backward reuses the forward's). The score is |s| for Cog (m >= 0, so rows with no
    kept key have m = 0), s for softmax (m = the lowest float on rows with no kept key)."""
    if cog:
        a = s.abs() if keep is None else torch.where(keep, s.abs(), 0.0)  # |0| cannot raise the row max (>= 0)
        if m is None:
            m = a.amax(-1, keepdim=True)
        e = torch.exp(a - m)
    else:
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        if m is None:
            m = s.amax(-1, keepdim=True)
            if keep is not None:
                m = m.clamp_min(torch.finfo(s.dtype).min)  # rows with no kept key: exp(-inf - finite) = 0, no NaN
        e = torch.exp(s - m)
    if keep is not None:
        e = torch.where(keep, e, 0.0)
    return e, m


def _tile_forward_weights(
    p: torch.Tensor, scale: float, kpm: torch.Tensor | None, band, softcap: float | None, cog: bool
) -> torch.Tensor:
    """The forward's element-wise tile math, in place: the products p = q k^T, (G, r, keys), whose scores are
    scale * p (the scale is applied here, in the fused pass, not by a pass over q), become the weights
    A = sign(p) * E / l (Cog; softmax: E / l), E = exp(score - m) over kept keys (`_tile_weights`), so that
    O = A v. kpm (G | 1, 1, keys) or None, band as `_tile_plan`. Exact zeros p = 0 count in l and get sign 0 (no
    weight), as in the reference; rows with no kept key (l = 0) get A = 0.
    Returns (G, r, 2): m (the row max of the score) and l = rowsum(E)."""
    s, _ = _capped(p * scale, softcap)
    e, m = _tile_weights(s, _tile_mask(s, kpm, band), cog)
    l = e.sum(-1, keepdim=True)
    e = e * _safe_reciprocal(l)
    p.copy_(e * torch.sign(s) if cog else e)
    return torch.cat([m, l], -1)


def _tile_backward_weights(
    p: torch.Tensor, g: torch.Tensor, rowstats: torch.Tensor, scale: float, kpm: torch.Tensor | None,
    band, softcap: float | None, cog: bool,
) -> None:
    """The backward's element-wise tile math, in place: the recomputed products p = q k^T (G, r, keys) become the
    weights A of `_tile_forward_weights` (from the forward's row max m and 1/l, so no reduction), and g = dO v^T
    (G, r, keys) becomes scale * dP, dP = A * (sign(s) * g - D) for the (capped) score s (softmax: A * (g - D)),
    times 1 - t^2 through a softcap (t = tanh(p / c)). rowstats (G, r, 3): m, 1/l and D = rowsum(dO * O).
    Then dV = A^T dO, dQ = (scale dP) K and dK = (scale dP)^T Q."""
    m, inv_l, D = rowstats[..., 0:1], rowstats[..., 1:2], rowstats[..., 2:3]
    s, t = _capped(p * scale, softcap)
    e, _ = _tile_weights(s, _tile_mask(s, kpm, band), cog, m)
    e = e * inv_l
    if cog:
        sgn = torch.sign(s)
        e = e * sgn  # A
        dp = e * (sgn * g - D)
    else:
        dp = e * (g - D)
    if t is not None:
        dp = dp * (1.0 - t * t)  # d(c tanh(p / c)) / dp
    p.copy_(e)
    g.copy_(dp * scale)


# The element-wise tile math compiled with torch.compile (Inductor fuses the abs/max/exp/sum/sign chain of a pass
# into one kernel, row by row; eager PyTorch makes ~7 passes over each score tile). The matrix products stay outside,
# as BLAS calls that write into the output slices, so a compiled graph has no extern calls or copies of its own. By default used on CPU for calls with at least
# COMPILE_MIN_SCORES scores (smaller ones are dominated by call overhead, and compiling them is not worth it);
# switched off by UVIC_ATTENTION_COMPILE=0, or for the process when the compiler is missing or fails (a warning).
COMPILE_MIN_SCORES = 2**20
_compiled: dict[str, object] = {}
_compile_failed: list[str] = []


def _use_compiled(q: torch.Tensor, n_scores: int, compile: bool | None) -> bool:
    if torch.compiler.is_compiling():  # inside a user's torch.compile: the outer graph fuses the tile math
        return False
    if compile is not None:
        return compile and not _compile_failed
    return (
        q.device.type == "cpu"
        and n_scores >= COMPILE_MIN_SCORES
        and not _compile_failed
        and os.environ.get("UVIC_ATTENTION_COMPILE", "1") != "0"
    )


def _run_tile(name: str, compiled: bool, ragged: bool, *args) -> torch.Tensor | None:
    """`_tile_forward_weights` / `_tile_backward_weights`, compiled when asked and possible, else eager. `ragged`:
    the tiles of the call differ in rows or keys."""
    fn = _tile_forward_weights if name == "forward" else _tile_backward_weights
    if compiled:
        if name not in _compiled:
            from uvic.errors import hide_cuda_home_warning

            hide_cuda_home_warning()  # Inductor's first compile imports torch.utils.cpp_extension, which logs it
            _compiled[name] = torch.compile(fn, dynamic=None)
        if ragged:
            # Rows and keys change from tile to tile: symbolic from the first compile, so that one graph takes
            # every tile (the head count and head dim stay static: Inductor's loops are faster so than fully
            # dynamic). Calls whose tiles are all alike compile for their sizes (U-ViT: static, faster still).
            scores, kpm = (args[:2], args[4]) if name == "backward" else (args[:1], args[2])
            for t in scores:
                torch._dynamo.maybe_mark_dynamic(t, 1)
                torch._dynamo.maybe_mark_dynamic(t, 2)
            if name == "backward":
                torch._dynamo.maybe_mark_dynamic(args[2], 1)  # rowstats
            if kpm is not None:
                torch._dynamo.maybe_mark_dynamic(kpm, 2)
        try:
            return _compiled[name](*args)
        except Exception as err:  # no C++ compiler, or an Inductor failure: eager from now on
            _compile_failed.append(f"{type(err).__name__}: {err}")
            logger.warning("uvic.attention: torch.compile of the Cog tile math failed (%s: %s); using eager PyTorch "
                           "from now on (set UVIC_ATTENTION_COMPILE=0 to skip the attempt)", type(err).__name__,
                           str(err).splitlines()[0] if str(err) else "")
    return fn(*args)


class _AttentionTorch(torch.autograd.Function):
    """Tiled Cog (or softmax) attention with the FlashAttention memory contract
    (docs/attention.md, "The torch backend").

    Tiles (see `_tiles`) hold complete query rows over the keys of their band, so the transient memory is a few
    tiles of `tile_elements` scores whatever the sequence length. Per tile, the matrix products run as plain
    (batched) BLAS calls that write into the outputs' slices, and only the element-wise math between them goes
    through `_run_tile` (compiled on CPU at large sizes), once per tile and pass.

    Forward saves q, k, v, the output and two floats per query row: the row max m_i of |p_i| over kept keys and
    l_i = sum_j exp(|p_ij| - m_i) (LSE_i = m_i + log l_i). Backward reuses m_i instead of recomputing it (no max
    pass over the tile), and since m_i and l_i are kept apart no precision is lost at large |p| (an absolute fp32
    LSE near |p| = 1e4 has an ulp of 1e-3, a 1e-3 relative error in every weight).
    With A = sign(p) * exp(|p| - m) / l:
        O = A v,   dV = A^T dO,   dP = A * (sign(p) * g - D),   g = dO v^T,   D = rowsum(dO * O),
        dQ = scale dP K,   dK = scale dP^T Q.
    (Softmax mode: A = exp(p - m) / l and dP = A * (g - D); a softcap multiplies dP by 1 - tanh^2(p / c).)
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, key_padding_mask, scale, tile_elements, compile, window, softcap, cog):
        B, nh, Lq, hd = q.shape
        Lk = k.shape[2]
        band = _band(causal, window)
        qc, kc, vc = _compute_inputs(q, k, v, key_padding_mask)
        ct = qc.dtype
        out = torch.empty(B, nh, Lq, hd, dtype=ct, device=q.device)
        ml = torch.empty(B, nh, Lq, 2, dtype=ct, device=q.device)  # per row: m, l
        compiled = _use_compiled(q, B * nh * Lq * Lk, compile)
        tiles = _tile_plan(B, nh, Lq, Lk, tile_elements, band, q.device)
        ragged = _ragged(tiles)
        for bs, hs, rs, ks, tile_band in tiles:
            kt, vt = _flat(kc[bs, hs, ks]), _flat(vc[bs, hs, ks])
            p = torch.bmm(_flat(qc[bs, hs, rs]), kt.transpose(1, 2))  # (G, rows, keys)
            # The out / ml slices of a tile are contiguous, so their 3-d views are written in place.
            _flat_out(ml[bs, hs, rs]).copy_(_run_tile(
                "forward", compiled, ragged, p, scale, _tile_keep(bs, hs, ks, key_padding_mask),
                tile_band, softcap, cog))
            torch.bmm(p, vt, out=_flat_out(out[bs, hs, rs]))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, ml, key_padding_mask)
        ctx.band, ctx.scale, ctx.tile_elements, ctx.compile = band, scale, tile_elements, compile
        ctx.softcap, ctx.cog = softcap, cog
        return out

    @staticmethod
    def backward(ctx, dout):
        with _autocast_off(dout.device.type):  # the bmm's below write float32 `out=` buffers
            return _AttentionTorch._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        q, k, v, out, ml, key_padding_mask = ctx.saved_tensors
        band, scale = ctx.band, ctx.scale
        B, nh, Lq, hd = q.shape
        Lk = k.shape[2]
        qc, kc, vc = _compute_inputs(q, k, v, key_padding_mask)
        ct = qc.dtype
        do = dout.to(ct)
        D = (do * out.to(ct)).sum(-1, keepdim=True)  # D_i = rowsum(dO_i * O_i), (B, nh, Lq, 1)
        # Per row: m, 1/l (0 on rows with no kept key) and D, (B, nh, Lq, 3).
        rowstats = torch.cat([ml[..., :1], _safe_reciprocal(ml[..., 1:]), D], -1)
        tiles = _tile_plan(B, nh, Lq, Lk, ctx.tile_elements, band, q.device)
        whole_heads = all(t[2].stop - t[2].start == Lq for t in tiles)  # else query blocks accumulate dK, dV
        dq = torch.empty(B, nh, Lq, hd, dtype=ct, device=q.device)
        dk = dq.new_empty(B, nh, Lk, hd) if whole_heads else dq.new_zeros(B, nh, Lk, hd)
        dv = torch.empty_like(dk) if whole_heads else torch.zeros_like(dk)
        if whole_heads and band != (-1, -1):  # keys outside every row's band get no gradient
            dk.zero_()
            dv.zero_()
        compiled, ragged = _use_compiled(q, B * nh * Lq * Lk, ctx.compile), _ragged(tiles)
        for bs, hs, rs, ks, tile_band in tiles:
            qt, dot = _flat(qc[bs, hs, rs]), _flat(do[bs, hs, rs])
            kt, vt = _flat(kc[bs, hs, ks]), _flat(vc[bs, hs, ks])
            p = torch.bmm(qt, kt.transpose(1, 2))  # (G, rows, keys)
            g = torch.bmm(dot, vt.transpose(1, 2))
            _run_tile("backward", compiled, ragged, p, g, _flat(rowstats[bs, hs, rs]).contiguous(), scale,
                      _tile_keep(bs, hs, ks, key_padding_mask), tile_band, ctx.softcap, ctx.cog)
            # p is now A and g is scale * dP. Query blocks of one head accumulate dK, dV (zero-initialised).
            dkt, dvt = _flat_out(dk[bs, hs, ks]), _flat_out(dv[bs, hs, ks])
            if whole_heads:
                torch.bmm(p.transpose(1, 2), dot, out=dvt)
                torch.bmm(g.transpose(1, 2), qt, out=dkt)
            else:
                dvt.baddbmm_(p.transpose(1, 2), dot)
                dkt.baddbmm_(g.transpose(1, 2), qt)
            torch.bmm(g, kt, out=_flat_out(dq[bs, hs, rs]))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, None


def _safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1 / x, with 0 where x == 0 (rows with no kept key)."""
    return torch.where(x > 0, x.reciprocal(), torch.zeros_like(x))


def tiled_cog_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    tile_elements: int = TILE_ELEMENTS,
    compile: bool | None = None,
) -> torch.Tensor:
    """Cog attention's "torch" backend with its two tuning knobs exposed; `cog_attention(..., backend="torch")`
    is this function with the defaults.

    Args:
        q, k, v, causal, key_padding_mask, scale, window, softcap: as `cog_attention`.
        tile_elements: scores per tile. A tile holds several whole batch items when they fit, else several whole
            heads of one item, else a block of query rows (of all heads of one item when causal or windowed, so
            that key blocks outside the band are skipped); the transient memory is a few tiles.
        compile: run the tile math through `torch.compile` (True), in eager PyTorch (False), or decide per call
            (None: CPU calls with at least COMPILE_MIN_SCORES scores, unless UVIC_ATTENTION_COMPILE=0). A compiler
            that fails is reported once (a warning) and eager PyTorch is used from then on.
    Returns:
        (B, nh, Lq, hd) in the input dtype.
    """
    scale, window, softcap = _checked_args(q, k, v, key_padding_mask, scale, "torch", window, softcap)
    if not (isinstance(tile_elements, int) and tile_elements >= 1):
        raise ValueError(f"tile_elements must be a positive int, got {tile_elements!r}")
    if q.numel() == 0 or k.shape[2] == 0:
        return attention_ref(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, window=window,
                             softcap=softcap)
    with _autocast_off(q.device.type):
        return _AttentionTorch.apply(q, k, v, causal, key_padding_mask, scale, tile_elements, compile, window,
                                     softcap, True)


def _normal_window(window, Lq: int, Lk: int) -> tuple[int, int] | None:
    """A valid `window` as a tuple, None when it bounds neither side. A side of max(Lq, Lk) or more reaches past
    every key, so it is unbounded (-1): the same keys, and no int too large for the index arithmetic."""
    if window is None:
        return None
    left, right = (-1 if w >= max(Lq, Lk) else int(w) for w in window)
    return None if (left, right) == (-1, -1) else (left, right)


# ---------------------------------------------------------------------------------------------------------
# Backend selection and the public ops
# ---------------------------------------------------------------------------------------------------------


def _attention(
    q, k, v, causal: bool, key_padding_mask, scale, window, softcap, backend: str, attention: str
) -> torch.Tensor:
    """The dispatcher behind `cog_attention` and `softmax_attention` (arguments as theirs)."""
    scale, window, softcap = _checked_args(q, k, v, key_padding_mask, scale, backend, window, softcap)
    if q.numel() == 0 or k.shape[2] == 0:
        # Nothing to attend with or to: an empty output, or zeros (a row with no key), and zero gradients.
        backend = "reference"
    elif backend == "auto":
        # cog: the kernel for 16-bit CUDA inputs inside its envelope (fp32 runs on the kernel only with small IEEE
        # tiles, so "auto" gives it to the torch backend). softmax: SDPA, PyTorch's fastest kernels.
        # The inputs passed `_checked_args`, so only the kernel's envelope is left to ask.
        use_kernel = attention == "cog" and q.is_cuda and q.dtype != torch.float32 and _kernel_problem(q, k) is None
        backend = "triton" if use_kernel else "torch"
    if backend == "torch" and attention == "softmax" and softcap is None:
        return _sdpa(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, window=window)
    kw = {"causal": causal, "key_padding_mask": key_padding_mask, "scale": scale, "window": window, "softcap": softcap}
    with _autocast_off(q.device.type):
        if backend == "reference":
            return attention_ref(q, k, v, attention=attention, **kw)
        if backend == "triton":
            from uvic.kernels.ops import fused_attention

            return fused_attention(q, k, v, cog=attention == "cog", **kw)
        # softmax with a softcap (which SDPA cannot apply) runs on the tiled backend's softmax mode.
        return _AttentionTorch.apply(q, k, v, causal, key_padding_mask, scale, TILE_ELEMENTS, None, window, softcap,
                                     attention == "cog")


def _sdpa(q, k, v, *, causal: bool, key_padding_mask, scale: float, window=None) -> torch.Tensor:
    """softmax_attention's "torch" backend: `F.scaled_dot_product_attention` with the op's mask semantics."""
    Lq, Lk = q.shape[2], k.shape[2]
    if key_padding_mask is None and window is None and (not causal or Lq == Lk):
        # The fast path: no explicit mask, so SDPA can use its fused kernels.
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    keep = _keep_mask(Lq, Lk, causal, key_padding_mask, q.device, window)
    if keep is None:  # a window wider than the keys
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    has_key = keep.any(-1, keepdim=True)
    k, v = _drop_padded_keys(k, v, key_padding_mask)
    # Rows with no kept key attend to everything (finite) and are zeroed afterwards, so no NaN anywhere.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep | ~has_key, scale=scale)
    return out * has_key.to(out.dtype)


def cog_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Cog attention: `sign(p) * softmax(|p|) @ v` with `p = scale * q k^T` (paper Eq. 3).

    Args:
        q: (B, nh, Lq, hd) queries.
        k: (B, nh, Lk, hd) keys.
        v: (B, nh, Lk, hd) values.
        causal: mask key j for query i when j > i + Lk - Lq (bottom-right aligned, KV-cache friendly).
        key_padding_mask: (B, Lk) bool, True = the key takes part; padded keys' k and v rows are never read.
        scale: multiplies q k^T; defaults to hd ** -0.5.
        window: (left, right) sliding window, FlashAttention's `window_size`: query i keeps key j when
            i + Lk - Lq - left <= j <= i + Lk - Lq + right; -1 leaves that side unbounded, as does any side
            of max(Lq, Lk) or more (it reaches past every key, however large the int). With `causal`,
            (w - 1, -1) or (w - 1, 0) is Mistral's local attention over the last w tokens. None: no window.
        softcap: logit softcap c > 0 (Gemma 2): the scores become p' = c * tanh(p / c) before the sign and the
            magnitude, so sign(p') = sign(p) and |p'| = c * tanh(|p| / c). None: no cap.
        backend: "auto", "reference", "torch" or "triton" (see the module docstring).
    Returns:
        (B, nh, Lq, hd) in the input dtype; rows with no kept key are zeros.
    Raises:
        ValueError: the inputs are malformed, or `backend` cannot run on them (the message says why).
    """
    return _attention(q, k, v, causal, key_padding_mask, scale, window, softcap, backend, "cog")


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Softmax attention `softmax(p) @ v`, with the signature, shapes and mask semantics of `cog_attention`.

    The "torch" backend, and "auto", is `F.scaled_dot_product_attention` (flash / memory-efficient kernels where
    PyTorch has them; with a softcap, which SDPA cannot apply, the tiled backend's softmax mode); "triton" is the
    fused kernel in its softmax mode, for like-for-like comparisons with Cog.
    Args, returns and raises: as `cog_attention`.
    """
    return _attention(q, k, v, causal, key_padding_mask, scale, window, softcap, backend, "softmax")
