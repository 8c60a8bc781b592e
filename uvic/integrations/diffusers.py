"""Cog attention in diffusers models through diffusers' own attention-processor API.

    from uvic.integrations.diffusers import apply_cog_attention
    switched = apply_cog_attention(unet, keep_softmax=1)   # names of the attention modules now on Cog

`CogAttnProcessor` computes what diffusers' default `AttnProcessor2_0` computes (spatial norm, group norm, 4-D
inputs, cross-attention, norm_q / norm_k, residual, rescale), with `uvic.attention.cog_attention` in place of
`F.scaled_dot_product_attention` (and, with `layer_scale=True`, what `AttnProcessor` computes: the default of layers
built with `scale_qk=False`); `CogJointAttnProcessor` does the same for `JointAttnProcessor2_0` (the MMDiT
blocks of `SD3Transformer2DModel`) and `CogFluxAttnProcessor` for `FluxAttnProcessor` (FluxTransformer2DModel's
double- and single-stream blocks). In `attention="softmax"` mode each makes the stock attention call, so a kept
layer gives the stock output. Shapes: B batch, L tokens, C channels, nh heads, hd head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0, JointAttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from uvic.attention import AttentionKind, Backend, cog_attention


__all__ = ["CogAttnProcessor", "CogFluxAttnProcessor", "CogJointAttnProcessor", "apply_cog_attention",
           "key_padding_mask_from"]

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


def _qkv_heads(attn, to_q, to_k, to_v, norm_q, norm_k, x: torch.Tensor, context: torch.Tensor):
    """Queries from x (B, Lq, C), keys and values from context (B, Lk, C'), split into heads (B, nh, L, hd), with
    the optional q and k norms applied."""
    heads = lambda t: t.unflatten(-1, (attn.heads, -1)).transpose(1, 2)  # noqa: E731
    q, k, v = heads(to_q(x)), heads(to_k(context)), heads(to_v(context))
    return (q if norm_q is None else norm_q(q)), (k if norm_k is None else norm_k(k)), v


def _merge_heads(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, nh, L, hd) -> (B, L, nh * hd) in `dtype`."""
    return x.transpose(1, 2).flatten(2).to(dtype)


class _Attend:
    """The attention step shared by the processors: stock SDPA (softmax) or `cog_attention` (cog)."""

    def __init__(self, attention: AttentionKind = "cog", backend: Backend = "auto", name: str = "attention"):
        if attention not in ("cog", "softmax"):
            raise ValueError(f"attention must be 'cog' or 'softmax', got {attention!r}")
        self.attention, self.backend, self.name = attention, backend, name

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


class CogAttnProcessor(_Attend):
    """diffusers' `AttnProcessor2_0` with Cog attention (`attention="cog"`) or its own SDPA call ("softmax").

    Args:
        attention: "cog" or "softmax".
        backend: the `uvic.attention.cog_attention` backend ("auto": the fused kernel on GPUs where it fits).
        name: the module's name, used in error messages.
        layer_scale: scale q k^T by the layer's `attn.scale`, as diffusers' `AttnProcessor` does (the default
            processor of layers built with `scale_qk=False`, whose `attn.scale` is 1). False (the default): the
            scale hd ** -0.5, as `AttnProcessor2_0` (which does not read `attn.scale`).
    """

    def __init__(self, attention: AttentionKind = "cog", backend: Backend = "auto", name: str = "attention",
                 layer_scale: bool = False):  # fmt: skip
        super().__init__(attention, backend, name)
        self.layer_scale = layer_scale

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, layer_scale={self.layer_scale})"

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

        scale = attn.scale if self.layer_scale else None
        hidden_states = _merge_heads(self.attend(query, key, value, attention_mask, scale), query.dtype)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))  # linear projection, dropout
        if input_ndim == 4:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch_size, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


class CogJointAttnProcessor(_Attend):
    """diffusers' `JointAttnProcessor2_0` (SD3's MMDiT blocks: image and context tokens attend jointly) with Cog
    attention or its own SDPA call. Like the stock processor it takes no attention mask (one passed is ignored,
    as there). Arguments as `CogAttnProcessor`."""

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


class CogFluxAttnProcessor(_Attend):
    """diffusers' `FluxAttnProcessor` (FluxTransformer2DModel: joint text-image blocks and single-stream blocks,
    RMS-normed q and k, rotary embeddings) with Cog attention or the stock attention call. Arguments as
    `CogAttnProcessor`."""

    # Set by diffusers' `set_attention_backend` on Flux processors; the softmax mode passes them on as the stock does.
    _attention_backend = None
    _parallel_config = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q (B, Lq, nh, hd), k and v (B, Lk, nh, hd) (Flux's layout) -> (B, Lq, nh, hd)."""
        if self.attention == "softmax":
            return dispatch_attention_fn(q, k, v, attn_mask=mask, backend=self._attention_backend,
                                         parallel_config=self._parallel_config)  # fmt: skip
        return super().attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask).transpose(1, 2)

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

        hidden_states = self.attend(query, key, value, attention_mask)

        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        if not with_context:
            return hidden_states
        n_context = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states[:, :n_context], hidden_states[:, n_context:]
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        return hidden_states, attn.to_add_out(encoder_hidden_states.contiguous())


# The stock processors each Cog processor reproduces (a Cog processor replaces itself, so the call can be repeated).
# AttnProcessor is AttnProcessor2_0 with attn.scale and the explicit softmax: CogAttnProcessor with layer_scale.
_REPLACEMENTS = {
    AttnProcessor2_0: CogAttnProcessor,
    AttnProcessor: CogAttnProcessor,
    CogAttnProcessor: CogAttnProcessor,
    JointAttnProcessor2_0: CogJointAttnProcessor,
    CogJointAttnProcessor: CogJointAttnProcessor,
    FluxAttnProcessor: CogFluxAttnProcessor,
    CogFluxAttnProcessor: CogFluxAttnProcessor,
}


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """(name, module, block) of every attention module (anything with a diffusers `processor`), in forward order.

    A block is the enclosing `...TransformerBlock` (its self- and cross-attention count as one block), or the
    attention module itself outside such blocks (e.g. the attention layers of a UNet2DModel). Forward order is
    module order, except that a UNet runs down_blocks, mid_block, up_blocks (registered as down, up, mid).
    """
    modules = dict(model.named_modules())
    stage = {"down_blocks": 0, "mid_block": 1, "up_blocks": 2}
    found = []
    for position, (name, module) in enumerate(modules.items()):
        if not (hasattr(module, "processor") and hasattr(module, "set_processor")):
            continue
        parent = name.rpartition(".")[0]
        block = parent if type(modules.get(parent)).__name__.endswith("TransformerBlock") else name
        found.append((stage.get(name.split(".")[0], -1), position, name, module, block))
    found.sort(key=lambda row: row[:2])
    return [row[2:] for row in found]


def apply_cog_attention(model: torch.nn.Module, keep_softmax: int = 1, backend: Backend = "auto") -> list[str]:
    """Switch a diffusers model to Cog attention in the paper's placement: every attention block on Cog except the
    first and last `keep_softmax` blocks in forward order, which keep softmax (the stock computation).

    Blocks: a transformer block's attention layers (self-, cross- or joint attention) form one block; for a
    UNet2DConditionModel that is each BasicTransformerBlock, in down, mid, up order. Processors are installed
    with diffusers' `set_processor`; call this again (another `keep_softmax`) to change the placement.

    Args:
        model: a diffusers model (DiTTransformer2DModel, UNet2DConditionModel, SD3Transformer2DModel, ...).
        keep_softmax: blocks kept on softmax at each end; 0 switches every block.
        backend: the `cog_attention` backend of the switched layers.
    Returns:
        The names of the attention modules switched to Cog, in forward order.
    Raises:
        ValueError: a bad `keep_softmax`, a model without attention modules, or an attention module whose
            processor has no Cog counterpart (the message names the module and its processor).
    """
    if not isinstance(keep_softmax, int) or isinstance(keep_softmax, bool) or keep_softmax < 0:
        raise ValueError(f"keep_softmax must be an int >= 0, got {keep_softmax!r}")
    layers = _attention_modules(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no diffusers attention modules to switch")
    for name, module, _ in layers:
        if type(module.processor) not in _REPLACEMENTS:
            known = ", ".join(sorted({c.__name__ for c in _REPLACEMENTS}))
            raise ValueError(f"attention module {name!r} uses {type(module.processor).__name__}, which uvic cannot "
                             f"switch to Cog attention (supported processors: {known})")  # fmt: skip
    blocks = list(dict.fromkeys(block for _, _, block in layers))
    cog_blocks = set(blocks[keep_softmax : len(blocks) - keep_softmax])
    switched = []
    for name, module, block in layers:
        attention = "cog" if block in cog_blocks else "softmax"
        old = module.processor
        cls = _REPLACEMENTS[type(old)]
        # AttnProcessor (and a Cog processor that replaced one) reads attn.scale.
        kwargs = {}
        if cls is CogAttnProcessor:
            kwargs["layer_scale"] = type(old) is AttnProcessor or getattr(old, "layer_scale", False)
        module.set_processor(cls(attention, backend, name, **kwargs))
        if attention == "cog":
            switched.append(name)
    return switched
