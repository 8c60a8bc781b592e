"""Cog processors for the processors diffusers keeps beside their models, which call `dispatch_attention_fn` in the
(B, L, nh, hd) layout: `FluxAttnProcessor`, `LTXVideoAttnProcessor` and `WanAttnProcessor`; each with its
kept-softmax twin.

Shapes: B batch, L tokens, C channels, nh heads, hd head dim.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_rotary_emb
from diffusers.models.transformers.transformer_wan import _get_added_kv_projections, _get_qkv_projections

from uvic.integrations.diffusers_processors.base import Dispatch, kept_softmax, prepare_mask, split_blhd


class CogFluxAttnProcessor(Dispatch):
    """diffusers' `FluxAttnProcessor` (FluxTransformer2DModel: joint text-image blocks and single-stream blocks,
    RMS-normed q and k, rotary embeddings)."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden_states (B, L, C), encoder_hidden_states (B, Lc, C) or None. Returns (B, L, C), and (B, Lc, C) for
        the context when it was given."""
        with_context = encoder_hidden_states is not None
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
            if with_context and hasattr(attn, "to_added_qkv"):
                c_qkv = attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
            if with_context and attn.added_kv_proj_dim is not None:
                c_qkv = (attn.add_q_proj(encoder_hidden_states), attn.add_k_proj(encoder_hidden_states),
                         attn.add_v_proj(encoder_hidden_states))
        split = lambda t: t.unflatten(-1, (-1, attn.head_dim))  # noqa: E731  (B, L, nh, hd)
        query, key, value = attn.norm_q(split(query)), attn.norm_k(split(key)), split(value)
        if with_context and attn.added_kv_proj_dim is not None:
            c_query, c_key, c_value = (split(t) for t in c_qkv)
            query = torch.cat([attn.norm_added_q(c_query), query], dim=1)
            key = torch.cat([attn.norm_added_k(c_key), key], dim=1)
            value = torch.cat([c_value, value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        hidden_states = self.attend_blhd(query, key, value, attention_mask, self._parallel_config)

        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        if not with_context:
            return hidden_states
        n_context = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states[:, :n_context], hidden_states[:, n_context:]
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        return hidden_states, attn.to_add_out(encoder_hidden_states.contiguous())


class CogLTXAttnProcessor(Dispatch):
    """diffusers' `LTXVideoAttnProcessor` (LTX-Video: q/k RMS norm across heads, rotary embedding on the full
    projections, self- and cross-attention with a key mask)."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """hidden_states (B, L, C); encoder_hidden_states (B, Lk, C_cross) or None. Returns (B, L, C)."""
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        attention_mask = prepare_mask(attn, attention_mask, encoder_hidden_states)
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(encoder_hidden_states))
        value = attn.to_v(encoder_hidden_states)
        if image_rotary_emb is not None:
            query = ltx_rotary_emb(query, image_rotary_emb)
            key = ltx_rotary_emb(key, image_rotary_emb)
        query, key, value = (split_blhd(t, attn.heads) for t in (query, key, value))

        hidden_states = self.attend_blhd(query, key, value, attention_mask, self._parallel_config)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](hidden_states))


def _wan_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on interleaved pairs: x (B, L, nh, hd), freqs (1, L, 1, hd) -> (B, L, nh, hd)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


class CogWanAttnProcessor(Dispatch):
    """diffusers' `WanAttnProcessor` (Wan: q/k RMS norms, interleaved rotary embedding in self-attention,
    cross-attention to the text, and in image-to-video models a second attention to the image tokens whose
    output is added)."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """hidden_states (B, L, C); encoder_hidden_states (B, Lk, C) or None (image-to-video: the image tokens,
        then 512 text tokens). Returns (B, L, C)."""
        image_context = None
        if attn.add_k_proj is not None:
            n_image = encoder_hidden_states.shape[1] - 512  # as the stock processor: 512 text tokens
            image_context = encoder_hidden_states[:, :n_image]
            encoder_hidden_states = encoder_hidden_states[:, n_image:]
        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        split = lambda t: split_blhd(t, attn.heads)  # noqa: E731  (B, L, nh, hd)
        query, key, value = split(attn.norm_q(query)), split(attn.norm_k(key)), split(value)
        if rotary_emb is not None:
            query, key = _wan_rotary(query, *rotary_emb), _wan_rotary(key, *rotary_emb)

        image_out = None
        if image_context is not None:
            key_img, value_img = _get_added_kv_projections(attn, image_context)
            image_out = self.attend_blhd(query, split(attn.norm_added_k(key_img)), split(value_img), None)
            image_out = image_out.flatten(2, 3).type_as(query)
        parallel_config = self._parallel_config if encoder_hidden_states is None else None
        hidden_states = self.attend_blhd(query, key, value, attention_mask, parallel_config)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        if image_out is not None:
            hidden_states = hidden_states + image_out
        return attn.to_out[1](attn.to_out[0](hidden_states))


KeptSoftmaxFluxAttnProcessor = kept_softmax(CogFluxAttnProcessor)
KeptSoftmaxLTXAttnProcessor = kept_softmax(CogLTXAttnProcessor)
KeptSoftmaxWanAttnProcessor = kept_softmax(CogWanAttnProcessor)
