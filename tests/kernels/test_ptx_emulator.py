"""The `min.xorsign.abs` emulator the interpreter suites run the forward's inline PTX through, against torch's
float arithmetic: |result| = min(|a|, |b|) and signbit(result) = signbit(a) XOR signbit(b)."""

import numpy as np
import pytest
import torch
import triton.language as tl
from ptx_emulator import min_xorsign_abs_bits


DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.int16).numpy().view(np.uint16)


def _values(dtype) -> torch.Tensor:
    """Random normals over many binades, both zeros, infinities, subnormals and the largest finite value."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, generator=g) * torch.exp2(torch.randint(-30, 30, (4000,), generator=g).float())
    fi = torch.finfo(dtype)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), fi.max, -fi.max, fi.smallest_normal,
                            fi.smallest_normal / 4, -fi.smallest_normal / 4, 1.0, -1.0])
    return torch.cat([x, special]).to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_matches_the_definition(dtype):
    a = _values(dtype)
    b = a[torch.randperm(len(a), generator=torch.Generator().manual_seed(1))]
    got = torch.from_numpy(min_xorsign_abs_bits(_bits(a), _bits(b), DTYPES[dtype]).view(np.int16)).view(dtype)
    mag = torch.minimum(a.float().abs(), b.float().abs())
    negative = torch.signbit(a) ^ torch.signbit(b)
    assert torch.equal(got.float().abs(), mag)
    assert torch.equal(torch.signbit(got), negative)  # includes the sign of zero results


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_operands(dtype):
    nan = torch.tensor([float("nan")], dtype=dtype)
    got = min_xorsign_abs_bits(_bits(nan), _bits(-nan), DTYPES[dtype])
    assert got.tolist() == [0x7FFF]  # two NaNs: the canonical NaN
    with pytest.raises(NotImplementedError, match="one NaN"):
        min_xorsign_abs_bits(_bits(nan), _bits(torch.ones(1, dtype=dtype)), DTYPES[dtype])
