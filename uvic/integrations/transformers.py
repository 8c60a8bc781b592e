"""Cog attention in transformers models through transformers' public attention interfaces.

Importing this module registers the attention implementation "cog" with `transformers.AttentionInterface` and
its mask with `transformers.masking_utils.AttentionMaskInterface`, so decoder-only models that dispatch attention
through the interface (Llama, Qwen2/3, Mistral, ...) accept it:

    import uvic.integrations.transformers  # registers "cog"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="cog")
    # or, on a loaded model, in one call:
    switched = apply_cog_attention(model, keep_softmax=1)

The placement rule lives in the model config as `cog_keep_softmax` (saved by `save_pretrained`): decoder layers
0 .. k-1 and the last k keep softmax attention (`uvic.attention.softmax_attention`, i.e. SDPA), every layer between
runs `uvic.attention.cog_attention`. A config without the field uses DEFAULT_KEEP_SOFTMAX.

Masks: causal (bottom-right aligned, so a KV cache needs no extra mask) or bidirectional, plus key padding from the
2-D `attention_mask`. Shapes: B batch, nh heads, Lq / Lk query / key tokens, hd head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function, causal_mask_function

from uvic.attention import Backend, cog_attention, softmax_attention


__all__ = ["CONFIG_FIELD", "DEFAULT_KEEP_SOFTMAX", "apply_cog_attention", "cog_attention_forward", "cog_mask",
           "layer_uses_cog"]  # fmt: skip

IMPLEMENTATION = "cog"
CONFIG_FIELD = "cog_keep_softmax"
DEFAULT_KEEP_SOFTMAX = 1  # the paper's placement: softmax in the first and last layer


def layer_uses_cog(config, layer_idx: int) -> bool:
    """Whether decoder layer `layer_idx` of a model with this config runs Cog attention (else softmax)."""
    keep = getattr(config, CONFIG_FIELD, DEFAULT_KEEP_SOFTMAX)
    return keep <= layer_idx < config.num_hidden_layers - keep


def cog_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """The mask "cog" attention gets: the (B, kv_length) key padding mask (True = the key takes part), or None.

    Registered with `AttentionMaskInterface`; transformers calls it with the arguments of its other mask builders.
    The causal part is not materialised: it is the op's bottom-right aligned `causal=True`, which equals
    transformers' causal pattern when the keys end at the current token (no cache, or a DynamicCache).

    Raises:
        ValueError: a mask pattern other than causal or bidirectional (sliding windows that cut keys, packed
            sequences, block masks), or a cache whose keys do not end at the current token (StaticCache). The mask
            is built once for all layers, so the message names the model (from `config`), not a layer.
    """
    config = kwargs.get("config")
    where = "attention mask" if config is None else f"{type(config).__name__.removesuffix('Config')} attention mask"
    q_offset = int(q_offset)
    if kv_offset != 0 or q_offset + q_length != kv_length:
        raise ValueError(f"{where}: Cog attention needs keys that end at the current token (self-attention with no "
                         f"cache or a DynamicCache); got {kv_length} keys at offset {kv_offset} for the {q_length} "
                         f"queries at {q_offset} (a static or sliding cache, or cross-attention)")  # fmt: skip
    if mask_function not in (causal_mask_function, bidirectional_mask_function):
        # Any other pattern (e.g. a sliding window longer than the sequence) is accepted only if it is the causal one.
        device = attention_mask.device if attention_mask is not None else kwargs.get("device", "cpu")
        i = torch.arange(q_length, device=device)[None, :, None] + q_offset
        j = torch.arange(kv_length, device=device)[None, None, :]
        b = torch.arange(batch_size, device=device)[:, None, None]
        pattern = mask_function(b, torch.zeros_like(b), i, j)
        if not bool((pattern == (j <= i)).all()):
            raise ValueError(f"{where}: Cog attention supports causal or bidirectional masks with key padding; "
                             f"this model asks for another pattern ({getattr(mask_function, '__name__', mask_function)}"
                             ": a sliding window shorter than the sequence, packed sequences or a block mask)")  # fmt: skip
    if attention_mask is None:
        return None
    kpm = attention_mask[:, -kv_length:].to(torch.bool)
    return None if bool(kpm.all()) else kpm


def cog_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The "cog" entry of `AttentionInterface`: Cog or softmax attention for `module` by its layer index.

    Args:
        module: the model's attention module (carries `config`, `layer_idx`, `is_causal`, `num_key_value_groups`).
        query: (B, nh, Lq, hd); key, value: (B, nh_kv, Lk, hd) (grouped-query heads are repeated).
        attention_mask: what `cog_mask` built: (B, Lk) bool key padding mask, or None.
        dropout: must be 0 (attention dropout is not supported).
        scaling: multiplies q k^T.
        is_causal: overrides `module.is_causal`.
    Returns:
        ((B, Lq, nh, hd) attention output, None): the interface's (output, weights); weights are not returned.
    """
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if dropout:
        raise ValueError(f"{where}: attention dropout ({dropout}) is not supported by Cog attention")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{where}: `{name}` is not supported by Cog attention")
    window = kwargs.get("sliding_window")
    if window is not None and key.shape[2] > window:
        raise ValueError(f"{where}: a sliding window ({window}) shorter than the keys ({key.shape[2]}) is not "
                         "supported by Cog attention")  # fmt: skip
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.dtype != torch.bool):
        raise ValueError(f"{where}: Cog attention takes causal or bidirectional attention with a 2-D key padding "
                         f"mask; got a {attention_mask.dim()}-D {attention_mask.dtype} mask (4-D masks are not "
                         "supported)")  # fmt: skip
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    op = cog_attention if layer_uses_cog(module.config, module.layer_idx) else softmax_attention
    out = op(query, key, value, causal=bool(causal), key_padding_mask=attention_mask, scale=scaling,
             backend=getattr(module.config, "cog_backend", "auto"))  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(IMPLEMENTATION, cog_attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, cog_mask)


def _attention_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of the model's per-layer attention modules (an `...Attention` class with an int `layer_idx`)."""
    return [(name, m) for name, m in model.named_modules()
            if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)]


def apply_cog_attention(model: PreTrainedModel, keep_softmax: int = 1, backend: Backend = "auto") -> list[str]:
    """Switch a transformers model to Cog attention in the paper's placement: decoder layers 0 .. k-1 and the last
    k keep softmax, every layer between runs Cog (k = `keep_softmax`).

    Sets `model.config.cog_keep_softmax` (saved with the model; load it again with
    `from_pretrained(path, attn_implementation="cog")`) and the attention implementation "cog".

    Args:
        model: a transformers model whose attention goes through `AttentionInterface` (Llama, Qwen2, ...).
        keep_softmax: layers kept on softmax at each end; 0 switches every layer.
        backend: the `uvic.attention` backend (stored as `config.cog_backend`).
    Returns:
        The names of the attention modules that now run Cog attention.
    Raises:
        ValueError: a bad `keep_softmax`, or a model that cannot take the "cog" implementation (named): not a
            transformers model, an encoder-decoder model, or one that does not use `AttentionInterface`.
    """
    if not isinstance(keep_softmax, int) or isinstance(keep_softmax, bool) or keep_softmax < 0:
        raise ValueError(f"keep_softmax must be an int >= 0, got {keep_softmax!r}")
    layers = _attention_layers(model)
    if not isinstance(model, PreTrainedModel) or not layers or not hasattr(model.config, "num_hidden_layers"):
        raise ValueError(f"{type(model).__name__} is not a transformers model with per-layer attention modules")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model; Cog attention covers decoder-only "
                         "models (its mask has no cross-attention)")  # fmt: skip
    model.set_attn_implementation(IMPLEMENTATION)
    if model.config._attn_implementation != IMPLEMENTATION:
        raise ValueError(f"{type(model).__name__} does not dispatch its attention through transformers' "
                         "AttentionInterface, so it cannot run Cog attention")  # fmt: skip
    setattr(model.config, CONFIG_FIELD, keep_softmax)
    model.config.cog_backend = backend
    return [name for name, m in layers if layer_uses_cog(model.config, m.layer_idx)]
