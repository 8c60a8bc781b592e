"""Tests for uvic.models.layers against closed-form math, einops and diffusers' own functions."""

import math

import einops
import pytest
import torch
import torch.nn.functional as F
from diffusers.models.embeddings import get_timestep_embedding

from uvic.models.layers import Attention, Mlp, PatchEmbed, patchify, timestep_embedding, unpatchify


@pytest.mark.parametrize("dim", [8, 64, 512])
def test_timestep_embedding_matches_diffusers_cos_first(dim):
    # U-ViT's embedding is diffusers' with flip_sin_to_cos=True, downscale_freq_shift=0 (docs/conventions.md, "Timestep embedding").
    t = torch.tensor([0.0, 1.0, 3.5, 999.0, 1000.0])
    ours = timestep_embedding(t, dim)
    ref = get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0)
    assert ours.shape == (5, dim) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_timestep_embedding_closed_form_and_odd_dim():
    t = torch.tensor([2.0, 7.25])
    emb = timestep_embedding(t, 7)  # half = 3, one zero column appended
    for b, tb in enumerate(t.tolist()):
        for i in range(3):
            f = math.exp(-math.log(10000) * i / 3)
            assert emb[b, i].item() == pytest.approx(math.cos(tb * f), abs=1e-6)
            assert emb[b, 3 + i].item() == pytest.approx(math.sin(tb * f), abs=1e-6)
    assert torch.all(emb[:, 6] == 0)
    # Integer timesteps embed the same as their float value.
    torch.testing.assert_close(
        timestep_embedding(torch.tensor([5, 9]), 16), timestep_embedding(torch.tensor([5.0, 9.0]), 16)
    )


def test_unpatchify_matches_official_einops_layout():
    x = torch.randn(2, 16, 4 * 3)  # 4x4 patches of 2x2 pixels, 3 channels
    ref = einops.rearrange(x, "B (h w) (p1 p2 C) -> B C (h p1) (w p2)", h=4, p1=2, p2=2)
    torch.testing.assert_close(unpatchify(x, 3), ref, rtol=0, atol=0)
    img = torch.randn(2, 3, 8, 8)
    ref_p = einops.rearrange(img, "B C (h p1) (w p2) -> B (h w) (p1 p2 C)", p1=2, p2=2)
    torch.testing.assert_close(patchify(img, 2), ref_p, rtol=0, atol=0)
    torch.testing.assert_close(unpatchify(patchify(img, 2), 3), img, rtol=0, atol=0)


def test_unpatchify_rejects_bad_shapes():
    with pytest.raises(ValueError, match="cannot unpatchify"):
        unpatchify(torch.randn(1, 15, 12), 3)


def test_patch_embed_row_major_tokens():
    torch.manual_seed(0)
    pe = PatchEmbed(patch_size=2, in_chans=3, embed_dim=5)
    img = torch.randn(1, 3, 6, 4)
    tokens = pe(img)
    assert tokens.shape == (1, 6, 5)  # (6/2) * (4/2) patches
    for i in range(3):
        for j in range(2):
            patch = img[0, :, 2 * i : 2 * i + 2, 2 * j : 2 * j + 2]
            expect = (pe.proj.weight * patch).sum(dim=(1, 2, 3)) + pe.proj.bias
            torch.testing.assert_close(tokens[0, i * 2 + j], expect, rtol=1e-5, atol=1e-6)


def _manual_attention(attn: Attention, x: torch.Tensor, attention: str) -> torch.Tensor:
    """U-ViT's math path: qkv rows [q | k | v], heads contiguous in each third, scale hd ** -0.5."""
    B, L, D = x.shape
    nh = attn.num_heads
    hd = D // nh
    W = attn.qkv.weight
    outs = []
    for h in range(nh):
        rows = slice(h * hd, (h + 1) * hd)
        q = x @ W[0:D][rows].T
        k = x @ W[D : 2 * D][rows].T
        v = x @ W[2 * D : 3 * D][rows].T
        p = q @ k.transpose(-1, -2) / math.sqrt(hd)
        w = torch.sign(p) * torch.softmax(p.abs(), dim=-1) if attention == "cog" else torch.softmax(p, dim=-1)
        outs.append(w @ v)
    return torch.cat(outs, dim=-1) @ attn.proj.weight.T + attn.proj.bias


@pytest.mark.parametrize("attention", ["softmax", "cog"])
@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_attention_matches_manual_formula(attention, backend):
    torch.manual_seed(1)
    attn = Attention(24, num_heads=3, attention=attention, backend=backend).double()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    torch.testing.assert_close(attn(x), _manual_attention(attn, x, attention), rtol=1e-10, atol=1e-10)
    assert [n for n, _ in attn.named_parameters()] == ["qkv.weight", "proj.weight", "proj.bias"]


def test_cog_and_softmax_attention_differ():
    torch.manual_seed(2)
    soft = Attention(16, num_heads=2, attention="softmax")
    cog = Attention(16, num_heads=2, attention="cog")
    cog.load_state_dict(soft.state_dict())
    x = torch.randn(1, 5, 16) * 3
    assert (soft(x) - cog(x)).abs().max() > 1e-3


def test_attention_causal_passthrough():
    torch.manual_seed(3)
    attn = Attention(16, num_heads=2, attention="cog", backend="torch")
    x = torch.randn(1, 6, 16)
    y1 = attn(x, causal=True)
    x2 = x.clone()
    x2[:, 4:] += 1.0  # change only the future of positions 0..3
    y2 = attn(x2, causal=True)
    torch.testing.assert_close(y1[:, :4], y2[:, :4])
    assert (y1[:, 4:] - y2[:, 4:]).abs().max() > 1e-4


def test_attention_rejects_bad_config():
    with pytest.raises(ValueError, match="divisible"):
        Attention(10, num_heads=3)
    with pytest.raises(ValueError, match="backend"):
        Attention(8, num_heads=2, backend="flash")


def test_mlp_is_exact_gelu_mlp():
    torch.manual_seed(4)
    mlp = Mlp(6, 24).double()
    x = torch.randn(3, 6, dtype=torch.float64)
    h = F.linear(x, mlp.fc1.weight, mlp.fc1.bias)
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))  # exact GELU, not the tanh approximation
    torch.testing.assert_close(mlp(x), F.linear(h, mlp.fc2.weight, mlp.fc2.bias), rtol=1e-12, atol=1e-12)
