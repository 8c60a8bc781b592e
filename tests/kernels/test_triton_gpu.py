"""The fused kernel on a real GPU against the float64 reference (skipped without CUDA).

Same rule as the interpreter suite: error <= 2x that of the plain formula in the input dtype, plus one rounding of
the largest reference value (docs in tests/kernels/interpret_numerics.py).
"""

import pytest
import torch

from uvic.attention import attention_ref, cog_attention


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _grads(fn, q, k, v, do, dtype):
    ts = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = fn(*ts)
    out.backward(do.to(dtype))
    return [out.detach().double()] + [t.grad.double() for t in ts]


@pytest.mark.parametrize("L", [64, 258, 1000])
@pytest.mark.parametrize("hd", [32, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cog", [True, False])
def test_fused_matches_reference_on_gpu(L, hd, causal, dtype, cog):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, L, hd, device="cuda", generator=g, dtype=torch.float64) for _ in range(4))
    kpm = torch.rand(2, L, device="cuda", generator=g) > 0.3
    kpm[1, : L // 2] = False
    kw = {"causal": causal, "key_padding_mask": kpm, "cog": cog}
    exact = _grads(lambda *a: attention_ref(*a, **kw), q, k, v, do, torch.float64)
    plain = _grads(lambda *a: attention_ref(*a, upcast=False, **kw), q, k, v, do, dtype)
    from uvic.kernels import fused_attention

    fused = _grads(lambda *a: fused_attention(*a, **kw), q, k, v, do, dtype)
    for name, f, p, e in zip(("out", "dq", "dk", "dv"), fused, plain, exact):
        floor = 0.5 * torch.finfo(dtype).eps * e.abs().max().item()
        err, err_plain = (f - e).abs().max().item(), (p - e).abs().max().item()
        assert err <= 2 * err_plain + floor, f"{name}: fused err {err:.3g} vs plain err {err_plain:.3g}"


def test_auto_backend_uses_triton_on_cuda():
    q = torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.bfloat16)
    out_auto = cog_attention(q, q, q, backend="auto")
    out_tri = cog_attention(q, q, q, backend="triton")
    assert torch.equal(out_auto, out_tri)
