"""Fused Cog attention (and softmax attention) in Triton: flash-style forward and deterministic backward.

Written for uvic. The structure follows the Triton fused-attention tutorial (python/tutorials/06-fused-attention.py)
and FlashAttention-2 (online softmax in base 2, one fp32 log-sum-exp per row, recompute in backward, D = rowsum(dO*O)
preprocessing). docs/kernel_math.md derives the Cog math ("Forward: online softmax over |p|", "Backward: dS and the
D preprocess"), the sign step's exact semantics ("Zero scores and masked entries") and why fp32 inputs keep the
row max and sum apart instead of one log-sum-exp ("Precision of the backward at large scores").

    p = scale * q k^T,    attn = sign(p) * softmax(|p|),    o = attn v        (COG=True)
    attn = softmax(p)                                                           (COG=False, the same kernels)

Supported envelope (enforced by `uvic.attention.unsupported_reason`):
    - q, k, v: (B, nh, Lq|Lk, hd) CUDA tensors with any strides (CPU tensors only under TRITON_INTERPRET=1), on an
      NVIDIA GPU of compute capability >= 8.0 with the shared memory its tile table needs (`configs.config_arch`:
      sm_90 tiles for majors 9-10, sm_80 tiles for the others, e.g. RTX 30xx-50xx); not ROCm.
    - dtypes float16, bfloat16, float32 (q, k, v share one). Accumulation is always fp32. For float32 inputs every
      tl.dot uses input_precision="ieee" (no TF32), so fp32 results match an fp32 reference; this path is for
      parity and has no tensor-core speed.
    - every head dim that is a multiple of 8 up to 256 (q, k, v share one). Powers of two run as one tile; the
      others as power-of-two chunks (`configs.head_dim_chunks`: 72 = 64 + 16 with 8 padding columns, 96 = 64 + 32;
      "Head dims that are not powers of two" in docs/kernel_math.md), with the tiles of the narrowest power of two
      that holds them. Head dim 256 runs on small tiles (32-64 rows/keys, 8 warps, 1-2 stages; see configs.py) so
      that every kernel stays spill-free on sm_80 and sm_90.
    - any Lq >= 1 and Lk >= 1 (not only block multiples), Lq != Lk, with L * hd < 2**31 (offsets inside one
      (batch, head) slice are 32-bit; a strided input whose slice spans more is copied first, `_int32_addressable`);
      causal is bottom-right aligned (key j is masked for query i when j > i + Lk - Lq, as FlashAttention-2);
      key_padding_mask (B, Lk) bool, True = keep. The k and v rows of removed keys are never read (a NaN or Inf
      stored there reaches no output or gradient; their dK/dV are 0), unlike SDPA's additive-mask behaviour.
    - sliding windows (left, right) with the same alignment (FlashAttention's window_size, -1 = unbounded side):
      the WINDOW specialization; tiles outside the band are skipped by the loop bounds of all three kernels.
    - logit softcaps p' = c tanh(p / c) (Gemma 2), applied before Cog's sign and magnitude, with the gradient
      factor 1 - tanh^2: the SOFTCAP specialization. Calls without a window or softcap compile the kernels of
      before (docs/kernel_math.md, "Sliding windows and softcaps"). Windows and softcaps run for every dtype and
      head dim above; where a plain tile spills in these "banded" kernels, they have tiles of their own
      (`configs.candidate_configs(..., banded=True)`).
    - any finite scale (a negative scale flips the signs of p, as in the reference; for Cog the launcher passes
      -q and |scale|, or q = 0 for scale 0, since the kernels take sign(p) from the bits of q.k).
Known differences from `uvic.attention.attention_ref`:
    - rounding: P and dS are cast to the input dtype before their matmuls (as every flash kernel); fp32 math
      elsewhere; the exp2 argument |q.k| * scale * log2(e) - m is one fused multiply-add. A softcap's tanh is
      1 - 2 / (exp2(2x log2 e) + 1) in fp32 (a few ulp of 1). Errors are within 2x those
      of computing the reference in the input dtype, plus one rounding of the largest value for 16-bit inputs
      (tests/kernels/interpret_numerics.py).
    - a row with no kept key gives O = 0, LSE = -inf and zero gradients, like the reference (which zeroes such
      rows) and `torch._safe_softmax`; the plain softmax formula would give NaN there.
    - no dropout and no attention bias (no backend of uvic.attention has them).
Determinism: the backward runs one program per key block for dK/dV (looping over query blocks) and one program
per query block for dQ (looping over key blocks). No atomics, so gradients are bitwise reproducible for a given
config (the autotuner's choice can differ between machines).
Code map: this file holds the @triton.jit kernels and their launchers; `uvic.kernels.ops` registers them as
torch.library custom ops (fake + autograd, so torch.compile traces them without graph breaks);
`uvic.kernels.configs` lists the autotune candidates; `uvic.kernels.aot` compiles them for sm_80/sm_90.
Cautions:
    - TRITON_INTERPRET=1 must be set before triton is first imported (triton builds its own @jit helpers then);
      under the interpreter a fixed small config runs (INTERPRET_CONFIGS) and bf16 dots are done in fp32
      (exact products, see `_dot`) because the triton 3.8 interpreter's bf16 tl.dot is wrong.
    - the forward's sign step is inline PTX (`min.xorsign.abs`) for 16-bit inputs on sm_86-89 and the sm_90 table's
      GPUs (SIGN_PTX, `configs.forward_sign_ptx`) and a clamp elsewhere (A100, sm_120, fp32). The interpreter can't
      run PTX: it runs the clamp unless INTERPRET_SIGN_PTX is set, as the tests do with an emulator of it.
    - autotuning benchmarks every candidate the first time a (head dim, dtype, causal, mask, length bucket) key
      is seen, re-running the kernel; the kernels only write their outputs, so this is safe.
    - the candidates live in `uvic.kernels.configs`; `python -m uvic.kernels.aot` compiles all of them for
      sm_80 and sm_90 and reports registers, spills and shared memory. Keep that report clean when editing, and
      compare `python -m uvic.kernels.aot --sass-mix` (instruction mix, Cog vs softmax mode) before and after.
    - Lq and Lk are runtime values (no recompile per length); the autotune key uses a power-of-two bucket.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from packaging.version import Version

from uvic.kernels import cuda_device_info
from uvic.kernels.configs import (
    KernelConfig,
    all_configs,
    candidate_configs,
    config_arch,
    forward_sign_ptx,
    gpu_dot_precision,
    head_dim_chunks,
    stride_unit,
)


LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): scores are kept in base 2 (exp2 is one MUFU op)

# Config used under TRITON_INTERPRET=1 (the autotuner benchmarks on a GPU). Small blocks so that short test
# sequences still cross block boundaries, the causal diagonal and the ragged tail. Tests may override it.
INTERPRET_CONFIGS: dict[str, KernelConfig] = {
    "fwd": KernelConfig(32, 16, 4, 1),
    "bwd_pre": KernelConfig(32, 16, 4, 1),
    "bwd_dkdv": KernelConfig(16, 32, 4, 1),
    "bwd_dq": KernelConfig(32, 16, 4, 1),
}

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}

# The interpreter cannot run inline PTX, so under TRITON_INTERPRET=1 the forward applies the sign with the clamp
# unless this is True; the tests set it while an emulator of `min.xorsign.abs` stands in for the PTX
# (tests/kernels/ptx_emulator.py). On a GPU, `configs.forward_sign_ptx` decides.
INTERPRET_SIGN_PTX = False


# ---------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr):
    """tl.dot with fp32 accumulation. DOT_PREC "ieee" (fp32 inputs) or "tf32" (ignored for 16-bit inputs);
    "upcast" multiplies in fp32 and is used only under the interpreter for bfloat16, whose tl.dot on CPU is
    wrong in triton 3.8 (it multiplies the raw bf16 bits). Products of bf16 numbers are exact in fp32, so this
    matches a bf16 MMA with fp32 accumulation."""
    if DOT_PREC == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PREC)


# ---- Head-dim chunks ("Head dims that are not powers of two" in docs/kernel_math.md) -----------------------------
# A row of q, k, v, dO (and of the accumulators) is held as a tuple of tiles, one per chunk of
# `head_dim_chunks(HEAD_DIM)` (power-of-two widths, e.g. 72 -> 64 + 16 with 8 padding columns). Products over the
# head dim sum the chunks' dots (`_dot_t`), products into it are taken chunk by chunk (`_dot_acc`). With one chunk
# (head dims 16, 32, 64, 128, 256) every helper below emits exactly the ops of a plain (rows, HEAD_DIM) tile.

_chunks = triton.constexpr_function(head_dim_chunks)


@triton.constexpr_function
def _chunk_start(dims, c):
    """The first column of chunk c of the widths `dims`."""
    return sum(dims[:c])


@triton.constexpr_function
def _is_padded(dims, c, head_dim):
    """Whether chunk c of `dims` reaches past the head dim (the last chunk of an odd multiple of 8)."""
    return sum(dims[: c + 1]) > head_dim


@triton.jit
def _head_cols(HEAD_DIM: tl.constexpr):
    """The column offsets of each chunk: a tuple of aranges [0, w0), [w0, w0 + w1), ..."""
    DIMS: tl.constexpr = _chunks(HEAD_DIM)
    cols = (tl.arange(0, DIMS[0]),)
    for c in tl.static_range(1, len(DIMS)):
        cols = cols + (_chunk_start(DIMS, c) + tl.arange(0, DIMS[c]),)
    return cols


@triton.jit
def _col_ok(DIMS: tl.constexpr, c: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(1, w) bool: which columns of chunk c are below HEAD_DIM (not padding)."""
    return ((_chunk_start(DIMS, c) + tl.arange(0, DIMS[c])) < HEAD_DIM)[None, :]


# Loads and stores of chunked tiles. Each is written as the one tl.load / tl.store of a plain tile it replaces
# (triton emits a call's keyword arguments, here the mask, before its positional ones), so that a one-chunk tile
# gives the very ops, in the very order, of the code before the split. Padding columns past HEAD_DIM (in the last
# chunk only) load as zeros without reading memory and are not stored.


@triton.jit
def _load_rows(base, rows, stride_r, cols, stride_d, row_ok, HEAD_DIM: tl.constexpr):
    """The (rows, head dim) tile at base + rows * stride_r + cols * stride_d, rows where `row_ok` (else zeros)."""
    DIMS: tl.constexpr = _chunks(HEAD_DIM)
    out = ()
    for c in tl.static_range(len(DIMS)):
        if _is_padded(DIMS, c, HEAD_DIM):
            x = tl.load(base + rows[:, None] * stride_r + cols[c][None, :] * stride_d,
                        mask=row_ok[:, None] & _col_ok(DIMS, c, HEAD_DIM), other=0.0)
        else:
            x = tl.load(base + rows[:, None] * stride_r + cols[c][None, :] * stride_d, mask=row_ok[:, None], other=0.0)
        out = out + (x,)
    return out


@triton.jit
def _tile_ptrs(base, rows, stride_r, cols, stride_d):
    """Pointers base + rows * stride_r + cols * stride_d of a tile, one (len(rows), w) block per chunk."""
    ptrs = ()
    for c in tl.static_range(len(cols)):
        ptrs = ptrs + (base + rows[:, None] * stride_r + cols[c][None, :] * stride_d,)
    return ptrs


@triton.jit
def _row_ptrs(base, rows, cols, HEAD_DIM: tl.constexpr):
    """Pointers base + rows * HEAD_DIM + cols of a tile of a contiguous (L, HEAD_DIM) array (dO)."""
    ptrs = ()
    for c in tl.static_range(len(cols)):
        ptrs = ptrs + (base + rows[:, None] * HEAD_DIM + cols[c][None, :],)
    return ptrs


@triton.jit
def _load_tile(ptrs, row_ok, HEAD_DIM: tl.constexpr, ROW_MASK: tl.constexpr):
    """Load the chunks at `ptrs` (`_tile_ptrs`, `_row_ptrs`); with ROW_MASK rows where `row_ok` is False load as
    zeros (without it `row_ok` is not read)."""
    DIMS: tl.constexpr = _chunks(HEAD_DIM)
    out = ()
    for c in tl.static_range(len(DIMS)):
        if _is_padded(DIMS, c, HEAD_DIM):
            if ROW_MASK:
                x = tl.load(ptrs[c], mask=row_ok[:, None] & _col_ok(DIMS, c, HEAD_DIM), other=0.0)
            else:
                x = tl.load(ptrs[c], mask=_col_ok(DIMS, c, HEAD_DIM), other=0.0)
        elif ROW_MASK:
            x = tl.load(ptrs[c], mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs[c])
        out = out + (x,)
    return out


@triton.jit
def _row_offsets(start, rows, cols, HEAD_DIM: tl.constexpr):
    """Element offsets start + rows * HEAD_DIM + cols in a contiguous (B*nh, L, HEAD_DIM) array (dO, O and the
    gradients), one block per chunk; int64 when `start` is."""
    out = ()
    for c in tl.static_range(len(cols)):
        out = out + (start + rows[:, None] * HEAD_DIM + cols[c][None, :],)
    return out


@triton.jit
def _load_at(base, offsets, row_ok, HEAD_DIM: tl.constexpr):
    """The tile at base + offsets (`_row_offsets`), rows where `row_ok` (else zeros)."""
    DIMS: tl.constexpr = _chunks(HEAD_DIM)
    out = ()
    for c in tl.static_range(len(DIMS)):
        if _is_padded(DIMS, c, HEAD_DIM):
            x = tl.load(base + offsets[c], mask=row_ok[:, None] & _col_ok(DIMS, c, HEAD_DIM), other=0.0)
        else:
            x = tl.load(base + offsets[c], mask=row_ok[:, None], other=0.0)
        out = out + (x,)
    return out


@triton.jit
def _store_rows(base, rows, cols, x, row_ok, HEAD_DIM: tl.constexpr):
    """Store the chunks of x at base + rows * HEAD_DIM + cols (contiguous rows), in base's dtype, rows where
    `row_ok`."""
    DIMS: tl.constexpr = _chunks(HEAD_DIM)
    for c in tl.static_range(len(DIMS)):
        if _is_padded(DIMS, c, HEAD_DIM):
            tl.store(base + rows[:, None] * HEAD_DIM + cols[c][None, :], x[c].to(base.dtype.element_ty),
                     mask=row_ok[:, None] & _col_ok(DIMS, c, HEAD_DIM))  # fmt: skip
        else:
            tl.store(base + rows[:, None] * HEAD_DIM + cols[c][None, :], x[c].to(base.dtype.element_ty),
                     mask=row_ok[:, None])  # fmt: skip


@triton.jit
def _store_at(base, offsets, x, row_ok, HEAD_DIM: tl.constexpr):
    """Store the chunks of x at base + offsets (`_row_offsets`), in base's dtype, rows where `row_ok`."""
    DIMS: tl.constexpr = _chunks(HEAD_DIM)
    for c in tl.static_range(len(DIMS)):
        if _is_padded(DIMS, c, HEAD_DIM):
            tl.store(base + offsets[c], x[c].to(base.dtype.element_ty), mask=row_ok[:, None] & _col_ok(DIMS, c, HEAD_DIM))
        else:
            tl.store(base + offsets[c], x[c].to(base.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _rowsum_prod(a, b):
    """sum over the head dim of a * b, (R, hd) x (R, hd) -> (R,), for fp32 chunked tiles."""
    acc = tl.sum(a[0] * b[0], 1)
    for c in tl.static_range(1, len(a)):
        acc += tl.sum(a[c] * b[c], 1)
    return acc


@triton.jit
def _zeros_tile(rows: tl.constexpr, HEAD_DIM: tl.constexpr):
    """fp32 accumulators of a (rows, head dim) tile, one per chunk."""
    DIMS: tl.constexpr = _chunks(HEAD_DIM)
    out = ()
    for c in tl.static_range(len(DIMS)):
        out = out + (tl.zeros([rows, DIMS[c]], dtype=tl.float32),)
    return out


@triton.jit
def _dot_t(a, b, DOT_PREC: tl.constexpr):
    """a @ b^T over the head dim, (R, hd) x (S, hd) -> (R, S) fp32, for chunked tiles: the sum of the chunks' dots
    (the padding columns are zeros in both)."""
    acc = _dot(a[0], tl.trans(b[0]), DOT_PREC)
    for c in tl.static_range(1, len(a)):
        acc += _dot(a[c], tl.trans(b[c]), DOT_PREC)
    return acc


@triton.jit
def _dot_acc(acc, p, b, DOT_PREC: tl.constexpr):
    """acc + p @ b into the head dim, chunk by chunk: (R, S) x (S, hd) added to the (R, hd) accumulators.

    The widest chunk's dot is emitted last. In a chain of dots (flash attention) triton 3.8 gives every dot the warp
    layout it picks from the shape of the last dot in program order (all warps along that dot's longer side): with
    the 16- or 32-wide chunk last, the 8 warps of the 32 x 32 tiles of head dims 136-240 all went along 32 rows
    (four times replicated) and ptxas spilled kilobytes; with the widest chunk last they go along the columns, as
    for head dim 256 ("Head dims that are not powers of two" in docs/kernel_math.md)."""
    out = ()
    for c in tl.static_range(len(acc) - 1, -1, -1):
        out = (acc[c] + _dot(p, b[c], DOT_PREC),) + out
    return out


@triton.jit
def _scale_rows(acc, alpha):
    """acc * alpha[:, None], chunk by chunk."""
    out = ()
    for c in tl.static_range(len(acc)):
        out = out + (acc[c] * alpha[:, None],)
    return out


@triton.jit
def _div_rows(acc, d):
    """acc / d[:, None], chunk by chunk."""
    out = ()
    for c in tl.static_range(len(acc)):
        out = out + (acc[c] / d[:, None],)
    return out


@triton.jit
def _times(x, y):
    """x * y, chunk by chunk (y a scalar)."""
    out = ()
    for c in tl.static_range(len(x)):
        out = out + (x[c] * y,)
    return out


@triton.jit
def _to_f32(x):
    """Each chunk in fp32."""
    out = ()
    for c in tl.static_range(len(x)):
        out = out + (x[c].to(tl.float32),)
    return out


@triton.jit
def _unit_stride(stride, STRIDE_UNIT: tl.constexpr):
    """A row stride in elements: the launcher divides the strides of q, k and v by STRIDE_UNIT = 8 when they are
    multiples of 8 and not all of 16 (head dims that are odd multiples of 8), so that the product here tells the
    compiler that the rows are 16-byte aligned (triton specialises an integer argument only on divisibility by 16)."""
    if STRIDE_UNIT == 1:
        return stride
    else:
        return stride * STRIDE_UNIT


@triton.jit
def _slice_base(ptr, off_b, off_h, stride_b, stride_h, STRIDE_UNIT: tl.constexpr):
    """ptr + the (batch, head) offset, in int64 (`off_b`, `off_h` are int64), strides as `_unit_stride`."""
    if STRIDE_UNIT == 1:
        return ptr + off_b * stride_b + off_h * stride_h
    else:
        return ptr + (off_b * stride_b + off_h * stride_h) * STRIDE_UNIT


_SIGN_BIT = tl.constexpr(-(2**31))  # 0x80000000 as an int32: the sign bit of a float32
_SIGN_GAIN = tl.constexpr(2.0**127)  # the forward's sign operand is q.k * 2**127 (see `_signed_operand`)
_M_FLOOR = tl.constexpr(24.0)  # the forward's Cog running max starts here for bf16 and fp32 (`_signed_operand`)


@triton.jit
def _load_kv(
    k_base, v_base, kpm_base, cols, offs_d, stride_kn, stride_kd, stride_vn, stride_vd, LK,
    HEAD_DIM: tl.constexpr, MASK: tl.constexpr, HAS_KPM: tl.constexpr,
):  # fmt: skip
    """The k and v rows of keys `cols` (BLOCK_N, HEAD_DIM), chunked (`_head_cols`), and, with a key padding mask,
    which of them it keeps (BLOCK_N,). Rows past LK (MASK) and rows of removed keys load as zeros: their memory is
    never read, so a NaN or Inf stored there cannot reach any output or gradient ("Masking and key padding" in
    docs/kernel_math.md)."""
    k_ptrs = _tile_ptrs(k_base, cols, stride_kn, offs_d, stride_kd)
    v_ptrs = _tile_ptrs(v_base, cols, stride_vn, offs_d, stride_vd)
    kpm_keep = cols < LK
    if HAS_KPM:
        kpm_keep = tl.load(kpm_base + cols, mask=cols < LK, other=0) != 0
    k = _load_tile(k_ptrs, kpm_keep, HEAD_DIM, HAS_KPM or MASK)
    v = _load_tile(v_ptrs, kpm_keep, HEAD_DIM, HAS_KPM or MASK)
    return k, v, kpm_keep


@triton.jit
def _tanh_nonneg(x):
    """tanh(x) for x >= 0 in fp32, as 1 - 2 / (exp2(2 x log2(e)) + 1): one MUFU.EX2 and one reciprocal; exp2
    overflowing to +inf gives exactly 1. Absolute error a few ulp of 1 (the softcap's score c * tanh is then off
    by a few ulp of c, as c * tanh(p / c) computed in fp32 is)."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _scores(qk, scale2, cap_in, cap_out, COG: tl.constexpr, SOFTCAP: tl.constexpr):
    """The score the softmax sees, before scaling for Cog: |q.k| (the kernels apply scale2 > 0 inside the exp2
    argument's FMA, so the rounded product p = scale2 * q.k is never formed), scale2 * q.k for softmax.

    SOFTCAP: the capped score in base 2, c log2(e) tanh(p / c) = cap_out * tanh(q.k * cap_in), of |q.k| for Cog
    (|p'| = c tanh(|p| / c)), signed for softmax; the exp2 argument is then s - m for both modes."""
    if SOFTCAP:
        t = _tanh_nonneg(tl.abs(qk) * cap_in)
        if COG:
            s = t * cap_out
        else:
            s = tl.where(qk < 0.0, -t, t) * cap_out
    elif COG:
        s = tl.abs(qk)
    else:
        s = qk * scale2
    return s


@triton.jit
def _exp2_arg(s, scale2, m, COG: tl.constexpr, SOFTCAP: tl.constexpr):
    """The exponent s - m of a weight in base 2: one FMA for Cog (|q.k| * scale2 - m), one add for softmax and
    for softcapped scores (already in base 2)."""
    if COG and not SOFTCAP:
        return s * scale2 - m
    else:
        return s - m


@triton.jit
def _softcap_fold(a, w, s, cap_out, SOFTCAP: tl.constexpr):
    """(a, w) times the softcap's gradient factor dp'/dp = 1 - tanh^2 = 1 - (s / cap_out)^2 (s the base-2 capped
    score of `_scores`; for Cog its magnitude, which has the same square), so that `_dscore` of the results is
    dL/dp: `_dscore` is linear in (a, w) and the factor is >= 0 (|a f| = |a| f). Folded in before the g = dO . v
    product, only the scaled weights stay live across it, not the weights and the score tile (the banded kernels
    then compile without spills, "Sliding windows and softcaps" in docs/kernel_math.md). Identity without SOFTCAP."""
    if SOFTCAP:
        # clamped to [-1, 1] (exact for tanh): masked entries have s = -inf and a = w = 0, and must give 0, not NaN
        t = tl.minimum(tl.maximum(s / cap_out, -1.0), 1.0)
        f = 1.0 - t * t
        return a * f, w * f
    else:
        return a, w


@triton.jit
def _signed(w, qk, COG: tl.constexpr):
    """The backward's signed weight, fp32: sign(p) * w for Cog (w >= 0; p = scale2 * q.k with scale2 > 0, so
    sign(p) = sign(q.k)), w for softmax. (The forward uses `_signed_operand`, which needs w <= |2**127 q.k|.)

    q.k's sign bit goes into w's bits (one LOP3 bit-select, integer pipe); where q.k is exactly zero the result is
    q.k itself (+-0), so sign(0) * w = 0 exactly (one compare and one select). Masked entries have w = 0, so they
    give +-0 either way ("Zero scores and masked entries" in docs/kernel_math.md)."""
    if COG:
        wb = w.to(tl.int32, bitcast=True)
        bits = wb ^ ((wb ^ qk.to(tl.int32, bitcast=True)) & _SIGN_BIT)
        return tl.where(qk != 0.0, bits.to(tl.float32, bitcast=True), qk)
    else:
        return w


# PTX of `min.xorsign.abs` on a pair of 16-bit values per 32-bit register: sign(a) * sign(b) * min(|a|, |b|).
_XORSIGN_PTX_BF16 = tl.constexpr("min.xorsign.abs.bf16x2 $0, $1, $2;")
_XORSIGN_PTX_F16 = tl.constexpr("min.xorsign.abs.f16x2 $0, $1, $2;")


@triton.jit
def _min_xorsign_abs(a, b, dtype: tl.constexpr):
    """sign(a) * sign(b) * min(|a|, |b|), elementwise, for a and b in `dtype` (bfloat16 or float16): the PTX
    instruction `min.xorsign.abs` on pairs (sm_86+, one HMNMX2.XORSIGN per pair on sm_90). The interpreter cannot
    run it; tests/kernels/ptx_emulator.py emulates it there."""
    if dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(_XORSIGN_PTX_BF16, "=r,r,r", [a, b], dtype=tl.bfloat16, is_pure=True,
                                         pack=2)  # fmt: skip
    else:
        tl.static_assert(dtype == tl.float16, "min.xorsign.abs is used for 16-bit inputs only")
        return tl.inline_asm_elementwise(_XORSIGN_PTX_F16, "=r,r,r", [a, b], dtype=tl.float16, is_pure=True,
                                         pack=2)  # fmt: skip


@triton.jit
def _signed_operand(w, qk, dtype: tl.constexpr, COG: tl.constexpr, DOT_PREC: tl.constexpr, SIGN_PTX: tl.constexpr):
    """The P operand of the forward's P @ V product, (BLOCK_M, BLOCK_N) in `dtype`: sign(p) * w for Cog, w for
    softmax. Cog rounds d = q.k * 2**127 and w to `dtype` and takes sign(d) * min(|d|, w): with SIGN_PTX (16-bit
    inputs on sm_90, `configs.forward_sign_ptx`) one `min.xorsign.abs` per pair of scores, else the clamp
    max(min(d, w), -w), two packed min/max per pair. Both give the same values.

    This is sign(q.k) * w exactly whenever |d| >= w for every nonzero q.k; then d = +-0 gives +-0, d > 0 gives w
    and d < 0 gives -w. Masked entries have w = 0 and give +-0. |d| >= w holds because ("Zero scores and masked
    entries" in docs/kernel_math.md):
      - fp16 inputs: a nonzero q.k is at least 2**-71 in magnitude (a sum of products of fp16 numbers, each a
        multiple of 2**-48), so d overflows to +-inf;
      - bf16 and fp32 inputs: |d| >= 2**-22 (|q.k| >= 2**-149), and the running max m starts at _M_FLOOR = 24.
        Where |q.k| < 2**-126, |p| = scale2 |q.k| < 2 |d| (scale2 < 2**128), so w <= exp2(2 |d| - 24) <= |d|;
        above that, |d| >= 2 and w <= 1 (up to the rounding of m). Starting m at 24 scales the weights of rows
        whose largest |p| is below 24 by a power of two, which O = acc / l and the backward cancel.
    Under the interpreter ("upcast") the triton 3.8 negation of a bf16 tensor gives wrong values (-0.5 -> -8), so
    the clamp runs in fp32 on the values rounded to bf16, which gives the same numbers (min and max are exact)."""
    if COG:
        d = (qk * _SIGN_GAIN).to(dtype)
        wq = w.to(dtype)
        if SIGN_PTX:
            return _min_xorsign_abs(d, wq, dtype)
        if DOT_PREC == "upcast":
            d = d.to(tl.float32)
            wq = wq.to(tl.float32)
        return tl.maximum(tl.minimum(d, wq), -wq).to(dtype)
    else:
        return w.to(dtype)


@triton.jit
def _dscore(a, w, g, dlt, COG: tl.constexpr):
    """dL/dp from the weight and g = dO . v: A * (sign(p) * g - D) for Cog, written as |A| g - A D (sign(p) A = |A|),
    which costs what the softmax form W * (g - D) costs."""
    if COG:
        return tl.abs(a) * g - a * dlt
    else:
        return w * (g - dlt)


@triton.jit
def _softcap_factors(sm_scale, softcap, SOFTCAP: tl.constexpr):
    """(cap_in, cap_out) = (scale / c, c log2(e)) of a softcap c: the capped base-2 score is
    cap_out * tanh(q.k * cap_in) (`_scores`). (0, 0) without SOFTCAP (unused)."""
    if SOFTCAP:
        return sm_scale / softcap, softcap * LOG2E
    else:
        return 0.0, 0.0


@triton.jit
def _in_band(cols, rows, lo_off, hi_off, ONE_COMPARE: tl.constexpr):
    """Sliding-window keep-mask, cols and rows broadcast against each other (a tile either way round): key j kept
    for query i when i + lo_off <= j <= i + hi_off.

    ONE_COMPARE (the forward): one unsigned compare per score, j - (i + lo_off) <= hi_off - lo_off, exact since
    `band_args` gives lo_off <= hi_off and |offsets| <= Lq + Lk + 1 (both sides fit in int32; j < i + lo_off wraps
    above hi_off - lo_off). With two compares ptxas ran out of predicate registers in the Cog forward (P2R / LOP3
    bit packing) and missed the --sass-mix target; in the backward kernels the one-compare form made ptxas spill
    registers instead, so they keep two ("Sliding windows and softcaps" in docs/kernel_math.md)."""
    if ONE_COMPARE:
        return (cols - (rows + lo_off)).to(tl.uint32, bitcast=True) <= (hi_off - lo_off).to(tl.uint32, bitcast=True)
    else:
        return (cols >= rows + lo_off) & (cols <= rows + hi_off)


@triton.jit
def _score_tile(
    q, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, cols, offs_d, LK, diag, scale2, lo_off, hi_off, cap_in, cap_out, HEAD_DIM: tl.constexpr,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr, COG: tl.constexpr, DOT_PREC: tl.constexpr,
    ZERO_MASKS: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, FWD: tl.constexpr,
):  # fmt: skip
    """One (query block x key block) tile of the query-major kernels (forward, FWD, and dQ): the k and v rows, q.k
    (BLOCK_M, BLOCK_N) and the masked score (`_scores`, -inf where the entry is masked).

    ZERO_MASKS (the Cog backward): only the causal mask is applied to the score. Keys past LK and keys removed by
    the key padding mask load as zero rows, so their q.k is exactly 0 and `_signed` already gives them weight 0;
    the backward has no denominator that they would otherwise enter. This saves the mask select per score."""
    k, v, kpm_keep = _load_kv(k_base, v_base, kpm_base, cols, offs_d, stride_kn, stride_kd, stride_vn, stride_vd,
                              LK, HEAD_DIM, MASK, HAS_KPM)  # fmt: skip
    qk = _dot_t(q, k, DOT_PREC)
    s = _scores(qk, scale2, cap_in, cap_out, COG, SOFTCAP)
    # Masked keys become -inf AFTER the abs (an additive -1e6 before it would become the largest |p|).
    if ZERO_MASKS:  # keys past LK or removed by the key padding mask have zero k rows: q.k = 0, weight 0
        if MASK and CAUSAL:
            s = tl.where(cols[None, :] <= offs_m[:, None] + diag, s, float("-inf"))
        if MASK and WINDOW:
            s = tl.where(_in_band(cols[None, :], offs_m[:, None], lo_off, hi_off, FWD), s, float("-inf"))
    else:
        if MASK:
            keep = cols[None, :] < LK
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + diag)
            if WINDOW:
                keep = keep & _in_band(cols[None, :], offs_m[:, None], lo_off, hi_off, FWD)
            s = tl.where(keep, s, float("-inf"))
        if HAS_KPM:
            s = tl.where(kpm_keep[None, :], s, float("-inf"))
    return k, v, qk, s


@triton.jit
def _key_range(start_m, LK, diag, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """The keys query block `start_m` visits (forward and dQ): [0, full_hi) need no mask for any of its rows,
    [full_hi, hi) get the causal / boundary mask; keys from hi on are causally masked for every row."""
    full_lk = (LK // BLOCK_N) * BLOCK_N
    if CAUSAL:
        row0 = start_m * BLOCK_M
        full_hi = tl.minimum((tl.maximum(row0 + diag + 1, 0) // BLOCK_N) * BLOCK_N, full_lk)
        hi = tl.minimum(tl.maximum(row0 + BLOCK_M + diag, 0), LK)
    else:
        full_hi = full_lk
        hi = LK
    return full_hi, hi


@triton.jit
def _window_key_range(start_m, LK, lo_off, hi_off, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys query block `start_m` visits under a sliding window (rows i keep i + lo_off <= j <= i + hi_off):
    [lo, a) and [b, hi) with the mask, [a, b) without; key blocks outside [lo, hi) are skipped (no row sees them).
    lo, a and b are multiples of BLOCK_N (or equal to hi)."""
    row0 = start_m * BLOCK_M
    full_lk = (LK // BLOCK_N) * BLOCK_N
    lo = tl.minimum((tl.maximum(row0 + lo_off, 0) // BLOCK_N) * BLOCK_N, LK)
    hi = tl.maximum(tl.minimum(tl.maximum(row0 + BLOCK_M + hi_off, 0), LK), lo)
    # A key block needs no mask when every row of the block keeps every key of it (and it ends before LK).
    full_lo = tl.cdiv(tl.maximum(row0 + BLOCK_M - 1 + lo_off, 0), BLOCK_N) * BLOCK_N
    full_hi = tl.minimum((tl.maximum(row0 + hi_off + 1, 0) // BLOCK_N) * BLOCK_N, full_lk)
    a = tl.minimum(tl.maximum(full_lo, lo), hi)
    b = tl.maximum(a, tl.minimum(full_hi, hi))
    return lo, a, b, hi


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_n, offs_d, lo, hi, LK, diag, scale2, lo_off, hi_off, cap_in, cap_out,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
    COG: tl.constexpr, DOT_PREC: tl.constexpr, SIGN_PTX: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    for start_n in tl.range(lo, hi, BLOCK_N):
        k, v, qk, s = _score_tile(q, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                  offs_m, start_n + offs_n, offs_d, LK, diag, scale2, lo_off, hi_off, cap_in, cap_out,
                                  HEAD_DIM, MASK, CAUSAL, HAS_KPM, COG, DOT_PREC, False, WINDOW, SOFTCAP,
                                  True)  # fmt: skip
        if COG and SOFTCAP:  # s is the capped |p| in base 2 already (`_scores`), >= 0
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        elif COG:
            # The max of |p| = scale2 * max |q.k| (scale2 > 0; rounding is monotone, so this is the max of the
            # rounded products). It starts at 0 or _M_FLOOR and |p| >= 0: always finite, no -inf - -inf.
            m_new = tl.maximum(m_i, tl.max(s, 1) * scale2)
            m_use = m_new
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        w = tl.math.exp2(_exp2_arg(s, scale2, m_use[:, None], COG, SOFTCAP))
        l_i = l_i * alpha + tl.sum(w, 1)  # the denominator sums the UNSIGNED weights
        acc = _scale_rows(acc, alpha)
        acc = _dot_acc(acc, _signed_operand(w, qk, v[0].dtype, COG, DOT_PREC, SIGN_PTX), v, DOT_PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE, KPM, sm_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_kpmb, NH, LQ, LK, L_BUCKET, WIN_LO, WIN_HI, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr, COG: tl.constexpr, DOT_PREC: tl.constexpr, SIGN_PTX: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, STRIDE_UNIT: tl.constexpr = 1,
):  # fmt: skip
    """One program: BLOCK_M query rows of one (batch, head); loops over key blocks. O, LSE are contiguous.
    SIGN_PTX: apply Cog's sign with `min.xorsign.abs` (`_signed_operand`). WINDOW (then CAUSAL is False): keys
    i + WIN_LO <= j <= i + WIN_HI only, and key blocks outside that band are skipped. SOFTCAP: scores capped to
    softcap * tanh(p / softcap). WIN_LO, WIN_HI and softcap are unused without them. Head dims that are not a
    power of two run as chunks (`_head_cols`); STRIDE_UNIT: the factor the strides of Q, K, V were divided by
    (`_unit_stride`)."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    off_b = (bh // NH).to(tl.int64)
    off_h = (bh % NH).to(tl.int64)
    stride_qm = _unit_stride(stride_qm, STRIDE_UNIT)
    stride_kn = _unit_stride(stride_kn, STRIDE_UNIT)
    stride_vn = _unit_stride(stride_vn, STRIDE_UNIT)
    q_base = _slice_base(Q, off_b, off_h, stride_qb, stride_qh, STRIDE_UNIT)
    k_base = _slice_base(K, off_b, off_h, stride_kb, stride_kh, STRIDE_UNIT)
    v_base = _slice_base(V, off_b, off_h, stride_vb, stride_vh, STRIDE_UNIT)
    kpm_base = KPM + off_b * stride_kpmb
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = _head_cols(HEAD_DIM)
    row_ok = offs_m < LQ
    q = _load_rows(q_base, offs_m, stride_qm, offs_d, stride_qd, row_ok, HEAD_DIM)

    scale2 = sm_scale * LOG2E
    diag = LK - LQ  # causal: key j is kept for query i when j <= i + diag
    cap_in, cap_out = _softcap_factors(sm_scale, softcap, SOFTCAP)
    if COG:
        # max of |p| >= 0; l_i must then start at 0 (not 1). bf16 and fp32 start at _M_FLOOR (`_signed_operand`)
        if V.dtype.element_ty == tl.float16:
            m_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            m_i = tl.full([BLOCK_M], _M_FLOOR, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = _zeros_tile(BLOCK_M, HEAD_DIM)

    if WINDOW:  # [lo, a) masked (left edge of the band), [a, b) unmasked, [b, hi) masked (right edge, ragged end)
        lo, a, b, hi = _window_key_range(start_m, LK, WIN_LO, WIN_HI, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, lo, a, LK, diag, scale2, WIN_LO, WIN_HI, cap_in, cap_out,
            HEAD_DIM, BLOCK_N, True, False, HAS_KPM, COG, DOT_PREC, SIGN_PTX, True, SOFTCAP,
        )  # fmt: skip
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, a, b, LK, diag, scale2, WIN_LO, WIN_HI, cap_in, cap_out,
            HEAD_DIM, BLOCK_N, False, False, HAS_KPM, COG, DOT_PREC, SIGN_PTX, True, SOFTCAP,
        )  # fmt: skip
        full_hi = b
    else:
        full_hi, hi = _key_range(start_m, LK, diag, BLOCK_M, BLOCK_N, CAUSAL)
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, 0, full_hi, LK, diag, scale2, WIN_LO, WIN_HI, cap_in, cap_out,
            HEAD_DIM, BLOCK_N, False, CAUSAL, HAS_KPM, COG, DOT_PREC, SIGN_PTX, False, SOFTCAP,
        )  # fmt: skip
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_n, offs_d, full_hi, hi, LK, diag, scale2, WIN_LO, WIN_HI, cap_in, cap_out,
        HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_KPM, COG, DOT_PREC, SIGN_PTX, WINDOW, SOFTCAP,
    )  # fmt: skip

    # Rows with no kept key: l_i == 0, acc == 0 -> O = 0 and LSE = -inf (backward turns it into weight 0).
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if DOT_PREC != "ieee":  # 16-bit: one log-sum-exp per row (computed before O: the order ptxas allocates best)
        lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))
    o = _div_rows(acc, l_safe)
    o_base = O + bh.to(tl.int64) * LQ * HEAD_DIM
    _store_rows(o_base, offs_m, offs_d, o, row_ok, HEAD_DIM)
    if DOT_PREC == "ieee":  # float32: the row max and the sum, (2, LQ) per row block ("Precision of the backward")
        tl.store(LSE + bh.to(tl.int64) * 2 * LQ + offs_m, m_i, mask=row_ok)
        tl.store(LSE + bh.to(tl.int64) * 2 * LQ + LQ + offs_m, l_i, mask=row_ok)
    else:
        tl.store(LSE + bh.to(tl.int64) * LQ + offs_m, lse, mask=row_ok)


@triton.jit
def _attn_bwd_pre(
    O, DO, DELTA, LQ, L_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """DELTA = rowsum(dO * O) in fp32; O, DO are contiguous (B*nh, Lq, hd)."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = _head_cols(HEAD_DIM)
    ok = offs_m < LQ
    off = _row_offsets(bh * LQ * HEAD_DIM, offs_m, offs_d, HEAD_DIM)
    o = _to_f32(_load_at(O, off, ok, HEAD_DIM))
    do = _to_f32(_load_at(DO, off, ok, HEAD_DIM))
    tl.store(DELTA + bh * LQ + offs_m, _rowsum_prod(o, do), mask=ok)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, kpm_keep, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd,
    offs_m, offs_n, offs_d, lo, hi, LQ, diag, scale2, lo_off, hi_off, cap_in, cap_out,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr, COG: tl.constexpr, DOT_PREC: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Transposed tiles (keys x queries) as in the tutorial: dV += A^T dO, dK += dS^T q (scaled by the caller)."""
    for start_m in tl.range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        q_ptrs = _tile_ptrs(q_base, rows, stride_qm, offs_d, stride_qd)
        do_ptrs = _row_ptrs(do_base, rows, offs_d, HEAD_DIM)
        if MASK:
            row_ok = rows < LQ
            q = _load_tile(q_ptrs, row_ok, HEAD_DIM, True)
            do = _load_tile(do_ptrs, row_ok, HEAD_DIM, True)
            m = tl.load(lse_base + rows, mask=row_ok, other=0.0)
            dlt = tl.load(delta_base + rows, mask=row_ok, other=0.0)
        else:
            q = _load_tile(q_ptrs, rows, HEAD_DIM, False)
            do = _load_tile(do_ptrs, rows, HEAD_DIM, False)
            m = tl.load(lse_base + rows)
            dlt = tl.load(delta_base + rows)
        m = tl.where(m == float("-inf"), 0.0, m)  # empty rows: every score is -inf, so every weight is 0
        qkT = _dot_t(k, q, DOT_PREC)  # (BLOCK_N, BLOCK_M)
        sT = _scores(qkT, scale2, cap_in, cap_out, COG, SOFTCAP)
        if COG:  # as `_score_tile` with ZERO_MASKS: rows past LQ and removed keys have q.k = 0, so weight 0
            if MASK and CAUSAL:
                sT = tl.where(offs_n[:, None] <= rows[None, :] + diag, sT, float("-inf"))
            if MASK and WINDOW:
                sT = tl.where(_in_band(offs_n[:, None], rows[None, :], lo_off, hi_off, False), sT, float("-inf"))
        else:
            if MASK:
                keep = rows[None, :] < LQ
                if CAUSAL:
                    keep = keep & (offs_n[:, None] <= rows[None, :] + diag)
                if WINDOW:
                    keep = keep & _in_band(offs_n[:, None], rows[None, :], lo_off, hi_off, False)
                sT = tl.where(keep, sT, float("-inf"))
            if HAS_KPM:
                sT = tl.where(kpm_keep[:, None], sT, float("-inf"))
        wT = tl.math.exp2(_exp2_arg(sT, scale2, m[None, :], COG, SOFTCAP))
        aT = _signed(wT, qkT, COG)
        dv = _dot_acc(dv, aT.to(do[0].dtype), do, DOT_PREC)
        aT, wT = _softcap_fold(aT, wT, sT, cap_out, SOFTCAP)
        gT = _dot_t(v, do, DOT_PREC)  # g_ij = dO_i . v_j
        dsT = _dscore(aT, wT, gT, dlt[None, :], COG)
        dk = _dot_acc(dk, dsT.to(q[0].dtype), q, DOT_PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, DK, DV, LSE, DELTA, KPM, sm_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_kpmb, NH, LQ, LK, L_BUCKET, WIN_LO, WIN_HI, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr, COG: tl.constexpr, DOT_PREC: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, STRIDE_UNIT: tl.constexpr = 1,
):  # fmt: skip
    """One program: BLOCK_N keys of one (batch, head); loops over query blocks. DO, DK, DV, LSE, DELTA contiguous.
    WINDOW, SOFTCAP, WIN_LO, WIN_HI, softcap, STRIDE_UNIT: as `_attn_fwd` (query blocks outside the band are
    skipped)."""
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    off_b = (bh // NH).to(tl.int64)
    off_h = (bh % NH).to(tl.int64)
    bh64 = bh.to(tl.int64)
    stride_qm = _unit_stride(stride_qm, STRIDE_UNIT)
    stride_kn = _unit_stride(stride_kn, STRIDE_UNIT)
    stride_vn = _unit_stride(stride_vn, STRIDE_UNIT)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = _head_cols(HEAD_DIM)
    col_ok = offs_n < LK
    k_base = _slice_base(K, off_b, off_h, stride_kb, stride_kh, STRIDE_UNIT)
    v_base = _slice_base(V, off_b, off_h, stride_vb, stride_vh, STRIDE_UNIT)
    k, v, kpm_keep = _load_kv(k_base, v_base, KPM + off_b * stride_kpmb, offs_n, offs_d, stride_kn, stride_kd,
                              stride_vn, stride_vd, LK, HEAD_DIM, True, HAS_KPM)  # fmt: skip
    q_base = _slice_base(Q, off_b, off_h, stride_qb, stride_qh, STRIDE_UNIT)
    do_base = DO + bh64 * LQ * HEAD_DIM
    lse_base = LSE + bh64 * LQ
    delta_base = DELTA + bh64 * LQ
    scale2 = sm_scale * LOG2E
    diag = LK - LQ
    cap_in, cap_out = _softcap_factors(sm_scale, softcap, SOFTCAP)
    dk = _zeros_tile(BLOCK_N, HEAD_DIM)
    dv = _zeros_tile(BLOCK_N, HEAD_DIM)

    # Query blocks: [lo, s1) masked (causal diagonal), [s1, s2) unmasked, [s2, end) masked (ragged tail of Lq).
    # Keys beyond Lk and keys removed by the key padding mask load as zeros; the former's dK/dV rows are not stored,
    # the latter get exact zeros (their weights are masked to 0 below, and q.k = 0, g = 0 with zero k and v rows).
    end = tl.cdiv(LQ, BLOCK_M) * BLOCK_M
    full_lq = (LQ // BLOCK_M) * BLOCK_M
    if WINDOW:  # rows i see this key block when i + WIN_LO <= j <= i + WIN_HI for some of its keys j
        col0 = start_n * BLOCK_N
        lo = tl.minimum((tl.maximum(col0 - WIN_HI, 0) // BLOCK_M) * BLOCK_M, end)
        unmasked_from = tl.cdiv(tl.maximum(col0 + BLOCK_N - 1 - WIN_HI, 0), BLOCK_M) * BLOCK_M
        unmasked_to = (tl.maximum(col0 - WIN_LO + 1, 0) // BLOCK_M) * BLOCK_M
        end = tl.minimum(end, tl.cdiv(tl.maximum(col0 + BLOCK_N - WIN_LO, 0), BLOCK_M) * BLOCK_M)
        s1 = tl.maximum(lo, tl.minimum(unmasked_from, end))
        s2 = tl.maximum(s1, tl.minimum(tl.minimum(unmasked_to, full_lq), end))
    else:
        if CAUSAL:
            col0 = start_n * BLOCK_N
            lo = (tl.maximum(col0 - diag, 0) // BLOCK_M) * BLOCK_M
            unmasked_from = tl.cdiv(tl.maximum(col0 + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M
            lo = tl.minimum(lo, end)
            s1 = tl.maximum(lo, tl.minimum(unmasked_from, end))
        else:
            lo = 0
            s1 = 0
        s2 = tl.maximum(s1, full_lq)
    dk, dv = _bwd_dkdv_inner(
        dk, dv, k, v, kpm_keep, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd,
        offs_m, offs_n, offs_d, lo, s1, LQ, diag, scale2, WIN_LO, WIN_HI, cap_in, cap_out,
        HEAD_DIM, BLOCK_M, True, CAUSAL, HAS_KPM, COG, DOT_PREC, WINDOW, SOFTCAP,
    )  # fmt: skip
    dk, dv = _bwd_dkdv_inner(
        dk, dv, k, v, kpm_keep, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd,
        offs_m, offs_n, offs_d, s1, s2, LQ, diag, scale2, WIN_LO, WIN_HI, cap_in, cap_out,
        HEAD_DIM, BLOCK_M, False, CAUSAL, HAS_KPM, COG, DOT_PREC, WINDOW, SOFTCAP,
    )  # fmt: skip
    dk, dv = _bwd_dkdv_inner(
        dk, dv, k, v, kpm_keep, q_base, do_base, lse_base, delta_base, stride_qm, stride_qd,
        offs_m, offs_n, offs_d, s2, end, LQ, diag, scale2, WIN_LO, WIN_HI, cap_in, cap_out,
        HEAD_DIM, BLOCK_M, True, CAUSAL, HAS_KPM, COG, DOT_PREC, WINDOW, SOFTCAP,
    )  # fmt: skip
    dk = _times(dk, sm_scale)  # p = scale * q k^T
    out_off = _row_offsets(bh64 * LK * HEAD_DIM, offs_n, offs_d, HEAD_DIM)
    _store_at(DK, out_off, dk, col_ok, HEAD_DIM)
    _store_at(DV, out_off, dv, col_ok, HEAD_DIM)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, m, dlt, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_n, offs_d, lo, hi, LK, diag, scale2, lo_off, hi_off, cap_in, cap_out,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_KPM: tl.constexpr,
    COG: tl.constexpr, DOT_PREC: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    for start_n in tl.range(lo, hi, BLOCK_N):
        k, v, qk, s = _score_tile(q, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                  offs_m, start_n + offs_n, offs_d, LK, diag, scale2, lo_off, hi_off, cap_in, cap_out,
                                  HEAD_DIM, MASK, CAUSAL, HAS_KPM, COG, DOT_PREC, COG, WINDOW, SOFTCAP,
                                  False)  # fmt: skip
        w = tl.math.exp2(_exp2_arg(s, scale2, m[:, None], COG, SOFTCAP))
        a, w = _softcap_fold(_signed(w, qk, COG), w, s, cap_out, SOFTCAP)
        g = _dot_t(do, v, DOT_PREC)  # g_ij = dO_i . v_j
        ds = _dscore(a, w, g, dlt[:, None], COG)
        dq = _dot_acc(dq, ds.to(k[0].dtype), k, DOT_PREC)
    return dq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, DQ, LSE, DELTA, KPM, sm_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_kpmb, NH, LQ, LK, L_BUCKET, WIN_LO, WIN_HI, softcap,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_KPM: tl.constexpr, COG: tl.constexpr, DOT_PREC: tl.constexpr,
    WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, STRIDE_UNIT: tl.constexpr = 1,
):  # fmt: skip
    """One program: BLOCK_M query rows of one (batch, head); loops over key blocks. DO, DQ, LSE, DELTA contiguous.
    WINDOW, SOFTCAP, WIN_LO, WIN_HI, softcap, STRIDE_UNIT: as `_attn_fwd`."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    off_b = (bh // NH).to(tl.int64)
    off_h = (bh % NH).to(tl.int64)
    bh64 = bh.to(tl.int64)
    stride_qm = _unit_stride(stride_qm, STRIDE_UNIT)
    stride_kn = _unit_stride(stride_kn, STRIDE_UNIT)
    stride_vn = _unit_stride(stride_vn, STRIDE_UNIT)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = _head_cols(HEAD_DIM)
    row_ok = offs_m < LQ
    q_base = _slice_base(Q, off_b, off_h, stride_qb, stride_qh, STRIDE_UNIT)
    q = _load_rows(q_base, offs_m, stride_qm, offs_d, stride_qd, row_ok, HEAD_DIM)
    io_off = _row_offsets(bh64 * LQ * HEAD_DIM, offs_m, offs_d, HEAD_DIM)
    do = _load_at(DO, io_off, row_ok, HEAD_DIM)
    m = tl.load(LSE + bh64 * LQ + offs_m, mask=row_ok, other=0.0)
    m = tl.where(m == float("-inf"), 0.0, m)
    dlt = tl.load(DELTA + bh64 * LQ + offs_m, mask=row_ok, other=0.0)
    k_base = _slice_base(K, off_b, off_h, stride_kb, stride_kh, STRIDE_UNIT)
    v_base = _slice_base(V, off_b, off_h, stride_vb, stride_vh, STRIDE_UNIT)
    kpm_base = KPM + off_b * stride_kpmb
    scale2 = sm_scale * LOG2E
    diag = LK - LQ
    cap_in, cap_out = _softcap_factors(sm_scale, softcap, SOFTCAP)
    dq = _zeros_tile(BLOCK_M, HEAD_DIM)

    if WINDOW:  # as the forward: [lo, a) masked, [a, b) unmasked, [b, hi) masked; other key blocks skipped
        lo, a, b, hi = _window_key_range(start_m, LK, WIN_LO, WIN_HI, BLOCK_M, BLOCK_N)
        dq = _bwd_dq_inner(
            dq, q, do, m, dlt, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, lo, a, LK, diag, scale2, WIN_LO, WIN_HI, cap_in, cap_out,
            HEAD_DIM, BLOCK_N, True, False, HAS_KPM, COG, DOT_PREC, True, SOFTCAP,
        )  # fmt: skip
        dq = _bwd_dq_inner(
            dq, q, do, m, dlt, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, a, b, LK, diag, scale2, WIN_LO, WIN_HI, cap_in, cap_out,
            HEAD_DIM, BLOCK_N, False, False, HAS_KPM, COG, DOT_PREC, True, SOFTCAP,
        )  # fmt: skip
        full_hi = b
    else:
        full_hi, hi = _key_range(start_m, LK, diag, BLOCK_M, BLOCK_N, CAUSAL)
        dq = _bwd_dq_inner(
            dq, q, do, m, dlt, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
            offs_m, offs_n, offs_d, 0, full_hi, LK, diag, scale2, WIN_LO, WIN_HI, cap_in, cap_out,
            HEAD_DIM, BLOCK_N, False, CAUSAL, HAS_KPM, COG, DOT_PREC, False, SOFTCAP,
        )  # fmt: skip
    dq = _bwd_dq_inner(
        dq, q, do, m, dlt, k_base, v_base, kpm_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, offs_n, offs_d, full_hi, hi, LK, diag, scale2, WIN_LO, WIN_HI, cap_in, cap_out,
        HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_KPM, COG, DOT_PREC, WINDOW, SOFTCAP,
    )  # fmt: skip
    dq = _times(dq, sm_scale)
    _store_at(DQ, io_off, dq, row_ok, HEAD_DIM)


# The kernels by name, for the launcher and for `uvic.kernels.aot`.
KERNEL_FNS = {"fwd": _attn_fwd, "bwd_pre": _attn_bwd_pre, "bwd_dkdv": _attn_bwd_dkdv, "bwd_dq": _attn_bwd_dq}


# ---------------------------------------------------------------------------------------------------------
# Launch: autotuned on a GPU, a fixed config under the interpreter
# ---------------------------------------------------------------------------------------------------------


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def length_bucket(n: int) -> int:
    """Autotune key for a sequence length: the next power of two, clamped to [16, 16384]."""
    return max(16, min(triton.next_power_of_2(n), 16384))


def pick_candidates(
    kernel: str, arch: int, dtype: torch.dtype, head_dim: int, bucket: int, banded: bool = False
) -> list[KernelConfig]:  # fmt: skip
    """The configs the autotuner benchmarks for one launch: the candidates of this (arch, dtype, head dim, banded),
    less tiles longer than the length bucket (keeping the smallest tile when none fits). Always a subset of
    `candidate_configs`, which is what `uvic.kernels.aot` compiles and checks."""
    allowed = candidate_configs(kernel, arch, _DTYPE_NAMES[dtype], head_dim, banded)
    fits = [c for c in allowed if (c.block_n if kernel == "bwd_dkdv" else c.block_m) <= bucket]
    return fits or [min(allowed, key=lambda c: c.block_m * c.block_n)]


def _arch(device: torch.device) -> int:
    """The candidate table (80 or 90) for this GPU; `unsupported_reason` has already refused GPUs with none."""
    arch, why = config_arch(*cuda_device_info(device.index))
    if arch is None:
        raise RuntimeError(f"the fused attention kernel cannot run on {device}: {why}")
    return arch


def _prune(kernel: str):
    """early_config_prune hook over `pick_candidates`."""

    def prune(configs, nargs, **kwargs):
        tensor = nargs["O"] if kernel == "bwd_pre" else nargs["Q"]
        banded = bool(kwargs.get("WINDOW", False) or kwargs.get("SOFTCAP", False))
        keep = pick_candidates(kernel, _arch(tensor.device), tensor.dtype, kwargs["HEAD_DIM"], nargs["L_BUCKET"],
                               banded)  # fmt: skip
        return [c for c in configs if _to_plain(c) in keep]

    return prune


def _to_plain(c: triton.Config) -> KernelConfig:
    return KernelConfig(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)


_AUTOTUNED: dict[tuple[str, int], object] = {}


def _autotuned(kernel: str, arch: int):
    """The autotuned wrapper of one kernel for one architecture (created on first use, then cached)."""
    key = (kernel, arch)
    if key not in _AUTOTUNED:
        configs = [
            triton.Config({"BLOCK_M": c.block_m, "BLOCK_N": c.block_n}, num_warps=c.num_warps, num_stages=c.num_stages)
            for c in all_configs(arch)[kernel]
        ]
        tune_key = (["HEAD_DIM", "L_BUCKET"] if kernel == "bwd_pre"
                    else ["HEAD_DIM", "CAUSAL", "HAS_KPM", "COG", "WINDOW", "SOFTCAP", "L_BUCKET"])  # fmt: skip
        _AUTOTUNED[key] = triton.autotune(configs, key=tune_key, prune_configs_by={"early_config_prune": _prune(kernel)})(
            KERNEL_FNS[kernel]
        )
    return _AUTOTUNED[key]


def _launch(kernel: str, device: torch.device, grid_rows: int, grid_blocks_of: str, bh: int, args: tuple, consts: dict):
    """Launch one kernel: a fixed config under the interpreter, else the autotuned wrapper for this GPU. Returns the
    launch as a replay for `_PLANS` (None under the interpreter, or where triton's launcher is not known)."""
    if _interpreting():
        c = INTERPRET_CONFIGS[kernel]
        block = c.block_n if grid_blocks_of == "BLOCK_N" else c.block_m
        KERNEL_FNS[kernel][(triton.cdiv(grid_rows, block), bh)](
            *args, **consts, BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages
        )
        return None
    fn = _autotuned(kernel, _arch(device))
    compiled = fn[lambda meta: (triton.cdiv(grid_rows, meta[grid_blocks_of]), bh)](*args, **consts)
    return _replay(kernel, compiled, fn.best_config, device, (grid_rows, grid_blocks_of, bh), args, consts)


# ---------------------------------------------------------------------------------------------------------
# Launch plans: a call's host work done once per shape
# ---------------------------------------------------------------------------------------------------------

# A small call (a U-ViT layer, B=8 nh=8 L=257) runs for tens of microseconds on a GPU, less than the host work of
# launching it through triton's autotuner and JIT (argument binding, specialization keys, the config lookup, per
# launch). Everything that work decides depends only on the call's shapes, strides, dtypes, flags and scalars and
# on the inputs' 16-byte alignment (what triton specializes on): the config, the compiled kernel, the grid and
# every argument but the tensors. `attention_forward` and `attention_backward` key their launches on exactly
# these, and after the first call with a key they launch the compiled kernels directly (`_replay`). The key holds
# the scale and the softcap by value (a model uses one of each), and at most `_MAX_PLANS` keys are kept.
_PLANS: dict[tuple, tuple] = {}
_MAX_PLANS = 4096
# Triton 3.3 and newer pass every kernel parameter to a compiled kernel's launcher, the constexprs included (older
# versions passed the others only). The replays are built for that convention; older triton launches every call
# through the autotuner.
_REPLAY_LAUNCHES = Version(triton.__version__) >= Version("3.3")


def _replay(kernel: str, compiled, config: triton.Config, device: torch.device, grid: tuple[int, str, int],
            args: tuple, consts: dict):  # fmt: skip
    """`compiled` (the kernel the autotuner launched with `args` on `device`) as a function of the call's tensors
    alone: `replay(*tensors)` launches it on the device's current stream with the other arguments, the constexprs
    and the grid of this launch. `args` must start with the tensors and hold no other tensor; the kernel takes
    its constexprs after the other parameters. None where triton's launcher is not the one this is built for."""
    from triton.compiler import CompiledKernel

    if not _REPLAY_LAUNCHES or not isinstance(compiled, CompiledKernel):
        return None
    n_tensors = next(i for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
    params = KERNEL_FNS[kernel].params
    if any(p.is_constexpr for p in params[: len(args)]) or not all(p.is_constexpr for p in params[len(args) :]):
        raise RuntimeError(f"kernel {kernel}: the launch plans need the constexpr parameters last")
    values = {**consts, **config.kwargs}
    constexprs = tuple(values[p.name] if p.name in values else p.default for p in params[len(args) :])
    grid_rows, grid_blocks_of, bh = grid
    runner = compiled[(triton.cdiv(grid_rows, config.kwargs[grid_blocks_of]), bh, 1)]
    fixed = (*args[n_tensors:], *constexprs)
    stream_of, index = triton.runtime.driver.active.get_current_stream, device.index  # torch's current stream
    return lambda *tensors: runner(*tensors, *fixed, stream=stream_of(index))


def _save_plan(key: tuple, *replays) -> None:
    """Keep the replays of one call's launches under `key` (nothing when a launch has no replay)."""
    if all(r is not None for r in replays):
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = replays


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make t's GPU the current one: triton launches (and autotunes) on the current CUDA device, not on the device
    of the tensors it is given. A no-op for CPU tensors (the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _dot_prec(dtype: torch.dtype) -> str:
    # fp32 inputs: full IEEE fp32 products (tl.dot would otherwise use TF32 on GPU and miss fp32 parity).
    if dtype == torch.bfloat16 and _interpreting():
        return "upcast"  # see _dot
    return gpu_dot_precision(_DTYPE_NAMES[dtype])


def _sign_ptx(q: torch.Tensor) -> bool:
    """The forward's SIGN_PTX switch for inputs like q (`_signed_operand`): by q's GPU's compute capability (the
    cached `cuda_device_info`), not by its tile table, since the sm_80 table's sm_86 and sm_89 GPUs have
    `min.xorsign.abs` too. Called once per launch plan."""
    if _interpreting():  # as an sm_90 GPU would, when the tests ask for it
        return INTERPRET_SIGN_PTX and forward_sign_ptx(90, _DTYPE_NAMES[q.dtype])
    major, minor = cuda_device_info(q.device.index)[:2]
    return forward_sign_ptx(10 * major + minor, _DTYPE_NAMES[q.dtype])


def _int32_addressable(t: torch.Tensor) -> torch.Tensor:
    """t (B, nh, L, hd) itself, or a contiguous copy when an element of one (batch, head) slice lies 2**31 or more
    elements past the slice's start (e.g. a packed qkv layout at very long L).

    The kernels add a 64-bit (batch, head) base to 32-bit row and column offsets (`offs_m * stride_qm + ...`),
    which would wrap there. 64-bit offsets in the kernels would cost registers in every launch instead: with the
    variants tried (int64 rows, or int64 block starts plus int32 offsets in the tile), ptxas spilled in 6 to 12 of
    the 254 sm_80/sm_90 kernels of `uvic.kernels.aot` (triton 3.9). A contiguous slice spans L * hd elements,
    which `unsupported_reason` keeps below 2**31 (as the contiguous outputs need too).
    """
    span = (t.shape[2] - 1) * t.stride(2) + (t.shape[3] - 1) * t.stride(3)
    return t if span < 2**31 else t.contiguous()


def _qkv_strides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """The strides of q, k, v (B, nh, L, hd) as the kernels take them, and their STRIDE_UNIT: the (batch, head,
    row) strides divided by `configs.stride_unit` of them (8 for contiguous head dims that are odd multiples of 8,
    so that the kernels know their rows are 16-byte aligned), the last-dim strides as they are."""
    unit = stride_unit(t.stride(i) for t in (q, k, v) for i in range(3))
    return tuple(x // unit if i < 3 else x for t in (q, k, v) for i, x in enumerate(t.stride())), unit


_NO_KPM: dict[torch.device, torch.Tensor] = {}


def _kpm_arg(q: torch.Tensor, key_padding_mask: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    if key_padding_mask is None:
        if (none := _NO_KPM.get(q.device)) is None:
            none = _NO_KPM[q.device] = q.new_empty(1, dtype=torch.int8)  # never read (HAS_KPM=False)
        return none, 0
    kpm = key_padding_mask.to(torch.int8).contiguous()
    return kpm, kpm.stride(0)


def _cog_scale(q: torch.Tensor, scale: float, cog: bool) -> tuple[torch.Tensor, float, float]:
    """(q', scale', sign) with scale' > 0 and scale' * q' = scale * q for Cog, which needs a positive scale: the
    kernels take sign(p) from the bits of q.k and fold scale * log2(e) into the exp2 argument's FMA. A negative
    scale negates q (sign(p) flips, |p| does not); scale 0 zeroes q (every score is exactly 0, as p = 0 * q.k).
    dL/dq = sign * dL/dq'. Softmax mode and positive scales pass through unchanged (sign 1)."""
    if not cog or scale > 0:
        return q, scale, 1.0
    if scale < 0:
        return -q, -scale, -1.0
    return torch.zeros_like(q), 1.0, 0.0


def band_args(Lq: int, Lk: int, causal: bool, window_left: int, window_right: int) -> tuple[bool, bool, int, int]:
    """(CAUSAL, WINDOW, WIN_LO, WIN_HI) for the kernels: without a window (both sides -1) the causal flag as given;
    with one, CAUSAL off and the band i + WIN_LO <= j <= i + WIN_HI, causal folded in as right = 0 and an unbounded
    side as an offset no row reaches (|offset| > Lq + Lk)."""
    if window_left < 0 and window_right < 0:
        return causal, False, 0, 0
    diag = Lk - Lq
    far = Lq + Lk + 1
    right = 0 if causal else window_right
    lo = diag - window_left if window_left >= 0 else -far
    hi = diag + right if right >= 0 else far
    return False, True, lo, hi


def row_stats_shape(q: torch.Tensor) -> tuple[int, ...]:
    """Shape of the row statistics `attention_forward` returns for q (B, nh, Lq, hd): (B, nh, 2, Lq) for float32
    inputs (row maximum and sum), (B, nh, Lq) otherwise (log-sum-exp)."""
    B, nh, Lq, _ = q.shape
    return (B, nh, 2, Lq) if q.dtype == torch.float32 else (B, nh, Lq)


def attention_forward(
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
    """Run the forward kernel. window_left / window_right: the sliding window (-1 = unbounded side); softcap: the
    logit cap c (0 = none); as `uvic.attention.cog_attention`. q (B, nh, Lq, hd), k and v (B, nh, Lk, hd), any strides (see `_int32_addressable`).

    Returns:
        out: (B, nh, Lq, hd) contiguous, q's dtype.
        stats: the row statistics the backward rebuilds the weights from (`row_stats_shape`), float32. For 16-bit
        inputs (B, nh, Lq): the base-2 log-sum-exp of the (scaled) scores, -inf on rows with no kept key. For
        float32 inputs (B, nh, 2, Lq): the base-2 row maximum m and the sum l of exp2(score - m) separately (l = 0
        on rows with no kept key), so that the backward can subtract the maximum before it normalises. For Cog, m
        is at least 24 (the forward's running max starts there for fp32, see `_signed_operand`).
    """
    B, nh, Lq, hd = q.shape
    Lk = k.shape[2]
    q, scale, _ = _cog_scale(q, scale, cog)
    q, k, v = _int32_addressable(q), _int32_addressable(k), _int32_addressable(v)
    out = torch.empty((B, nh, Lq, hd), dtype=q.dtype, device=q.device)
    lse = torch.empty(row_stats_shape(q), dtype=torch.float32, device=q.device)
    kpm, stride_kpmb = _kpm_arg(q, key_padding_mask)
    key = ("fwd", q.device, q.dtype, q.shape, Lk, q.stride(), k.stride(), v.stride(), q.data_ptr() % 16,
           k.data_ptr() % 16, v.data_ptr() % 16, key_padding_mask is None, causal, scale, cog, window_left,
           window_right, softcap)  # fmt: skip
    if (plan := _PLANS.get(key)) is not None:
        with _on_device(q):
            plan[0](q, k, v, out, lse, kpm)
        return out, lse
    causal, window, win_lo, win_hi = band_args(Lq, Lk, causal, window_left, window_right)
    qkv_strides, unit = _qkv_strides(q, k, v)
    args = (q, k, v, out, lse, kpm, float(scale), *qkv_strides, stride_kpmb, nh, Lq, Lk,
            length_bucket(max(Lq, Lk)), win_lo, win_hi, float(softcap))  # fmt: skip
    consts = {"HEAD_DIM": hd, "CAUSAL": causal, "HAS_KPM": key_padding_mask is not None, "COG": cog,
              "DOT_PREC": _dot_prec(q.dtype), "SIGN_PTX": _sign_ptx(q), "WINDOW": window, "SOFTCAP": softcap > 0,
              "STRIDE_UNIT": unit}  # fmt: skip
    with _on_device(q):
        _save_plan(key, _launch("fwd", q.device, Lq, "BLOCK_M", B * nh, args, consts))
    return out, lse


def attention_backward(
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
    """Run the three backward kernels (D preprocess, dK/dV, dQ). Shapes and arguments as `attention_forward`;
    returns dq, dk, dv (contiguous, in the dtype of q, k, v)."""
    B, nh, Lq, hd = q.shape
    Lk = k.shape[2]
    q, scale, q_sign = _cog_scale(q, scale, cog)
    q, k, v = _int32_addressable(q), _int32_addressable(k), _int32_addressable(v)
    # The kernels index dO, O and LSE as contiguous (B*nh, Lq[, hd]) arrays.
    if q.dtype == torch.float32:
        # The kernels rebuild exp2(score - m) / l as exp2(score - m) with dO / l in place of dO: D = rowsum(dO O)
        # then comes out as D / l, and dV, dS (so dQ, dK) are linear in dO and D ("Precision of the backward").
        m, l_sum = lse[:, :, 0], lse[:, :, 1]
        inv_l = torch.where(l_sum > 0, 1.0 / l_sum, torch.zeros_like(l_sum))  # rows with no kept key: weights 0
        do = do * inv_l[..., None]
        lse = m
    do = do.contiguous()
    out = out.contiguous()
    lse = lse.contiguous()
    delta = torch.empty((B, nh, Lq), dtype=torch.float32, device=q.device)
    dq = torch.empty((B, nh, Lq, hd), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, nh, Lk, hd), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, nh, Lk, hd), dtype=v.dtype, device=q.device)
    kpm, stride_kpmb = _kpm_arg(q, key_padding_mask)
    key = ("bwd", q.device, q.dtype, q.shape, Lk, q.stride(), k.stride(), v.stride(), q.data_ptr() % 16,
           k.data_ptr() % 16, v.data_ptr() % 16, do.data_ptr() % 16, out.data_ptr() % 16, lse.data_ptr() % 16,
           key_padding_mask is None, causal, scale, cog, window_left, window_right, softcap)  # fmt: skip
    if (plan := _PLANS.get(key)) is not None:
        with _on_device(q):
            plan[0](out, do, delta)
            plan[1](q, k, v, do, dk, dv, lse, delta, kpm)
            plan[2](q, k, v, do, dq, lse, delta, kpm)
    else:
        causal, window, win_lo, win_hi = band_args(Lq, Lk, causal, window_left, window_right)
        qkv_strides, unit = _qkv_strides(q, k, v)
        strides = (*qkv_strides, stride_kpmb, nh, Lq, Lk, length_bucket(max(Lq, Lk)),
                   win_lo, win_hi, float(softcap))  # fmt: skip
        consts = {"HEAD_DIM": hd, "CAUSAL": causal, "HAS_KPM": key_padding_mask is not None, "COG": cog,
                  "DOT_PREC": _dot_prec(q.dtype), "WINDOW": window, "SOFTCAP": softcap > 0, "STRIDE_UNIT": unit}  # fmt: skip
        with _on_device(q):
            _save_plan(
                key,
                _launch("bwd_pre", q.device, Lq, "BLOCK_M", B * nh, (out, do, delta, Lq, length_bucket(Lq)),
                        {"HEAD_DIM": hd}),  # fmt: skip
                _launch("bwd_dkdv", q.device, Lk, "BLOCK_N", B * nh,
                        (q, k, v, do, dk, dv, lse, delta, kpm, float(scale), *strides), consts),  # fmt: skip
                _launch("bwd_dq", q.device, Lq, "BLOCK_M", B * nh,
                        (q, k, v, do, dq, lse, delta, kpm, float(scale), *strides), consts),  # fmt: skip
            )
    if q_sign != 1.0:
        dq = dq * q_sign
    return dq, dk, dv
