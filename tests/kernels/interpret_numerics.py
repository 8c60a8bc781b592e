"""Numerics of the fused kernels under the Triton interpreter (CPU) against the float64 reference.

Run by test_triton_interpret.py in a subprocess with TRITON_INTERPRET=1 (triton decides between compiled and
interpreted kernels, its own included, when it is first imported). By hand:
    TRITON_INTERPRET=1 python -m pytest tests/kernels/interpret_numerics.py -q

FlashAttention's rule: the error of the kernel (vs attention_ref in float64) on the output and on dq, dk, dv is at
most 2x the error of the plain formula computed in the input dtype, plus a small floor: 1e-5 for float32, and
for 16-bit inputs one rounding (unit roundoff) of the largest reference value. The floor covers short rows (one
or two kept keys), where dq/dk are small differences of O(1) terms and the kernel's rounding of dS and O to the
input dtype (as in every flash kernel) differs in pattern from the plain formula's.
"""

import math
import os

import pytest
import torch


if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.fail("run with TRITON_INTERPRET=1 set before python starts (see the module docstring)", pytrace=False)

import ptx_emulator

import uvic.kernels.attention as kattn
from uvic.attention import attention_ref, cog_attention, softmax_attention
from uvic.kernels.configs import HEAD_DIMS, KernelConfig, all_configs, candidate_configs
from uvic.kernels.ops import fused_attention


def _floor(dtype, ref):
    if dtype == torch.float32:
        return 1e-5
    return 0.5 * torch.finfo(dtype).eps * ref.abs().max().item()


def _assert_output_close(out, want, dtype):
    """A forward output against its float64 value: 1e-6 for fp32; for 16-bit inputs two units of roundoff of the
    largest value (P and O are rounded to the input dtype)."""
    tol = 1e-6 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(out, want, rtol=tol, atol=tol * want.abs().max().item())


def _inputs(B, nh, Lq, Lk, hd, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, nh, Lq, hd, generator=g, dtype=torch.float64)
    k = torch.randn(B, nh, Lk, hd, generator=g, dtype=torch.float64)
    v = torch.randn(B, nh, Lk, hd, generator=g, dtype=torch.float64)
    do = torch.randn(B, nh, Lq, hd, generator=g, dtype=torch.float64)
    q, k, v, do = (t.to(dtype).to(torch.float64) for t in (q, k, v, do))  # exactly representable in dtype
    return q, k, v, do


def _strided(t, dtype, layout):
    """t (B, nh, L, hd) float64 -> the same values in dtype (a fresh leaf tensor), laid out as asked."""
    t = t.detach().clone()
    if layout == "bshd":  # (B, L, nh, hd) storage, as a fused qkv projection gives
        return t.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "gapped":  # non-unit last-dim stride
        big = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=dtype)
        big[..., ::2] = t.to(dtype)
        return big[..., ::2]
    return t.to(dtype).contiguous()


def _mask(kind, B, Lk, seed=1):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    kpm = torch.rand(B, Lk, generator=g) > 0.4
    if kind == "empty_batch" and B > 1:
        kpm[-1] = False  # every query of the last batch item has no kept key
    kpm[0, 0] = True
    return kpm


def _fused(*args, attention="cog", **kw):
    """The fused op called with the reference's keywords (`attention` is the kind, the op takes `cog`)."""
    return fused_attention(*args, cog=attention == "cog", **kw)


def _run(fn, q, k, v, do, dtype, layout="contiguous", **kw):
    ts = [_strided(t, dtype, layout).requires_grad_() for t in (q, k, v)]
    out = fn(*ts, **kw)
    out.backward(_strided(do, dtype, "contiguous"))
    return [out.detach().double()] + [t.grad.double() for t in ts]


def _check(q, k, v, do, dtype, *, causal, kpm, cog, scale=None, layout="contiguous", window=None, softcap=None):
    kw = {"causal": causal, "key_padding_mask": kpm, "scale": scale, "window": window, "softcap": softcap}
    kw["attention"] = "cog" if cog else "softmax"
    exact = _run(lambda *a, **k_: attention_ref(*a, **k_), q, k, v, do, torch.float64, **kw)
    plain = _run(lambda *a, **k_: attention_ref(*a, upcast=False, **k_), q, k, v, do, dtype, **kw)
    fused = _run(_fused, q, k, v, do, dtype, layout=layout, **kw)
    for name, f, p, e in zip(("out", "dq", "dk", "dv"), fused, plain, exact):
        assert torch.isfinite(f).all(), f"{name} has NaN/inf"
        err, err_plain = (f - e).abs().max().item(), (p - e).abs().max().item()
        assert err <= 2 * err_plain + _floor(dtype, e), f"{name}: fused err {err:.3g} vs plain {dtype} err {err_plain:.3g}"
    return fused


# (B, nh, Lq, Lk, hd, dtype, causal, mask, cog, layout): covers L in {1, 17, 65, 130, 258}, Lq != Lk (incl.
# Lq = 1 and Lq > Lk with causal rows that see no key), every head dim in fp32 and in 16-bit, both modes.
CASES = [
    (1, 2, 1, 1, 16, torch.float32, False, None, True, "contiguous"),
    (2, 1, 17, 17, 32, torch.float32, True, None, True, "bshd"),
    (1, 2, 65, 65, 64, torch.float32, False, "empty_batch", True, "contiguous"),
    (1, 1, 130, 130, 128, torch.float32, True, "partial", True, "gapped"),
    (2, 1, 65, 17, 32, torch.float32, True, "partial", True, "contiguous"),
    (1, 2, 17, 130, 64, torch.float32, True, None, False, "contiguous"),
    (2, 1, 130, 130, 16, torch.float16, True, "empty_batch", True, "contiguous"),
    (1, 1, 258, 258, 64, torch.bfloat16, True, None, True, "bshd"),
    (2, 1, 1, 258, 128, torch.float16, True, "partial", True, "contiguous"),
    (1, 2, 65, 65, 32, torch.bfloat16, False, "partial", True, "contiguous"),
    (1, 1, 40, 17, 128, torch.bfloat16, False, None, False, "contiguous"),
    (2, 1, 65, 130, 16, torch.float16, True, "empty_batch", False, "contiguous"),
    # head dim 256: ragged L, Lq > Lk causal (rows with no key), Lq < Lk, masks, strides, 16-bit and both modes
    (1, 1, 65, 40, 256, torch.float32, True, "partial", True, "bshd"),
    (2, 1, 130, 130, 256, torch.float32, False, "empty_batch", True, "gapped"),
    (1, 2, 33, 70, 256, torch.bfloat16, True, None, True, "contiguous"),
    (2, 1, 130, 258, 256, torch.float16, True, "partial", True, "contiguous"),
    (1, 1, 33, 17, 256, torch.float16, False, "partial", False, "contiguous"),
]


@pytest.mark.parametrize("B,nh,Lq,Lk,hd,dtype,causal,mask,cog,layout", CASES)
def test_matches_reference(B, nh, Lq, Lk, hd, dtype, causal, mask, cog, layout):
    q, k, v, do = _inputs(B, nh, Lq, Lk, hd, dtype)
    kpm = _mask(mask, B, Lk)
    _check(q, k, v, do, dtype, causal=causal, kpm=kpm, cog=cog, layout=layout)


def _use_sign_ptx(monkeypatch) -> ptx_emulator.Emulator:
    """Run the forward as GPUs of compute capability 8.6+ do for 16-bit inputs: Cog's sign through the inline PTX
    `min.xorsign.abs` (`_signed_operand`), which the interpreter runs through tests/kernels/ptx_emulator.py."""
    monkeypatch.setattr(kattn, "INTERPRET_SIGN_PTX", True)
    return ptx_emulator.install(monkeypatch)


SIGN_PTX_CASES = [c for c in CASES if c[5] != torch.float32 and c[8]]  # 16-bit inputs, Cog


@pytest.mark.parametrize("B,nh,Lq,Lk,hd,dtype,causal,mask,cog,layout", SIGN_PTX_CASES)
def test_matches_reference_with_sign_ptx(monkeypatch, B, nh, Lq, Lk, hd, dtype, causal, mask, cog, layout):
    """The 16-bit Cog cases of `test_matches_reference` again, with the forward's sign step in the form sm_86+ runs."""
    emu = _use_sign_ptx(monkeypatch)
    q, k, v, do = _inputs(B, nh, Lq, Lk, hd, dtype)
    _check(q, k, v, do, dtype, causal=causal, kpm=_mask(mask, B, Lk), cog=cog, layout=layout)
    assert emu.calls > 0  # the PTX path really ran


def test_sign_ptx_cases_cover_both_dtypes_and_masks():
    kinds = {(c[5], c[6], c[7]) for c in SIGN_PTX_CASES}
    assert {d for d, _, _ in kinds} == {torch.float16, torch.bfloat16}
    assert {m for _, _, m in kinds} == {None, "partial", "empty_batch"} and {c for _, c, _ in kinds} == {False, True}


@pytest.mark.parametrize("causal", [False, True])
def test_other_block_sizes(monkeypatch, causal):
    """Tiles whose sizes differ per kernel (BM > BN and BM < BN) cross the causal diagonal differently."""
    monkeypatch.setitem(kattn.INTERPRET_CONFIGS, "fwd", KernelConfig(16, 32, 4, 1))
    monkeypatch.setitem(kattn.INTERPRET_CONFIGS, "bwd_dkdv", KernelConfig(32, 16, 4, 1))
    monkeypatch.setitem(kattn.INTERPRET_CONFIGS, "bwd_dq", KernelConfig(16, 32, 4, 1))
    q, k, v, do = _inputs(1, 2, 70, 57, 32, torch.float32, seed=3)
    _check(q, k, v, do, torch.float32, causal=causal, kpm=_mask("partial", 1, 57), cog=True)


@pytest.mark.parametrize("arch", [80, 90])
def test_head_dim_256_gpu_tiles(monkeypatch, arch):
    """The kernels run with the very tiles the autotuner may pick for head dim 256 (the interpreter ignores warps
    and stages): bf16, causal with Lq > Lk, a key padding mask, lengths that are not tile multiples."""
    for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
        for c in candidate_configs(kernel, arch, "bf16", 256):
            monkeypatch.setitem(kattn.INTERPRET_CONFIGS, kernel, c)
            q, k, v, do = _inputs(1, 1, 100, 75, 256, torch.bfloat16, seed=8)
            _check(q, k, v, do, torch.bfloat16, causal=True, kpm=_mask("partial", 1, 75), cog=True)


def test_exact_zero_scores_and_negative_scale():
    """sign(0) = 0: zero query/key vectors count in the denominator but not the numerator; scale < 0 flips signs."""
    q, k, v, do = _inputs(1, 1, 33, 33, 16, torch.float32, seed=4)
    q[..., 3, :] = 0.0
    k[..., 5, :] = 0.0
    _check(q, k, v, do, torch.float32, causal=True, kpm=None, cog=True)
    _check(q, k, v, do, torch.float32, causal=False, kpm=None, cog=True, scale=-0.3)


def test_no_kept_key_gives_exact_zeros():
    q, k, v, do = _inputs(2, 2, 20, 20, 16, torch.float32, seed=5)
    kpm = torch.ones(2, 20, dtype=torch.bool)
    kpm[1] = False
    out, dq, dk, dv = _run(lambda *a, **kw: fused_attention(*a, **kw), q, k, v, do, torch.float32,
                           key_padding_mask=kpm)
    for t in (out, dq, dk, dv):
        assert torch.equal(t[1], torch.zeros_like(t[1]))
    assert out[0].abs().sum() > 0


def test_backward_is_deterministic():
    q, k, v, do = _inputs(1, 2, 50, 50, 32, torch.float16, seed=6)
    first = _run(lambda *a, **kw: fused_attention(*a, **kw), q, k, v, do, torch.float16, causal=True)
    second = _run(lambda *a, **kw: fused_attention(*a, **kw), q, k, v, do, torch.float16, causal=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", [cog_attention, softmax_attention])
def test_dispatcher_triton_backend_matches_reference(op):
    q, k, v, do = _inputs(2, 2, 37, 37, 32, torch.float32, seed=7)
    kpm = _mask("partial", 2, 37)
    ref = _run(lambda *a, **kw: op(*a, backend="reference", **kw), q, k, v, do, torch.float32, causal=True,
               key_padding_mask=kpm)
    tri = _run(lambda *a, **kw: op(*a, backend="triton", **kw), q, k, v, do, torch.float32, causal=True,
               key_padding_mask=kpm)
    for a, b in zip(tri, ref):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)



def test_autotuner_picks_only_checked_candidates():
    """The prune hook never leaves the candidate list that the AOT test compiles, and what it keeps is in the
    autotuner's config list (`all_configs`), so no launch is left with no config."""
    for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
        for arch in (80, 90):
            tuned = all_configs(arch)[kernel]
            for dtype, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "fp32")):
                for hd in HEAD_DIMS:
                    for banded in (False, True):
                        allowed = candidate_configs(kernel, arch, name, hd, banded)
                        assert allowed, (kernel, arch, name, hd, banded)
                        for bucket in (16, 64, 256, 16384):
                            picked = kattn.pick_candidates(kernel, arch, dtype, hd, bucket, banded)
                            assert picked and all(c in allowed and c in tuned for c in picked)


def test_backward_accepts_strided_lse():
    """attention_backward indexes LSE as contiguous (B*nh, Lq): a strided lse (as a compiled graph may hand it
    back) gives the same gradients, bit for bit."""
    q, k, v, do = (t.float() for t in _inputs(2, 3, 37, 37, 16, torch.float32, seed=9))
    out, lse = kattn.attention_forward(q, k, v, None, True, 0.25, True)
    strided = lse.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous() and torch.equal(strided, lse)
    want = kattn.attention_backward(do, q, k, v, out, lse, None, True, 0.25, True)
    got = kattn.attention_backward(do, q, k, v, out, strided, None, True, 0.25, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_packed_qkv_beyond_32_bit_offsets(tmp_path):
    """q, k, v interleaved in one buffer with a row stride of 2**22 elements and L = 520: row offsets inside a
    (batch, head) slice reach 2.2e9 > 2**31, where 32-bit offsets wrap (the kernels read out of bounds). The buffer
    is a sparse file mapping, so only the rows used take memory or disk."""
    L, hd, S, dtype = 520, 16, 2**22, torch.float16
    n = (L - 1) * S + 3 * hd
    path = tmp_path / "packed.bin"
    with open(path, "wb") as f:
        f.truncate(n * torch.finfo(dtype).bits // 8)
    big = torch.from_file(str(path), shared=True, size=n, dtype=dtype)
    q, k, v, do = _inputs(1, 1, L, L, hd, dtype, seed=10)
    packed = []
    for j, t in enumerate((q, k, v)):
        view = big[j * hd :].as_strided((1, 1, L, hd), (0, 0, S, 1))
        view.copy_(t.to(dtype))
        packed.append(view.requires_grad_())
    assert (L - 1) * S >= 2**31
    out = fused_attention(*packed, causal=True)
    out.backward(do.to(dtype))
    fused = [out.detach().double()] + [t.grad.double() for t in packed]
    exact = _run(lambda *a, **kw: attention_ref(*a, **kw), q, k, v, do, torch.float64, causal=True)
    plain = _run(lambda *a, **kw: attention_ref(*a, upcast=False, **kw), q, k, v, do, dtype, causal=True)
    for name, f, p, e in zip(("out", "dq", "dk", "dv"), fused, plain, exact):
        err, err_plain = (f - e).abs().max().item(), (p - e).abs().max().item()
        assert err <= 2 * err_plain + _floor(dtype, e), f"{name}: fused err {err:.3g} vs plain {dtype} err {err_plain:.3g}"


@pytest.mark.parametrize("cog,dtype,sign_ptx", [(cog, dtype, False) for cog in (True, False)
                                                for dtype in (torch.float32, torch.bfloat16)]
                         + [(True, torch.bfloat16, True)])
def test_masked_keys_are_never_read(monkeypatch, cog, dtype, sign_ptx):
    """NaN / Inf in the k and v rows of keys that key_padding_mask removes reach no output and no gradient: out,
    dq and the dk/dv of kept keys are bitwise those of the same inputs with finite rows there, and the removed
    keys' dk/dv are exactly zero. Covers a batch item with no kept key, causal and ragged lengths."""
    emu = _use_sign_ptx(monkeypatch) if sign_ptx else None
    B, nh, Lq, Lk, hd = 2, 2, 37, 45, 16
    q, k, v, do = _inputs(B, nh, Lq, Lk, hd, dtype, seed=11)
    kpm = _mask("empty_batch", B, Lk, seed=12)
    poisoned_k, poisoned_v = k.clone(), v.clone()
    drop = ~kpm[:, None, :, None].expand(B, nh, Lk, hd)
    poisoned_k[drop] = float("nan")
    poisoned_v[drop] = torch.tensor([float("inf"), float("-inf"), float("nan")]).repeat(drop.sum() // 3 + 1)[
        : drop.sum()
    ].double()
    for causal in (False, True):
        kw = {"causal": causal, "key_padding_mask": kpm, "attention": "cog" if cog else "softmax"}
        clean = _run(_fused, q, k, v, do, dtype, **kw)
        dirty = _run(_fused, q, poisoned_k, poisoned_v, do, dtype, **kw)
        for name, c, d in zip(("out", "dq", "dk", "dv"), clean, dirty):
            assert torch.isfinite(d).all(), f"{name}: a removed key's NaN/Inf leaked"
            assert torch.equal(c, d), f"{name} depends on the removed keys' k/v rows"
        for g in dirty[2:]:
            assert torch.equal(g[drop], torch.zeros_like(g[drop]))
        # and the clean run still matches the reference
        _check(q, k, v, do, dtype, causal=causal, kpm=kpm, cog=cog)
    assert emu is None or emu.calls > 0


# (dtype, sign_ptx): every dtype with the clamp, the 16-bit ones also with `min.xorsign.abs` (sm_86+'s form)
SIGN_FORMS = [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True),
              (torch.float16, True)]


@pytest.mark.parametrize("dtype,sign_ptx", SIGN_FORMS)
@pytest.mark.parametrize("scale", [0.5, -0.5, 0.0])
def test_sign_of_zero_scores_and_masked_entries(monkeypatch, scale, dtype, sign_ptx):
    """The sign step's exact semantics: a score of exactly 0 (orthogonal one-hot q and k, a zero key row; -0 when
    the scale is negative) has weight 0 in the numerator but exp(0 - m) in the denominator; a masked entry has
    weight 0 in both; neither gets a gradient. Checked against the closed form sign(p) e^|p| / sum e^|p|, in
    every input dtype and both forms of the forward's sign step (`_signed_operand`)."""
    emu = _use_sign_ptx(monkeypatch) if sign_ptx else None
    hd = 16
    e = torch.eye(hd, dtype=torch.float64)
    q = e[0].expand(1, 1, 2, hd).clone()  # two identical queries (so a key block holds several rows)
    q[0, 0, 1] = 0.0  # ... except that the second is a zero vector: all its scores are 0
    k = torch.stack([2 * e[0], -3 * e[0], e[1], torch.zeros(hd), 10 * e[0], e[2]])[None, None]  # (1, 1, 6, hd)
    kpm = torch.tensor([[True, True, True, True, False, True]])  # key 4 (the largest |p|) is masked
    g = torch.Generator().manual_seed(13)
    v = torch.randn(1, 1, 6, hd, generator=g, dtype=torch.float64).to(dtype).double()
    do = torch.randn(1, 1, 2, hd, generator=g, dtype=torch.float64).to(dtype).double()
    out, dq, dk, dv = _run(lambda *a, **kw: fused_attention(*a, **kw), q, k, v, do, dtype, scale=scale,
                           key_padding_mask=kpm)
    # Closed form for query 0: scores p = scale * (2, -3, 0, 0, -, 0); keys 2, 3, 5 count only in the denominator.
    p = scale * torch.tensor([2.0, -3.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    kept = [0, 1, 2, 3, 5]
    w = torch.exp(p.abs() - p.abs().max())
    want = (torch.sign(p) * w / w.sum()) @ v[0, 0, kept]
    _assert_output_close(out[0, 0, 0], want, dtype)
    # Query 1 (zero vector): every score is 0, so every weight is 0 and the output is exactly 0.
    assert torch.equal(out[0, 0, 1], torch.zeros(hd, dtype=torch.float64))
    # No gradient reaches a zero-score or masked key, nor (for the zero query) q.
    for j in (2, 3, 4, 5):
        assert torch.equal(dk[0, 0, j], torch.zeros(hd, dtype=torch.float64)), j
        assert torch.equal(dv[0, 0, j], torch.zeros(hd, dtype=torch.float64)), j
    assert torch.equal(dq[0, 0, 1], torch.zeros(hd, dtype=torch.float64))
    # Everything else as the float64 reference (fp32 only: on these one-hot rows dq is a difference of two or three
    # terms, the short-row case where the 2x rule does not hold for 16-bit inputs, as `_floor` explains; the 16-bit
    # gradients of random inputs are checked by test_matches_reference).
    if dtype == torch.float32:
        _check(q, k, v, do, dtype, causal=False, kpm=kpm, cog=True, scale=scale)
    assert emu is None or emu.calls > 0


@pytest.mark.parametrize("scale", [0.5, 2.0**126])
@pytest.mark.parametrize("dtype,sign_ptx", SIGN_FORMS)
def test_tiny_nonzero_scores_keep_their_sign(monkeypatch, dtype, scale, sign_ptx):
    """A nonzero score, however small, has weight sign(p) e^|p| / sum e^|p|, not 0 and not a fraction of it.

    Every q.k is +-2**-140 for fp32 and bf16 inputs (a float32 subnormal: q and k entries of 2**-70) and +-2**-48
    for fp16 (the smallest fp16 entries, 2**-24; no fp16 q.k that is not 0 is smaller than about 2**-71); one key
    is a zero row (score exactly 0). With scale 0.5 every |p| is ~0 and query 0 averages sign(q.k_j) v_j over the
    5 keys; scale 2**126 makes the same q.k into |p| = 2**-15 (fp32, bf16) or 2**78 (fp16). Checked against the
    paper's formula in float64 (`attention_ref`, where every such p keeps its sign). The forward's sign
    step takes sign(d) * min(|d|, w) with d = q.k * 2**127 (a clamp, or `min.xorsign.abs`); without the 2**127,
    or with the running max starting at 0 for bf16/fp32, these weights come out 0 or a fraction of the right ones."""
    emu = _use_sign_ptx(monkeypatch) if sign_ptx else None
    hd = 16
    tiny = 2.0**-24 if dtype == torch.float16 else 2.0**-70
    e = torch.eye(hd, dtype=torch.float64)
    q = (tiny * e[0]).expand(1, 1, 2, hd).clone()
    q[0, 0, 1] = -q[0, 0, 1]  # query 1: every sign flipped
    signs = torch.tensor([1.0, -1.0, 1.0, 0.0, -1.0], dtype=torch.float64)
    k = (tiny * signs[:, None] * e[0])[None, None]  # (1, 1, 5, hd); key 3 is a zero row (score exactly 0)
    g = torch.Generator().manual_seed(7)
    v = torch.randn(1, 1, 5, hd, generator=g, dtype=torch.float64).to(dtype).double()
    do = torch.randn(1, 1, 2, hd, generator=g, dtype=torch.float64).to(dtype).double()
    out = _run(lambda *a, **kw: fused_attention(*a, **kw), q, k, v, do, dtype, scale=scale)[0]
    assert ((q[0, 0] @ k[0, 0].T) != 0).sum() == 8  # the scores are nonzero (and q.k is representable in float32)
    _assert_output_close(out, attention_ref(q, k, v, scale=scale, attention="cog"), dtype)  # the formula, float64
    assert emu is None or emu.calls > 0


@pytest.mark.parametrize("cog", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_float32_backward_at_large_scores(cog, causal):
    """Scores of magnitude ~100: the float32 backward rebuilds each weight as exp2(scale2 |q.k| - m) / l from the
    row maximum m and the sum l stored separately, so its gradients are as accurate as the dense float32 formula's
    (the 2x rule with no floor). Rebuilt from one stored log-sum-exp m + log2 l, whose rounding near 150 shifts
    every weight of a row by ~5e-6, dv was 6-11x the dense formula's error here.

    The inputs make the interpreter's arithmetic as exact as a GPU's where the two differ: q and k hold small
    integers, so every q.k is exact in float32 whatever the order of summation (numpy sums the forward's q k^T
    and the backward's k q^T in different orders), and the scale is ln(2) / 2, so scale * log2(e) = 1/2 and the
    product scale2 * |q.k| is exact too (a GPU fuses it into the exponent's FMA; the interpreter rounds it)."""
    g = torch.Generator().manual_seed(13)
    q, k = (torch.randint(-7, 8, (1, 2, 70, 32), generator=g).double() for _ in range(2))
    _, _, v, do = _inputs(1, 2, 70, 70, 32, torch.float32, seed=13)
    kw = {"causal": causal, "key_padding_mask": None, "attention": "cog" if cog else "softmax", "scale": 0.5 * math.log(2)}
    exact = _run(lambda *a, **k_: attention_ref(*a, **k_), q, k, v, do, torch.float64, **kw)
    plain = _run(lambda *a, **k_: attention_ref(*a, upcast=False, **k_), q, k, v, do, torch.float32, **kw)
    fused = _run(_fused, q, k, v, do, torch.float32, **kw)
    p_max = kw["scale"] * (q @ k.transpose(-1, -2)).abs().max().item()
    assert 80 < p_max < 400, p_max
    for name, f, p, e in zip(("out", "dq", "dk", "dv"), fused, plain, exact):
        err, err_plain = (f - e).abs().max().item(), (p - e).abs().max().item()
        assert err <= 2 * err_plain, f"{name}: fused err {err:.3g} vs plain float32 err {err_plain:.3g}"


# Sliding windows and softcaps: (B, nh, Lq, Lk, hd, dtype, causal, window, softcap, mask, cog). Window 1 (each row
# sees its diagonal key only), a window at least L, windows with key padding, softcaps with masked keys (padding,
# causal, window edges), Lq != Lk both ways (rows whose band holds no key), one-sided and two-sided windows.
WINDOW_CASES = [
    (1, 2, 70, 70, 16, torch.float32, True, (0, -1), None, None, True),
    (2, 1, 65, 65, 32, torch.bfloat16, True, (100, -1), None, "partial", True),
    (1, 2, 70, 70, 32, torch.float16, False, (5, 9), None, "partial", True),
    (2, 1, 66, 66, 16, torch.bfloat16, True, None, 2.0, "empty_batch", True),
    (1, 2, 40, 90, 16, torch.float32, True, (20, -1), 1.0, "partial", False),
    (1, 1, 90, 40, 64, torch.float16, False, (3, 3), 5.0, None, True),
    (1, 2, 57, 57, 16, torch.float32, False, (-1, 6), 0.5, "partial", True),
    (1, 1, 50, 70, 128, torch.bfloat16, False, (1, 1), 3.0, "partial", False),
    # every head dim in 16-bit and in fp32 (the banded tiles of configs.py): head dim 256 with window 1, a window
    # wider than the keys, softcaps with padded keys; fp32 beyond head dim 16. (Window 1 in 16-bit: the exact dq is
    # 0 there, where the kernel's rounding of D = rowsum(dO O) leaves ~1e-6 that the floor, 0, does not allow.)
    (1, 1, 33, 33, 256, torch.float16, True, (5, -1), 4.0, "partial", True),
    (1, 1, 30, 45, 256, torch.bfloat16, False, (50, 50), None, "partial", False),
    (1, 1, 17, 30, 256, torch.float32, False, (0, 0), 1.0, "partial", True),
    (2, 1, 30, 30, 64, torch.float32, True, None, 1.5, "empty_batch", True),
    (1, 1, 40, 24, 128, torch.float32, True, (7, -1), None, "partial", False),
    (1, 1, 24, 24, 32, torch.float32, False, (40, 40), 2.0, None, True),
]


@pytest.mark.parametrize("B,nh,Lq,Lk,hd,dtype,causal,window,softcap,mask,cog", WINDOW_CASES)
def test_window_and_softcap_match_reference(B, nh, Lq, Lk, hd, dtype, causal, window, softcap, mask, cog):
    q, k, v, do = _inputs(B, nh, Lq, Lk, hd, dtype, seed=Lq + Lk)
    _check(q, k, v, do, dtype, causal=causal, kpm=_mask(mask, B, Lk), cog=cog, window=window, softcap=softcap)


@pytest.mark.parametrize("case", [c for c in WINDOW_CASES if c[5] != torch.float32 and c[10]])
def test_window_and_softcap_with_sign_ptx(monkeypatch, case):
    B, nh, Lq, Lk, hd, dtype, causal, window, softcap, mask, cog = case
    emu = _use_sign_ptx(monkeypatch)
    q, k, v, do = _inputs(B, nh, Lq, Lk, hd, dtype, seed=Lq + Lk)
    _check(q, k, v, do, dtype, causal=causal, kpm=_mask(mask, B, Lk), cog=cog, window=window, softcap=softcap)
    assert emu.calls > 0


@pytest.mark.parametrize("arch,dtype", [(80, torch.bfloat16), (90, torch.float16), (80, torch.float32)])
def test_banded_gpu_tiles_at_head_dim_256(monkeypatch, arch, dtype):
    """The banded kernels with the very tiles the autotuner may pick for them at head dim 256 (their own lists in
    configs.py, e.g. 32 x 64 for the sm_80 forward; the interpreter ignores warps and stages): window, softcap and
    key padding, lengths that are not tile multiples."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
        monkeypatch.setitem(kattn.INTERPRET_CONFIGS, kernel, candidate_configs(kernel, arch, name, 256, banded=True)[0])
    q, k, v, do = _inputs(1, 1, 50, 70, 256, dtype, seed=14)
    _check(q, k, v, do, dtype, causal=False, kpm=_mask("partial", 1, 70), cog=True, window=(30, 10), softcap=3.0)


@pytest.mark.parametrize("window", [(4, 3), (9, -1)])
def test_window_with_other_block_sizes(monkeypatch, window):
    """Band edges crossing tiles with BM > BN and BM < BN, masked and unmasked key blocks in one row block."""
    monkeypatch.setitem(kattn.INTERPRET_CONFIGS, "fwd", KernelConfig(16, 32, 4, 1))
    monkeypatch.setitem(kattn.INTERPRET_CONFIGS, "bwd_dkdv", KernelConfig(32, 16, 4, 1))
    monkeypatch.setitem(kattn.INTERPRET_CONFIGS, "bwd_dq", KernelConfig(16, 32, 4, 1))
    q, k, v, do = _inputs(1, 2, 100, 100, 16, torch.float32, seed=9)
    _check(q, k, v, do, torch.float32, causal=window[1] < 0, kpm=_mask("partial", 1, 100), cog=True, window=window)


@pytest.mark.parametrize("cog", [True, False])
def test_key_blocks_outside_the_band_are_skipped(cog):
    """Key blocks that no query's band reaches are not visited (loop bounds, not masks): NaN in their k and v rows
    reaches nothing, where a visited-but-masked tile would spread it (0 * NaN in P @ V and in dS). Queries i of
    Lq = 16 with Lk = 100, causal, window (10, 0), see keys i + 74 ... i + 84 only."""
    q, k, v, do = _inputs(1, 1, 16, 100, 16, torch.float32, seed=10)
    kw = {"causal": True, "window": (10, 0), "attention": "cog" if cog else "softmax"}
    clean = _run(_fused, q, k, v, do, torch.float32, **kw)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[..., :64, :] = float("nan")  # key blocks 0-3 of 16 keys; the band starts at key 74
    v_bad[..., :64, :] = float("nan")
    got = _run(_fused, q, k_bad, v_bad, do, torch.float32, **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, clean):
        assert torch.equal(a, b), name
    assert (got[2][..., :74, :] == 0).all() and (got[3][..., :74, :] == 0).all()


# Head dims that are not powers of two run as power-of-two chunks (`configs.head_dim_chunks`: 8 -> 16, 24 -> 32,
# 40 -> 32 + 16, 72 -> 64 + 16, 96 -> 64 + 32, 104 -> 64 + 32 + 16, 136 -> 128 + 16, 232 -> 128 + 64 + 32 + 16,
# 248 -> 256; odd multiples of 8 with 8 padding columns). (B, nh, Lq, Lk, hd, dtype, causal, window, softcap, mask,
# cog, layout): every dtype, both modes, causal and key padding (a batch item with no kept key), windows and
# softcaps, Lq != Lk both ways and L = 1, contiguous inputs (STRIDE_UNIT 8 for odd multiples of 8) and strided
# ones ("bshd": 8 too; "gapped": row strides of 16, STRIDE_UNIT 1). The head dims of the models that need them
# (40, 80, 160: Stable Diffusion 1.x; 72: U-ViT-H, DiT-XL; 96: Phi-3) run in every dtype.
CHUNKED_CASES = [
    (1, 2, 17, 17, 8, torch.float32, False, None, None, None, True, "contiguous"),
    (2, 1, 33, 20, 24, torch.bfloat16, True, None, None, "empty_batch", True, "bshd"),
    (1, 1, 1, 1, 40, torch.float16, False, None, None, None, True, "contiguous"),
    (1, 1, 30, 45, 40, torch.float32, True, None, 2.0, "partial", False, "gapped"),
    (2, 1, 21, 34, 40, torch.bfloat16, False, (6, 2), 2.0, "empty_batch", True, "contiguous"),
    (2, 1, 40, 40, 72, torch.float16, True, None, None, "partial", True, "contiguous"),
    (1, 1, 33, 50, 72, torch.bfloat16, False, (5, 9), 2.0, "partial", True, "gapped"),
    (1, 2, 30, 30, 72, torch.float32, True, (7, -1), None, "empty_batch", False, "bshd"),
    (1, 1, 29, 41, 80, torch.float32, True, (6, -1), 1.5, "partial", True, "contiguous"),
    (2, 1, 35, 26, 80, torch.float16, True, None, None, "empty_batch", False, "bshd"),
    (1, 1, 26, 26, 80, torch.bfloat16, False, (4, 4), 2.5, "partial", True, "contiguous"),
    (1, 2, 22, 37, 96, torch.bfloat16, True, None, None, None, True, "contiguous"),
    (1, 1, 25, 25, 96, torch.float32, False, (3, 3), 1.0, "partial", True, "contiguous"),
    (1, 1, 27, 19, 96, torch.float16, True, (5, -1), 1.5, "partial", True, "gapped"),
    (1, 1, 25, 33, 104, torch.float16, False, None, 3.0, "partial", True, "bshd"),
    (1, 1, 21, 37, 136, torch.bfloat16, False, None, 3.0, "partial", False, "contiguous"),
    (1, 1, 23, 31, 160, torch.float32, True, None, 2.0, "partial", True, "contiguous"),
    (1, 1, 31, 19, 160, torch.float16, False, (5, 5), None, "partial", True, "gapped"),
    (2, 1, 19, 27, 160, torch.bfloat16, True, (8, -1), 3.0, "empty_batch", False, "contiguous"),
    (1, 1, 20, 30, 232, torch.float32, False, (3, 3), 1.0, "partial", True, "contiguous"),
    (1, 1, 37, 21, 248, torch.float16, True, (9, -1), None, None, True, "gapped"),
]


@pytest.mark.parametrize("B,nh,Lq,Lk,hd,dtype,causal,window,softcap,mask,cog,layout", CHUNKED_CASES)
def test_chunked_head_dims_match_reference(B, nh, Lq, Lk, hd, dtype, causal, window, softcap, mask, cog, layout):
    q, k, v, do = _inputs(B, nh, Lq, Lk, hd, dtype, seed=hd)
    _check(q, k, v, do, dtype, causal=causal, kpm=_mask(mask, B, Lk), cog=cog, layout=layout, window=window,
           softcap=softcap)


@pytest.mark.parametrize("case", [c for c in CHUNKED_CASES if c[5] != torch.float32 and c[10]])
def test_chunked_head_dims_with_sign_ptx(monkeypatch, case):
    B, nh, Lq, Lk, hd, dtype, causal, window, softcap, mask, cog, layout = case
    emu = _use_sign_ptx(monkeypatch)
    q, k, v, do = _inputs(B, nh, Lq, Lk, hd, dtype, seed=hd)
    _check(q, k, v, do, dtype, causal=causal, kpm=_mask(mask, B, Lk), cog=cog, layout=layout, window=window,
           softcap=softcap)
    assert emu.calls > 0


def test_chunked_cases_cover_the_chunk_shapes_and_stride_units():
    """The cases above reach one-chunk padded head dims, two-, three- and four-chunk splits, head dims with and
    without padding columns, every dtype at each of the models' head dims 40, 72, 80, 96 and 160, and both stride
    units (`_qkv_strides`, which the launcher passes as the kernels' STRIDE_UNIT)."""
    from uvic.kernels.configs import head_dim_chunks

    hds = {c[4] for c in CHUNKED_CASES}
    assert {len(head_dim_chunks(hd)) for hd in hds} == {1, 2, 3, 4} and {hd % 16 == 0 for hd in hds} == {True, False}
    for hd in (40, 72, 80, 96, 160):
        assert {c[5] for c in CHUNKED_CASES if c[4] == hd} == {torch.float32, torch.float16, torch.bfloat16}, hd
    units = set()
    for c in CHUNKED_CASES:
        q, k, v = (_strided(torch.zeros(c[0], c[1], L, c[4]), c[5], c[11]) for L in (c[2], c[3], c[3]))
        units.add((c[4] % 16 == 0, kattn._qkv_strides(q, k, v)[1]))
    assert units == {(False, 8), (False, 1), (True, 1)}


@pytest.mark.parametrize("hd,arch,dtype", [(72, 80, torch.bfloat16), (72, 90, torch.bfloat16),
                                            (136, 90, torch.bfloat16), (248, 80, torch.float32)])
def test_chunked_head_dims_with_gpu_tiles(monkeypatch, hd, arch, dtype):
    """The kernels at head dims 72 and 136 with every tile the autotuner may pick for them (those of head dims 128
    and 256, `configs.table_head_dim`; the interpreter ignores warps and stages): bf16, causal with Lq != Lk, key
    padding, lengths that are not tile multiples; and the banded tiles with a window and a softcap. fp32 at head
    dim 248 (one chunk of 256 with 8 padding columns) runs its own tiles (`configs._CHUNKED_FP32`: 16 x 16, and
    32 x 16 for the banded dQ). (Rows that see few keys, Lq > Lk, are in
    `test_chunked_head_dims_equal_zero_padded_power_of_two`: with bf16 there the 2x rule fails for the one-chunk
    head dim 128 too, on some seeds.)"""
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    for banded in (False, True):
        for kernel in ("fwd", "bwd_dkdv", "bwd_dq"):
            for c in candidate_configs(kernel, arch, name, hd, banded=banded):
                monkeypatch.setitem(kattn.INTERPRET_CONFIGS, kernel, c)
                q, k, v, do = _inputs(1, 1, 45, 70, hd, dtype, seed=15)
                kw = {"window": (20, 5), "softcap": 3.0} if banded else {}
                _check(q, k, v, do, dtype, causal=not banded, kpm=_mask("partial", 1, 70), cog=True, **kw)


@pytest.mark.parametrize("hd,width,dtype", [(24, 32, torch.float16), (72, 128, torch.bfloat16),
                                            (96, 128, torch.float16), (136, 256, torch.float16),
                                            (232, 256, torch.bfloat16)])
def test_chunked_head_dims_equal_zero_padded_power_of_two(hd, width, dtype):
    """A chunked head dim gives what the one-chunk kernel of a power-of-two head dim gives on the same inputs padded
    with zero columns (and the scale of the true head dim), for 16-bit inputs: the split changes which columns a
    tile holds, not the arithmetic, except the order in which the fp32 partial sums of q.k and dO.v over the chunks
    are added. That order can move a 16-bit rounding, so the bound is one unit roundoff of the largest value
    (measured: at most 0.1 of it, mostly bitwise equal); the error against the float64 reference is ~100x that.
    Forward and gradients (Cog), causal with Lq > Lk (rows that see few or no keys) and key padding; the padded
    gradient columns are exactly 0."""
    q, k, v, do = _inputs(2, 1, 37, 22, hd, dtype, seed=17)
    kw = {"causal": True, "key_padding_mask": _mask("empty_batch", 2, 22), "scale": hd**-0.5}
    chunked = _run(lambda *a, **k_: fused_attention(*a, **k_), q, k, v, do, dtype, **kw)
    pad = [torch.nn.functional.pad(t, (0, width - hd)) for t in (q, k, v, do)]
    padded = _run(lambda *a, **k_: fused_attention(*a, **k_), *pad, dtype, **kw)
    for name, c, p in zip(("out", "dq", "dk", "dv"), chunked, padded):
        assert not p[..., hd:].any(), name
        tol = torch.finfo(dtype).eps * p.abs().max().item()
        torch.testing.assert_close(c, p[..., :hd], rtol=0, atol=tol, msg=name)
    assert chunked[0].abs().max() > 0


def test_padding_columns_are_never_read():
    """q, k, v of head dim 72 are views into rows of 80 whose last 8 columns hold NaN: the kernels' padded chunk
    (64 + 16) masks its last 8 columns, so nothing there reaches an output or gradient, which equal those of
    contiguous copies bit for bit."""
    q, k, v, do = _inputs(2, 1, 37, 29, 72, torch.float16, seed=16)
    kpm = _mask("partial", 2, 29)

    def in_wide_rows(t):
        wide = torch.full((*t.shape[:-1], 80), float("nan"), dtype=torch.float16)
        wide[..., :72] = t.to(torch.float16)
        return wide[..., :72].requires_grad_()

    for cog in (True, False):
        kw = {"causal": True, "key_padding_mask": kpm, "attention": "cog" if cog else "softmax"}
        clean = _run(_fused, q, k, v, do, torch.float16, **kw)
        ts = [in_wide_rows(t) for t in (q, k, v)]
        out = _fused(*ts, **kw)
        out.backward(do.to(torch.float16))
        for name, c, d in zip(("out", "dq", "dk", "dv"), clean, [out.detach().double()] + [t.grad.double() for t in ts]):
            assert torch.isfinite(d).all() and torch.equal(c, d), name
