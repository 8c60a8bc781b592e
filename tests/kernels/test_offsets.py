"""32-bit offsets inside a (batch, head) slice: the launcher copies inputs that would overflow them, and
`unsupported_reason` refuses lengths that no layout can fit (CPU only; the interpreter run of a real overflowing
layout is in interpret_numerics.py)."""

import pytest
import torch

import uvic.kernels.attention as kattn
from uvic.attention import unsupported_reason


def test_inputs_within_32_bit_offsets_are_passed_as_they_are():
    packed = torch.empty(2, 100, 3, 4, 16).permute(2, 0, 3, 1, 4)  # (3, B, nh, L, hd) views of a packed qkv
    for t in packed:
        assert kattn._int32_addressable(t) is t


@pytest.mark.parametrize("L,row_stride", [(520, 2**22), (2, 2**31), (175_000, 3 * 4096)])
def test_inputs_beyond_32_bit_offsets_are_made_contiguous(L, row_stride):
    """Meta tensors: the strides are real, no memory is needed. (175000, 3 * 4096): a packed qkv at 32 x 128."""
    t = torch.empty_strided((1, 2, L, 16), (0, 16, row_stride, 1), device="meta")
    out = kattn._int32_addressable(t)
    assert out.is_contiguous() and out.shape == t.shape
    assert (L - 1) * out.stride(2) + 15 < 2**31


def test_lengths_beyond_32_bit_offsets_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so that CPU tensors get past the device check
    ok = torch.zeros(1, 1, 1, 16).expand(1, 1, 2**27 - 1, 16)  # stride 0 rows: no memory
    assert unsupported_reason(ok, ok, ok, backend="triton") is None
    long = torch.zeros(1, 1, 1, 16).expand(1, 1, 2**27, 16)
    assert "2**31" in unsupported_reason(ok[:, :, :5], long, long, backend="triton")
    assert "2**31" in unsupported_reason(long, long, long, backend="triton")
