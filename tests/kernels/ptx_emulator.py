"""An emulator of the one PTX instruction the kernels reach through inline assembly, for TRITON_INTERPRET=1 runs.

The forward kernel applies Cog's sign on sm_86 and newer with `min.xorsign.abs.{bf16x2,f16x2}`
(`_min_xorsign_abs` in kernels/attention.py); the triton interpreter cannot run PTX. `install` replaces the
interpreter's `create_inline_asm` with a reader of exactly that instruction: it checks the PTX text, the
constraints, the packing and the operand types a GPU compile gets, and computes the result as the PTX ISA defines
`min` with `.xorsign.abs` (PTX ISA 7.2, sm_86+):

    d = min(|a|, |b|), and the sign bit of d is the XOR of the sign bits of a and b.
    Without `.NaN`, a NaN operand yields the other one; two NaNs give the canonical NaN (0x7fff).

It works on the raw 16-bit patterns (for finite and infinite values, |x| orders as x's low 15 bits do), so it does
not depend on the interpreter's bf16 arithmetic. Any other inline assembly, and the one-NaN case (whose sign rule
the kernels never need: q.k is NaN exactly when w is), raise instead of guessing.
"""

from __future__ import annotations

import re

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


_PTX = re.compile(r"^\s*min\.xorsign\.abs\.(bf16x2|f16x2) \$0, \$1, \$2;\s*$")
_TYPES = {"bf16x2": tl.bfloat16, "f16x2": tl.float16}
_SIGN, _MAG, _CANONICAL_NAN = np.uint16(0x8000), np.uint16(0x7FFF), np.uint16(0x7FFF)
_INF_BITS = {tl.bfloat16: 0x7F80, tl.float16: 0x7C00}  # magnitudes above these are NaN


def min_xorsign_abs_bits(a: np.ndarray, b: np.ndarray, dtype) -> np.ndarray:
    """`min.xorsign.abs` on 16-bit patterns a, b (uint16 arrays of one shape) of `dtype` (tl.bfloat16 or
    tl.float16); returns the result's patterns (uint16)."""
    a, b = a.astype(np.uint16), b.astype(np.uint16)
    ma, mb = a & _MAG, b & _MAG
    nan_a, nan_b = ma > _INF_BITS[dtype], mb > _INF_BITS[dtype]
    if (nan_a ^ nan_b).any():
        raise NotImplementedError("min.xorsign.abs with exactly one NaN operand is not emulated")
    out = np.minimum(ma, mb) | ((a ^ b) & _SIGN)
    return np.where(nan_a & nan_b, _CANONICAL_NAN, out).astype(np.uint16)


class _Call:
    def __init__(self, handle):
        self._handle = handle

    def get_result(self, i):
        assert i == 0
        return self._handle


class Emulator:
    """Stands in for the interpreter's inline assembly; `calls` counts the instructions' invocations (tensors)."""

    def __init__(self):
        self.calls = 0

    def create_inline_asm(self, builder, asm, constraints, values, types, is_pure, pack):
        m = _PTX.match(asm)
        if m is None:
            raise NotImplementedError(f"no emulation for inline assembly {asm!r}")
        dtype = _TYPES[m.group(1)]
        if constraints != "=r,r,r" or pack != 2 or not is_pure:
            raise AssertionError(f"{asm!r}: constraints {constraints!r}, pack {pack}, pure {is_pure}; a GPU compile "
                                 "needs '=r,r,r' (one 32-bit register per pair), pack 2 and a pure op")
        if len(values) != 2 or len(types) != 1:
            raise AssertionError(f"{asm!r} takes two operands and gives one result")
        for v in values:
            if v.dtype != dtype:
                raise AssertionError(f"{asm!r} applied to {v.dtype} operands")
        if types[0].scalar != dtype:
            raise AssertionError(f"{asm!r} declared to return {types[0].scalar}")
        a, b = (np.ascontiguousarray(v.data).view(np.uint16) for v in values)
        if a.shape != b.shape:
            raise AssertionError(f"operand shapes differ: {a.shape} vs {b.shape}")
        out = min_xorsign_abs_bits(a, b, dtype).view(values[0].data.dtype)
        self.calls += 1
        return _Call(interpreter.TensorHandle(out, dtype))


def install(monkeypatch) -> Emulator:
    """Route the interpreter's inline assembly through a fresh `Emulator` (undone with the monkeypatch)."""
    emu = Emulator()

    def create_inline_asm(builder, asm, constraints, values, types, is_pure, pack):
        return emu.create_inline_asm(builder, asm, constraints, values, types, is_pure, pack)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", create_inline_asm)
    return emu
