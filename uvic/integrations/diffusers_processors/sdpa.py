"""Cog processors for diffusers' `attention_processor.py` processors, which call SDPA in the (B, nh, L, hd) layout:
`AttnProcessor2_0` / `AttnProcessor`, `AttnAddedKVProcessor2_0` / `AttnAddedKVProcessor`, `JointAttnProcessor2_0`,
`AuraFlowAttnProcessor2_0`, `CogVideoXAttnProcessor2_0` and `HunyuanAttnProcessor2_0`; each with its kept-softmax
twin.

Shapes: B batch, L tokens, C channels, nh heads, hd head dim.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import apply_rotary_emb

from uvic.integrations.diffusers_processors.base import (
    Attend,
    LayerScale,
    kept_softmax,
    merge_heads,
    prepare_mask,
    qkv_heads,
    split_blhd,
    split_heads,
)


def _attn_processor_call(
    processor: Attend,
    attn,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    temb: torch.Tensor | None,
    scale: float | None,
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`AttnProcessor2_0`'s computation with `processor.attend` as its attention call: spatial and group norm, 4-D
    inputs, cross-attention norm, q/k norms, residual, rescale; with `image_rotary_emb`, Hunyuan's rotary embedding
    on q, and on k in self-attention.

    hidden_states (B, L, C) or (B, C, H, W); encoder_hidden_states (B, Lk, C_cross) or None; attention_mask as
    diffusers passes it; scale of q k^T (None: hd ** -0.5). Returns a tensor of hidden_states' shape.
    """
    residual = hidden_states
    if attn.spatial_norm is not None:
        hidden_states = attn.spatial_norm(hidden_states, temb)
    input_shape = hidden_states.shape
    if hidden_states.ndim == 4:
        hidden_states = hidden_states.flatten(2).transpose(1, 2)
    context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
    attention_mask = prepare_mask(attn, attention_mask, context)
    if attn.group_norm is not None:
        hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
    if encoder_hidden_states is None:
        encoder_hidden_states = hidden_states
    elif attn.norm_cross:
        encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
    query, key, value = qkv_heads(attn, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k, hidden_states,
                                  encoder_hidden_states)
    if image_rotary_emb is not None:
        query = apply_rotary_emb(query, image_rotary_emb)
        if not attn.is_cross_attention:
            key = apply_rotary_emb(key, image_rotary_emb)

    hidden_states = merge_heads(processor.attend(query, key, value, attention_mask, scale), query.dtype)
    hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))  # linear projection, dropout
    if len(input_shape) == 4:
        hidden_states = hidden_states.transpose(-1, -2).reshape(input_shape)
    if attn.residual_connection:
        hidden_states = hidden_states + residual
    return hidden_states / attn.rescale_output_factor


class CogAttnProcessor(LayerScale, Attend):
    """diffusers' `AttnProcessor2_0` (and `AttnProcessor`, see `LayerScale`) with Cog attention: self- and
    cross-attention, spatial and group norm, 4-D inputs, cross-attention norm, q/k norms, residual, rescale."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states (B, L, C) or (B, C, H, W); encoder_hidden_states (B, Lk, C_cross) or None; attention_mask
        as diffusers passes it. Returns a tensor of hidden_states' shape."""
        return _attn_processor_call(self, attn, hidden_states, encoder_hidden_states, attention_mask, temb,
                                    self.scale_for(attn))


class CogHunyuanAttnProcessor(Attend):
    """diffusers' `HunyuanAttnProcessor2_0` (HunyuanDiT: `AttnProcessor2_0` plus a rotary embedding on q, and on k
    in self-attention)."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """hidden_states (B, L, C) or (B, C, H, W); encoder_hidden_states (B, Lk, C_cross) or None. Returns a
        tensor of hidden_states' shape."""
        return _attn_processor_call(self, attn, hidden_states, encoder_hidden_states, attention_mask, temb, None,
                                    image_rotary_emb)


class CogAddedKVAttnProcessor(LayerScale, Attend):
    """diffusers' `AttnAddedKVProcessor2_0` (and `AttnAddedKVProcessor`, see `LayerScale`): the SimpleCrossAttn
    blocks of UNets (e.g. UnCLIP, DeepFloyd IF), where the image tokens attend to the projected text tokens
    followed by themselves (or only the text, `only_cross_attention`)."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states (B, C, H, W); encoder_hidden_states (B, Lc, C_cross) or None. Returns (B, C, H, W)."""
        residual = hidden_states
        hidden_states = hidden_states.view(hidden_states.shape[0], hidden_states.shape[1], -1).transpose(1, 2)
        batch_size, sequence_length, _ = hidden_states.shape
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size, out_dim=4)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        query = split_heads(attn.to_q(hidden_states), attn.heads)
        key = split_heads(attn.add_k_proj(encoder_hidden_states), attn.heads)
        value = split_heads(attn.add_v_proj(encoder_hidden_states), attn.heads)
        if not attn.only_cross_attention:  # the text tokens, then the image tokens themselves
            key = torch.cat([key, split_heads(attn.to_k(hidden_states), attn.heads)], dim=2)
            value = torch.cat([value, split_heads(attn.to_v(hidden_states), attn.heads)], dim=2)

        hidden_states = self.attend(query, key, value, attention_mask, self.scale_for(attn))
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, residual.shape[1])
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        return hidden_states.transpose(-1, -2).reshape(residual.shape) + residual


class CogJointAttnProcessor(Attend):
    """diffusers' `JointAttnProcessor2_0` (SD3's MMDiT blocks: image and context tokens attend jointly). Like the
    stock processor it takes no attention mask (one passed is ignored, as there)."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden_states (B, L, C), encoder_hidden_states (B, Lc, C) or None. Returns (B, L, C), and (B, Lc, C) for
        the context when it was given."""
        n_image = hidden_states.shape[1]
        query, key, value = qkv_heads(attn, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k, hidden_states,
                                      hidden_states)
        if encoder_hidden_states is not None:
            c_query, c_key, c_value = qkv_heads(attn, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj,
                                                attn.norm_added_q, attn.norm_added_k, encoder_hidden_states,
                                                encoder_hidden_states)
            query = torch.cat([query, c_query], dim=2)
            key = torch.cat([key, c_key], dim=2)
            value = torch.cat([value, c_value], dim=2)

        hidden_states = merge_heads(self.attend(query, key, value, None), query.dtype)
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = hidden_states[:, :n_image], hidden_states[:, n_image:]
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


class CogAuraFlowAttnProcessor(Attend):
    """diffusers' `AuraFlowAttnProcessor2_0` (AuraFlow's joint and single-stream blocks: context tokens first, q/k
    norms, the layer's `attn.scale`)."""

    def __call__(
        self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None, *args, **kwargs
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden_states (B, L, C), encoder_hidden_states (B, Lc, C) or None. Returns (B, L, C), and (B, Lc, C) for
        the context when it was given."""
        query, key, value = (split_blhd(f(hidden_states), attn.heads) for f in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            c_query, c_key, c_value = (split_blhd(f(encoder_hidden_states), attn.heads)
                                       for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                c_query = attn.norm_added_q(c_query)
            if attn.norm_added_k is not None:
                c_key = attn.norm_added_k(c_key)
            query, key = torch.cat([c_query, query], 1), torch.cat([c_key, key], 1)
            value = torch.cat([c_value, value], 1)

        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        hidden_states = merge_heads(self.attend(q, k, v, None, attn.scale), query.dtype)
        if encoder_hidden_states is not None:
            n_context = encoder_hidden_states.shape[1]
            hidden_states, encoder_hidden_states = hidden_states[:, n_context:], hidden_states[:, :n_context]
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, attn.to_add_out(encoder_hidden_states)
        return hidden_states


class CogCogVideoXAttnProcessor(Attend):
    """diffusers' `CogVideoXAttnProcessor2_0` (CogVideoX: text tokens first, then video tokens, one attention over
    both; q/k norms; the rotary embedding on the video tokens only)."""

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden_states (B, L, C) video tokens, encoder_hidden_states (B, Lc, C) text tokens. Returns both."""
        n_text = encoder_hidden_states.size(1)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        attention_mask = prepare_mask(attn, attention_mask, hidden_states)
        query, key, value = qkv_heads(attn, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k, hidden_states,
                                      hidden_states)
        if image_rotary_emb is not None:
            query = torch.cat([query[:, :, :n_text], apply_rotary_emb(query[:, :, n_text:], image_rotary_emb)], 2)
            if not attn.is_cross_attention:
                key = torch.cat([key[:, :, :n_text], apply_rotary_emb(key[:, :, n_text:], image_rotary_emb)], 2)

        hidden_states = self.attend(query, key, value, attention_mask).transpose(1, 2).flatten(2)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        encoder_hidden_states, hidden_states = hidden_states.split([n_text, hidden_states.size(1) - n_text], dim=1)
        return hidden_states, encoder_hidden_states


KeptSoftmaxAttnProcessor = kept_softmax(CogAttnProcessor)
KeptSoftmaxHunyuanAttnProcessor = kept_softmax(CogHunyuanAttnProcessor)
KeptSoftmaxAddedKVAttnProcessor = kept_softmax(CogAddedKVAttnProcessor)
KeptSoftmaxJointAttnProcessor = kept_softmax(CogJointAttnProcessor)
KeptSoftmaxAuraFlowAttnProcessor = kept_softmax(CogAuraFlowAttnProcessor)
KeptSoftmaxCogVideoXAttnProcessor = kept_softmax(CogCogVideoXAttnProcessor)
