"""Autotune candidates of the fused attention kernels, per GPU architecture, dtype and head dim.

This file is triton-free on purpose: `uvic.kernels.aot` compiles exactly these configs for sm_80 and sm_90 (the
sm_80 forwards for sm_86/89 too) and checks them with ptxas (no register spills, shared memory under the limit),
and the autotuner in `uvic.kernels.attention` only ever picks from them. Change a list and the AOT test re-checks.

Choices follow "Tiles and shared memory" in docs/kernel_math.md: Cog's sign handling costs registers, so the
128-wide tiles use 8 warps, and the (32, 128, 4 warps) dK/dV tile of the Triton tutorial is left out (it spills).
Configs that ptxas showed to spill for some dtype/head dim are dropped for that case (comments below).
"""

from __future__ import annotations

from dataclasses import dataclass

from uvic.kernels import SUPPORTED_HEAD_DIMS


KERNELS = ("fwd", "bwd_pre", "bwd_dkdv", "bwd_dq")
ARCHS = (80, 90)
HEAD_DIMS = SUPPORTED_HEAD_DIMS  # every multiple of 8 up to 256
# The head dims with tile tables of their own; every other head dim uses the table of the narrowest of these that
# holds its padded width (`table_head_dim`).
TABLE_HEAD_DIMS = (16, 32, 64, 128, 256)
DTYPES = ("fp16", "bf16", "fp32")


def head_dim_chunks(head_dim: int) -> tuple[int, ...]:
    """The tile widths the kernels split a head dim into, largest first: the binary expansion of the head dim
    rounded up to a multiple of 16, e.g. 72 -> (64, 16), 96 -> (64, 32), 104 -> (64, 32, 16), 128 -> (128,).

    Triton tiles are powers of two, and a tl.dot needs a reduction dim of at least 16 for 16-bit inputs (the
    head dim is the reduction of q k^T and dO v^T), so each chunk is a power of two >= 16. Every chunk but the last
    is full; the last has 8 padding columns when the head dim is an odd multiple of 8 (loaded as zeros, not
    stored). Head dims 16, 32, 64, 128 and 256 are one chunk: their kernels are those of before the split
    ("Head dims that are not powers of two" in docs/kernel_math.md).

    Self-contained on purpose: the kernels call it at compile time (`triton.constexpr_function`), and triton
    hashes its source into their cache key.
    """
    width = (head_dim + 15) // 16 * 16
    return tuple(1 << b for b in range(width.bit_length() - 1, 3, -1) if width >> b & 1)


def stride_unit(strides) -> int:
    """What the launcher divides the (batch, head, row) strides of q, k and v by, `STRIDE_UNIT` of the kernels: 8
    when they are all multiples of 8 but not all of 16 (the rows of a head dim that is an odd multiple of 8), else
    1. Triton specialises an integer argument on divisibility by 16 only; passed as stride / 8 and multiplied back
    by the constexpr 8 in the kernel, the strides tell the compiler that rows are 16-byte aligned (8 elements of a
    16-bit dtype), so tiles load with 16-byte vector loads instead of element by element."""
    strides = list(strides)
    return 8 if all(s % 8 == 0 for s in strides) and not all(s % 16 == 0 for s in strides) else 1


def padded_width(head_dim: int) -> int:
    """Columns the kernels compute per row for a head dim (the sum of its chunks); the rest of it is padding."""
    return sum(head_dim_chunks(head_dim))


def table_head_dim(head_dim: int) -> int:
    """The head dim whose tile table (`TABLE_HEAD_DIMS`) a head dim uses: the narrowest that holds its padded
    width, so that its tiles hold at most as many columns as those checked there."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} not supported; expected a multiple of 8 up to {HEAD_DIMS[-1]}")
    return min(t for t in TABLE_HEAD_DIMS if t >= padded_width(head_dim))

# Shared memory per block (bytes) a kernel may use: A100 164 KB, H100 228 KB (227 KB usable per block).
SMEM_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
# Shared memory the most demanding candidate of each table needs (triton's metadata.shared, read by
# `uvic.kernels.aot`; tests/kernels/test_triton_compile.py fails if a candidate needs more). 96 KB fits the 99 KB
# that sm_86/sm_89 (RTX 30xx/40xx) and sm_120 (RTX 50xx) give a block, so those GPUs can run the sm_80 table.
SMEM_NEEDED = {80: 96 * 1024, 90: 128 * 1024}


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration: tile sizes (rows of queries, columns of keys), warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"BM{self.block_m}-BN{self.block_n}-w{self.num_warps}-s{self.num_stages}"


_C = KernelConfig

# Preprocess (D = rowsum(dO * O)) is memory-bound and tiny; block_n is unused. (fp32 hd 256: 230-236 registers.)
_PRE = [_C(64, 16, 4, 1)]
_PRE_FP32 = {80: [_C(64, 16, 8, 1)]}  # by head dim: (64, 16, 4, 1) spills 4-8 bytes at fp32 hd 80 (sm_80 and sm_90)

# 16-bit inputs (fp16 / bf16). Keys: (arch, head dim). Head dims 16 and 32 are cheap at any tile: one config.
# Head dim 256 holds (rows x 256) fp32 accumulators per program: one small 8-warp tile per kernel, the largest tried
# that ptxas compiles without spills and below the 255-register cap (tiles noted as spilling or at 255: Cog fp16).
_FWD_16 = {
    (80, 16): [_C(64, 64, 4, 2)],
    (80, 32): [_C(64, 64, 4, 2)],
    (80, 64): [_C(128, 64, 8, 3), _C(64, 64, 4, 3)],
    (80, 128): [_C(128, 32, 8, 2), _C(64, 64, 4, 2)],  # (128, 64, 8, 2) spills
    (90, 16): [_C(64, 64, 4, 3)],
    (90, 32): [_C(64, 64, 4, 3)],
    (90, 64): [_C(128, 64, 8, 3), _C(128, 128, 8, 3)],
    (90, 128): [_C(128, 64, 8, 3), _C(128, 64, 8, 2)],  # (128, 128, 8, 1|2) spill with triton 3.9
    (80, 256): [_C(64, 64, 8, 1)],  # (64, 32, 4, 2), (128, 32, 8, 2) spill; (64, 64|32, 8, 2) at 255 registers
    # (64, 32, 8, 2) spills 4 bytes (fp16 softmax with a key padding mask, whose k/v loads are masked);
    # (64, 64, 8, 1) spills; (64, 64, 8, 2), (128, 32, 8, 2) at 247-255 registers
    (90, 256): [_C(64, 32, 8, 1)],
}
_DKDV_16 = {
    (80, 16): [_C(64, 64, 4, 2)],
    (80, 32): [_C(64, 64, 4, 2)],
    (80, 64): [_C(32, 128, 8, 2)],  # (64, 64, 4|8 warps) and Cog (32, 64, 4) spill
    (80, 128): [_C(32, 64, 8, 2), _C(16, 128, 8, 1)],  # (32, 128, 8, 1) and (32, 64, 4, 2) spill
    (90, 16): [_C(64, 64, 4, 3)],
    (90, 32): [_C(64, 64, 4, 3)],
    (90, 64): [_C(64, 128, 8, 3), _C(64, 64, 8, 3)],  # Cog (64, 64, 4, 2|3) spills with triton 3.9
    (90, 128): [_C(32, 64, 8, 3), _C(16, 128, 8, 2)],  # (64, 64, 4|8 warps), (32, 64, 4, 2) and, with triton 3.9,
    # (32, 128, 8, 2|3) spill
    (80, 256): [_C(32, 32, 8, 1)],  # (32, 64, 8, 1) spills; (16, 64, 8, 1) at 255 registers
    (90, 256): [_C(32, 32, 8, 1)],  # (16, 64, 8, 1) and (32, 64, 8, 1) spill 1.7-1.9 KB
}
_DQ_16 = {
    (80, 16): [_C(64, 64, 4, 2)],
    (80, 32): [_C(64, 64, 4, 2)],
    (80, 64): [_C(128, 32, 8, 2), _C(64, 64, 8, 2)],  # softmax spills at (128, 64, 8) and (64, 64, 4)
    (80, 128): [_C(64, 64, 8, 2), _C(64, 32, 4, 2)],
    (90, 16): [_C(64, 64, 4, 3)],
    (90, 32): [_C(64, 64, 4, 3)],
    (90, 64): [_C(128, 64, 8, 3), _C(64, 64, 4, 3)],
    (90, 128): [_C(128, 64, 8, 2), _C(64, 64, 4, 2)],
    (80, 256): [_C(32, 64, 8, 1)],  # (64, 32, 8, 2) and (64, 64, 8, 1) at 255 registers
    (90, 256): [_C(64, 32, 8, 2)],  # (64, 64, 8, 1) spills 0.7 KB
}
# fp32 inputs: IEEE fp32 dots run on the FMA units (no tensor cores), which hold a whole head-dim row of each
# operand per thread: every 32-64 wide tile with 4 warps spills (up to 7.6 KB at hd 128, and so does tf32x3), so
# fp32 uses 16 x 16 tiles (48-168 registers). 8 warps, except where ptxas spilled a few bytes with 8 and not with
# 4 (sm_80 hd 16 dQ, sm_90 hd 64 dK/dV and dQ). A parity path, not a fast one.
_FP32 = _C(16, 16, 8, 1)
_FP32_4_WARPS = {(80, 16, "bwd_dq"), (90, 64, "bwd_dkdv"), (90, 64, "bwd_dq")}


def gpu_dot_precision(dtype: str) -> str:
    """tl.dot input_precision the GPU kernels use for an input dtype (ignored by triton for 16-bit inputs)."""
    return "ieee" if dtype == "fp32" else "tf32"


# GPU targets besides a table's own that `uvic.kernels.aot` compiles the table's 16-bit Cog forward kernels for:
# the sm_80 table's GPUs that take the PTX sign step (`forward_sign_ptx`), RTX 30xx / A10 / A40 (sm_86) and
# RTX 40xx / L4 / L40 (sm_89). Compute capabilities as triton's GPUTarget takes them.
SIGN_PTX_TARGETS = {80: (86, 89)}


def forward_sign_ptx(capability: int, dtype: str) -> bool:
    """Whether the forward kernel applies Cog's sign with the PTX instruction `min.xorsign.abs` (one packed
    instruction per pair of scores) instead of a clamp (two): for 16-bit inputs on GPUs that have it and whose
    tiles are checked with it.

    `capability` is the GPU's compute capability as 10 * major + minor (86 for sm_86), not its tile table. The
    instruction needs sm_86 or newer (PTX ISA 7.2): A100 (sm_80) keeps the clamp. The PTX form runs on the sm_90
    table's GPUs (majors 9 and 10) and on the sm_80 table's sm_86, sm_87 and sm_89, where it compiles to one
    HMNMX2.XORSIGN per pair and spills nowhere the clamp does not (ptxas for sm_86 and sm_89, triton 3.8.0;
    `SIGN_PTX_TARGETS`). Majors 11 and 12 (sm_120: RTX 50xx) keep the clamp: the sm_80 table spills there in
    either form (46 of its 148 16-bit Cog forward kernels with the clamp, 42 with the PTX form, up to 108 bytes),
    and the PTX form spills in one where the clamp does not. float32 inputs keep the clamp (their P operand is
    fp32). "Zero scores and masked entries" in docs/kernel_math.md."""
    checked = 86 <= capability < 90 or capability // 10 in (9, 10)
    return checked and dtype in ("fp16", "bf16")


# Sliding-window / softcap kernels (WINDOW or SOFTCAP, "banded" below) keep a few more values per score (the band
# compares, the capped score and its tanh). Their variants of the plain candidates compile spill-free except in the
# cases below, which get a list of their own (ptxas -v, triton 3.8, window + softcap + key padding, Cog and softmax):
_BANDED_16 = {
    (80, 16, "bwd_dkdv"): [_C(32, 64, 4, 2)],  # (64, 64, 4, 2) spills 4 bytes (Cog)
    (80, 128, "bwd_dq"): [_C(64, 64, 8, 2)],  # (64, 32, 4, 2) spills 8-40 bytes
    (80, 256, "fwd"): [_C(32, 64, 8, 1)],  # (64, 64, 8, 1) spills 12 bytes (Cog); (64, 32, 8, 1|2) at 255 registers
    (90, 64, "fwd"): [_C(128, 64, 8, 3)],  # (128, 128, 8, 3) spills 16 bytes (Cog bf16)
    (90, 128, "bwd_dq"): [_C(128, 64, 8, 2)],  # (64, 64, 4, 2) spills 16-24 bytes
    (90, 256, "bwd_dq"): [_C(32, 64, 8, 1)],  # (64, 32, 8, 2) spills 20 bytes (softmax), (64, 32, 8, 1) 1 KB
}
_BANDED_FP32 = {  # the 16 x 16 tiles' warp count flips where ptxas spilled 4-24 bytes with the plain one
    (80, 64, "bwd_dq"): [_C(16, 16, 4, 1)],
    (80, 128, "bwd_dq"): [_C(16, 16, 4, 1)],
    (80, 256, "bwd_dq"): [_C(16, 16, 4, 1)],
    (80, 256, "fwd"): [_C(16, 32, 8, 1)],  # (16, 16, 8 | 4 warps, 1) spill 4 | 32 bytes
    (90, 32, "fwd"): [_C(16, 16, 4, 1)],
    (90, 32, "bwd_dkdv"): [_C(16, 16, 4, 1)],
}


# Head dims that are not powers of two (chunked, `head_dim_chunks`) take their table head dim's lists, except where
# ptxas spilled with them at some chunked head dim of that table (triton 3.8, fp16, Cog and softmax, plain and banded,
# searched at head dims 24 / 72, 96, 104, 120 / 136, 200, 232, 248). A list here serves plain and banded kernels
# both, unless _CHUNKED_BANDED_16 has one; _HEAD_DIM_16 holds single head dims.
_CHUNKED_16 = {
    (80, 32, "fwd"): [_C(64, 64, 4, 1)],  # (64, 64, 4, 2) spills 8 bytes at hd 24
    (80, 128, "fwd"): [_C(128, 32, 8, 2)],  # (64, 64, 4, 2) spills 4 bytes at hd 104
    # (32, 64, 8, 2) spills 8-724 bytes, (16, 128, 8, 1 | 2) 8-96 at hd 72-120; (16|32, 64, 4, 1) 12-700
    (80, 128, "bwd_dkdv"): [_C(16, 64, 8, 1)],
    # (64, 64, 8, 2) and (64, 32, 4, 2) spill 12-384 bytes at hd 72-104; (128, 32, 8, 2), (128, 64, 8, 1) too
    (80, 128, "bwd_dq"): [_C(64, 32, 8, 2), _C(32, 64, 4, 1)],
    (80, 256, "fwd"): [_C(32, 64, 8, 1)],  # (64, 64, 8, 1) spills 28 bytes at hd 200, 232; (64, 32, 8 | 4, 1) too
    (80, 256, "bwd_dkdv"): [_C(16, 32, 8, 1)],  # (32, 32, 8, 1) spills 8-32 bytes at hd 232 (softmax)
    (90, 128, "fwd"): [_C(128, 64, 8, 1), _C(128, 32, 8, 2)],  # (128, 64, 8, 2 | 3) spill 8-56 bytes at hd 120
    (90, 256, "bwd_dkdv"): [_C(16, 32, 8, 1)],  # (32, 32, 8, 1) spills 8-56 bytes at hd 232
    (90, 256, "bwd_dq"): [_C(32, 64, 8, 1)],  # (64, 32, 8, 2) spills 4 bytes at hd 232 (softmax), (64, 32, 8, 1) more
}
_CHUNKED_BANDED_16 = {
    (90, 256, "fwd"): [_C(32, 64, 8, 1)],  # (64, 32, 8, 1) spills 36 bytes at hd 232
}
_HEAD_DIM_16 = {  # (arch, head dim, kernel), plain and banded
    (80, 80, "bwd_dq"): [_C(64, 32, 8, 2), _C(32, 64, 4, 2)],  # (32, 64, 4, 1) spills 8 bytes at hd 80 (Cog, plain)
    # four chunks (128 + 64 + 32 + 16): (16, 32, 8, 1) spills 4 bytes (softmax, banded), (16, 32, 8, 2) 8,
    # (16, 16, 4, 1) 4 at hd 136
    (90, 232, "bwd_dkdv"): [_C(16, 16, 8, 1)],
    (90, 240, "bwd_dkdv"): [_C(16, 16, 8, 1)],
}

# fp32 at head dims that are not powers of two. ptxas fits the 16 x 16 FMA tiles into a register budget of its own
# choosing (64 or 80 registers with 8 warps, 128 or 168 with 4) and spills 4-48 bytes to stay in it at some head
# dims and not at the next: with their table head dim's fp32 tiles, 118 of the 702 fp32 kernels of head dims 8-248
# spilled (e.g. sm_80 hd 56 dK/dV, hd 96 dQ, hd 168 forward, hd 240 banded dQ). So each (arch, kernel, plain or
# banded) has the tile that compiled spill-free at most of those head dims, and by head dim another where that one
# spilled (triton 3.8, Cog and softmax; searched over 2-16 warps, 1-4 stages and 16-64 wide tiles, within SMEM_NEEDED).
# Two stages are no pipelining choice here: they move ptxas's budget. Sm_80 hd 248 banded dQ spilled with every
# tile of 2-8 warps (8-52 bytes; (16, 16, 4, 1) in softmax mode only): it takes 16 warps (84-90 registers, 96 KB).
_F4S1, _F4S2, _F8S1, _F8S2 = _C(16, 16, 4, 1), _C(16, 16, 4, 2), _C(16, 16, 8, 1), _C(16, 16, 8, 2)
_CHUNKED_FP32 = {  # (arch, kernel, banded) -> (tile, {head dim: tile where that one spills})
    (80, "fwd", False): (_F4S1, {56: _F4S2, 96: _F4S2, 232: _F4S2, 240: _F4S2}),
    (80, "fwd", True): (_F4S2, {104: _F4S1, 168: _F8S1}),
    (80, "bwd_dkdv", False): (_F8S2, {232: _F8S1}),
    (80, "bwd_dkdv", True): (_F8S2, {}),
    (80, "bwd_dq", False): (_F4S2, {24: _F8S1, 56: _F8S1, 96: _F4S1, 120: _F4S1}),
    (80, "bwd_dq", True): (_F4S2, {112: _F4S1, 248: _C(32, 16, 16, 1)}),
    (90, "fwd", False): (_F4S2, {}),
    (90, "fwd", True): (_F4S1, {}),
    (90, "bwd_dkdv", False): (_F8S2, {24: _F8S1}),
    (90, "bwd_dkdv", True): (_F8S2, {24: _F4S1}),
    (90, "bwd_dq", False): (_F4S2, {}),
    (90, "bwd_dq", True): (_F4S1, {}),
}


def candidate_configs(kernel: str, arch: int, dtype: str, head_dim: int, banded: bool = False) -> list[KernelConfig]:
    """Every config the autotuner may pick for one kernel on one architecture (sm_80 or sm_90).

    Args:
        kernel: one of `KERNELS`.
        arch: the candidate table, 80 or 90 (`config_arch` says which one a GPU gets; other values map to the
            nearest: < 90 -> 80, >= 90 -> 90).
        dtype: "fp16", "bf16" or "fp32".
        head_dim: a multiple of 8 up to 256 (`HEAD_DIMS`); one not in `TABLE_HEAD_DIMS` gets the candidates of
            `table_head_dim(head_dim)` where they compile spill-free, for fp32 the tiles of `_CHUNKED_FP32`.
        banded: for the sliding-window / softcap kernels (WINDOW or SOFTCAP), which have their own list where
            the plain candidates' banded variants spill.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    hd = table_head_dim(head_dim)
    arch = 90 if arch >= 90 else 80
    if kernel == "bwd_pre":
        return list(_PRE_FP32.get(head_dim, _PRE) if dtype == "fp32" else _PRE)
    if head_dim != hd and dtype == "fp32":  # chunked (or padded) fp32: tiles of its own, by head dim
        tile, by_head_dim = _CHUNKED_FP32[(arch, kernel, banded)]
        return [by_head_dim.get(head_dim, tile)]
    if head_dim != hd:  # chunked (or padded): its own lists where the table's spill
        own = _HEAD_DIM_16.get((arch, head_dim, kernel))
        if own is None and banded:
            own = _CHUNKED_BANDED_16.get((arch, hd, kernel))
        if own is None:
            own = _CHUNKED_16.get((arch, hd, kernel))
        if own is not None:
            return list(own)
    own = (_BANDED_FP32 if dtype == "fp32" else _BANDED_16).get((arch, hd, kernel)) if banded else None
    if own is not None:
        return list(own)
    if dtype == "fp32":
        return [_C(16, 16, 4, 1)] if (arch, hd, kernel) in _FP32_4_WARPS else [_FP32]
    table = {"fwd": _FWD_16, "bwd_dkdv": _DKDV_16, "bwd_dq": _DQ_16}[kernel]
    return list(table[(arch, hd)])


def config_arch(major: int, minor: int, smem_optin: int, is_hip: bool) -> tuple[int | None, str | None]:
    """Which candidate table (sm_80 or sm_90) a GPU may use, or why it may use none.

    The sm_90 tiles (checked by `uvic.kernels.aot` against SMEM_LIMIT[90]) need up to 128 KB of shared memory, so
    they go only to majors 9 and 10 (H100/H200, B200) that grant a block SMEM_LIMIT[90]. Other GPUs of compute
    capability 8.0 or newer (A100, RTX 30xx/40xx, RTX 50xx = sm_120) get the sm_80 tiles if they grant a block the
    SMEM_NEEDED[80] those tiles need. ROCm builds of torch report AMD GPUs as CUDA devices, but the kernels use
    NVIDIA-only settings (tf32 dot precision, tiles tuned with ptxas), so they are refused.
    The tables are spill-checked by `uvic.kernels.aot` for sm_80 and sm_90, and the sm_80 table's 16-bit Cog
    forwards also for sm_86 and sm_89 (`SIGN_PTX_TARGETS`), where four of them (hd 104 and 112, at 255 registers on
    sm_80) spill 16 bytes, with the PTX sign step and with the clamp alike (triton 3.8.0). Compiled for sm_120, 46
    of those 148 forwards spill 24-108 bytes with the clamp that sm_120 runs (`forward_sign_ptx`). The backward
    kernels were not compiled for those GPUs (with triton 3.9, a run over the whole table found four tiles spilling
    4-8 bytes on sm_86/87/89 and twelve 4-64 bytes on sm_120). Correct there, but not tuned for those GPUs.

    Args:
        major, minor: compute capability (`torch.cuda.get_device_capability`).
        smem_optin: bytes of shared memory a block may opt in to (`shared_memory_per_block_optin`).
        is_hip: torch is a ROCm build (`torch.version.hip` is set).
    Returns:
        (80 or 90, None), or (None, a short reason).
    """
    if is_hip:
        return None, "ROCm (HIP) GPUs are not supported: the kernel's tiles and dot precisions are for NVIDIA GPUs"
    name = f"sm_{major}{minor}"
    if major < 8:
        return None, f"the kernel needs compute capability 8.0 or newer (A100/H100 class); this GPU is {name}"
    kb = smem_optin // 1024
    if major in (9, 10):
        if smem_optin >= SMEM_LIMIT[90]:
            return 90, None
        return None, (f"{name} grants a block {kb} KB of shared memory; the sm_90 tiles are checked against "
                      f"{SMEM_LIMIT[90] // 1024} KB")  # fmt: skip
    if smem_optin >= SMEM_NEEDED[80]:
        return 80, None
    need = SMEM_NEEDED[80] // 1024
    return None, f"{name} grants a block {kb} KB of shared memory; the sm_80 tiles need up to {need} KB"


def all_configs(arch: int) -> dict[str, list[KernelConfig]]:
    """Union over dtypes, head dims and banded or not of the candidates of each kernel (the autotuner's config
    list, which its prune hook narrows to `candidate_configs` of each launch)."""
    out: dict[str, list[KernelConfig]] = {}
    for kernel in KERNELS:
        seen: list[KernelConfig] = []
        for dtype in DTYPES:
            for hd in HEAD_DIMS:
                for banded in (False, True):
                    for c in candidate_configs(kernel, arch, dtype, hd, banded):
                        if c not in seen:
                            seen.append(c)
        out[kernel] = seen
    return out
