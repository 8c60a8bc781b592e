"""uvic.attention: every CPU backend against an independent float64 implementation of the paper's formula."""

import collections
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from uvic.attention import (
    COMPILE_MIN_SCORES,
    attention_ref,
    cog_attention,
    kept_by_mask,
    softmax_attention,
    tiled_cog_attention,
    unsupported_reason,
)


# ---------------------------------------------------------------------------------------------------------
# Independent float64 ground truth (written from the paper, Eq. 3, not from uvic.attention)
# ---------------------------------------------------------------------------------------------------------


def keep_mask_f64(Lq, Lk, causal, kpm, B, window=None):
    keep = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
    if causal:
        for i in range(Lq):
            keep[:, :, i, i + Lk - Lq + 1 :] = False  # key j kept iff j <= i + Lk - Lq
    if window is not None:  # FlashAttention's window_size: i + Lk - Lq - left <= j <= i + Lk - Lq + right
        left, right = window
        for i in range(Lq):
            for j in range(Lk):
                if (left >= 0 and j < i + Lk - Lq - left) or (right >= 0 and j > i + Lk - Lq + right):
                    keep[:, :, i, j] = False
    if kpm is not None:
        keep &= kpm[:, None, None, :]
    return keep


def cog_f64(q, k, v, causal=False, kpm=None, scale=None, attention="cog", window=None, softcap=None):
    """attn_ij = s_ij exp(|p_ij| - m_i) / sum_{j kept} exp(|p_ij| - m_i); empty rows give 0 (attention="softmax":
    exp(p_ij - m_i) and no sign). A softcap c first maps p to c tanh(p / c)."""
    cog = attention == "cog"
    q, k, v = q.double(), k.double(), v.double()
    B, _, Lq, hd = q.shape
    Lk = k.shape[2]
    scale = hd**-0.5 if scale is None else scale
    p = scale * torch.einsum("bhid,bhjd->bhij", q, k)
    if softcap is not None:
        p = softcap * torch.tanh(p / softcap)
    keep = keep_mask_f64(Lq, Lk, causal, kpm, B, window)
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


def plain_formula(q, k, v, attention="cog", **kw):
    """The paper's 'faster' formula computed in the input dtype (no upcast): the error baseline."""
    return attention_ref(q, k, v, attention=attention, upcast=False, **kw)


def check_backend(backend, q, k, v, do, attention="cog", factor=4.0, floor=1e-6, **kw):
    """FlashAttention's rule: error vs float64 at most `factor` x that of the plain formula (plus a tiny floor).
    `backend` is a backend name, or a function with cog_attention's signature less `backend`."""
    if callable(backend):
        op, backend_kw = backend, {}
    else:
        op, backend_kw = {"cog": cog_attention, "softmax": softmax_attention}[attention], {"backend": backend}
    truth = fwd_bwd(lambda *a, **k_: cog_f64(*a, attention=attention, **k_), q.double(), k.double(), v.double(), do.double(),
                    causal=kw.get("causal", False), kpm=kw.get("key_padding_mask"), scale=kw.get("scale"),
                    window=kw.get("window"), softcap=kw.get("softcap"))
    got = fwd_bwd(lambda *a, **k_: op(*a, **backend_kw, **k_), q, k, v, do, **kw)
    base = fwd_bwd(lambda *a, **k_: plain_formula(*a, attention=attention, **k_), q, k, v, do, **kw)
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


def tiled(tile_elements, compile=False):
    """The "torch" backend with a given tile budget (and compile choice), as a `check_backend` op."""
    return lambda *a, **kw: tiled_cog_attention(*a, tile_elements=tile_elements, compile=compile, **kw)


def test_torch_backend_tiles_over_query_blocks():
    # A tile budget smaller than one head forces query blocks (and ragged last blocks) in both passes.
    q, k, v, do = make_inputs(2, 3, 43, 50, 16, seed=17)
    kpm = torch.rand(2, 50, generator=torch.Generator().manual_seed(0)) > 0.3
    check_backend(tiled(7 * 50), q, k, v, do, causal=True, key_padding_mask=kpm)
    # Causal query blocks skip the key blocks they cannot see; with Lq > Lk the first rows see no key at all.
    for Lq, Lk in ((50, 43), (43, 50)):
        q2, k2, v2, do2 = make_inputs(2, 3, Lq, Lk, 16, seed=Lq)
        check_backend(tiled(7 * 50), q2, k2, v2, do2, causal=True)
        check_backend(tiled(7 * 50), q2, k2, v2, do2, causal=True, key_padding_mask=kpm[:, :Lk])
    check_backend(tiled(2 * 43 * 50 + 1), q, k, v, do, key_padding_mask=kpm)  # two whole heads per tile


def test_torch_backend_tiles_over_batch_items():
    # Short sequences: a tile holds several whole batch items (5 items, tiles of 2: a ragged last tile), and the
    # inputs are strided views of one fused qkv projection (B, L, 3, nh, hd), as in the models.
    B, nh, L, hd = 5, 3, 9, 16
    qkv = torch.randn(B, L, 3, nh, hd, generator=torch.Generator().manual_seed(3)).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0, :, :, :7], qkv[1], qkv[2]
    do = torch.randn(B, nh, 7, hd, generator=torch.Generator().manual_seed(4))
    kpm = torch.rand(B, L, generator=torch.Generator().manual_seed(5)) > 0.4
    kpm[1] = False  # a batch item with no kept key: zeros, never NaN
    check_backend(tiled(2 * 3 * 7 * 9), q, k, v, do, causal=True, key_padding_mask=kpm)
    check_backend(tiled(2 * 3 * 7 * 9), q, k, v, do)


def test_torch_backend_default_tiles_split_long_sequences():
    # Through cog_attention itself: one head of 1100 x 1000 scores is more than a default tile (query blocks).
    q, k, v, do = make_inputs(1, 1, 1100, 1000, 16, seed=29)
    assert 1100 * 1000 > 2**20
    kpm = torch.ones(1, 1000, dtype=torch.bool)
    kpm[0, 990:] = False
    check_backend("torch", q, k, v, do, causal=True, key_padding_mask=kpm)


def test_compiled_tile_math_matches_f64(caplog):
    # Query-block tiles with causal + padding (rows with no key), then multi-item tiles from a fused qkv.
    q, k, v, do = make_inputs(2, 3, 43, 50, 16, seed=17)
    kpm = torch.rand(2, 50, generator=torch.Generator().manual_seed(0)) > 0.3
    kpm[1, :10] = False
    with caplog.at_level("WARNING", logger="uvic.attention"):
        check_backend(tiled(7 * 50, compile=True), q, k, v, do, causal=True, key_padding_mask=kpm)
        q, k, v, do = make_inputs(3, 4, 65, 65, 32, seed=5)
        check_backend(tiled(2**20, compile=True), q, k, v, do)
    assert "torch.compile" not in caplog.text  # the compiled functions ran (no eager fallback)


def test_compile_failure_falls_back_to_eager(tmp_path):
    """A process whose torch.compile cannot build code: one warning, then eager results (a subprocess, since the
    fallback lasts for the rest of the process)."""
    script = textwrap.dedent("""
        import logging, torch
        def no_compiler(fn, **kwargs):
            def run(*args):
                raise RuntimeError("InvalidCxxCompiler: no working C++ compiler found")
            return run
        torch.compile = no_compiler
        logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
        from uvic.attention import cog_attention, tiled_cog_attention
        q, k, v = torch.randn(3, 2, 2, 17, 16, generator=torch.Generator().manual_seed(2))
        for _ in range(2):
            out = tiled_cog_attention(q, k, v, causal=True, compile=True)
            torch.testing.assert_close(out, cog_attention(q, k, v, causal=True, backend="reference"))
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "ok"
    warnings = [line for line in res.stderr.splitlines() if line.startswith("uvic.attention")]
    assert len(warnings) == 1, res.stderr  # tried once, then eager for the rest of the process
    assert "no working C++ compiler" in warnings[0] and "eager" in warnings[0]


def test_compile_threshold_is_one_default_tile():
    assert COMPILE_MIN_SCORES == 2**20
    q = torch.zeros(1, 1, 1, 16)
    with pytest.raises(ValueError, match="tile_elements"):
        tiled_cog_attention(q, q, q, tile_elements=0)


def test_torch_backend_saves_no_score_matrix():
    """The memory contract: saved for backward are q, k, v, the output and two floats per query row (the row max
    and the row sum of the weights)."""
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
    assert sum(numels) == 4 * B * nh * L * hd + 2 * B * nh * L  # q, k, v, out + m, l; nothing L x L
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
    check_backend(backend, q, k, v, do, attention="softmax", causal=causal, key_padding_mask=kpm)


def test_softmax_torch_backend_is_sdpa():
    q, k, v, _ = make_inputs(2, 2, 16, 16, 32)
    torch.testing.assert_close(softmax_attention(q, k, v, backend="torch"), F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(
        softmax_attention(q, k, v, causal=True, scale=0.3), F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                          scale=0.3)
    )


def test_softmax_auto_is_sdpa():
    q, k, v, _ = make_inputs(2, 2, 16, 16, 32)
    torch.testing.assert_close(softmax_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))


def test_cog_differs_from_softmax_and_has_negative_weights():
    q, k, v, _ = make_inputs(1, 1, 8, 8, 8, dtype=torch.float64)
    eye = torch.eye(8, dtype=torch.float64)[None, None]
    w_cog = cog_attention(q, k, eye, backend="torch")  # v = I exposes the attention matrix
    w_soft = softmax_attention(q, k, eye, backend="torch")
    assert (w_cog < 0).any() and (w_soft >= 0).all()
    torch.testing.assert_close(w_cog.abs().sum(-1), torch.ones(1, 1, 8, dtype=torch.float64))  # sum |w| = 1
    p = (q @ k.transpose(-2, -1)) * 9**-0.5
    torch.testing.assert_close(torch.sign(w_cog), torch.sign(p))


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v, _ = make_inputs(1, 2, 10, 10, 64, dtype=torch.float64)
    torch.testing.assert_close(cog_attention(q, k, v), cog_attention(q, k, v, scale=1 / math.sqrt(64)))
    assert not torch.allclose(cog_attention(q, k, v), cog_attention(q, k, v, scale=1.0))


# ---------------------------------------------------------------------------------------------------------
# Empty inputs and non-finite values in padded keys
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", [cog_attention, softmax_attention])
@pytest.mark.parametrize("backend", ["auto", "reference", "torch"])
@pytest.mark.parametrize("B,Lq,Lk", [(2, 0, 5), (2, 4, 0), (2, 0, 0), (0, 4, 5)])
@pytest.mark.parametrize("causal,pad", [(False, False), (True, True)])
def test_empty_inputs(op, backend, B, Lq, Lk, causal, pad):
    """Lq = 0 gives an empty output, Lk = 0 zeros (every row has no key); gradients are zeros of the inputs' shapes."""
    q, k, v, do = make_inputs(B, 2, Lq, Lk, 16)
    kpm = torch.ones(B, Lk, dtype=torch.bool) if pad else None
    out, dq, dk, dv = fwd_bwd(lambda *a: op(*a, causal=causal, key_padding_mask=kpm, backend=backend), q, k, v, do)
    assert out.shape == (B, 2, Lq, 16) and (out == 0).all()
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == t.shape and (g == 0).all()


def tiles_of_rows(*a, **kw):
    """The "torch" backend over query blocks of 3 rows, eager."""
    return tiled_cog_attention(*a, tile_elements=3 * a[1].shape[2], compile=False, **kw)


@pytest.mark.parametrize("op", [
    cog_attention,
    softmax_attention,
    tiles_of_rows,
])
@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_keys_are_never_read(op, backend, causal):
    """NaN and Inf in the k and v rows of padded keys reach no output and no gradient: the results equal those
    with finite rows, and the padded rows' gradients are zero."""
    q, k, v, do = make_inputs(2, 2, 7, 9, 16, seed=31)
    kpm = torch.ones(2, 9, dtype=torch.bool)
    kpm[0, 6:] = False
    kpm[1, :2] = False
    bad_k, bad_v = k.clone(), v.clone()
    bad_k[0, :, 6] = float("nan")
    bad_k[1, :, 0] = float("inf")
    bad_v[0, :, 7] = float("nan")
    bad_v[1, :, 1] = float("-inf")
    kw = {"causal": causal, "key_padding_mask": kpm}
    if op is not tiles_of_rows:
        kw["backend"] = backend
    clean = fwd_bwd(op, q, k, v, do, **kw)
    dirty = fwd_bwd(op, q, bad_k, bad_v, do, **kw)
    for a, b in zip(dirty, clean):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    _, _, dk, dv = dirty
    assert (dk[0, :, 6:] == 0).all() and (dv[1, :, :2] == 0).all()
    expect = cog_f64(q, k, v, causal=causal, kpm=kpm, attention="softmax" if op is softmax_attention else "cog")
    assert (dirty[0].double() - expect).abs().max() < 1e-5


def test_causally_masked_keys_are_ordinary_values():
    """Only key padding drops a key's rows: a NaN in a key that the causal mask hides from rows 0 and 1 is an
    ordinary value (it is read, as by SDPA) and reaches the output."""
    q, k, v, _ = make_inputs(1, 1, 4, 4, 16)
    v[0, 0, 2] = float("nan")
    for backend in ("reference", "torch"):
        out = cog_attention(q, k, v, causal=True, backend=backend)
        assert torch.isnan(out[0, 0, 2:]).all()
        out = cog_attention(q, k, v, causal=True, backend=backend, key_padding_mask=torch.arange(4)[None] != 2)
        assert torch.isfinite(out).all()


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
        ((q[..., :0], k[..., :0], v[..., :0]), {}, "head dim is 0"),
        ((q.to("meta"), k.to("meta"), v.to("meta")), {}, "meta tensors"),
        ((q, k, v), {"window": 3}, "window must be"),
        ((q, k, v), {"window": (2, -2)}, "window must be"),
        ((q, k, v), {"window": (2.0, 1)}, "window must be"),
        ((q, k, v), {"softcap": 0.0}, "softcap must be"),
        ((q, k, v), {"softcap": float("inf")}, "softcap must be"),
    ]
    for args, kw, msg in cases:
        for backend in ("auto", "reference", "torch") if "backend" not in kw else (kw["backend"],):
            with pytest.raises(ValueError, match=None) as info:
                op(*args, **{"backend": backend, **kw})
            assert msg in str(info.value), (msg, backend, str(info.value))


def test_kept_by_mask_reads_bool_and_additive_masks():
    keep = torch.tensor([[True, False, True]])
    assert kept_by_mask(keep) is keep
    additive = torch.tensor([[0.0, float("-inf"), -1e4, 0.0]])
    assert kept_by_mask(additive, -1e4).tolist() == [[True, False, False, True]]
    assert kept_by_mask(additive, -2e4) is None  # -1e4 is then a bias, not a removed key
    assert kept_by_mask(torch.tensor([[0.0, 0.5]]), -1e4) is None
    # The default: half the dtype's lowest value, where masks built from finfo.min sit (and -inf).
    low = torch.finfo(torch.float16).min
    assert kept_by_mask(torch.tensor([0.0, low, low / 2, float("-inf")], dtype=torch.float16)).tolist() == [
        True, False, False, False]
    assert kept_by_mask(torch.tensor([0.0, low / 4], dtype=torch.float16)) is None


def test_triton_backend_on_cpu_is_a_clear_error():
    q, k, v, _ = make_inputs(1, 1, 4, 4, 16)
    why = unsupported_reason(q, k, v, backend="triton")
    assert why is not None and ("CUDA" in why or "triton is not installed" in why)
    with pytest.raises(ValueError, match="backend='triton' cannot run on these inputs: " + why.split(";")[0]):
        cog_attention(q, k, v, backend="triton")
    for backend in ("auto", "reference", "torch"):
        assert unsupported_reason(q, k, v, backend=backend) is None
    assert "unknown attention backend" in unsupported_reason(q, k, v, backend="flash")
    # "auto" falls back to the torch backend on CPU.
    torch.testing.assert_close(cog_attention(q, k, v), cog_attention(q, k, v, backend="torch"))


def _frames(fn) -> collections.Counter:
    """The Python functions one call of `fn` enters, by name (frames counted with sys.setprofile)."""
    entered = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            entered[frame.f_code.co_name] += 1
            entered[Path(frame.f_code.co_filename).name] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return entered


def _host_work(op, q, k, v) -> collections.Counter:
    with torch.no_grad():
        op(q, k, v)  # first-call work out of the way
        return _frames(lambda: op(q, k, v))


@pytest.mark.parametrize("op", [cog_attention, softmax_attention])
def test_host_work_per_call_on_cpu(op):
    """The Python a call runs before its math: the input checks once, and no autocast context while autocast is
    off (entering `torch.autocast` cost several microseconds, as much as the checks; under autocast one is entered,
    the op's math being float32). softmax_attention's whole call is a few frames around SDPA."""
    q, k, v, _ = make_inputs(1, 2, 16, 16, 64)
    frames = _host_work(op, q, k, v)
    assert frames["_input_problem"] == 1 and frames["autocast_mode.py"] == 0
    if op is softmax_attention:
        assert sum(n for name, n in frames.items() if not name.endswith(".py")) <= 10
    with torch.autocast("cpu", dtype=torch.bfloat16):
        frames = _host_work(op, q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert frames["_input_problem"] == 1 and frames["autocast_mode.py"] >= (op is cog_attention)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_checks_a_cuda_call_once():
    """backend="auto" on 16-bit CUDA inputs: the input checks run once and then only the kernel's envelope is
    asked (the whole `unsupported_reason(backend="triton")` used to run a second time), and no autocast context is
    entered while autocast is off."""
    q, k, v = (torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    frames = _host_work(cog_attention, q, k, v)
    assert unsupported_reason(q, k, v, backend="triton") is None  # the call ran the kernel
    assert frames["_input_problem"] == 1 and frames["_kernel_problem"] == 1 and frames["autocast_mode.py"] == 0


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
    expect = cog_f64(q.detach(), k.detach(), v.detach(), causal=True,
                     attention="cog" if op is cog_attention else "softmax")
    assert (out.double() - expect).abs().max() < 0.05


@pytest.mark.parametrize("op, kw", [(cog_attention, {}), (softmax_attention, {"softcap": 5.0})], ids=["cog", "softmax"])
@pytest.mark.parametrize("where", ["eager, backward inside autocast", "torch.compile"])
def test_backward_under_autocast(op, kw, where):
    """The torch backend's backward in an autocast state: called inside the autocast block in eager mode, and
    traced by torch.compile (AOTAutograd runs the backward of an autograd.Function in the caller's autocast, not in
    the forward's). It used to fail there with "expected scalar type BFloat16 but found Float": autocast turned the
    float32 tile products into bf16 ones, which its float32 `out=` buffers refuse. The gradients are those of a
    backward called outside autocast, where it always worked. q, k, v come from a projection, as in a model, so
    they are bf16 tensors made under autocast (inside the compiled graph)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 9, 8, generator=g)
    w = torch.randn(3, 8, 8, generator=g)

    def attend(x, w):
        return op(x @ w[0], x @ w[1], x @ w[2], backend="torch", **kw)  # (B, nh, L, hd) bf16

    def grads(fn, backward_inside: bool):
        wl = w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x, wl)
            if backward_inside:
                out.float().square().sum().backward()
        if not backward_inside:
            out.float().square().sum().backward()
        return out, wl.grad

    expect_out, expect_grad = grads(attend, backward_inside=False)
    if where == "torch.compile":
        torch._dynamo.reset()
        # aot_eager: AOTAutograd traces the backward as Inductor's does (where it failed), without compiling C++.
        out, grad = grads(torch.compile(attend, backend="aot_eager", fullgraph=True), backward_inside=False)
        torch._dynamo.reset()
    else:
        out, grad = grads(attend, backward_inside=True)
    assert out.dtype == torch.bfloat16 and grad.dtype == torch.float32
    torch.testing.assert_close(out, expect_out, rtol=0, atol=0)
    torch.testing.assert_close(grad, expect_grad, rtol=1e-2, atol=1e-2 * expect_grad.abs().max().item())


# ---------------------------------------------------------------------------------------------------------
# Sliding windows and logit softcaps (FlashAttention's window_size and softcap)
# ---------------------------------------------------------------------------------------------------------

# (Lq, Lk, causal, window, softcap, pad): window 1 (a row sees only its diagonal key), windows wider than the keys,
# two-sided and one-sided windows, windows with key padding, softcaps with masked keys, Lq != Lk both ways (rows
# that see no key: Lq > Lk causal, or a window that ends before key 0).
WINDOW_CASES = [
    (33, 33, True, (0, -1), None, False),
    (33, 33, False, (0, 0), 2.0, True),
    (33, 33, True, (40, -1), None, False),
    (33, 33, False, (50, 50), 1.0, False),
    (40, 40, True, (6, -1), None, True),
    (40, 40, False, (3, 7), 2.0, True),
    (40, 40, False, (-1, 4), None, False),
    (17, 45, True, (5, 0), 5.0, True),
    (45, 17, True, (3, -1), 0.5, True),
    (45, 17, False, (2, 2), None, False),
    (29, 29, False, None, 1.5, True),
]


@pytest.mark.parametrize("op", [cog_attention, softmax_attention])
@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("Lq,Lk,causal,window,softcap,pad", WINDOW_CASES)
def test_window_and_softcap_match_f64(op, backend, Lq, Lk, causal, window, softcap, pad):
    q, k, v, do = make_inputs(2, 3, Lq, Lk, 16, seed=Lq + 3 * Lk, qk_std=2.0)
    kpm = None
    if pad:
        kpm = torch.rand(2, Lk, generator=torch.Generator().manual_seed(2)) > 0.35
        kpm[1, Lk // 2 :] = False  # late rows of item 1 have their whole window padded away
    attention = "cog" if op is cog_attention else "softmax"
    kw = {"causal": causal, "window": window, "softcap": softcap, "key_padding_mask": kpm}
    # floor: rows with one kept key have dS = A (s g - D) = 0 exactly in the plain formula's autograd (softmax over
    # one entry), while the tiled backend's g = dO . v and D = dO . O round differently (~1e-6 at these sizes).
    check_backend(backend, q, k, v, do, attention=attention, floor=1e-5, **kw)
    if backend == "torch" and attention == "cog":
        # Small banded tiles: blocks of 5 query rows over the keys of their band (the skipping path).
        check_backend(tiled(3 * 5 * 8), q, k, v, do, floor=1e-5, **kw)


def test_window_one_and_window_wider_than_keys():
    q, k, v, _ = make_inputs(1, 2, 20, 20, 8, dtype=torch.float64, seed=4)
    for op in (cog_attention, softmax_attention):
        for backend in ("reference", "torch"):
            # window (0, 0): each row keeps only its diagonal key, so o_i = sign(p_ii) v_i (Cog) or v_i (softmax).
            out = op(q, k, v, window=(0, 0), backend=backend)
            p_ii = (q * k).sum(-1, keepdim=True)
            want = torch.sign(p_ii) * v if op is cog_attention else v
            torch.testing.assert_close(out, want)
            # a window reaching past every key is no window.
            torch.testing.assert_close(op(q, k, v, causal=True, window=(25, 3), backend=backend),
                                       op(q, k, v, causal=True, backend=backend))


@pytest.mark.parametrize("Lq,Lk", [(6, 9), (9, 6)])
def test_windows_larger_than_any_index_are_unbounded(Lq, Lk):
    """A side past every key (up to 10**30, beyond int64) keeps the keys the unbounded side keeps; the reference
    with the side written as -1 is the expected value, and the widest side that still bounds the band on its own
    (left Lk - 1, right Lq - 1) gives the same keys too."""
    q, k, v, _ = make_inputs(2, 2, Lq, Lk, 8, dtype=torch.float64, seed=5)
    kpm = torch.rand(2, Lk, generator=torch.Generator().manual_seed(3)) > 0.3
    for op in (cog_attention, softmax_attention):
        attention = "cog" if op is cog_attention else "softmax"
        for huge, unbounded, widest in [((10**30, 0), (-1, 0), (Lk - 1, 0)), ((1, 2**63), (1, -1), (1, Lq - 1)),
                                        ((10**30, 10**30), None, (Lk - 1, Lq - 1))]:
            want = attention_ref(q, k, v, key_padding_mask=kpm, window=unbounded, attention=attention)
            torch.testing.assert_close(attention_ref(q, k, v, key_padding_mask=kpm, window=widest,
                                                     attention=attention), want)
            for backend in ("reference", "torch", "auto"):
                torch.testing.assert_close(op(q, k, v, key_padding_mask=kpm, window=huge, backend=backend), want)


def test_softcap_keeps_signs_and_bounds_magnitudes():
    # With c small against |p|, every |p'| = c tanh(|p| / c) is close to c: the weights of kept keys become
    # nearly uniform in magnitude, and their signs stay those of p.
    q, k, v, _ = make_inputs(1, 1, 6, 9, 9, dtype=torch.float64, seed=8, qk_std=4.0)
    p = (q @ k.transpose(-2, -1)) * 9**-0.5
    assert p.abs().min() > 0.02  # |p| / c > 20: tanh is 1 to float64 precision
    eye = torch.eye(9, dtype=torch.float64).expand(1, 1, 9, 9)
    for backend in ("reference", "torch"):
        attn = cog_attention(q, k, eye, softcap=1e-3, backend=backend)  # v = identity: the output is the weights
        torch.testing.assert_close(attn, torch.sign(p) / 9, atol=1e-6, rtol=0)


@pytest.mark.parametrize("attention", ["cog", "softmax"])
def test_window_softcap_gradcheck_float64(attention):
    q, k, v, _ = make_inputs(1, 2, 6, 8, 4, dtype=torch.float64, seed=12)
    kpm = torch.tensor([[True, True, False, True, True, True, False, True]])
    op = cog_attention if attention == "cog" else softmax_attention
    for backend in ("reference", "torch"):
        inputs = tuple(t.clone().requires_grad_(True) for t in (q, k, v))
        fn = lambda q_, k_, v_: op(q_, k_, v_, causal=True, window=(2, -1), softcap=0.8, key_padding_mask=kpm,
                                   backend=backend)
        assert torch.autograd.gradcheck(fn, inputs)


def test_banded_tiles_skip_keys_outside_the_band():
    """The torch backend's tiles cover only key blocks some row of the tile can see: the scores it computes for a
    causal or windowed call are within one tile-diagonal of the band's area, not the full Lq x Lk."""
    from uvic.attention import _band, _tile_keys, _tiles

    Lq = Lk = 2048
    nh = 12
    for causal, window, band_area in [(True, None, Lq * (Lq + 1) // 2), (True, (255, -1), 256 * Lq),
                                      (False, (63, 64), 128 * Lq)]:
        band = _band(causal, window)
        computed = 0
        for _, hs, rs in _tiles(1, nh, Lq, Lk, 2**20, band):
            ks = _tile_keys(rs, Lq, Lk, band)
            computed += (hs.stop - hs.start) * (rs.stop - rs.start) * (ks.stop - ks.start)
        rows = max(rs.stop - rs.start for _, _, rs in _tiles(1, nh, Lq, Lk, 2**20, band))
        assert nh * band_area <= computed <= nh * (band_area + rows * Lk), (causal, window, computed / nh / band_area)


def test_the_attention_compile_does_not_show_torch_cuda_home_warning(tmp_path):
    """A CUDA build of torch on a machine without a GPU logs "No CUDA runtime is found, using CUDA_HOME=..." when
    torch.compile's Inductor first imports torch.utils.cpp_extension; uvic's compile of the tile math is the one that
    triggers it in a CPU user's process, and hides it. (torch.compile is replaced by what it does first, that
    import, so the test does not wait for Inductor; the other half shows the set-up provokes the warning.)"""
    if not (torch.cuda._is_compiled() and torch.version.cuda) or torch.cuda.is_available():
        pytest.skip("torch logs the warning only from a CUDA build without a GPU")
    script = textwrap.dedent("""
        import importlib, logging, sys
        import torch
        from uvic.attention import tiled_cog_attention

        def compile(fn, **kwargs):  # what Inductor's first compile does before anything else here
            importlib.import_module("torch.utils.cpp_extension")
            return fn

        logging.basicConfig()
        if sys.argv[1] == "uvic":
            torch.compile = compile
            q = torch.randn(1, 2, 16, 8)
            tiled_cog_attention(q, q, q, compile=True)
        else:
            importlib.import_module("torch.utils.cpp_extension")
    """)
    env = {**os.environ, "CUDA_HOME": str(tmp_path), "OMP_NUM_THREADS": "1"}
    runs = {how: subprocess.run([sys.executable, "-c", script, how], env=env, capture_output=True, text=True,
                                timeout=300) for how in ("uvic", "plain")}
    assert runs["plain"].returncode == 0 and "No CUDA runtime is found" in runs["plain"].stderr
    assert runs["uvic"].returncode == 0, runs["uvic"].stderr
    assert "No CUDA runtime is found" not in runs["uvic"].stderr


# ---------------------------------------------------------------------------------------------------------
# Attention kinds: the op picker and the placement rule
# ---------------------------------------------------------------------------------------------------------


def test_attention_op_picks_the_op_of_each_kind():
    from uvic.attention import ATTENTIONS, attention_op

    assert [attention_op(kind) for kind in ATTENTIONS] == [cog_attention, softmax_attention]
    with pytest.raises(ValueError, match=r"attention must be one of \('cog', 'softmax'\), got 'linear'"):
        attention_op("linear")


@pytest.mark.parametrize(
    "n, first, last, expected",
    [
        (5, 1, 1, "SCCCS"),  # U-ViC / Cogformer k = 1: softmax in the first and last layer
        (5, 0, 0, "CCCCC"),  # Cog everywhere
        (5, 1, 0, "SCCCC"),  # the paper's ablation: softmax in the first layer only
        (6, 2, 2, "SSCCSS"),  # Cogformer 600M's k = 2, at a smaller depth
        (6, 0, 4, "CCSSSS"),
        (1, 0, 0, "C"),
        (0, 0, 0, ""),
    ],
)
def test_attention_placement(n, first, last, expected):
    from uvic.attention import attention_placement

    kinds = attention_placement(n, first, last)
    assert "".join("C" if kind == "cog" else "S" for kind in kinds) == expected
    assert attention_placement(n, first, last, "softmax") == ["softmax"] * n


@pytest.mark.parametrize("bad", [-1, True, False, 1.0, 0.5, float("nan"), float("inf"), 1e6, "1", None, [1]])
def test_placement_counts_must_be_ints_at_least_0(bad):
    from uvic.attention import attention_placement, check_softmax_count

    with pytest.raises(ValueError, match=r"^cog_keep_softmax must be an int >= 0, got "):
        check_softmax_count(bad, "cog_keep_softmax")
    with pytest.raises(ValueError, match=r"^keep_softmax_last must be an int >= 0"):
        attention_placement(5, 1, bad)
    with pytest.raises(ValueError, match=r"^n_first must be an int >= 0"):
        attention_placement(5, bad, 1, allow_overlap=True, names=("n_first", "n_last"))


def test_placement_overlap_is_refused_unless_allowed(recwarn):
    from uvic.attention import attention_placement

    with pytest.raises(ValueError, match=r"keep_softmax_first=3 and keep_softmax_last=3 keep softmax in 6 layers, "
                                         r"more than the 5 there are"):
        attention_placement(5, 3, 3)
    # The integrations: one count for stacks of any length; a short stack keeps softmax everywhere, silently
    # (they warn once for the whole model).
    assert attention_placement(5, 3, 3, allow_overlap=True) == ["softmax"] * 5
    assert attention_placement(2, 1, 1, allow_overlap=True) == ["softmax"] * 2
    assert not recwarn.list
    # Exactly every layer: allowed, but a Cog model without a Cog layer warns.
    with pytest.warns(UserWarning, match=r"attention='cog' with keep_softmax_first=2 and keep_softmax_last=3 keeps all "
                                         r"5 layers on softmax"):
        assert attention_placement(5, 2, 3) == ["softmax"] * 5
    attention_placement(5, 2, 3, "softmax")  # nothing to say for a softmax model
    assert not recwarn.list
