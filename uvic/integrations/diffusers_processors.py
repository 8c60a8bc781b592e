"""diffusers attention processors that run Cog attention, and their kept-softmax twins.

Each `Cog...Processor` computes what one stock diffusers processor computes, with `uvic.attention.cog_attention` in
place of the softmax attention call; its `KeptSoftmax...Processor` twin (a subclass) makes the stock attention call
itself, for the layers the placement keeps on softmax. The mode is the class (`attention` is a class attribute), so
a processor that diffusers re-creates as `processor.__class__()` (IP-adapter loading does, for self-attention)
keeps its mode. `uvic.integrations.diffusers.apply_cog_attention` installs them.

| stock processor | Cog / kept-softmax processors | used by |
|---|---|---|
| `AttnProcessor2_0`, `AttnProcessor` | `CogAttnProcessor` / `KeptSoftmaxAttnProcessor` | DiT, PixArt, UNets, VAEs, ... |
| `AttnAddedKVProcessor2_0`, `AttnAddedKVProcessor` | `CogAddedKVAttnProcessor` / `KeptSoftmax...` | UNet SimpleCrossAttn blocks |
| `JointAttnProcessor2_0` | `CogJointAttnProcessor` / `KeptSoftmax...` | SD3 |
| `FluxAttnProcessor` | `CogFluxAttnProcessor` / `KeptSoftmax...` | Flux |
| `AuraFlowAttnProcessor2_0` | `CogAuraFlowAttnProcessor` / `KeptSoftmax...` | AuraFlow |
| `CogVideoXAttnProcessor2_0` | `CogCogVideoXAttnProcessor` / `KeptSoftmax...` | CogVideoX |
| `HunyuanAttnProcessor2_0` | `CogHunyuanAttnProcessor` / `KeptSoftmax...` | HunyuanDiT |
| `LTXVideoAttnProcessor` | `CogLTXAttnProcessor` / `KeptSoftmax...` | LTX-Video |
| `WanAttnProcessor` | `CogWanAttnProcessor` / `KeptSoftmax...` | Wan |

Shapes: B batch, L tokens, C channels, nh heads, hd head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import (
    AttnAddedKVProcessor,
    AttnAddedKVProcessor2_0,
    AttnProcessor,
    AttnProcessor2_0,
    AuraFlowAttnProcessor2_0,
    CogVideoXAttnProcessor2_0,
    HunyuanAttnProcessor2_0,
    JointAttnProcessor2_0,
    SanaLinearAttnProcessor2_0,
)
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor
from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_rotary_emb
from diffusers.models.transformers.transformer_wan import (
    WanAttnProcessor,
    _get_added_kv_projections,
    _get_qkv_projections,
)

from uvic.attention import AttentionKind, Backend, cog_attention


# Additive mask entries at or below this remove a key (diffusers builds its masks with -10000.0).
REMOVED_KEY_BIAS = -10000.0


def key_padding_mask_from(attention_mask: torch.Tensor | None, where: str = "attention") -> torch.Tensor | None:
    """The (B, Lk) key padding mask (True = the key takes part) that a diffusers attention mask stands for.

    Supported: masks that remove keys, the same keys for every head and query. Boolean masks (True = keep, as
    SDPA reads them) or additive masks whose entries are 0 (keep) or at most REMOVED_KEY_BIAS / -inf (remove).

    Args:
        attention_mask: (B, nh | 1, Lq | 1, Lk) as the stock processor hands it to SDPA ((B, Lk) and (B, Lq | 1, Lk)
            are read as (B, 1, 1, Lk) and (B, 1, Lq | 1, Lk)), or None.
        where: the module's name, for the error message.
    Returns:
        (B, Lk) bool, or None when no key is removed.
    Raises:
        ValueError: any other mask (a bias, a per-query or per-head pattern), naming `where` and the supported kinds.
    """
    if attention_mask is None:
        return None
    supported = ("Cog attention supports masks that only remove keys: boolean (True = keep) or additive "
                 f"(0 = keep, <= {REMOVED_KEY_BIAS:g} or -inf = remove), the same for every head and query")
    if attention_mask.dim() in (2, 3):
        attention_mask = attention_mask[:, None, None] if attention_mask.dim() == 2 else attention_mask[:, None]
    if attention_mask.dim() != 4:
        raise ValueError(f"{where}: expected a (B, heads, Lq, Lk) mask, got shape {tuple(attention_mask.shape)}; "
                         f"{supported}")  # fmt: skip
    if attention_mask.dtype == torch.bool:
        keep = attention_mask
    else:
        keep = attention_mask == 0
        if not (keep | (attention_mask <= REMOVED_KEY_BIAS)).all():
            raise ValueError(f"{where}: the additive attention mask has entries other than 0 and "
                             f"<= {REMOVED_KEY_BIAS:g} (a bias, not a key mask); {supported}")  # fmt: skip
    if not (keep == keep[:, :1, :1, :]).all():
        raise ValueError(f"{where}: the attention mask differs between queries or heads; {supported}")
    kpm = keep[:, 0, 0, :]
    return None if bool(kpm.all()) else kpm


def _heads(x: torch.Tensor, nh: int) -> torch.Tensor:
    """(B, L, nh * hd) -> (B, nh, L, hd)."""
    return x.unflatten(-1, (nh, -1)).transpose(1, 2)


def _qkv_heads(attn, to_q, to_k, to_v, norm_q, norm_k, x: torch.Tensor, context: torch.Tensor):
    """Queries from x (B, Lq, C), keys and values from context (B, Lk, C'), split into heads (B, nh, L, hd), with
    the optional q and k norms applied."""
    q, k, v = _heads(to_q(x), attn.heads), _heads(to_k(context), attn.heads), _heads(to_v(context), attn.heads)
    return (q if norm_q is None else norm_q(q)), (k if norm_k is None else norm_k(k)), v


def _merge_heads(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, nh, L, hd) -> (B, L, nh * hd) in `dtype`."""
    return x.transpose(1, 2).flatten(2).to(dtype)


class _Attend:
    """The attention step shared by the processors: `cog_attention` (class attribute `attention = "cog"`) or the
    stock SDPA call ("softmax", the kept-softmax subclasses).

    Args:
        backend: the `uvic.attention.cog_attention` backend ("auto": the fused kernel on GPUs where it fits).
        name: the module's name, used in error messages.
    """

    attention: AttentionKind = "cog"

    def __init__(self, backend: Backend = "auto", name: str = "attention"):
        self.backend, self.name = backend, name

    @property
    def runs_softmax(self) -> bool:
        """True on a layer kept on softmax (the stock attention call), False on a Cog layer."""
        return self.attention == "softmax"

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
    ) -> torch.Tensor:
        """q (B, nh, Lq, hd), k and v (B, nh, Lk, hd), mask as SDPA takes it or None, scale of q k^T (None:
        hd ** -0.5) -> (B, nh, Lq, hd)."""
        if self.attention == "softmax":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=scale)
        kpm = key_padding_mask_from(mask, self.name)
        return cog_attention(q, k, v, key_padding_mask=kpm, scale=scale, backend=self.backend)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(attention={self.attention!r}, backend={self.backend!r}, name={self.name!r})"


class _Dispatch(_Attend):
    """`_Attend` for processors that call diffusers' `dispatch_attention_fn` in the (B, L, nh, hd) layout."""

    # Set by diffusers' `set_attention_backend`; the softmax mode passes them on as the stock processor does.
    _attention_backend = None
    _parallel_config = None

    def attend_blhd(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, parallel_config=None
    ) -> torch.Tensor:
        """q (B, Lq, nh, hd), k and v (B, Lk, nh, hd) -> (B, Lq, nh, hd)."""
        if self.attention == "softmax":
            return dispatch_attention_fn(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False,
                                         backend=self._attention_backend, parallel_config=parallel_config)  # fmt: skip
        return self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask).transpose(1, 2)


class _LayerScale:
    """The q k^T scale of processors that stand for both an SDPA processor (scale hd ** -0.5) and its explicit
    twin (`AttnProcessor`, `AttnAddedKVProcessor`: the layer's `attn.scale`, 1 for layers built with
    `scale_qk=False`).

    Args:
        layer_scale: True: `attn.scale`; False: hd ** -0.5; None (the default, and what a re-created processor
            gets): as the layer's default processor, i.e. `attn.scale` on `scale_qk=False` layers, else hd ** -0.5.
    """

    def __init__(self, backend: Backend = "auto", name: str = "attention", layer_scale: bool | None = None):
        super().__init__(backend, name)
        self.layer_scale = layer_scale

    def scale_for(self, attn) -> float | None:
        """The scale to pass to `attend` (None: hd ** -0.5, SDPA's default)."""
        use_layer = not getattr(attn, "scale_qk", True) if self.layer_scale is None else self.layer_scale
        return attn.scale if use_layer else None

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, layer_scale={self.layer_scale})"


# ---------------------------------------------------------------------------------------------------------
# The processors
# ---------------------------------------------------------------------------------------------------------


class CogAttnProcessor(_LayerScale, _Attend):
    """diffusers' `AttnProcessor2_0` (and `AttnProcessor`, see `_LayerScale`) with Cog attention: self- and
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
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        batch_size, sequence_length, _ = context.shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        query, key, value = _qkv_heads(attn, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k, hidden_states,
                                       encoder_hidden_states)  # fmt: skip

        hidden_states = _merge_heads(self.attend(query, key, value, attention_mask, self.scale_for(attn)), query.dtype)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))  # linear projection, dropout
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


class CogAddedKVAttnProcessor(_LayerScale, _Attend):
    """diffusers' `AttnAddedKVProcessor2_0` (and `AttnAddedKVProcessor`, see `_LayerScale`): the SimpleCrossAttn
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

        query = _heads(attn.to_q(hidden_states), attn.heads)
        key = _heads(attn.add_k_proj(encoder_hidden_states), attn.heads)
        value = _heads(attn.add_v_proj(encoder_hidden_states), attn.heads)
        if not attn.only_cross_attention:  # the text tokens, then the image tokens themselves
            key = torch.cat([key, _heads(attn.to_k(hidden_states), attn.heads)], dim=2)
            value = torch.cat([value, _heads(attn.to_v(hidden_states), attn.heads)], dim=2)

        hidden_states = self.attend(query, key, value, attention_mask, self.scale_for(attn))
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, residual.shape[1])
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        return hidden_states.transpose(-1, -2).reshape(residual.shape) + residual


class CogJointAttnProcessor(_Attend):
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
        query, key, value = _qkv_heads(attn, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k, hidden_states,
                                       hidden_states)  # fmt: skip
        if encoder_hidden_states is not None:
            c_query, c_key, c_value = _qkv_heads(attn, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj,
                                                 attn.norm_added_q, attn.norm_added_k, encoder_hidden_states,
                                                 encoder_hidden_states)  # fmt: skip
            query = torch.cat([query, c_query], dim=2)
            key = torch.cat([key, c_key], dim=2)
            value = torch.cat([value, c_value], dim=2)

        hidden_states = _merge_heads(self.attend(query, key, value, None), query.dtype)
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = hidden_states[:, :n_image], hidden_states[:, n_image:]
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


class CogFluxAttnProcessor(_Dispatch):
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
                         attn.add_v_proj(encoder_hidden_states))  # fmt: skip
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


class CogAuraFlowAttnProcessor(_Attend):
    """diffusers' `AuraFlowAttnProcessor2_0` (AuraFlow's joint and single-stream blocks: context tokens first, q/k
    norms, the layer's `attn.scale`)."""

    def __call__(
        self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None, *args, **kwargs
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """hidden_states (B, L, C), encoder_hidden_states (B, Lc, C) or None. Returns (B, L, C), and (B, Lc, C) for
        the context when it was given."""
        split = lambda t: t.unflatten(-1, (attn.heads, -1))  # noqa: E731  (B, L, nh, hd)
        query, key, value = (split(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            c_query, c_key, c_value = (split(f(encoder_hidden_states))
                                       for f in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))  # fmt: skip
            if attn.norm_added_q is not None:
                c_query = attn.norm_added_q(c_query)
            if attn.norm_added_k is not None:
                c_key = attn.norm_added_k(c_key)
            query, key = torch.cat([c_query, query], 1), torch.cat([c_key, key], 1)
            value = torch.cat([c_value, value], 1)

        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        hidden_states = _merge_heads(self.attend(q, k, v, None, attn.scale), query.dtype)
        if encoder_hidden_states is not None:
            n_context = encoder_hidden_states.shape[1]
            hidden_states, encoder_hidden_states = hidden_states[:, n_context:], hidden_states[:, :n_context]
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, attn.to_add_out(encoder_hidden_states)
        return hidden_states


class CogCogVideoXAttnProcessor(_Attend):
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
        batch_size, sequence_length, _ = hidden_states.shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        query, key, value = _qkv_heads(attn, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k, hidden_states,
                                       hidden_states)  # fmt: skip
        if image_rotary_emb is not None:
            query = torch.cat([query[:, :, :n_text], apply_rotary_emb(query[:, :, n_text:], image_rotary_emb)], 2)
            if not attn.is_cross_attention:
                key = torch.cat([key[:, :, :n_text], apply_rotary_emb(key[:, :, n_text:], image_rotary_emb)], 2)

        hidden_states = self.attend(query, key, value, attention_mask).transpose(1, 2).flatten(2)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        encoder_hidden_states, hidden_states = hidden_states.split([n_text, hidden_states.size(1) - n_text], dim=1)
        return hidden_states, encoder_hidden_states


class CogHunyuanAttnProcessor(_Attend):
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
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        input_ndim = hidden_states.ndim
        if input_ndim == 4:
            batch_size, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch_size, channel, height * width).transpose(1, 2)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        batch_size, sequence_length, _ = context.shape
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        query, key, value = _qkv_heads(attn, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k, hidden_states,
                                       encoder_hidden_states)  # fmt: skip
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb)
            if not attn.is_cross_attention:
                key = apply_rotary_emb(key, image_rotary_emb)

        hidden_states = _merge_heads(self.attend(query, key, value, attention_mask), query.dtype)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


class CogLTXAttnProcessor(_Dispatch):
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
        batch_size, sequence_length, _ = (hidden_states if encoder_hidden_states is None
                                          else encoder_hidden_states).shape  # fmt: skip
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(encoder_hidden_states))
        value = attn.to_v(encoder_hidden_states)
        if image_rotary_emb is not None:
            query = ltx_rotary_emb(query, image_rotary_emb)
            key = ltx_rotary_emb(key, image_rotary_emb)
        split = lambda t: t.unflatten(2, (attn.heads, -1))  # noqa: E731  (B, L, nh, hd)

        hidden_states = self.attend_blhd(split(query), split(key), split(value), attention_mask, self._parallel_config)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](hidden_states))


def _wan_rotary(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on interleaved pairs: x (B, L, nh, hd), freqs (1, L, 1, hd) -> (B, L, nh, hd)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)


class CogWanAttnProcessor(_Dispatch):
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
        split = lambda t: t.unflatten(2, (attn.heads, -1))  # noqa: E731  (B, L, nh, hd)
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


# The kept-softmax twins: the stock attention call, as a class of its own so that re-creating it keeps the mode.
class KeptSoftmaxAttnProcessor(CogAttnProcessor):
    """`CogAttnProcessor` on a layer kept on softmax: exactly the stock processor's computation."""

    attention = "softmax"


class KeptSoftmaxAddedKVAttnProcessor(CogAddedKVAttnProcessor):
    """`CogAddedKVAttnProcessor` on a layer kept on softmax."""

    attention = "softmax"


class KeptSoftmaxJointAttnProcessor(CogJointAttnProcessor):
    """`CogJointAttnProcessor` on a layer kept on softmax."""

    attention = "softmax"


class KeptSoftmaxFluxAttnProcessor(CogFluxAttnProcessor):
    """`CogFluxAttnProcessor` on a layer kept on softmax."""

    attention = "softmax"


class KeptSoftmaxAuraFlowAttnProcessor(CogAuraFlowAttnProcessor):
    """`CogAuraFlowAttnProcessor` on a layer kept on softmax."""

    attention = "softmax"


class KeptSoftmaxCogVideoXAttnProcessor(CogCogVideoXAttnProcessor):
    """`CogCogVideoXAttnProcessor` on a layer kept on softmax."""

    attention = "softmax"


class KeptSoftmaxHunyuanAttnProcessor(CogHunyuanAttnProcessor):
    """`CogHunyuanAttnProcessor` on a layer kept on softmax."""

    attention = "softmax"


class KeptSoftmaxLTXAttnProcessor(CogLTXAttnProcessor):
    """`CogLTXAttnProcessor` on a layer kept on softmax."""

    attention = "softmax"


class KeptSoftmaxWanAttnProcessor(CogWanAttnProcessor):
    """`CogWanAttnProcessor` on a layer kept on softmax."""

    attention = "softmax"


# (stock processors, Cog processor, kept-softmax processor) for each supported family.
FAMILIES: list[tuple[tuple[type, ...], type, type]] = [
    ((AttnProcessor2_0, AttnProcessor), CogAttnProcessor, KeptSoftmaxAttnProcessor),
    ((AttnAddedKVProcessor2_0, AttnAddedKVProcessor), CogAddedKVAttnProcessor, KeptSoftmaxAddedKVAttnProcessor),
    ((JointAttnProcessor2_0,), CogJointAttnProcessor, KeptSoftmaxJointAttnProcessor),
    ((FluxAttnProcessor,), CogFluxAttnProcessor, KeptSoftmaxFluxAttnProcessor),
    ((AuraFlowAttnProcessor2_0,), CogAuraFlowAttnProcessor, KeptSoftmaxAuraFlowAttnProcessor),
    ((CogVideoXAttnProcessor2_0,), CogCogVideoXAttnProcessor, KeptSoftmaxCogVideoXAttnProcessor),
    ((HunyuanAttnProcessor2_0,), CogHunyuanAttnProcessor, KeptSoftmaxHunyuanAttnProcessor),
    ((LTXVideoAttnProcessor,), CogLTXAttnProcessor, KeptSoftmaxLTXAttnProcessor),
    ((WanAttnProcessor,), CogWanAttnProcessor, KeptSoftmaxWanAttnProcessor),
]

# Stock processors that scale q k^T by the layer's `attn.scale` (their SDPA twins use hd ** -0.5): see `_LayerScale`.
LAYER_SCALED = (AttnProcessor, AttnAddedKVProcessor)

# Stock processors whose attention is not softmax attention, so Cog attention has nothing to replace.
REFUSED = {
    SanaLinearAttnProcessor2_0: "linear attention (ReLU feature maps, no softmax over the scores), which has no "
    "signed-softmax counterpart",
}
