"""uvic.attention: every CPU backend against an independent float64 implementation of the paper's formula."""

import math

import pytest
import torch
import torch.nn.functional as F

import uvic.attention as attn_mod
from uvic.attention import attention_ref, cog_attention, softmax_attention


# ---------------------------------------------------------------------------------------------------------
# Independent float64 ground truth (written from the paper, Eq. 3, not from uvic.attention)
# ---------------------------------------------------------------------------------------------------------


def keep_mask_f64(Lq, Lk, causal, kpm, B):
    keep = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
    if causal:
        for i in range(Lq):
            keep[:, :, i, i + Lk - Lq + 1 :] = False  # key j kept iff j <= i + Lk - Lq
    if kpm is not None:
        keep &= kpm[:, None, None, :]
    return keep


def cog_f64(q, k, v, causal=False, kpm=None, scale=None, cog=True):
    """attn_ij = s_ij exp(|p_ij| - m_i) / sum_{j kept} exp(|p_ij| - m_i); empty rows give 0."""
    q, k, v = q.double(), k.double(), v.double()
    B, _, Lq, hd = q.shape
    Lk = k.shape[2]
    scale = hd**-0.5 if scale is None else scale
    p = scale * torch.einsum("bhid,bhjd->bhij", q, k)
    keep = keep_mask_f64(Lq, Lk, causal, kpm, B)
    score = p.abs() if cog else p
    score = torch.where(keep, score, torch.full_like(score, -1e300))
    m = score.amax(-1, keepdim=True).detach()
    e = torch.where(keep, torch.exp(score - m), torch.zeros_like(score))
    denom = e.sum(-1, keepdim=True)
    w = e / torch.where(denom > 0, denom, torch.ones_like(denom))
    a = torch.sign(p) * w if cog else w
    return torch.einsum("bhij,bhjd->bhid", a, v)


def cog_naive_fig2(q, k, v):
    """The paper's naive implementation (Fig. 2, `Cog_Attention_naive`), no mask, with the 1/sqrt(d) scale."""
    p = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    p_sign = torch.sign(p)
    max_p = torch.abs(p).max(-1, keepdim=True).values
    e = p_sign * torch.exp(p_sign * p - max_p)
    attn_w = e / torch.abs(e).sum(-1, keepdim=True)
    return attn_w @ v


def make_inputs(B, nh, Lq, Lk, hd, dtype=torch.float32, seed=0, qk_std=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, nh, Lq, hd, generator=g) * qk_std).to(dtype)
    k = (torch.randn(B, nh, Lk, hd, generator=g) * qk_std).to(dtype)
    v = torch.randn(B, nh, Lk, hd, generator=g).to(dtype)
    do = torch.randn(B, nh, Lq, hd, generator=g).to(dtype)
    return q, k, v, do


def fwd_bwd(fn, q, k, v, do, **kw):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = fn(q, k, v, **kw)
    o.backward(do)
    return [o.detach(), q.grad, k.grad, v.grad]


def max_err(a, b):
    return [(x.double() - y.double()).abs().max().item() for x, y in zip(a, b)]


def plain_formula(q, k, v, causal=False, key_padding_mask=None, scale=None, cog=True):
    """The paper's 'faster' formula computed in the input dtype (no upcast): the error baseline."""
    return attention_ref(q, k, v, causal=causal, key_padding_mask=key_padding_mask, scale=scale, cog=cog, upcast=False)


def check_backend(backend, q, k, v, do, cog=True, factor=4.0, floor=1e-6, **kw):
    """FlashAttention's rule: error vs float64 at most `factor` x that of the plain formula (plus a tiny floor)."""
    op = cog_attention if cog else softmax_attention
    truth = fwd_bwd(lambda *a, **k_: cog_f64(*a, cog=cog, **k_), q.double(), k.double(), v.double(), do.double(),
                    causal=kw.get("causal", False), kpm=kw.get("key_padding_mask"), scale=kw.get("scale"))
    got = fwd_bwd(lambda *a, **k_: op(*a, backend=backend, **k_), q, k, v, do, **kw)
    base = fwd_bwd(lambda *a, **k_: plain_formula(*a, cog=cog, **k_), q, k, v, do, **kw)
    for t in got:
        assert t.dtype == q.dtype
        assert torch.isfinite(t).all()
    err, err_base = max_err(got, truth), max_err(base, truth)
    for name, e, eb in zip(("out", "dq", "dk", "dv"), err, err_base):
        assert e <= factor * eb + floor, f"{backend} {name}: error {e:.3g} vs plain-formula error {eb:.3g}"
    return err


# ---------------------------------------------------------------------------------------------------------
# Cog attention vs the float64 truth
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("L,hd", [(1, 16), (17, 32), (257, 64), (258, 128), (334, 64), (1000, 32)])
@pytest.mark.parametrize("causal", [False, True])
def test_cog_matches_f64(backend, L, hd, causal):
    q, k, v, do = make_inputs(2, 2, L, L, hd, seed=L + hd)
    check_backend(backend, q, k, v, do, causal=causal)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("hd", [16, 32, 64, 128])
def test_cog_head_dims_with_padding(backend, hd):
    q, k, v, do = make_inputs(3, 2, 33, 33, hd, seed=hd)
    kpm = torch.rand(3, 33, generator=torch.Generator().manual_seed(1)) > 0.4
    kpm[2] = False  # a batch item with no kept key: every row of it is fully masked
    check_backend(backend, q, k, v, do, key_padding_mask=kpm, causal=hd == 64)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("Lq,Lk", [(1, 257), (1, 1), (17, 334), (258, 17), (5, 9)])
@pytest.mark.parametrize("causal", [False, True])
def test_cog_lq_ne_lk(backend, Lq, Lk, causal):
    q, k, v, do = make_inputs(2, 2, Lq, Lk, 32, seed=Lq * 7 + Lk)
    kpm = torch.ones(2, Lk, dtype=torch.bool)
    kpm[1, : Lk // 2] = False
    check_backend(backend, q, k, v, do, causal=causal, key_padding_mask=kpm)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_fully_masked_rows_are_zero_with_zero_grads(backend):
    q, k, v, do = make_inputs(2, 2, 6, 4, 16)
    kpm = torch.tensor([[True, True, False, False], [False, False, False, False]])
    # causal with Lq > Lk: query rows 0 and 1 of item 0 see no key (j <= i - 2); item 1 sees none at all.
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    o = cog_attention(q, k, v, causal=True, key_padding_mask=kpm, backend=backend)
    o.backward(do)
    assert torch.isfinite(o).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert (o[1] == 0).all() and (o[0, :, :2] == 0).all()
    assert (q.grad[1] == 0).all() and (q.grad[0, :, :2] == 0).all()
    assert (k.grad[1] == 0).all() and (v.grad[1] == 0).all()
    assert (k.grad[0, :, 2:] == 0).all() and (v.grad[0, :, 2:] == 0).all()  # padded keys get no gradient
    assert o[0, :, 2:].abs().sum() > 0


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_large_logits_do_not_overflow(backend):
    # |p| up to ~1e4: the max-|p| subtraction keeps every exponent <= 0.
    q, k, v, do = make_inputs(1, 2, 40, 40, 16, seed=3, qk_std=45.0)
    p = (q @ k.transpose(-2, -1)) * 16**-0.5
    assert 5e3 < p.abs().max() < 2e4
    out = cog_attention(q, k, v, backend=backend)
    assert torch.isfinite(out).all()
    check_backend(backend, q, k, v, do, causal=True, floor=1e-4)


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs(backend, dtype):
    q, k, v, do = make_inputs(2, 2, 65, 65, 32, dtype=dtype, seed=5)
    check_backend(backend, q, k, v, do, causal=True, factor=2.0)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_exact_zero_scores(backend):
    # Zero query vectors give p = 0 exactly: weight exp(0 - m) in the denominator but sign 0 in the numerator.
    q, k, v, do = make_inputs(1, 2, 9, 9, 16, seed=7)
    q[:, :, 3] = 0
    k[:, :, 5] = 0
    check_backend(backend, q, k, v, do)


@pytest.mark.parametrize("causal", [False, True])
def test_gradcheck_float64(causal):
    q, k, v, _ = make_inputs(1, 2, 5, 7, 8, dtype=torch.float64, seed=11)
    kpm = torch.tensor([[True, False, True, True, True, False, True]])
    for backend in ("reference", "torch"):
        inputs = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
        fn = lambda q_, k_, v_: cog_attention(q_, k_, v_, causal=causal, key_padding_mask=kpm, backend=backend)
        assert torch.autograd.gradcheck(fn, inputs)


def test_naive_formula_of_fig2_agrees():
    q, k, v, _ = make_inputs(2, 3, 31, 31, 16, dtype=torch.float64, seed=13)
    assert (q @ k.transpose(-2, -1) != 0).all()  # the two formulas differ only where p == 0
    expect = cog_naive_fig2(q, k, v)
    for backend in ("reference", "torch"):
        torch.testing.assert_close(cog_attention(q, k, v, backend=backend), expect, rtol=1e-12, atol=1e-12)


def test_torch_backend_tiles_over_query_blocks(monkeypatch):
    # A tile budget smaller than one head forces query blocks (and ragged last blocks) in both passes.
    monkeypatch.setattr(attn_mod, "_TILE_ELEMENTS", 7 * 50)
    q, k, v, do = make_inputs(2, 3, 43, 50, 16, seed=17)
    kpm = torch.rand(2, 50, generator=torch.Generator().manual_seed(0)) > 0.3
    check_backend("torch", q, k, v, do, causal=True, key_padding_mask=kpm)
    # Causal query blocks skip the key blocks they cannot see; with Lq > Lk the first rows see no key at all.
    for Lq, Lk in ((50, 43), (43, 50)):
        q2, k2, v2, do2 = make_inputs(2, 3, Lq, Lk, 16, seed=Lq)
        check_backend("torch", q2, k2, v2, do2, causal=True)
        check_backend("torch", q2, k2, v2, do2, causal=True, key_padding_mask=kpm[:, :Lk])
    monkeypatch.setattr(attn_mod, "_TILE_ELEMENTS", 2 * 43 * 50 + 1)  # two whole heads per tile
    check_backend("torch", q, k, v, do, key_padding_mask=kpm)


def test_torch_backend_tiles_over_batch_items(monkeypatch):
    # Short sequences: a tile holds several whole batch items (5 items, tiles of 2: a ragged last tile), and the
    # inputs are strided views of one fused qkv projection (B, L, 3, nh, hd), as in the models.
    monkeypatch.setattr(attn_mod, "_TILE_ELEMENTS", 2 * 3 * 7 * 9)
    B, nh, L, hd = 5, 3, 9, 16
    assert [t[0] for t in attn_mod._tiles(B, nh, 7, L, attn_mod._TILE_ELEMENTS)] == [
        slice(0, 2), slice(2, 4), slice(4, 5)]
    qkv = torch.randn(B, L, 3, nh, hd, generator=torch.Generator().manual_seed(3)).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0, :, :, :7], qkv[1], qkv[2]
    do = torch.randn(B, nh, 7, hd, generator=torch.Generator().manual_seed(4))
    kpm = torch.rand(B, L, generator=torch.Generator().manual_seed(5)) > 0.4
    kpm[1] = False  # a batch item with no kept key: zeros, never NaN
    check_backend("torch", q, k, v, do, causal=True, key_padding_mask=kpm)
    check_backend("torch", q, k, v, do)


@pytest.fixture
def compile_all_tiles(monkeypatch):
    """Route every "torch" backend call through the torch.compile'd tile math (normally only large calls)."""
    monkeypatch.setattr(attn_mod, "_COMPILE_MIN_SCORES", 0)
    monkeypatch.setattr(attn_mod, "_compile_failed", [])
    monkeypatch.setenv("UVIC_ATTENTION_COMPILE", "1")


def test_compiled_tile_math_matches_f64(compile_all_tiles, monkeypatch):
    # Query-block tiles with causal + padding (rows with no key), then multi-item tiles from a fused qkv.
    monkeypatch.setattr(attn_mod, "_TILE_ELEMENTS", 7 * 50)
    q, k, v, do = make_inputs(2, 3, 43, 50, 16, seed=17)
    kpm = torch.rand(2, 50, generator=torch.Generator().manual_seed(0)) > 0.3
    kpm[1, :10] = False
    check_backend("torch", q, k, v, do, causal=True, key_padding_mask=kpm)
    monkeypatch.setattr(attn_mod, "_TILE_ELEMENTS", 2 ** 20)
    q, k, v, do = make_inputs(3, 4, 65, 65, 32, seed=5)
    check_backend("torch", q, k, v, do)
    assert attn_mod._compile_failed == []
    assert set(attn_mod._compiled) == {"forward", "backward"}  # the compiled functions ran (no eager fallback)


def test_compile_failure_falls_back_to_eager(monkeypatch, caplog):
    monkeypatch.setattr(attn_mod, "_COMPILE_MIN_SCORES", 0)
    monkeypatch.setattr(attn_mod, "_compiled", {})
    monkeypatch.setattr(attn_mod, "_compile_failed", [])
    monkeypatch.setenv("UVIC_ATTENTION_COMPILE", "1")

    def no_compiler(fn, **kwargs):
        def run(*args):
            raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")
        return run

    monkeypatch.setattr(torch, "compile", no_compiler)
    q, k, v, do = make_inputs(2, 2, 17, 17, 16, seed=2)
    with caplog.at_level("WARNING", logger="uvic.attention"):
        check_backend("torch", q, k, v, do, causal=True)
    assert "no working C++ compiler" in caplog.text and "eager" in caplog.text
    assert len(attn_mod._compile_failed) == 1  # tried once, then eager for the rest of the process


def test_compile_switch_and_threshold(monkeypatch):
    q = torch.zeros(1, 1, 1, 1)
    monkeypatch.setattr(attn_mod, "_compile_failed", [])
    monkeypatch.setenv("UVIC_ATTENTION_COMPILE", "1")
    assert attn_mod._use_compiled(q, attn_mod._COMPILE_MIN_SCORES)
    assert not attn_mod._use_compiled(q, attn_mod._COMPILE_MIN_SCORES - 1)  # small calls stay eager
    monkeypatch.setenv("UVIC_ATTENTION_COMPILE", "0")
    assert not attn_mod._use_compiled(q, attn_mod._COMPILE_MIN_SCORES)


def test_torch_backend_saves_no_score_matrix():
    """The memory contract: saved for backward are q, k, v, the output and one float per query row."""
    B, nh, L, hd = 2, 4, 300, 32
    q, k, v, _ = make_inputs(B, nh, L, L, hd)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cog_attention(q, k, v, backend="torch")
    numels = sorted(t.numel() for t in saved)
    assert max(numels) == B * nh * L * hd
    assert sum(numels) == 4 * B * nh * L * hd + B * nh * L  # q, k, v, out + LSE; nothing L x L
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cog_attention(q, k, v, backend="reference")
    assert max(t.numel() for t in saved) >= B * nh * L * L  # the dense formula keeps L x L tensors


# ---------------------------------------------------------------------------------------------------------
# Softmax attention (the baseline op, on SDPA)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("Lq,Lk,causal,pad", [(17, 17, False, False), (17, 17, True, False), (5, 12, True, True),
                                              (12, 5, True, False), (1, 9, True, True), (65, 65, False, True)])
def test_softmax_matches_f64(backend, Lq, Lk, causal, pad):
    q, k, v, do = make_inputs(2, 2, Lq, Lk, 32, seed=Lq + Lk)
    kpm = None
    if pad:
        kpm = torch.ones(2, Lk, dtype=torch.bool)
        kpm[0, -2:] = False
        kpm[1] = False
    check_backend(backend, q, k, v, do, cog=False, causal=causal, key_padding_mask=kpm)


def test_softmax_torch_backend_is_sdpa():
    q, k, v, _ = make_inputs(2, 2, 16, 16, 32)
    torch.testing.assert_close(softmax_attention(q, k, v, backend="torch"), F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(
        softmax_attention(q, k, v, causal=True, scale=0.3), F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                          scale=0.3)
    )


def test_softmax_auto_is_sdpa_and_never_the_kernel(monkeypatch):
    """`auto` gives softmax baselines SDPA on every device; only an explicit backend="triton" reaches the kernel."""
    reached = []
    monkeypatch.setattr(attn_mod, "triton_unsupported_reason", lambda *a: reached.append(a) or None)
    q, k, v, _ = make_inputs(2, 2, 16, 16, 32)
    torch.testing.assert_close(softmax_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert reached == []


def test_cog_differs_from_softmax_and_has_negative_weights():
    q, k, v, _ = make_inputs(1, 1, 8, 8, 8, dtype=torch.float64)
    eye = torch.eye(8, dtype=torch.float64)[None, None]
    w_cog = cog_attention(q, k, eye, backend="torch")  # v = I exposes the attention matrix
    w_soft = softmax_attention(q, k, eye, backend="torch")
    assert (w_cog < 0).any() and (w_soft >= 0).all()
    torch.testing.assert_close(w_cog.abs().sum(-1), torch.ones(1, 1, 8, dtype=torch.float64))  # sum |w| = 1
    p = (q @ k.transpose(-2, -1)) * 8**-0.5
    torch.testing.assert_close(torch.sign(w_cog), torch.sign(p))


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v, _ = make_inputs(1, 2, 10, 10, 64, dtype=torch.float64)
    torch.testing.assert_close(cog_attention(q, k, v), cog_attention(q, k, v, scale=1 / math.sqrt(64)))
    assert not torch.allclose(cog_attention(q, k, v), cog_attention(q, k, v, scale=1.0))


# ---------------------------------------------------------------------------------------------------------
# Bad input gets a ValueError that names the problem
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [cog_attention, softmax_attention])
def test_bad_inputs(op):
    q, k, v, _ = make_inputs(2, 2, 5, 6, 8)
    cases = [
        ((q[0], k, v), {}, "4 dims"),
        ((q, k[..., :4], v), {}, "does not match q"),
        ((q, k, v[:, :, :3]), {}, "must have the (B, nh, Lk)"),
        ((q, k, v[..., :4]), {}, "head dim"),
        ((q, k.double(), v), {}, "one dtype"),
        ((q.long(), k.long(), v.long()), {}, "floating-point"),
        ((q, k.to("meta"), v), {}, "one device"),
        ((q, k, v), {"key_padding_mask": torch.ones(2, 6)}, "bool"),
        ((q, k, v), {"key_padding_mask": torch.ones(2, 5, dtype=torch.bool)}, "(B, Lk)"),
        ((q, k, v), {"backend": "flash"}, "unknown attention backend"),
        ((q, k, v), {"scale": float("nan")}, "scale"),
    ]
    for args, kw, msg in cases:
        with pytest.raises(ValueError, match=None) as info:
            op(*args, **kw)
        assert msg in str(info.value), (msg, str(info.value))


def test_triton_backend_on_cpu_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v, _ = make_inputs(1, 1, 4, 4, 16)
    with pytest.raises(ValueError, match="backend='triton' cannot run"):
        cog_attention(q, k, v, backend="triton")
    # "auto" falls back to the torch backend on CPU.
    torch.testing.assert_close(cog_attention(q, k, v), cog_attention(q, k, v, backend="torch"))


@pytest.mark.parametrize("op", [cog_attention, softmax_attention])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_autocast_bf16(op, backend):
    # Mixed-precision training: inside autocast, q, k, v come in bf16 and the result stays bf16.
    q, k, v, do = make_inputs(2, 2, 33, 33, 16, dtype=torch.bfloat16, seed=23)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = op(q, k, v, causal=True, backend=backend)
    out.backward(do)
    assert out.dtype == torch.bfloat16 and q.grad.dtype == torch.bfloat16
    expect = cog_f64(q.detach(), k.detach(), v.detach(), causal=True, cog=op is cog_attention)
    assert (out.double() - expect).abs().max() < 0.05
