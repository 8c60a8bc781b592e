"""Building blocks shared by the uvic models: timestep embedding, patch (un)embedding, attention, MLP.

The parameter names follow U-ViT (Bao et al., "All are Worth Words", CVPR 2023, github baofff/U-ViT) so the
official state dicts load key for key: `Attention.qkv` (fused, layout `(K nh hd)`) and `Attention.proj`,
`Mlp.fc1` / `Mlp.fc2`, `PatchEmbed.proj`.

Shape letters: B batch, C channels, H W spatial, L tokens, D width, nh heads, hd head dim, p patch size.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from einops import rearrange

from uvic.attention import BACKENDS, attention_op, check_attention_kind


def timestep_embedding(timesteps: torch.Tensor, dim: int, max_period: int = 10000) -> torch.Tensor:
    """Sinusoidal embedding `[cos(t f), sin(t f)]` with `f_i = max_period ** (-i / (dim // 2))` (U-ViT's).

    Cos comes first and the exponent is divided by `dim // 2`; this equals diffusers
    `get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0)`. Fractional `t` is fine.

    Args:
        timesteps: (B,) timesteps, int or float; embedded exactly as given.
        dim: output width D (an odd D gets one trailing zero column).
        max_period: the longest period of the sinusoids.
    Returns:
        (B, D) float32 embedding.
    """
    half = dim // 2
    # Frequencies and arguments in float32 whatever the model dtype (DiT does the same).
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half)
    args = timesteps[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding


class PatchEmbed(nn.Module):
    """Image to patch tokens with a strided convolution (ViT's patch embedding).

    Args:
        patch_size: p, the side of a square patch.
        in_chans: C, input channels.
        embed_dim: D, token width.
    """

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, L, D) with L = (H/p)(W/p) in row-major `(h w)` order."""
        return self.proj(x).flatten(2).transpose(1, 2)


def patchify(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) -> (B, L, p*p*C): the inverse of `unpatchify`, channel fastest inside a patch."""
    return rearrange(x, "B C (h p1) (w p2) -> B (h w) (p1 p2 C)", p1=patch_size, p2=patch_size)


def unpatchify(x: torch.Tensor, channels: int) -> torch.Tensor:
    """(B, L, p*p*C) -> (B, C, H, W) with U-ViT's layout `B (h w) (p1 p2 C) -> B C (h p1) (w p2)`.

    The patch grid must be square (h = w = sqrt(L)); the channel is the fastest index inside a patch.
    """
    B, L, patch_dim = x.shape
    p = int(math.isqrt(patch_dim // channels))
    h = int(math.isqrt(L))
    if p * p * channels != patch_dim or h * h != L:
        raise ValueError(f"cannot unpatchify tokens of shape {tuple(x.shape)} into {channels} channels")
    return rearrange(x, "B (h w) (p1 p2 C) -> B C (h p1) (w p2)", h=h, p1=p, p2=p)


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection; softmax or Cog weights.

    `attention="softmax"` calls `uvic.attention.softmax_attention` (SDPA / flash), `attention="cog"` calls
    `uvic.attention.cog_attention`: weights `sign(p) * softmax(|p|)`, `p = q k^T / sqrt(hd)` (paper Eq. 3).
    Parameters are those of U-ViT's `Attention`: `qkv` (3D x D, rows q | k | v, heads contiguous inside
    each third) and `proj` (D x D with bias). There is no dropout in any backend.

    Args:
        dim: D, token width; must be divisible by `num_heads`.
        num_heads: nh.
        qkv_bias: give `qkv` a bias (False in every U-ViT config).
        attention: "cog" (Cog weights) or "softmax".
        backend: the `uvic.attention` backend ("auto", "reference", "torch", "triton").
    """

    def __init__(
        self, dim: int, num_heads: int, qkv_bias: bool = False, attention: str = "softmax", backend: str = "auto"
    ) -> None:
        super().__init__()
        check_attention_kind(attention)
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by num_heads={num_heads}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")
        self.num_heads = num_heads
        self.attention = attention
        self.backend = backend
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, *, causal: bool = False, key_padding_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """
        Args:
            x: (B, L, D) tokens.
            causal: causal mask (for decoder use; U-ViT attends to all tokens).
            key_padding_mask: (B, L) bool, True = the token can be attended to.
        Returns:
            (B, L, D).
        """
        # Head split as U-ViT's: qkv rows are q | k | v, heads contiguous inside each third.
        q, k, v = rearrange(self.qkv(x), "B L (K nh hd) -> K B nh L hd", K=3, nh=self.num_heads)
        op = attention_op(self.attention)  # cog_attention or softmax_attention
        out = op(q, k, v, causal=causal, key_padding_mask=key_padding_mask, backend=self.backend)  # (B, nh, L, hd)
        return self.proj(rearrange(out, "B nh L hd -> B L (nh hd)"))

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, attention={self.attention!r}, backend={self.backend!r}"


class Mlp(nn.Module):
    """Two-layer MLP `fc2(GELU(fc1(x)))` with exact (erf) GELU, as timm's `Mlp` used by U-ViT.

    Args:
        in_features: D.
        hidden_features: the hidden width (U-ViT: mlp_ratio * D).
    """

    def __init__(self, in_features: int, hidden_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_features, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, D) -> (B, L, D)."""
        return self.fc2(self.act(self.fc1(x)))
