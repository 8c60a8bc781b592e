"""Compile the attention kernels ahead of time for sm_80 / sm_90 (no GPU needed) and read their resource usage.

`triton.compile(ASTSource(...), target=GPUTarget("cuda", 80 | 90, 32))` builds PTX and a cubin on a CPU-only
machine ("Checking without a GPU: AOT compile and the SASS proxy" in docs/kernel_math.md). The ptxas shipped with
triton is then run with `-v` on that PTX, with the flags triton itself uses, to read registers and spill bytes;
shared memory is triton's `metadata.shared`.

Every config the autotuner may pick (`uvic.kernels.configs.candidate_configs`), for every dtype and head dim (every
multiple of 8 up to 256), is compiled with the mask variants that have the most code: causal + key padding mask
for the plain candidates, and sliding window + softcap + key padding mask for the banded ones (`banded=True`), in
Cog mode and in softmax mode: `all_specs()`, the full matrix that `make aot-full` checks. The sm_80 table's 16-bit
Cog forward kernels are also compiled for sm_86 and sm_89 (`configs.SIGN_PTX_TARGETS`), the GPUs of that table
that run them with the PTX sign step (`configs.forward_sign_ptx`). `make test` compiles `representative_specs()`,
a subset chosen by a rule that meets every kernel, head dim, arch, dtype and variant, and a few of those.

`--sass-mix` instead disassembles the cubins (`cuobjdump -sass`, also shipped with triton) of each kernel's first
candidate config in both modes and counts instructions by opcode class, over the whole kernel and over one
iteration of its main loop (the loop over key tiles, dK/dV: query tiles; `main_loop`), where the per-score work is
not diluted by the prologue and epilogue: a static stand-in for the GPU timing of Cog against the same kernel's
softmax mode, with the targets of `SASS_RATIO_TARGET` and `SASS_LOOP_RATIO_TARGET`.

    python -m uvic.kernels.aot --workers 2     # the full matrix (make aot-full); exit 1 on a spill or smem overflow
    python -m uvic.kernels.aot --arch 86 --arch 89 --workers 2     # its sm_86 / sm_89 part: PTX-sign forwards
    python -m uvic.kernels.aot --representative --workers 2     # the subset `make test` compiles
    python -m uvic.kernels.aot --arch 90 --dtype bf16 --head-dim 128 --workers 2
    python -m uvic.kernels.aot --sass-mix --workers 2     # sm_90, bf16 + fp16, hd 64, 72, 96, 128; exit 1 on a miss
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import logging
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from uvic.io import atomic_write  # the one home of atomic writes; this tool alone in uvic.kernels imports uvic
from uvic.kernels.configs import (
    ARCHS,
    DTYPES,
    HEAD_DIMS,
    KERNELS,
    SIGN_PTX_TARGETS,
    SMEM_NEEDED,
    KernelConfig,
    candidate_configs,
    forward_sign_ptx,
    gpu_dot_precision,
    stride_unit,
)


logger = logging.getLogger(__name__)

_PTR = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}


@dataclass(frozen=True)
class Spec:
    """One compile job: a kernel in one config of one tile table (`arch`), for one GPU target, dtype, head dim and
    mode."""

    kernel: str
    arch: int  # the tile table, 80 or 90, and the GPU target unless `target` names another
    dtype: str
    head_dim: int
    config: KernelConfig
    cog: bool = True
    causal: bool = True
    has_kpm: bool = True
    dot_prec: str | None = None  # None: what the launcher uses for this dtype on a GPU
    sign_ptx: bool | None = None  # forward only; None: what the launcher uses (`configs.forward_sign_ptx`)
    window: bool = False  # the sliding-window variant (WINDOW; the launcher then passes CAUSAL=False)
    softcap: bool = False  # the softcapped variant (SOFTCAP)
    target: int | None = None  # the GPU compiled for (compute capability, e.g. 86) where not the table's own

    @property
    def gpu(self) -> int:
        """The compute capability compiled for (triton's GPUTarget): `target`, else the table's own."""
        return self.arch if self.target is None else self.target

    @property
    def sign_step_ptx(self) -> bool:
        """The forward's SIGN_PTX constexpr: `sign_ptx`, else what the launcher passes on this GPU."""
        return forward_sign_ptx(self.gpu, self.dtype) if self.sign_ptx is None else self.sign_ptx


# The sm_80 table's forward kernels that spill when compiled for its other GPU targets, with the PTX sign step and
# with the clamp alike (ptxas -v, triton 3.8.0, Cog mode, plain and banded): (target, dtype, head dim, banded,
# config) -> spill store bytes. The table is spill-free on sm_80, where these tiles use all 255 registers; ptxas
# for sm_86 / sm_89 needs 16 bytes more. The full matrix fails on any other spill, or on more bytes than listed.
_C = KernelConfig
OTHER_TARGET_SPILLS: dict[tuple[int, str, int, bool, KernelConfig], int] = {
    (target, dtype, hd, False, _C(128, 32, 8, 2)): 16 for target in (86, 89) for dtype in ("fp16", "bf16")
    for hd in (104, 112)
}  # fmt: skip


@dataclass(frozen=True)
class Result:
    """ptxas / triton resource usage of one compiled kernel."""

    spec: Spec
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int  # dynamic shared memory in bytes (triton's metadata.shared)
    compile_s: float

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    @property
    def known_spill(self) -> bool:
        """A spill of `OTHER_TARGET_SPILLS`, no larger than listed there (another target than the table's own)."""
        s = self.spec
        known = OTHER_TARGET_SPILLS.get((s.gpu, s.dtype, s.head_dim, s.window or s.softcap, s.config))
        return self.spills and s.target is not None and known is not None and self.spill_stores <= known

    @property
    def smem_ok(self) -> bool:
        """Within the shared memory `configs.config_arch` assumes its table needs (at most the GPU's limit)."""
        return self.shared <= SMEM_NEEDED[self.spec.arch]


# Every GPU target the full matrix compiles for: the tables' own (ARCHS) and the other GPUs of a table that take
# the forward's PTX sign step (`configs.SIGN_PTX_TARGETS`).
TARGETS = (*ARCHS, *(t for ts in SIGN_PTX_TARGETS.values() for t in ts))


def table_of(gpu: int) -> int:
    """The tile table (an arch of ARCHS) that `all_specs` and `sass_specs` compile for a GPU target of TARGETS."""
    if gpu in ARCHS:
        return gpu
    return next(arch for arch, targets in SIGN_PTX_TARGETS.items() if gpu in targets)


def all_specs(
    archs=TARGETS, dtypes=DTYPES, head_dims=HEAD_DIMS, kernels=KERNELS, modes=(True, False)
) -> list[Spec]:  # fmt: skip
    """Every (kernel, arch, dtype, head dim, candidate config, mode) the autotuner can reach, for each GPU target
    of `archs`: every kernel of a table (80, 90) for its own arch; for another target (`SIGN_PTX_TARGETS`: 86, 89)
    the Cog forward kernels of its table for 16-bit inputs, the ones whose code differs there (the PTX sign
    step, `configs.forward_sign_ptx`)."""
    specs = []
    for gpu in archs:
        if gpu not in ARCHS:
            specs += [replace(s, target=gpu) for s in all_specs((table_of(gpu),), [d for d in dtypes if d != "fp32"],
                                                                head_dims, [k for k in kernels if k == "fwd"],
                                                                [m for m in modes if m])]  # fmt: skip
            continue
        arch = gpu
        for dtype in dtypes:
            for hd in head_dims:
                for kernel in kernels:
                    for c in candidate_configs(kernel, arch, dtype, hd):
                        if kernel == "bwd_pre":  # has no mode or mask switches
                            specs.append(Spec(kernel, arch, dtype, hd, c, cog=False, causal=False, has_kpm=False))
                            continue
                        specs += [Spec(kernel, arch, dtype, hd, c, cog=cog) for cog in modes]
                    if kernel == "bwd_pre":
                        continue
                    for c in candidate_configs(kernel, arch, dtype, hd, banded=True):  # banded: their own list
                        specs += [Spec(kernel, arch, dtype, hd, c, cog=cog, causal=False, window=True, softcap=True)
                                  for cog in modes]  # fmt: skip
    return specs


# The (mode, banded) variants `representative_specs` rotates through: Cog / softmax, plain (causal + key padding)
# / banded (window + softcap + key padding).
_VARIANTS = ((True, False), (False, True), (True, True), (False, False))


# The forward specs `representative_specs` compiles for each other GPU target of a table (`SIGN_PTX_TARGETS`, in
# that order): (head dim, dtype, banded) with the table's first candidate, in Cog mode (the PTX sign step).
_TARGET_SPECS = (((64, "bf16", False), (128, "fp16", True)),  # sm_86
                 ((72, "fp16", False), (256, "bf16", True)))  # sm_89  # fmt: skip


def representative_specs() -> list[Spec]:
    """The subset of `all_specs()` that `make test` compiles (`make aot-full` compiles all of it): for the i-th
    head dim of `HEAD_DIMS` and the j-th kernel of `KERNELS`, one spec, the kernel's first candidate on arch
    `ARCHS[(i + j) % 2]` and dtype `DTYPES[(i + j) % 3]`, in the variant (Cog or softmax, plain or banded)
    `_VARIANTS[i % 4]` (bwd_pre has one). So every kernel compiles at every head dim, on every (arch, dtype) pair
    and in every variant somewhere (tests/kernels/test_triton_compile.py checks this), with one spec per (head
    dim, kernel) instead of every candidate, arch, dtype and variant. Then, for each other GPU target of a table
    (`SIGN_PTX_TARGETS`: sm_86, sm_89), the two Cog forward specs of `_TARGET_SPECS`, plain and banded,
    bf16 and fp16, with the PTX sign step."""
    specs = []
    for i, hd in enumerate(HEAD_DIMS):
        for j, kernel in enumerate(KERNELS):
            arch, dtype = ARCHS[(i + j) % len(ARCHS)], DTYPES[(i + j) % len(DTYPES)]
            if kernel == "bwd_pre":
                c = candidate_configs(kernel, arch, dtype, hd)[0]
                specs.append(Spec(kernel, arch, dtype, hd, c, cog=False, causal=False, has_kpm=False))
                continue
            cog, banded = _VARIANTS[i % len(_VARIANTS)]
            c = candidate_configs(kernel, arch, dtype, hd, banded=banded)[0]
            specs.append(Spec(kernel, arch, dtype, hd, c, cog=cog, causal=not banded, window=banded, softcap=banded))
    targets = [(arch, t) for arch, ts in SIGN_PTX_TARGETS.items() for t in ts]
    for (arch, target), chosen in zip(targets, _TARGET_SPECS, strict=True):
        for hd, dtype, banded in chosen:
            c = candidate_configs("fwd", arch, dtype, hd, banded=banded)[0]
            specs.append(Spec("fwd", arch, dtype, hd, c, causal=not banded, window=banded, softcap=banded,
                              target=target))  # fmt: skip
    return specs


def _signature(spec: Spec, arg_names: list[str]) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as the JIT would specialise a launch on contiguous, 16-byte aligned tensors."""
    ptr = _PTR[spec.dtype]
    consts = {"HEAD_DIM": spec.head_dim, "BLOCK_M": spec.config.block_m, "BLOCK_N": spec.config.block_n}
    if spec.kernel != "bwd_pre":
        consts.update(CAUSAL=spec.causal, HAS_KPM=spec.has_kpm, COG=spec.cog,
                      DOT_PREC=spec.dot_prec or gpu_dot_precision(spec.dtype), WINDOW=spec.window,
                      SOFTCAP=spec.softcap)  # fmt: skip
    if spec.kernel == "fwd":
        consts["SIGN_PTX"] = spec.sign_step_ptx
    # The (batch, head, row) strides of contiguous q, k, v as the launcher passes them: divided by STRIDE_UNIT
    # (`configs.stride_unit`), with the divisibility by 16 the JIT would see at an odd length (257 rows, 3 heads).
    bhm = dict(zip("bhm", (3 * 257 * spec.head_dim, 257 * spec.head_dim, spec.head_dim)))
    unit = stride_unit(bhm.values())
    if spec.kernel != "bwd_pre":
        consts["STRIDE_UNIT"] = unit
    sig, attrs = {}, {}
    for i, name in enumerate(arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name.startswith("stride_") and name.endswith("d"):  # last-dim strides of contiguous inputs are 1
            sig[name] = "constexpr"
            consts[name] = 1
        elif name in ("LSE", "DELTA"):
            sig[name], attrs[(i,)] = "*fp32", [["tt.divisibility", 16]]
        elif name == "KPM":
            sig[name], attrs[(i,)] = "*i8", [["tt.divisibility", 16]]
        elif name in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV"):  # tensors in the input dtype
            sig[name], attrs[(i,)] = ptr, [["tt.divisibility", 16]]
        elif name in ("sm_scale", "softcap"):
            sig[name] = "fp32"
        elif name.startswith("stride_") and name != "stride_kpmb":  # (b, h, m|n) strides of (B, nh, L, hd)
            sig[name] = "i32"
            if bhm["m" if name[-1] == "n" else name[-1]] // unit % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "L_BUCKET":
            sig[name], attrs[(i,)] = "i32", [["tt.divisibility", 16]]
        else:  # NH, LQ, LK, stride_kpmb, WIN_LO, WIN_HI: any value
            sig[name] = "i32"
    return sig, consts, attrs


_USAGE_RE = (re.compile(r"Used (\d+) registers"), re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads"))


_PTXAS_FLAGS = ("-lineinfo", "-v", "--regAllocOptLevel=2")  # what triton's make_cubin passes (triton 3.8)


def _parse_ptxas_log(log: str) -> tuple[int, int, int] | None:
    regs, spill = (r.search(log) for r in _USAGE_RE)
    if regs is None or spill is None:
        return None
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2))


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from `ptxas -v` with triton's own flags.

    Memoised on disk next to triton's cache, keyed by the PTX text, the ptxas binary and the flags: ptxas is
    deterministic, so this only saves re-running it when triton's cache hands back an already compiled kernel.
    """
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    tool = get_ptxas(arch)
    memo = _memo_path(ptx, arch)
    if memo.is_file():
        return tuple(json.loads(memo.read_text()))

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [tool.path, *_PTXAS_FLAGS, f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o",
               str(Path(tmp) / "k.o")]  # fmt: skip
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    usage = _parse_ptxas_log(log)
    if usage is None:
        raise RuntimeError(f"could not parse ptxas -v output:\n{log}")
    _write_memo(memo, usage)
    return usage


def _memo_path(ptx: str, arch: int) -> Path:
    """Where the ptxas -v result of this PTX is kept (next to triton's cache), keyed by PTX, ptxas and flags."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(arch)
    key = hashlib.sha256(f"{tool.path}|{_PTXAS_FLAGS}|{arch}|{ptx}".encode()).hexdigest()
    return Path(triton.knobs.cache.dir) / "uvic_ptxas_usage" / f"{key}.json"


def _write_memo(memo: Path, usage: tuple[int, int, int]) -> None:
    memo.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(memo, "w") as f:  # parallel workers may write the same memo: each replaces it whole
        json.dump(usage, f)


def _compile(spec: Spec, log: io.StringIO | None = None):
    """triton.compile of one spec for its GPU target (stdout, where triton prints ptxas logs, goes to `log`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from uvic.kernels.attention import KERNEL_FNS

    fn = KERNEL_FNS[spec.kernel]
    sig, consts, attrs = _signature(spec, fn.arg_names)
    with contextlib.redirect_stdout(log or io.StringIO()):
        return triton.compile(
            ASTSource(fn, signature=sig, constexprs=consts, attrs=attrs),
            target=GPUTarget("cuda", spec.gpu, 32),
            options={"num_warps": spec.config.num_warps, "num_stages": spec.config.num_stages},
        )


def compile_spec(spec: Spec) -> Result:
    """Compile one spec with triton for its GPU target and read ptxas -v's register and spill counts.

    On a fresh compile the counts come from the ptxas run triton does itself (TRITON_DUMP_PTXAS_LOG, set by the
    worker); when triton's cache already holds the kernel, ptxas -v is run again on the cached PTX.
    """
    t0 = time.perf_counter()
    log = io.StringIO()
    compiled = _compile(spec, log)
    usage = _parse_ptxas_log(log.getvalue())
    if usage is None:  # cache hit: triton did not run ptxas
        usage = _ptxas_usage(compiled.asm["ptx"], spec.gpu)
    else:
        _memo_path(compiled.asm["ptx"], spec.gpu).parent.mkdir(parents=True, exist_ok=True)
        _write_memo(_memo_path(compiled.asm["ptx"], spec.gpu), usage)
    return Result(spec, *usage, int(compiled.metadata.shared), time.perf_counter() - t0)


def _worker_init() -> None:
    # The kernels must be real @triton.jit functions, not the interpreter's (a test session may have set
    # TRITON_INTERPRET=1); triton reads the variable when `uvic.kernels.attention` is first imported, which in a
    # freshly spawned worker happens after this.
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # triton prints ptxas -v's log when it compiles (cache misses)


def compile_all(specs: list[Spec], workers: int = 1) -> list[Result]:
    """Compile many specs in `workers` freshly spawned processes (each compile is single-threaded)."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=ctx, initializer=_worker_init) as pool:
        return list(pool.map(compile_spec, specs, chunksize=2))


# ---------------------------------------------------------------------------------------------------------
# SASS instruction mix: Cog mode against softmax mode (a static stand-in for GPU timings)
# ---------------------------------------------------------------------------------------------------------

# Opcode classes of the SASS mix report, by base opcode (the name before any ".MODIFIER"). Everything else
# (loads/stores, conversions such as F2FP, barriers, branches, moves, NOPs) counts only in the total.
SASS_CLASSES: dict[str, frozenset[str]] = {
    "fp32": frozenset({"FADD", "FMUL", "FFMA", "FMNMX", "FADD32I", "FMUL32I", "FFMA32I", "FCHK", "FSWZADD"}),
    "int": frozenset({"IADD3", "IADD", "IADD32I", "VIADD", "IMAD", "IMUL", "LOP3", "LOP", "LOP32I", "SHF", "SHL",
                      "SHR", "LEA", "IMNMX", "VIMNMX", "IABS", "POPC", "FLO", "PRMT", "BMSK", "SGXT", "ISCADD"}),
    "half2": frozenset({"HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2", "HSET2"}),  # packed 16-bit pairs
    "mufu": frozenset({"MUFU"}),
    "mma": frozenset({"HGMMA", "HMMA", "IMMA", "BMMA", "DMMA", "WGMMA", "QGMMA"}),
    "sel/cmp": frozenset({"FSETP", "FSET", "FSEL", "ISETP", "ISET", "SEL", "PLOP3", "PSETP"}),
}
SASS_COLUMNS = ("total", *SASS_CLASSES)
# The targets: whole-kernel instruction count of Cog over softmax mode, per kernel; MUFU and MMA equal.
SASS_RATIO_TARGET = {"fwd": 1.05, "bwd_dkdv": 1.10, "bwd_dq": 1.10}
SASS_EQUAL_CLASSES = ("mufu", "mma")
# The same ratio over one iteration of the main loop (`main_loop`), where the per-score work is not diluted by the
# prologue and epilogue. These are not goals but the measured state with a small margin, so that a change that
# makes Cog's loop longer shows (triton 3.8.0, sm_90, bf16 and fp16, first candidate; hd 64, 72, 96, 128 plain or
# causal; hd 64, 128 with a window, softcap, both, key padding): forward 1.073-1.089, 1.093 with a window (one
# instruction per score: the sign step); dK/dV 1.052-1.284 and dQ 1.296-1.382, the highest with a window (three per
# score: `_signed`'s bit-select, compare and select; "Checking without a GPU: AOT compile and the SASS proxy" in
# docs/kernel_math.md).
SASS_LOOP_RATIO_TARGET = {"fwd": 1.10, "bwd_dkdv": 1.30, "bwd_dq": 1.40}

# One instruction line of `cuobjdump -sass`: address, optional predicate, opcode, modifiers, operands.
_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Za-z0-9_]+)*)"
                        r"([^;]*)")  # fmt: skip
_SASS_LABEL = re.compile(r"^\s*(\.L[\w.]+):")  # a label line (nvdisasm style), naming the next instruction
# BRA's operands: an optional uniform predicate (sm_120: `BRA.U !UP0, 0x1150`), then an address or a label
_BRANCH_TARGET = re.compile(r"^\s*(?:!?U?P[T0-9]+\s*,\s*)?(?:0x([0-9a-f]+)|`?\(?(\.L[\w.]+)\)?)")


def _class_counts(opcodes: dict[str, int]) -> dict[str, int]:
    """{"total", "fp32", "int", "half2", "mufu", "mma", "sel/cmp"} -> number of instructions, from base opcodes."""
    out = {"total": sum(opcodes.values())}
    for name, ops in SASS_CLASSES.items():
        out[name] = sum(n for op, n in opcodes.items() if op in ops)
    return out


@dataclass(frozen=True)
class SassLoop:
    """One loop of a kernel's machine code: the instructions from the target of a backward branch (the loop head)
    to that branch, each counted once (static: code that a forward branch inside the body skips counts too)."""

    start: int  # address of the loop head
    end: int  # address of the backward branch (the farthest one, when several branch back to the same head)
    opcodes: dict[str, int]  # base opcode -> count
    variants: dict[str, int]  # full mnemonic with modifiers -> count

    def counts(self) -> dict[str, int]:
        return _class_counts(self.opcodes)


@dataclass(frozen=True)
class SassMix:
    """Opcode counts of one compiled kernel (base opcode -> count), read from `cuobjdump -sass` of its cubin, and
    of the loops that hold its MMA instructions (`loops`, in address order; `loop` is the main one)."""

    spec: Spec
    opcodes: dict[str, int]
    variants: dict[str, int] = field(default_factory=dict)  # full mnemonic with modifiers -> count
    loops: tuple[SassLoop, ...] = ()
    loop_index: int | None = None  # which of `loops` is the main one; None: `main_loop` decides (`sass_pairs`)

    def counts(self) -> dict[str, int]:
        """{"total", "fp32", "int", "half2", "mufu", "mma", "sel/cmp"} -> number of instructions."""
        return _class_counts(self.opcodes)

    @property
    def loop(self) -> SassLoop | None:
        """The main loop: `loops[loop_index]`, or `main_loop(loops)`; None if no loop holds an MMA."""
        return self.loops[self.loop_index] if self.loop_index is not None else main_loop(self.loops)

    def loop_counts(self) -> dict[str, int]:
        """`counts()` of one iteration of the main loop (all zero without one)."""
        return self.loop.counts() if self.loop else _class_counts({})


def _sass_instructions(text: str) -> list[tuple[int, str, str, str]]:
    """(address, base opcode, full mnemonic, operands) of each instruction of `cuobjdump -sass` output, in order;
    label operands (`.L_x_3`, as nvdisasm writes them) are replaced by the address they name."""
    rows, labels, pending = [], {}, []
    for line in text.splitlines():
        label = _SASS_LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _SASS_LINE.match(line)
        if m:
            addr = int(m.group(1), 16)
            labels.update(dict.fromkeys(pending, addr))
            pending = []
            rows.append((addr, m.group(2), m.group(2) + m.group(3), m.group(4)))
    out = []
    for addr, op, name, operands in rows:
        t = _BRANCH_TARGET.match(operands)
        if op == "BRA" and t and t.group(2) in labels:
            operands = f" {labels[t.group(2)]:#x}"
        out.append((addr, op, name, operands))
    return out


def parse_sass(text: str, modifiers: bool = False) -> dict[str, int]:
    """Opcode counts of `cuobjdump -sass` output: by base opcode (predicates and modifiers stripped), or with
    `modifiers` by full mnemonic (e.g. "HMNMX2.BF16_V2.XORSIGN")."""
    counts: dict[str, int] = {}
    for _, op, name, _ in _sass_instructions(text):
        key = name if modifiers else op
        counts[key] = counts.get(key, 0) + 1
    return counts


def sass_loops(text: str) -> list[SassLoop]:
    """The loops of `cuobjdump -sass` output, by loop head address: each BRA whose target lies before it (a
    self-branch, the trap after EXIT, is no loop) closes the loop from that target to itself; branches back to the
    same head make one loop, up to the farthest. Nested loops each appear, the outer one holding the inner's
    instructions."""
    insts = _sass_instructions(text)
    ends: dict[int, int] = {}
    for addr, op, _, operands in insts:
        t = _BRANCH_TARGET.match(operands)
        if op == "BRA" and t and t.group(1) and int(t.group(1), 16) < addr:
            head = int(t.group(1), 16)
            ends[head] = max(ends.get(head, addr), addr)
    loops = []
    for head in sorted(ends):
        body = [(op, name) for addr, op, name, _ in insts if head <= addr <= ends[head]]
        loops.append(SassLoop(head, ends[head], dict(Counter(op for op, _ in body)),
                              dict(Counter(name for _, name in body))))  # fmt: skip
    return loops


def main_loop(loops) -> SassLoop | None:
    """The loop whose per-iteration cost matters: of the loops holding the most MMA instructions, the one with the
    fewest instructions. A kernel's key (or query) loop comes as an unmasked body and masked ones (the causal
    diagonal, the ragged end, a window's edges), each with the whole tile's MMAs; the masked ones run a few
    iterations per program, the unmasked one the rest. In softmax mode masking adds a select per score, so the
    unmasked body is the shortest; Cog's backward takes its masks from zero rows, so a masked body can be as short
    there, and `sass_pairs` gives a Cog kernel the loop at the place its softmax mode's main loop has. An outer loop
    around an inner one that holds all the MMAs has as many MMAs and more instructions, so the inner one is chosen.
    Loops without an MMA (a wait on a barrier) are never chosen; None if no loop has an MMA."""
    with_mma = [lp for lp in loops if lp.counts()["mma"] > 0]
    if not with_mma:
        return None
    return min(with_mma, key=lambda lp: (-lp.counts()["mma"], lp.counts()["total"]))


def disassemble(cubin: bytes) -> str:
    """`cuobjdump -sass` of a cubin, with the cuobjdump shipped in the triton wheel."""
    import triton

    tool = triton.knobs.nvidia.cuobjdump.path
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([tool, "-sass", str(path)], check=True, capture_output=True, text=True).stdout


def sass_mix(spec: Spec) -> SassMix:
    """Compile one spec for its GPU target and count the opcodes of its machine code."""
    text = disassemble(_compile(spec).asm["cubin"])
    loops = tuple(lp for lp in sass_loops(text) if lp.counts()["mma"] > 0)
    return SassMix(spec, parse_sass(text), parse_sass(text, modifiers=True), loops)


# The head dims `--sass-mix` reports by default: the two most used powers of two and the two most used chunked head
# dims (U-ViT-H, DiT-XL: 72 = 64 + 16 with 8 padding columns; Phi-3: 96 = 64 + 32).
SASS_HEAD_DIMS = (64, 72, 96, 128)


def sass_specs(archs=(90,), dtypes=("bf16", "fp16"), head_dims=SASS_HEAD_DIMS, kernels=tuple(SASS_RATIO_TARGET),
               causal: bool = False, has_kpm: bool = False, sign_ptx: bool | None = None, window: bool = False,
               softcap: bool = False) -> list[Spec]:  # fmt: skip
    """(Cog, softmax) spec pairs, flattened, for the config each kernel's candidate list (the banded list with a
    window or softcap) ranks first. `archs`: GPU targets of TARGETS, each with its table's configs (`table_of`).
    `sign_ptx` (forward only): False compiles the clamp form of the sign step where the launcher would use the PTX
    form."""
    specs = []
    for gpu in archs:
        arch, target = table_of(gpu), None if gpu in ARCHS else gpu
        for dtype in dtypes:
            for hd in head_dims:
                for kernel in kernels:
                    c = candidate_configs(kernel, arch, dtype, hd, banded=window or softcap)[0]
                    for cog in (True, False):
                        specs.append(Spec(kernel, arch, dtype, hd, c, cog=cog, causal=causal and not window,
                                          has_kpm=has_kpm, sign_ptx=sign_ptx if kernel == "fwd" else None,
                                          window=window, softcap=softcap, target=target))  # fmt: skip
    return specs


def sass_mix_all(specs: list[Spec], workers: int = 1) -> list[SassMix]:
    """`sass_mix` of many specs in `workers` freshly spawned processes."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, workers), mp_context=ctx, initializer=_worker_init) as pool:
        return list(pool.map(sass_mix, specs, chunksize=1))


def sass_pairs(mixes: list[SassMix]) -> list[tuple[SassMix, SassMix]]:
    """Pair each Cog-mode kernel with the softmax-mode kernel of the same spec otherwise. Where both have as many
    MMA loops, the Cog kernel's main loop is the one at the place of the softmax kernel's (`main_loop`), so that
    the loops compared are the same loop of the source."""
    by_key = {(m.spec.kernel, m.spec.arch, m.spec.target, m.spec.dtype, m.spec.head_dim, m.spec.config, m.spec.causal,
               m.spec.has_kpm, m.spec.window, m.spec.softcap, m.spec.cog): m for m in mixes}  # fmt: skip
    pairs = []
    for k, cog in by_key.items():
        soft = by_key.get(k[:-1] + (False,))
        if not k[-1] or soft is None:
            continue
        if soft.loop is not None and len(cog.loops) == len(soft.loops):
            cog = replace(cog, loop_index=soft.loops.index(soft.loop))
        pairs.append((cog, soft))
    return pairs


def sass_target_failures(pairs: list[tuple[SassMix, SassMix]]) -> list[str]:
    """One line per pair that misses a target: the ratio of totals, of the whole kernel and of the main loop; MUFU
    and MMA counts equal, in the whole kernel and in the loop; the main loop found in both modes, at the same place
    among as many MMA loops (so that the loops compared are the same loop of the source)."""
    bad = []
    for cog, soft in pairs:
        s, c, n = cog.spec, cog.counts(), soft.counts()
        where = f"sm_{s.gpu} {s.dtype} hd {s.head_dim} {s.kernel} {s.config}"
        limit = SASS_RATIO_TARGET.get(s.kernel)
        if limit is not None and c["total"] > limit * n["total"]:
            bad.append(f"{where}: cog/softmax = {c['total']}/{n['total']} = {c['total'] / n['total']:.3f} > {limit}")
        for cls in SASS_EQUAL_CLASSES:
            if c[cls] != n[cls]:
                bad.append(f"{where}: {cls} cog {c[cls]} != softmax {n[cls]}")
        if cog.loop is None or soft.loop is None:
            bad.append(f"{where}: no loop with an MMA found (cog: {cog.loop is not None}, softmax: "
                       f"{soft.loop is not None})")  # fmt: skip
            continue
        if cog.loops.index(cog.loop) != soft.loops.index(soft.loop) or len(cog.loops) != len(soft.loops):
            bad.append(f"{where}: main loop is MMA loop {cog.loops.index(cog.loop)} of {len(cog.loops)} in Cog mode, "
                       f"{soft.loops.index(soft.loop)} of {len(soft.loops)} in softmax mode")  # fmt: skip
        lc, ln = cog.loop_counts(), soft.loop_counts()
        limit = SASS_LOOP_RATIO_TARGET.get(s.kernel)
        if limit is not None and lc["total"] > limit * ln["total"]:
            bad.append(f"{where}: main loop cog/softmax = {lc['total']}/{ln['total']} = "
                       f"{lc['total'] / ln['total']:.3f} > {limit}")  # fmt: skip
        for cls in SASS_EQUAL_CLASSES:
            if lc[cls] != ln[cls]:
                bad.append(f"{where}: main loop {cls} cog {lc[cls]} != softmax {ln[cls]}")
    return bad


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.3f}" if b else "-"


def format_sass_mix(pairs: list[tuple[SassMix, SassMix]], loop: bool = False) -> str:
    """A fixed-width table: per kernel, 'cog/softmax' counts of each opcode class and the ratio of totals, of the
    whole kernel beside the ratio of the main loop's totals; with `loop`, the class counts of one iteration of the
    main loop (`main_loop`) instead, with its place among the kernel's MMA loops ('1/2': the first of two)."""
    targets = SASS_LOOP_RATIO_TARGET if loop else SASS_RATIO_TARGET
    head = f"{'arch':<7}{'dtype':<6}{'hd':>4} {'kernel':<9}{'config':<20}"
    tail = f"{'loop':>6}{'ratio':>7}{'target':>8}" if loop else f"{'ratio':>7}{'target':>8}{'loop':>7}{'target':>8}"
    lines = [head + "".join(f"{c:>12}" for c in SASS_COLUMNS) + tail]
    for cog, soft in pairs:
        s = cog.spec
        c, n = (cog.loop_counts(), soft.loop_counts()) if loop else (cog.counts(), soft.counts())
        cells = "".join(f"{f'{c[k]}/{n[k]}':>12}" for k in SASS_COLUMNS)
        target = targets.get(s.kernel)
        row = f"{f'sm_{s.gpu}':<7}{s.dtype:<6}{s.head_dim:>4} {s.kernel:<9}{str(s.config):<20}{cells}"
        if loop:
            where = f"{cog.loops.index(cog.loop) + 1}/{len(cog.loops)}" if cog.loop else "-"
            row += f"{where:>6}{_ratio(c['total'], n['total']):>7}{f'<={target}' if target else '':>8}"
        else:
            lc, ln = cog.loop_counts(), soft.loop_counts()
            ltarget = SASS_LOOP_RATIO_TARGET.get(s.kernel)
            row += (f"{_ratio(c['total'], n['total']):>7}{f'<={target}' if target else '':>8}"
                    f"{_ratio(lc['total'], ln['total']):>7}{f'<={ltarget}' if ltarget else '':>8}")  # fmt: skip
        lines.append(row)
    return "\n".join(lines)


def format_report(results: list[Result]) -> str:
    """A fixed-width table: one line per compiled kernel, flagged when it spills or exceeds shared memory."""
    lines = [f"{'arch':<7}{'dtype':<6}{'hd':>4} {'kernel':<9}{'mode':<17}{'config':<20}{'regs':>5}"
             f"{'spill st/ld':>13}{'smem KB':>9}{'limit':>7}  flag"]  # fmt: skip
    for r in results:
        s = r.spec
        mode = "-" if s.kernel == "bwd_pre" else ("cog" if s.cog else "softmax") + ("+win+cap" if s.window else "")
        if s.kernel == "fwd" and s.cog:  # the form of the sign step
            mode += "/ptx" if s.sign_step_ptx else "/clamp"
        flag = "spill (known) " if r.known_spill else "SPILL " if r.spills else ""
        flag += "" if r.smem_ok else "SMEM"
        lines.append(
            f"{f'sm_{s.gpu}':<7}{s.dtype:<6}{s.head_dim:>4} {s.kernel:<9}{mode:<17}{str(s.config):<20}{r.registers:>5}"
            f"{f'{r.spill_stores}/{r.spill_loads}':>13}{r.shared / 1024:>9.1f}{SMEM_NEEDED[s.arch] // 1024:>7}  {flag}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, choices=TARGETS, action="append",
                        help="GPU target, default: all; 86 and 89 compile the sm_80 table's 16-bit Cog forward "
                             "kernels (with --sass-mix: every kernel of that table)")  # fmt: skip
    parser.add_argument("--dtype", choices=DTYPES, action="append", help="default: all")
    parser.add_argument("--head-dim", type=int, choices=HEAD_DIMS, action="append", help="default: all")
    parser.add_argument("--kernel", choices=KERNELS, action="append", help="default: all")
    parser.add_argument("--cog-only", action="store_true", help="skip the softmax mode")
    parser.add_argument("--representative", action="store_true",
                        help="compile the subset `make test` compiles (representative_specs) instead of the full "
                             "matrix")  # fmt: skip
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--sass-mix", action="store_true",
                        help="instead: SASS opcode mix, Cog vs softmax mode, of each kernel's first candidate "
                             "(default sm_90, bf16 and fp16, head dims 64, 72, 96 and 128); exit code 1 if a target "
                             "is missed")  # fmt: skip
    parser.add_argument("--causal", action="store_true", help="--sass-mix: compile the causal variant")
    parser.add_argument("--key-padding-mask", action="store_true", help="--sass-mix: compile with a key padding mask")
    parser.add_argument("--window", action="store_true", help="--sass-mix: compile the sliding-window variant")
    parser.add_argument("--softcap", action="store_true", help="--sass-mix: compile the softcapped variant")
    parser.add_argument("--sign-clamp", action="store_true",
                        help="--sass-mix: compile the forward's sign step as the clamp (what the sm_80 table runs) "
                             "instead of min.xorsign.abs")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.sass_mix:
        return _main_sass_mix(args)
    specs = all_specs(
        archs=args.arch or TARGETS,
        dtypes=args.dtype or DTYPES,
        head_dims=args.head_dim or HEAD_DIMS,
        kernels=args.kernel or KERNELS,
        modes=(True,) if args.cog_only else (True, False),
    )
    if args.representative:
        wanted = set(specs)
        specs = [s for s in representative_specs() if s in wanted]
    t0 = time.perf_counter()
    results = compile_all(specs, workers=args.workers)
    logger.info(format_report(results))
    bad = [r for r in results if (r.spills and not r.known_spill) or not r.smem_ok]
    import triton

    logger.info("%d kernels compiled by triton %s in %.0f s; %d spill or exceed shared memory; %d known spills on "
                "other targets (OTHER_TARGET_SPILLS)", len(results), triton.__version__, time.perf_counter() - t0,
                len(bad), sum(r.known_spill for r in results))  # fmt: skip
    if args.json:
        with atomic_write(args.json, "w") as f:
            json.dump([{**asdict(r), "config": str(r.spec.config)} for r in results], f, indent=1)
    return 1 if bad else 0


def _main_sass_mix(args: argparse.Namespace) -> int:
    kernels = [k for k in (args.kernel or SASS_RATIO_TARGET) if k != "bwd_pre"]
    specs = sass_specs(archs=args.arch or (90,), dtypes=args.dtype or ("bf16", "fp16"),
                       head_dims=args.head_dim or SASS_HEAD_DIMS, kernels=kernels, causal=args.causal,
                       has_kpm=args.key_padding_mask, sign_ptx=False if args.sign_clamp else None,
                       window=args.window, softcap=args.softcap)  # fmt: skip
    mixes = sass_mix_all(specs, workers=args.workers)
    pairs = sass_pairs(mixes)
    logger.info("SASS instruction counts, cog/softmax (causal=%s, key_padding_mask=%s, window=%s, softcap=%s, "
                "forward sign step: %s), whole kernel (ratio) and its main loop (loop):\n%s\n"
                "One iteration of the main loop (the shortest loop with the most MMAs, `main_loop`):\n%s",
                args.causal, args.key_padding_mask, args.window, args.softcap,
                "clamp" if args.sign_clamp else "as launched", format_sass_mix(pairs),
                format_sass_mix(pairs, loop=True))  # fmt: skip
    bad = sass_target_failures(pairs)
    logger.info("targets: total cog/softmax <= %s, main loop <= %s, %s counts equal; %d misses%s", SASS_RATIO_TARGET,
                SASS_LOOP_RATIO_TARGET, "/".join(SASS_EQUAL_CLASSES), len(bad),
                "".join("\n  " + b for b in bad))  # fmt: skip
    if args.json:
        with atomic_write(args.json, "w") as f:
            json.dump([{**asdict(m.spec), "config": str(m.spec.config), "counts": m.counts(), "opcodes": m.opcodes,
                        "loop_counts": m.loop_counts(), "loop_opcodes": m.loop.opcodes if m.loop else {}}
                       for m in mixes], f, indent=1)  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
