"""Cog attention and softmax attention: the one attention op every uvic model calls.

Cog attention (Lv et al., "More Expressive Attention with Negative Weights", ICML 2025, Eq. 3) replaces the
softmax weights with signed ones:

    p = scale * q k^T,    attn = sign(p) * softmax(|p|),    o = attn v

so a query can subtract a value vector as well as add it. Masked keys (causal or key padding) are left out of
the max and the sum and get weight 0; a query row with no kept key returns zeros (and zero gradients).

Shape letters: B batch, nh heads, Lq / Lk query / key tokens, hd head dim. Every tensor is in the
`F.scaled_dot_product_attention` layout (B, nh, L, hd).

Backends (the same semantics in each, tested against `attention_ref` in float64):
    "reference"  the paper's "faster" formula (Fig. 2), dense, upcast to float32; the ground truth.
    "torch"      memory-efficient PyTorch: works over tiles of queries, saves only q, k, v, the output and one
                 float per row (the log-sum-exp of |p|) and recomputes the weights in backward.
                 For `softmax_attention` this is `F.scaled_dot_product_attention`.
    "triton"     the fused flash-style kernel in `uvic.kernels` (CUDA only).
    "auto"       "triton" for fp16/bf16 CUDA inputs inside the kernel's envelope, else "torch".
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F


Backend = Literal["auto", "reference", "torch", "triton"]
BACKENDS = ("auto", "reference", "torch", "triton")

# Elements of one (rows x keys) score tile in the "torch" backend. 2**18 fp32 scores = 1 MiB: the tile and
# its few same-sized temporaries stay in the L2 cache, which matters more on CPU than the Python loop cost.
_TILE_ELEMENTS = 2**18


# ---------------------------------------------------------------------------------------------------------
# Input checks and masks
# ---------------------------------------------------------------------------------------------------------


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    scale: float | None,
    backend: str,
) -> None:
    """Raise a ValueError that names the problem for anything the op does not accept."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (B, nh, L, hd) (4 dims), got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, nh, _, hd = q.shape
    if k.shape[0] != B or k.shape[1] != nh or k.shape[3] != hd:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in B, nh or hd")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v {tuple(v.shape)} must have the (B, nh, Lk) of k {tuple(k.shape)}")
    if v.shape[3] != hd:
        raise ValueError(f"v head dim {v.shape[3]} must equal the q/k head dim {hd}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            got = key_padding_mask.dtype if isinstance(key_padding_mask, torch.Tensor) else type(key_padding_mask)
            raise ValueError(f"key_padding_mask must be a bool tensor (True = key takes part), got {got}")
        if tuple(key_padding_mask.shape) != (B, k.shape[2]):
            raise ValueError(
                f"key_padding_mask must have shape (B, Lk) = {(B, k.shape[2])}, got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but q is on {q.device}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")


def _keep_mask(
    Lq: int,
    Lk: int,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    device: torch.device,
    rows: slice | None = None,
) -> torch.Tensor | None:
    """Boolean keep-mask broadcastable to (B, 1, Lq, Lk) (True = the key takes part), or None when all keys do.

    `causal` keeps key j for query i when j <= i + Lk - Lq (bottom-right aligned, as FlashAttention-2).
    `rows` restricts the query rows to a slice (used by the tiled backend).
    """
    keep = None
    if causal:
        i = torch.arange(Lq, device=device)
        if rows is not None:
            i = i[rows]
        j = torch.arange(Lk, device=device)
        keep = (j[None, :] <= i[:, None] + (Lk - Lq))[None, None]  # (1, 1, Lq, Lk)
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]  # (B, 1, 1, Lk)
        keep = kpm if keep is None else keep & kpm
    return keep


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Math in float32 for 16/32-bit inputs; float64 stays float64 (gradcheck).
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    cog: bool = True,
    upcast: bool = True,
) -> torch.Tensor:
    """Dense attention by the paper's formula; the ground truth every other backend is tested against.

    Cog: `sign(p) * softmax(|p|.masked_fill(~keep, -inf))` (paper Fig. 2, "faster"); softmax: `softmax(p)`.
    Query rows with no kept key return zeros with zero gradients (no NaN).

    Args:
        q: (B, nh, Lq, hd); k, v: (B, nh, Lk, hd).
        causal: bottom-right aligned causal mask.
        key_padding_mask: (B, Lk) bool, True = the key takes part.
        scale: multiplies q k^T; defaults to hd ** -0.5.
        cog: Cog weights if True, softmax weights if False.
        upcast: compute in float32 (float64 stays float64) and cast the result back.
    Returns:
        (B, nh, Lq, hd) in q's dtype.
    """
    dtype = q.dtype
    if upcast:
        ct = _compute_dtype(dtype)
        q, k, v = q.to(ct), k.to(ct), v.to(ct)
    Lq, Lk = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    p = scale * (q @ k.transpose(-2, -1))  # (B, nh, Lq, Lk)
    keep = _keep_mask(Lq, Lk, causal, key_padding_mask, q.device)
    has_key = None
    if keep is not None:
        has_key = keep.any(-1, keepdim=True)  # (B or 1, 1, Lq, 1)
        # A row with no kept key keeps all keys here and is zeroed below: a finite softmax, so no NaN
        # reaches the gradients through the weights.
        keep = keep | ~has_key
    if cog:
        scores = p.abs()
        if keep is not None:
            scores = scores.masked_fill(~keep, float("-inf"))
        attn = torch.sign(p) * torch.softmax(scores, dim=-1)
    else:
        scores = p if keep is None else p.masked_fill(~keep, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
    if has_key is not None:
        attn = attn * has_key
    return (attn @ v).to(dtype)


# ---------------------------------------------------------------------------------------------------------
# "torch" backend for Cog: tiled, recompute in backward, O(L * tile) memory
# ---------------------------------------------------------------------------------------------------------


def _tiles(B: int, nh: int, Lq: int, Lk: int, tile_elements: int) -> list[tuple[slice, slice, slice]]:
    """Split the (B, nh, Lq) rows into tiles of about `tile_elements` scores, as (batch items, heads, query rows).

    A tile holds several whole batch items when one fits (short sequences: few, large matmuls instead of a
    Python loop over batch items), else several whole heads of one batch item, else a block of query rows of
    one head. A one-item tile is a strided view that bmm reads without a copy (also for q, k, v sliced out of
    a fused qkv projection); the out, dk and dv slices a tile writes are always contiguous.
    """
    per_head = Lq * Lk
    if per_head * nh <= tile_elements:
        items = max(1, tile_elements // (per_head * nh))
        return [(slice(b, min(b + items, B)), slice(0, nh), slice(0, Lq)) for b in range(0, B, items)]
    if per_head <= tile_elements:
        heads = max(1, min(nh, tile_elements // per_head))
        return [(slice(b, b + 1), slice(h, min(h + heads, nh)), slice(0, Lq))
                for b in range(B) for h in range(0, nh, heads)]
    rows = max(1, tile_elements // Lk)
    return [(slice(b, b + 1), slice(h, h + 1), slice(r, min(r + rows, Lq))) for b in range(B) for h in range(nh)
            for r in range(0, Lq, rows)]


def _tile_keep(
    bs: slice, rs: slice, Lq: int, Lk: int, causal: bool, kpm: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Keep-mask of one tile, broadcastable to (items, heads, rows, Lk); None when every key is kept."""
    keep = None
    if causal and rs.start < Lq - 1:  # otherwise every row of the tile sees all keys (j <= i + Lk - Lq)
        i = torch.arange(rs.start, rs.stop, device=device)
        j = torch.arange(Lk, device=device)
        keep = (j[None, :] <= i[:, None] + (Lk - Lq))[None, None]  # (1, 1, rows, Lk)
    if kpm is not None:
        tile_kpm = kpm[bs][:, None, None, :]  # (items, 1, 1, Lk)
        keep = tile_kpm if keep is None else keep & tile_kpm
    return keep


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(items, heads, m, n) -> (items * heads, m, n) for bmm: a view for one-item tiles, else maybe a copy."""
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """p = scale * q k^T for a tile: q (items, h, r, hd), k (items, h, Lk, hd) -> (items, h, r, Lk)."""
    zero = q.new_zeros(())
    s = torch.baddbmm(zero, _flat(q), _flat(k).transpose(1, 2), beta=0, alpha=scale)
    return s.view(*q.shape[:3], k.shape[2])


def _signed_exp_(s: torch.Tensor, keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on a score tile s = p (..., r, Lk): returns (e, sign(p)) with e = exp(|p| - m), m the row max of |p|
    over kept keys (0 for rows with none); masked keys give e = 0. Exact zeros p = 0 keep e = exp(-m) (they count
    in the softmax denominator) and sign 0 (no weight)."""
    if keep is not None:
        s.masked_fill_(~keep, 0.0)  # |0| cannot raise the row max, which is >= 0 anyway
    sgn = torch.sign(s)
    # Two plain reductions: much faster on CPU than torch.aminmax over a dim.
    m = torch.maximum(s.amax(-1, keepdim=True), s.amin(-1, keepdim=True).neg_())
    e = torch.addcmul(m.neg_(), s, sgn, out=s)  # |p| - m, as s * sign(s) = |s|; exact near the max
    if keep is not None:
        e.masked_fill_(~keep, float("-inf"))
    return e.exp_(), sgn


class _CogAttentionTorch(torch.autograd.Function):
    """Tiled Cog attention with the FlashAttention memory contract (see docs/kernel_math.md Sec. 2).

    Tiles (see `_tiles`) hold complete query rows, so the transient memory is a few tiles of `tile_elements`
    scores whatever the sequence length.

    Forward saves q, k, v, the output and one float per query row: log l_i, the log-sum-exp of |p_i| relative to
    its row max m_i (LSE_i = m_i + log l_i). Backward recomputes m_i from the same tile, so no precision is lost
    at large |p| (an absolute fp32 LSE near |p| = 1e4 has an ulp of 1e-3, a 1e-3 relative error in every weight).
    With E = sign(p) * exp(|p| - m) = l * A, every 1/l factor moves onto a (rows, hd) block:
        O = (E v) / l,   dV = A^T dO = E^T (dO / l),   dP = A * (sign(p) * g - D) = (E * (sign(p) * g - D)) / l,
    with g = dO v^T and D = rowsum(dO * O); dQ = scale dP K and dK = scale dP^T Q.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, key_padding_mask, scale, tile_elements):
        B, nh, Lq, hd = q.shape
        Lk = k.shape[2]
        ct = _compute_dtype(q.dtype)
        qc, kc, vc = q.to(ct), k.to(ct), v.to(ct)  # views when already in the compute dtype
        out = torch.empty(B, nh, Lq, hd, dtype=ct, device=q.device)
        log_l = torch.empty(B, nh, Lq, 1, dtype=ct, device=q.device)
        for bs, hs, rs in _tiles(B, nh, Lq, Lk, tile_elements):
            s = _scores(qc[bs, hs, rs], kc[bs, hs], scale)  # (items, h, r, Lk)
            e, sgn = _signed_exp_(s, _tile_keep(bs, rs, Lq, Lk, causal, key_padding_mask, q.device))
            l = e.sum(-1, keepdim=True)  # taken before the sign: exact zeros p = 0 count here
            o = torch.bmm(_flat(e.mul_(sgn)), _flat(vc[bs, hs])).view(*s.shape[:3], hd)  # l * O
            out[bs, hs, rs] = o.mul_(_safe_reciprocal(l))  # rows with no kept key: l = 0, O = 0
            log_l[bs, hs, rs] = l.log_()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, log_l, key_padding_mask)
        ctx.causal, ctx.scale, ctx.tile_elements = causal, scale, tile_elements
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, log_l, key_padding_mask = ctx.saved_tensors
        causal, scale = ctx.causal, ctx.scale
        B, nh, Lq, hd = q.shape
        Lk = k.shape[2]
        ct = _compute_dtype(q.dtype)
        qc, kc, vc, do, oc = q.to(ct), k.to(ct), v.to(ct), dout.to(ct), out.to(ct)
        dq = torch.empty(B, nh, Lq, hd, dtype=ct, device=q.device)
        dk = torch.empty(B, nh, Lk, hd, dtype=ct, device=q.device)
        dv = torch.empty(B, nh, Lk, hd, dtype=ct, device=q.device)
        for bs, hs, rs in _tiles(B, nh, Lq, Lk, ctx.tile_elements):
            s = _scores(qc[bs, hs, rs], kc[bs, hs], scale)
            e, sgn = _signed_exp_(s, _tile_keep(bs, rs, Lq, Lk, causal, key_padding_mask, q.device))
            e = _flat(e.mul_(sgn))  # E = l * A, (items * h, r, Lk)
            sgn = _flat(sgn)
            inv_l = _safe_reciprocal(_flat(log_l[bs, hs, rs]).exp())  # (items * h, r, 1); 0 on rows with no key
            do_t = _flat(do[bs, hs, rs])
            D = (do_t * _flat(oc[bs, hs, rs])).sum(-1, keepdim=True)  # D_i = rowsum(dO_i * O_i)
            # The first query block of these heads writes dK, dV; later ones accumulate. The dK/dV slices of a
            # tile are contiguous, so their 3-d views are written in place.
            dv_t, dk_t = _flat(dv[bs, hs]), _flat(dk[bs, hs])
            first = rs.start == 0
            if first:  # dV = E^T (dO / l)
                torch.bmm(e.transpose(1, 2), do_t * inv_l, out=dv_t)
            else:
                dv_t.baddbmm_(e.transpose(1, 2), do_t * inv_l)
            g = torch.bmm(do_t, _flat(vc[bs, hs]).transpose(1, 2))  # g_ij = dO_i . v_j
            dp = torch.addcmul(D.neg_(), g, sgn, out=g).mul_(e)  # l * dP = E * (sign(p) * g - D)
            inv_l.mul_(scale)
            kc_t = _flat(kc[bs, hs])
            dq[bs, hs, rs] = torch.bmm(dp, kc_t).mul_(inv_l).view(*dq[bs, hs, rs].shape)  # dQ = scale dP K
            q_l = _flat(qc[bs, hs, rs]) * inv_l  # dK = scale dP^T Q = (l dP)^T (scale Q / l)
            if first:
                torch.bmm(dp.transpose(1, 2), q_l, out=dk_t)
            else:
                dk_t.baddbmm_(dp.transpose(1, 2), q_l)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _safe_reciprocal(x: torch.Tensor) -> torch.Tensor:
    """1 / x, with 0 where x == 0 (rows with no kept key)."""
    return torch.where(x > 0, x.reciprocal(), torch.zeros_like(x))


# ---------------------------------------------------------------------------------------------------------
# Backend selection and the public ops
# ---------------------------------------------------------------------------------------------------------


def triton_unsupported_reason(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None = None
) -> str | None:
    """Why the fused Triton kernel cannot run on these inputs (None when it can)."""
    try:
        from uvic.kernels import unsupported_reason
    except ImportError as err:  # triton missing, or the kernel package not importable
        return f"the Triton kernel is not available ({err})"
    return unsupported_reason(q, k, v, key_padding_mask)


def _resolve_backend(q, k, v, key_padding_mask, backend: str) -> str:
    if backend == "auto":
        # fp32 runs on the kernel only with small IEEE tiles (larger ones spill registers), so on CUDA "auto"
        # gives fp32 to the torch backend; an explicit backend="triton" still accepts it.
        if q.is_cuda and q.dtype != torch.float32 and triton_unsupported_reason(q, k, v, key_padding_mask) is None:
            return "triton"
        return "torch"
    if backend == "triton":
        why = triton_unsupported_reason(q, k, v, key_padding_mask)
        if why is not None:
            raise ValueError(f"backend='triton' cannot run on these inputs: {why}")
    return backend


def cog_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Cog attention: `sign(p) * softmax(|p|) @ v` with `p = scale * q k^T` (paper Eq. 3).

    Args:
        q: (B, nh, Lq, hd) queries.
        k: (B, nh, Lk, hd) keys.
        v: (B, nh, Lk, hd) values.
        causal: mask key j for query i when j > i + Lk - Lq (bottom-right aligned, KV-cache friendly).
        key_padding_mask: (B, Lk) bool, True = the key takes part.
        scale: multiplies q k^T; defaults to hd ** -0.5.
        backend: "auto", "reference", "torch" or "triton" (see the module docstring).
    Returns:
        (B, nh, Lq, hd) in the input dtype; rows with no kept key are zeros.
    """
    _check_inputs(q, k, v, key_padding_mask, scale, backend)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    backend = _resolve_backend(q, k, v, key_padding_mask, backend)
    # The op chooses its own compute precision (float32 math on q, k, v as given), so autocast is off inside it:
    # under autocast q, k, v already carry the low-precision dtype, and the output comes back in that dtype.
    with torch.autocast(q.device.type, enabled=False):
        if backend == "reference":
            return attention_ref(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, cog=True)
        if backend == "triton":
            from uvic.kernels import fused_attention

            return fused_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, cog=True)
        return _CogAttentionTorch.apply(q, k, v, causal, key_padding_mask, scale, _TILE_ELEMENTS)


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Softmax attention with the same signature and masking semantics as `cog_attention`.

    The "torch" backend is `F.scaled_dot_product_attention` (flash / memory-efficient kernels where PyTorch
    has them); "triton" is the fused kernel in its softmax mode, for like-for-like comparisons.

    Args:
        q: (B, nh, Lq, hd); k, v: (B, nh, Lk, hd).
        causal: bottom-right aligned causal mask.
        key_padding_mask: (B, Lk) bool, True = the key takes part.
        scale: defaults to hd ** -0.5.
        backend: "auto", "reference", "torch" or "triton".
    Returns:
        (B, nh, Lq, hd) in the input dtype; rows with no kept key are zeros.
    """
    _check_inputs(q, k, v, key_padding_mask, scale, backend)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    backend = _resolve_backend(q, k, v, key_padding_mask, backend)
    if backend == "reference":
        with torch.autocast(q.device.type, enabled=False):  # float32 math, as for cog_attention
            return attention_ref(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, cog=False)
    if backend == "triton":
        from uvic.kernels import fused_attention

        with torch.autocast(q.device.type, enabled=False):
            return fused_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, cog=False)
    Lq, Lk = q.shape[2], k.shape[2]
    if key_padding_mask is None and (not causal or Lq == Lk):
        # The fast path: no explicit mask, so SDPA can use its fused kernels.
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    keep = _keep_mask(Lq, Lk, causal, key_padding_mask, q.device)
    has_key = keep.any(-1, keepdim=True)
    # Rows with no kept key attend to everything (finite) and are zeroed afterwards, so no NaN anywhere.
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep | ~has_key, scale=scale)
    return out * has_key.to(out.dtype)
