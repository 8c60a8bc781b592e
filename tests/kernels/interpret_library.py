"""torch.library registration of the fused kernels: opcheck and torch.compile, under the Triton interpreter (CPU).

Run by test_triton_interpret.py in a subprocess with TRITON_INTERPRET=1. By hand:
    TRITON_INTERPRET=1 python -m pytest tests/kernels/interpret_library.py -q
"""

import os

import pytest
import torch

from uvic.attention import attention_ref, cog_attention, softmax_attention, unsupported_reason
from uvic.kernels.ops import _bwd_op, _fwd_op, fused_attention


if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("run with TRITON_INTERPRET=1 set before python starts (see the module docstring)", pytrace=False)


def _qkv(B=1, nh=2, Lq=19, Lk=23, hd=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, nh, L, hd, generator=g) for L in (Lq, Lk, Lk)]


@pytest.mark.parametrize("causal,use_mask,band", [(False, False, ()), (True, True, ()), (True, True, (4, -1, 2.0))])
def test_opcheck(causal, use_mask, band):
    q, k, v = (t.requires_grad_() for t in _qkv())
    kpm = torch.tensor([[True] * 20 + [False] * 3]) if use_mask else None
    torch.library.opcheck(_fwd_op, (q, k, v, kpm, causal, 0.25, True, *band))
    with torch.no_grad():
        out, lse = _fwd_op(q, k, v, kpm, causal, 0.25, True, *band)
    do = torch.randn_like(out)
    torch.library.opcheck(_bwd_op, (do, q.detach(), k.detach(), v.detach(), out, lse, kpm, causal, 0.25, True, *band))


def test_torch_compile_fullgraph_matches_eager():
    """A small attention block compiled with fullgraph=True (a graph break would raise) gives eager's values."""
    q, k, v = _qkv(Lq=21, Lk=21)
    proj = torch.nn.Linear(16, 16)

    def block(q, k, v):
        out = cog_attention(proj(q), k, v, causal=True, backend="triton")
        return (out * out).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = block(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    leaves_c = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves_c)
    grads = torch.autograd.grad(out, leaves_c)
    torch.testing.assert_close(out, eager)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b)
    # and both agree with the dense reference
    ref = attention_ref(proj(q), k, v, causal=True)
    torch.testing.assert_close(fused_attention(proj(q), k, v, causal=True), ref, atol=1e-5, rtol=1e-5)


def test_torch_compile_inductor_calls_the_op_as_extern_kernel():
    """Inductor (C++ codegen on CPU) compiles a block around the triton backend with fullgraph=True: the opaque
    custom ops appear as extern calls in the generated forward and backward code, and values and gradients match
    eager and the dense reference."""
    from torch._inductor.utils import run_and_get_code

    q, k, v = _qkv(Lq=21, Lk=21, seed=1)
    kpm = torch.ones(1, 21, dtype=torch.bool)
    kpm[0, 3] = False

    def block(q, k, v):
        out = cog_attention(q * 2.0, k, v, causal=True, key_padding_mask=kpm, backend="triton")
        return (out.relu() * out).sum()

    def value_and_grads(fn, inputs):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        return [out, *torch.autograd.grad(out, leaves)]

    eager = value_and_grads(block, (q, k, v))
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    got, codes = run_and_get_code(value_and_grads, compiled, (q, k, v))
    assert len(codes) == 2, "expected one generated module for forward and one for backward"
    assert "torch.ops.uvic.fused_attention_fwd.default(" in codes[0]
    assert "torch.ops.uvic.fused_attention_bwd.default(" in codes[1]
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b)

    def reference(q, k, v):
        out = attention_ref(q * 2.0, k, v, causal=True, key_padding_mask=kpm)
        return (out.relu() * out).sum()

    for a, b in zip(got, value_and_grads(reference, (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_unsupported_reason_names_the_kernels_limits():
    q = torch.randn(1, 2, 8, 32)
    assert unsupported_reason(q, q, q, backend="triton") is None  # CPU is fine under the interpreter
    assert "dtype" in unsupported_reason(q.double(), q.double(), q.double(), backend="triton")
    # every multiple of 8 up to 256 (U-ViT-H and DiT-XL 72, SD 1.x 40 / 80 / 160, Phi-3 96); others take "torch"
    for hd in (8, 24, 40, 72, 80, 96, 160, 248):
        t = torch.randn(1, 2, 8, hd, dtype=torch.bfloat16)
        assert unsupported_reason(t, t, t, backend="triton") is None, hd
    for hd in (4, 20, 100, 264, 512):
        t = torch.randn(1, 2, 8, hd)
        why = unsupported_reason(t, t, t, backend="triton")
        assert why == f"head dim {hd} is not supported (a multiple of 8 up to 256)", why
        assert unsupported_reason(t, t, t, backend="torch") is None
    q20 = q[..., :20]
    assert "key_padding_mask" in unsupported_reason(q, q, q, torch.ones(1, 8), backend="triton")
    q256, q16 = torch.randn(1, 2, 8, 256, dtype=torch.float16), q.half()
    assert unsupported_reason(q256, q256, q256, backend="triton") is None
    for band in ({"window": (3, -1)}, {"softcap": 30.0}):  # the banded kernels cover every head dim and dtype
        for t in (q256, q, q[..., :16], q16[..., :16], q16[..., :24]):
            assert unsupported_reason(t, t, t, backend="triton", **band) is None
        assert "head dim" in unsupported_reason(q20, q20, q20, backend="triton", **band)
    long = torch.zeros(1, 1, 1, 16).expand(1, 1, 2**27, 16)  # stride-0 rows: no memory
    assert "2**31" in unsupported_reason(long, long, long, backend="triton")
    with pytest.raises(ValueError, match="backend='triton' cannot run on these inputs: head dim 20"):
        cog_attention(q20, q20, q20, backend="triton")


@pytest.mark.parametrize("op", [cog_attention, softmax_attention])
@pytest.mark.parametrize("B,Lq,Lk", [(1, 0, 5), (1, 4, 0), (0, 4, 5)])
def test_empty_inputs_agree_with_the_other_backends(op, B, Lq, Lk):
    """Lq = 0: an empty output; Lk = 0: zeros; zero gradients, as the reference and torch backends give."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, 2, L, 16, generator=g).requires_grad_() for L in (Lq, Lk, Lk))
    kpm = torch.ones(B, Lk, dtype=torch.bool)
    out = op(q, k, v, causal=True, key_padding_mask=kpm, backend="triton")
    out.sum().backward()
    assert out.shape == (B, 2, Lq, 16) and (out == 0).all()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and (t.grad == 0).all()
