"""The fused kernel on a real GPU against the float64 reference (skipped without CUDA).

Same rule as the interpreter suite: error <= 2x that of the plain formula in the input dtype, plus one rounding of
the largest reference value (docs in tests/kernels/interpret_numerics.py).
"""

import pytest
import torch

from uvic.attention import attention_ref, cog_attention, softmax_attention


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
    kw = {"causal": causal, "key_padding_mask": kpm, "attention": "cog" if cog else "softmax"}
    exact = _grads(lambda *a: attention_ref(*a, **kw), q, k, v, do, torch.float64)
    plain = _grads(lambda *a: attention_ref(*a, upcast=False, **kw), q, k, v, do, dtype)
    from uvic.kernels.ops import fused_attention

    fused = _grads(lambda *a: fused_attention(*a, causal=causal, key_padding_mask=kpm, cog=cog), q, k, v, do, dtype)
    for name, f, p, e in zip(("out", "dq", "dk", "dv"), fused, plain, exact):
        floor = 0.5 * torch.finfo(dtype).eps * e.abs().max().item()
        err, err_plain = (f - e).abs().max().item(), (p - e).abs().max().item()
        assert err <= 2 * err_plain + floor, f"{name}: fused err {err:.3g} vs plain err {err_plain:.3g}"


def test_auto_backend_uses_triton_on_cuda():
    q = torch.randn(1, 2, 100, 64, device="cuda", dtype=torch.bfloat16)
    out_auto = cog_attention(q, q, q, backend="auto")
    out_tri = cog_attention(q, q, q, backend="triton")
    assert torch.equal(out_auto, out_tri)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("causal", [False, True])
def test_runs_on_the_inputs_gpu_not_the_current_one(causal):
    """Inputs on cuda:1 while cuda:0 is current: forward and backward still match the reference."""
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 300, 64, device=dev, generator=g, dtype=torch.float64) for _ in range(4))
    dtype = torch.bfloat16
    exact = _grads(lambda *a: attention_ref(*a, causal=causal), q, k, v, do, torch.float64)
    plain = _grads(lambda *a: attention_ref(*a, causal=causal, upcast=False), q, k, v, do, dtype)
    fused = _grads(lambda *a: cog_attention(*a, causal=causal, backend="triton"), q, k, v, do, dtype)
    for name, f, p, e in zip(("out", "dq", "dk", "dv"), fused, plain, exact):
        assert f.device == dev
        floor = 0.5 * torch.finfo(dtype).eps * e.abs().max().item()
        err, err_plain = (f - e).abs().max().item(), (p - e).abs().max().item()
        assert err <= 2 * err_plain + floor, f"{name}: fused err {err:.3g} vs plain err {err_plain:.3g}"
    assert torch.cuda.current_device() == 0


def test_this_gpu_gets_a_tile_table():
    """The tile table config_arch picks for this GPU (sm_90 on H100/H200, sm_80 on A100 and RTX cards)."""
    from uvic.kernels import cuda_device_info
    from uvic.kernels.configs import config_arch

    major, minor, smem, is_hip = cuda_device_info(torch.cuda.current_device())
    arch, why = config_arch(major, minor, smem, is_hip)
    assert why is None, why
    assert arch == (90 if major in (9, 10) else 80)


@pytest.mark.parametrize("cog", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_removed_keys_are_never_read_on_gpu(cog, causal):
    """NaN / Inf in the k, v rows of keys removed by key_padding_mask change nothing (GPU launch path, bf16)."""
    from uvic.kernels.ops import fused_attention

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(2, 3, 300, 64, device="cuda", generator=g, dtype=torch.float64) for _ in range(4))
    kpm = torch.rand(2, 300, device="cuda", generator=g) > 0.3
    kpm[1] = False
    drop = ~kpm[:, None, :, None].expand_as(k)
    kw = {"causal": causal, "key_padding_mask": kpm, "cog": cog}
    clean = _grads(lambda *a: fused_attention(*a, **kw), q, k, v, do, torch.bfloat16)
    dirty = _grads(lambda *a: fused_attention(*a, **kw), q, k.masked_fill(drop, float("nan")),
                   v.masked_fill(drop, float("inf")), do, torch.bfloat16)
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)
    assert torch.equal(dirty[2][drop], torch.zeros_like(dirty[2][drop]))


@pytest.mark.parametrize("scale", [0.5, -0.5, 0.0])
def test_zero_scores_on_gpu(scale):
    """sign(0) = 0 on the GPU path: one-hot queries and keys give exact-zero scores (-0 for a negative scale)."""
    hd = 64
    e = torch.eye(hd, dtype=torch.float64, device="cuda")
    q = torch.stack([e[0], e[1], torch.zeros(hd, dtype=torch.float64, device="cuda")] * 22)[None, None]  # (1,1,66,hd)
    k = torch.stack([2 * e[0], -3 * e[0], e[2], 5 * e[1]] * 20)[None, None]  # (1, 1, 80, hd)
    g = torch.Generator(device="cuda").manual_seed(2)
    v = torch.randn(1, 1, 80, hd, device="cuda", generator=g, dtype=torch.float64)
    do = torch.randn(1, 1, 66, hd, device="cuda", generator=g, dtype=torch.float64)
    from uvic.kernels.ops import fused_attention

    dtype = torch.bfloat16
    exact = _grads(lambda *a: attention_ref(*a, scale=scale), q, k, v, do, torch.float64)
    plain = _grads(lambda *a: attention_ref(*a, scale=scale, upcast=False), q, k, v, do, dtype)
    fused = _grads(lambda *a: fused_attention(*a, scale=scale), q, k, v, do, dtype)
    for name, f, p, ex in zip(("out", "dq", "dk", "dv"), fused, plain, exact):
        floor = 0.5 * torch.finfo(dtype).eps * ex.abs().max().item()
        err, err_plain = (f - ex).abs().max().item(), (p - ex).abs().max().item()
        assert err <= 2 * err_plain + floor, f"{name}: fused err {err:.3g} vs plain err {err_plain:.3g}"
    assert torch.equal(fused[0][0, 0, 2::3], torch.zeros_like(fused[0][0, 0, 2::3]))  # zero queries: output 0
    assert torch.equal(fused[2][0, 0, 2::4], torch.zeros_like(fused[2][0, 0, 2::4]))  # e[2] keys: no gradient


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sign_forms_agree_on_gpu(monkeypatch, dtype):
    """The forward's two forms of the sign step, `min.xorsign.abs` (16-bit inputs on compute capability 8.6+) and the
    clamp (A100), give bitwise the same output on this GPU, on random scores, exact zeros (a zero query and a
    zero key) and scores far below the 16-bit range (q.k ~ 2**-140 for bf16, 2**-48 for fp16)."""
    import uvic.kernels.attention as kattn
    from uvic.kernels.ops import fused_attention

    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 2, 300, 64, device="cuda", generator=g) for _ in range(3))
    q[:, :, 7] = 0.0
    k[:, :, 11] = 0.0
    tiny = 2.0**-24 if dtype == torch.float16 else 2.0**-70
    q[:, :, 20:40] = torch.sign(q[:, :, 20:40]) * tiny
    k[:, :, 50:70] = torch.sign(k[:, :, 50:70]) * tiny
    q, k, v = (t.to(dtype) for t in (q, k, v))
    ptx = fused_attention(q, k, v)
    monkeypatch.setattr(kattn, "forward_sign_ptx", lambda arch, dtype: False)
    monkeypatch.setattr(kattn, "_PLANS", {})  # the launch plans of these shapes hold the first call's form
    clamp = fused_attention(q, k, v)
    assert torch.equal(ptx, clamp)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tiny_nonzero_scores_keep_their_sign_on_gpu(dtype):
    """As the interpreter test of the same name: every q.k is +-2**-120 (bf16; normal in fp32, so the tensor cores'
    treatment of subnormal results does not enter) or +-2**-48 (fp16), one key is a zero row; the output matches
    the paper's formula in float64."""
    from uvic.kernels.ops import fused_attention

    hd = 64
    tiny = 2.0**-24 if dtype == torch.float16 else 2.0**-60
    e = torch.eye(hd, dtype=torch.float64, device="cuda")
    q = (tiny * e[0]).expand(1, 1, 70, hd).clone()
    q[0, 0, 1::2] = -q[0, 0, 1::2]
    signs = torch.tensor([1.0, -1.0, 1.0, 0.0, -1.0] * 20, dtype=torch.float64, device="cuda")
    k = (tiny * signs[:, None] * e[0])[None, None]
    g = torch.Generator(device="cuda").manual_seed(7)
    v = torch.randn(1, 1, 100, hd, device="cuda", generator=g, dtype=torch.float64).to(dtype).double()
    out = fused_attention(q.to(dtype), k.to(dtype), v.to(dtype)).double()
    want = attention_ref(q, k, v, attention="cog")
    tol = 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out, want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hd", [32, 64, 128, 256])
@pytest.mark.parametrize(
    "L,window,softcap,causal",
    [
        (300, (0, 0), None, False),  # window 1: each query sees its own key
        (1000, (127, 0), None, True),  # Mistral-style local causal attention, many tiles skipped
        (258, (400, 0), None, True),  # window >= L: plain causal
        (1000, (37, 90), None, False),  # two-sided band, not tile aligned
        (700, None, 5.0, True),  # Gemma-2 style softcap alone
        (1000, (255, 0), 30.0, True),  # window and softcap together
    ],
)
def test_windows_and_softcaps_match_reference_on_gpu(L, window, softcap, causal, hd, dtype):
    """window / softcap with key padding, forward and gradients, against the float64 formula. Calls inside the
    fused kernel's envelope run the banded kernel (checked through `unsupported_reason`); the others must take the
    torch backend under "auto" and still match.

    The floor of dq and dk is one unit roundoff of the largest absolute sum they are formed from,
    scale * (|dO_i| . |v_j|) * |k_j| (|q_i| for dk), not of their largest value: with window (0, 0) every row keeps
    one key, so the exact dq and dk are 0 (and so is the plain formula's, whose softmax backward cancels exactly),
    while a flash backward forms dO_i . v_i - dO_i . O_i from separately rounded terms (seen on an H100: 0.04 for
    float16 at head dim 256, where that sum is about 56)."""
    from uvic.attention import unsupported_reason

    g = torch.Generator(device="cuda").manual_seed(L + hd)
    q, k, v, do = (torch.randn(2, 3, L, hd, device="cuda", generator=g, dtype=torch.float64) for _ in range(4))
    kpm = torch.rand(2, L, device="cuda", generator=g) > 0.2
    kpm[1, : L // 3] = False
    kw = {"causal": causal, "key_padding_mask": kpm, "window": window, "softcap": softcap}
    fused_ok = unsupported_reason(q.to(dtype), k.to(dtype), v.to(dtype), kpm, backend="triton", window=window,
                                  softcap=softcap) is None
    if dtype != torch.float32 and hd in (64, 128):
        assert fused_ok, "fp16/bf16 at hd 64/128 must stay inside the banded kernel's envelope"
    g_max = (do.abs() @ v.abs().transpose(-2, -1)).max().item() * hd**-0.5
    term = {"dq": g_max * k.abs().max().item(), "dk": g_max * q.abs().max().item()}
    for cog in (True, False):
        exact = _grads(lambda *a: attention_ref(*a, attention="cog" if cog else "softmax", **kw), q, k, v, do,
                       torch.float64)
        plain = _grads(lambda *a: attention_ref(*a, attention="cog" if cog else "softmax", upcast=False, **kw), q, k,
                       v, do, dtype)
        op = cog_attention if cog else softmax_attention
        fused = _grads(lambda *a: op(*a, backend="triton" if fused_ok else "auto", **kw), q, k, v, do, dtype)
        for name, f, p, e in zip(("out", "dq", "dk", "dv"), fused, plain, exact):
            eps = torch.finfo(dtype).eps
            floor = 1e-5 if dtype == torch.float32 else max(0.5 * eps * e.abs().max().item(), eps * term.get(name, 0))
            err, err_plain = (f - e).abs().max().item(), (p - e).abs().max().item()
            assert err <= 2 * err_plain + floor, f"{name} cog={cog}: err {err:.3g} vs plain err {err_plain:.3g}"


def _assert_within_rule(fused, plain, exact, dtype, what=""):
    for name, f, p, e in zip(("out", "dq", "dk", "dv"), fused, plain, exact):
        floor = 1e-5 if dtype == torch.float32 else 0.5 * torch.finfo(dtype).eps * e.abs().max().item()
        err, err_plain = (f - e).abs().max().item(), (p - e).abs().max().item()
        assert err <= 2 * err_plain + floor, f"{name} {what}: fused err {err:.3g} vs plain err {err_plain:.3g}"


# Head dims that are not powers of two run as power-of-two chunks (`configs.head_dim_chunks`; docs/kernel_math.md,
# "Head dims that are not powers of two"): 40 = 32 + 16 (8 padding columns), 72 = 64 + 16 (8), 96 = 64 + 32,
# 136 = 128 + 16 (8), 160 = 128 + 32, 232 = 128 + 64 + 32 + 16 (8). Contiguous inputs of odd multiples of 8 run with
# STRIDE_UNIT 8 (16-byte row alignment), which only a GPU compile exercises with real vector loads.
@pytest.mark.parametrize(
    "hd,dtype",
    [(72, torch.bfloat16), (72, torch.float16), (72, torch.float32), (96, torch.bfloat16), (160, torch.float16),
     (40, torch.bfloat16), (136, torch.float16), (232, torch.bfloat16)],
)
def test_chunked_head_dims_match_reference_on_gpu(hd, dtype):
    """Forward and gradients, causal with key padding (a batch item with half its keys removed), both modes, against
    the float64 formula; the call runs the fused kernel (inside its envelope)."""
    from uvic.attention import unsupported_reason

    g = torch.Generator(device="cuda").manual_seed(hd)
    q, k, v, do = (torch.randn(2, 3, 300, hd, device="cuda", generator=g, dtype=torch.float64) for _ in range(4))
    kpm = torch.rand(2, 300, device="cuda", generator=g) > 0.3
    kpm[1, :150] = False
    assert unsupported_reason(q.to(dtype), k.to(dtype), v.to(dtype), kpm, backend="triton") is None
    for cog in (True, False):
        kw = {"causal": True, "key_padding_mask": kpm, "attention": "cog" if cog else "softmax"}
        exact = _grads(lambda *a: attention_ref(*a, **kw), q, k, v, do, torch.float64)
        plain = _grads(lambda *a: attention_ref(*a, upcast=False, **kw), q, k, v, do, dtype)
        op = cog_attention if cog else softmax_attention
        fused = _grads(lambda *a: op(*a, causal=True, key_padding_mask=kpm, backend="triton"), q, k, v, do, dtype)
        _assert_within_rule(fused, plain, exact, dtype, f"cog={cog}")


@pytest.mark.parametrize("hd", [72, 96])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunked_head_dims_with_window_and_softcap_on_gpu(hd, dtype):
    """The banded kernels at head dims 72 and 96: a causal window of 128 keys and a softcap of 30, key padding,
    L = 1000 (many key blocks skipped), both modes."""
    g = torch.Generator(device="cuda").manual_seed(hd + 1)
    q, k, v, do = (torch.randn(2, 3, 1000, hd, device="cuda", generator=g, dtype=torch.float64) for _ in range(4))
    kpm = torch.rand(2, 1000, device="cuda", generator=g) > 0.2
    for cog in (True, False):
        kw = {"causal": True, "key_padding_mask": kpm, "window": (127, 0), "softcap": 30.0}
        kind = {"attention": "cog" if cog else "softmax"}
        exact = _grads(lambda *a: attention_ref(*a, **kw, **kind), q, k, v, do, torch.float64)
        plain = _grads(lambda *a: attention_ref(*a, upcast=False, **kw, **kind), q, k, v, do, dtype)
        op = cog_attention if cog else softmax_attention
        fused = _grads(lambda *a: op(*a, backend="triton", **kw), q, k, v, do, dtype)
        _assert_within_rule(fused, plain, exact, dtype, f"cog={cog}")


@pytest.mark.parametrize("layout", ["packed_qkv", "gapped"])
def test_head_dim_72_strided_inputs_on_gpu(layout):
    """Head dim 72 from a packed qkv projection, (B, L, 3, nh, hd) storage (row strides 3 nh hd: multiples of 8, so
    STRIDE_UNIT 8), and from rows with a last-dim stride of 2 (row strides multiples of 16: STRIDE_UNIT 1), bf16,
    against the float64 formula; the two layouts give the same values as contiguous inputs, bit for bit."""
    import uvic.kernels.attention as kattn

    B, nh, L, hd, dtype = 2, 4, 257, 72, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = (torch.randn(B, nh, L, hd, device="cuda", generator=g, dtype=torch.float64) for _ in range(4))

    def laid_out(ts):
        if layout == "packed_qkv":
            packed = torch.stack([t.to(dtype).transpose(1, 2) for t in ts], dim=2).contiguous()  # (B, L, 3, nh, hd)
            views = [packed[:, :, i].transpose(1, 2) for i in range(3)]
        else:
            wide = torch.zeros(3, B, nh, L, 2 * hd, device="cuda", dtype=dtype)
            for i, t in enumerate(ts):
                wide[i, ..., ::2] = t.to(dtype)
            views = [wide[i, ..., ::2] for i in range(3)]
        return [t.detach().requires_grad_() for t in views]

    views = laid_out((q, k, v))
    assert kattn._qkv_strides(*views)[1] == (8 if layout == "packed_qkv" else 1)
    out = cog_attention(*views, causal=True, backend="triton")
    out.backward(do.to(dtype))
    strided = [out.detach().double()] + [t.grad.double() for t in views]
    contiguous = _grads(lambda *a: cog_attention(*a, causal=True, backend="triton"), q, k, v, do, dtype)
    for a, b in zip(strided, contiguous):
        assert torch.equal(a, b)
    exact = _grads(lambda *a: attention_ref(*a, causal=True), q, k, v, do, torch.float64)
    plain = _grads(lambda *a: attention_ref(*a, causal=True, upcast=False), q, k, v, do, dtype)
    _assert_within_rule(strided, plain, exact, dtype, layout)
