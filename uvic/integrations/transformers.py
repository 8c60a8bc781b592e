"""Cog attention in transformers models through transformers' public attention interfaces.

Importing this module registers the attention implementation "cog" with `transformers.AttentionInterface` and
its mask with `transformers.masking_utils.AttentionMaskInterface`, so models that dispatch attention through the
interface (Llama, Qwen2/3, Mistral, Gemma 2/3, ViT, CLIP, Whisper, ...) accept it:

    import uvic.integrations.transformers  # registers "cog"
    switched = apply_cog_attention(model, keep_softmax_first=1, keep_softmax_last=1)
    model.save_pretrained("run")            # config.json names the implementation and the placement
    model = AutoModelForCausalLM.from_pretrained("run")   # Cog again, as long as this module is imported

The placement rule lives in the model config as `cog_keep_softmax_first` / `cog_keep_softmax_last` (saved by
`save_pretrained`): in each stack of layers (a decoder's, an encoder's, a vision tower's), the first
`keep_softmax_first` and the last `keep_softmax_last` layers keep softmax attention
(`uvic.attention.softmax_attention`), every layer between runs `uvic.attention.cog_attention` (the rule is
`uvic.attention.attention_placement`; a stack no longer than the two ends keeps softmax throughout). A config
without the fields uses DEFAULT_KEEP_SOFTMAX at each end; a model built from a config whose field is not an int >= 0
raises a ValueError. A config saved with the old single count `cog_keep_softmax` (both ends) loads as that
placement, with a FutureWarning.

Importing this module also makes every transformers model check its attention implementation when it is built:
one whose config records Cog attention (`cog_keep_softmax_first`) but runs another implementation warns, and one built
with "cog" gets `attn_implementation: "cog"` in its config, which is what `from_pretrained` reads back.

Masks: causal (bottom-right aligned, so a KV cache needs no extra mask), causal with a sliding window (Mistral,
Gemma 2/3 local layers) or bidirectional (encoders, cross-attention), plus key padding from the 2-D
`attention_mask` (or from a caller's 4-D mask of that pattern); logit softcaps (Gemma 2) go to the op. `generate`
with a StaticCache and `compile_config=CompileConfig(fullgraph=True)` compiles its decoding step to one graph, as
with SDPA. Shapes: B batch, nh heads, Lq / Lk query / key tokens,
hd head dim.
"""

from __future__ import annotations

import functools
import reprlib
import warnings
from collections.abc import Callable

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, bidirectional_mask_function, causal_mask_function

from uvic.attention import (
    BACKENDS,
    Backend,
    attention_op,
    attention_placement,
    check_softmax_count,
    kept_by_mask,
    renamed_placement,
)


__all__ = ["CONFIG_FIELDS", "DEFAULT_KEEP_SOFTMAX", "apply_cog_attention", "cog_attention_forward", "cog_mask",
           "layer_uses_cog"]

IMPLEMENTATION = "cog"
# The model-config fields of the placement: keep_softmax_first, keep_softmax_last.
CONFIG_FIELDS = ("cog_keep_softmax_first", "cog_keep_softmax_last")
OLD_CONFIG_FIELD = "cog_keep_softmax"  # the one count of both ends that configs saved before the rename hold
DEFAULT_KEEP_SOFTMAX = 1  # the paper's placement: softmax in the first and last layer


def layer_uses_cog(config, layer_idx: int, num_layers: int | None = None) -> bool:
    """Whether layer `layer_idx` of a stack of `num_layers` layers (default: `config.num_hidden_layers`) runs Cog
    attention (else softmax) under this config's placement."""
    first, last = (getattr(config, f, DEFAULT_KEEP_SOFTMAX) for f in CONFIG_FIELDS)
    n = config.num_hidden_layers if num_layers is None else num_layers
    # The same counts for every stack; a stack no longer than the two ends keeps softmax in all of its layers.
    return attention_placement(n, first, last, allow_overlap=True, names=CONFIG_FIELDS)[layer_idx] == "cog"


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
    """The mask "cog" attention gets: a (B, n) key padding mask (True = the key takes part) over the first n keys,
    or None (every key takes part).

    Registered with `AttentionMaskInterface`; transformers calls it with the arguments of its other mask builders.
    The causal part and a sliding window are not materialised: they are the op's bottom-right aligned `causal=True`
    and `window`, which equal transformers' patterns when the keys end at the current token (no cache, a
    DynamicCache, or its sliding layers). A StaticCache holds `kv_length` slots from position 0 of which only the
    first q_offset + q_length are filled, and no query sees the rest:
    - one query (a decoding step, what `generate` compiles): the mask covers all `kv_length` slots, with the unfilled
      ones False. Its shape does not change from step to step, and it is computed from the cache's offset tensor
      without reading it, so a compiled decoding step is one graph (no recompile per token, no graph break);
    - several queries (a prefill): the mask has n = q_offset + q_length < kv_length columns, and
      `cog_attention_forward` attends to the first n keys only, which end at the current token (`int(q_offset)`:
      outside torch.compile, as `generate` runs its prefill).
    A mask in which every key takes part becomes None outside torch.compile (kept softmax layers then run SDPA's
    fused kernels); under torch.compile it stays a tensor, since testing its values would break the graph.

    Raises:
        ValueError: a mask pattern other than causal, causal with the config's sliding window, or bidirectional
            (packed sequences, block masks, bidirectional windows), or causal keys that neither end at the current
            token nor start at position 0 and reach it (a static sliding-window cache). The mask is built once for
            all layers, so the message names the model (from `config`), not a layer.
    """
    config = kwargs.get("config")
    where = "attention mask" if config is None else f"{type(config).__name__.removesuffix('Config')} attention mask"
    device = attention_mask.device if attention_mask is not None else kwargs.get("device", "cpu")
    if (isinstance(q_offset, torch.Tensor) and q_length == 1 and kv_offset == 0
            and mask_function is causal_mask_function):
        # A decoding step on a StaticCache (whose layers give their offset as a tensor): all kv_length slots, the
        # unfilled ones off, so the shape is the same at every step and no value is read.
        kpm = (torch.arange(kv_length, device=device) < q_offset + q_length)[None].expand(batch_size, -1)
        if attention_mask is None:
            return kpm
        return kpm & _padded(attention_mask[:, :kv_length].to(torch.bool), kv_length)
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    filled = kv_length  # keys up to the current token
    if mask_function is not bidirectional_mask_function and kv_offset + kv_length != q_offset + q_length:
        filled = q_offset + q_length
        if kv_offset != 0 or not 0 < filled <= kv_length:
            raise ValueError(f"{where}: Cog attention needs causal keys that end at the current token, or a cache "
                             f"whose keys start at position 0 (a DynamicCache or a StaticCache); got {kv_length} keys "
                             f"at offset {kv_offset} for the {q_length} queries at {q_offset} (a static "
                             "sliding-window cache)")
    if mask_function not in (causal_mask_function, bidirectional_mask_function):
        # Any other pattern is accepted only if it is the causal one or the causal one cut by the sliding window.
        i = torch.arange(q_length, device=device)[None, :, None] + q_offset
        j = torch.arange(kv_length, device=device)[None, None, :] + kv_offset
        b = torch.arange(batch_size, device=device)[:, None, None]
        pattern = mask_function(b, torch.zeros_like(b), i, j)
        window = getattr(config, "sliding_window", None)
        allowed = [j <= i] + ([(j <= i) & (j > i - window)] if isinstance(window, int) else [])
        if not any(bool((pattern == a).all()) for a in allowed):
            raise ValueError(f"{where}: Cog attention supports causal masks (with the config's sliding window, if "
                             "any) or bidirectional ones, with key padding; this model asks for another pattern "
                             f"({getattr(mask_function, '__name__', mask_function)}: packed sequences, a block "
                             "mask or a bidirectional window)")
    if filled < kv_length:  # a static cache: the first `filled` positions (transformers pads a short mask with 0)
        if attention_mask is None:
            return torch.ones(batch_size, filled, dtype=torch.bool, device=device)
        return _padded(attention_mask[:, :filled].to(torch.bool), filled)
    if attention_mask is None:
        return None
    kpm = attention_mask[:, -kv_length:].to(torch.bool)
    if not torch.compiler.is_compiling() and bool(kpm.all()):
        return None
    return kpm


def _padded(kpm: torch.Tensor, n: int) -> torch.Tensor:
    """A (B, m) key padding mask with m <= n as (B, n): the keys past the mask's end are off, as transformers
    pads a short 2-D mask."""
    return torch.nn.functional.pad(kpm, (0, n - kpm.shape[-1]))


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
    """The "cog" entry of `AttentionInterface`: Cog or softmax attention for `module` by its place in its stack.

    Args:
        module: the model's attention module (carries `config`, and `cog_layer` = (index, stack length) set by
            `apply_cog_attention` or at build time, else `layer_idx`; `is_causal`, `num_key_value_groups`).
        query: (B, nh, Lq, hd); key, value: (B, nh_kv, Lk, hd) (grouped-query heads are repeated).
        attention_mask: what `cog_mask` built: (B, n) bool key padding mask over the first n <= Lk keys (n < Lk:
            a static cache's filled slots, and only those keys are attended to), or None. A 4-D mask a caller
            passed to the model ((B or 1, nh or 1, Lq, Lk), bool True = attend, or additive float: 0 = attend,
            -inf or the dtype's lowest value = masked) is taken when it is this layer's causal (or bidirectional)
            pattern, with its sliding window, cut by key padding: it becomes that key padding mask.
        dropout: must be 0 (attention dropout is not supported).
        scaling: multiplies q k^T.
        is_causal: overrides `module.is_causal`.
        kwargs: `sliding_window` w (causal: keys i - w < j <= i) and `softcap` c go to the op.
    Returns:
        ((B, Lq, nh, hd) attention output, None): the interface's (output, weights); weights are not returned.
    """
    place = getattr(module, "cog_layer", None)
    where = f"{type(module).__name__} (layer {place[0] if place else getattr(module, 'layer_idx', '?')})"
    if dropout:
        raise ValueError(f"{where}: attention dropout ({dropout}) is not supported by Cog attention")
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"{where}: attention sinks (`s_aux`) are not supported by Cog attention")
    if attention_mask is not None and attention_mask.dim() != 4 and (attention_mask.dim() != 2
                                                                    or attention_mask.dtype != torch.bool):
        raise ValueError(f"{where}: Cog attention takes causal or bidirectional attention with a 2-D key padding "
                         f"mask or a 4-D mask of that pattern; got a {attention_mask.dim()}-D {attention_mask.dtype} "
                         "mask")
    if place is None:
        if not isinstance(getattr(module, "layer_idx", None), int):
            raise ValueError(f"{where}: no layer index to place Cog attention by; call apply_cog_attention(model)")
        place = (module.layer_idx, module.config.num_hidden_layers)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = kwargs.get("sliding_window")
    if window is not None:
        if not causal:
            raise ValueError(f"{where}: a bidirectional sliding window is not supported by Cog attention")
        window = (int(window) - 1, 0)  # transformers' window w: keys i - w < j <= i
    if attention_mask is not None and attention_mask.dim() == 4:
        attention_mask = _key_padding_of(attention_mask, query.shape[0], key.shape[-2], causal, window, where)
    if attention_mask is not None and attention_mask.shape[-1] < key.shape[-2]:  # a static cache's filled slots
        key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    op = attention_op("cog" if layer_uses_cog(module.config, *place) else "softmax")
    out = op(query, key, value, causal=causal, key_padding_mask=attention_mask, scale=scaling, window=window,
             softcap=kwargs.get("softcap"), backend=getattr(module.config, "cog_backend", "auto"))
    return out.transpose(1, 2).contiguous(), None


def _key_padding_of(mask: torch.Tensor, batch_size: int, kv_length: int, causal: bool,
                    window: tuple[int, int] | None, where: str) -> torch.Tensor | None:
    """The (B, Lk) key padding mask (None: every key) that, with the op's bottom-right aligned causal band (or
    none) and `window`, keeps exactly what the 4-D `mask` keeps; a ValueError naming `where` for any other mask.

    Args:
        mask: (B or 1, nh or 1, Lq, Lk) bool (True = attend), or float, added to the scores (0 = attend, -inf or
            below half the dtype's lowest value = masked).
    """
    b, _, q_length, k_length = mask.shape
    if b not in (1, batch_size) or k_length != kv_length:
        raise ValueError(f"{where}: a 4-D attention mask of shape {tuple(mask.shape)} does not fit {batch_size} "
                         f"sequences of {kv_length} keys")
    keep = kept_by_mask(mask)
    if keep is None:
        raise ValueError(f"{where}: the 4-D float attention mask holds values other than 0 and -inf (a bias on "
                         "the scores); Cog attention takes only masks that remove keys")
    # The keys any query keeps; in a causal pattern the last query keeps every key that is not padding.
    kpm = keep.any(dim=2)[:, 0]  # (b, Lk)
    i = torch.arange(q_length, device=mask.device)[:, None] + (kv_length - q_length)
    j = torch.arange(kv_length, device=mask.device)[None, :]
    band = j <= i if causal else torch.ones_like(i == j)
    if window is not None:
        band = band & (j >= i - window[0])
    if not bool((keep == (band & kpm[:, None, None, :])).all()):
        pattern = "causal" + (f" (window {window[0] + 1})" if window else "") if causal else "bidirectional"
        raise ValueError(f"{where}: Cog attention takes a 4-D mask only when it is the layer's {pattern} pattern "
                         f"with key padding (the same for every head); this one keeps other keys (a custom or "
                         f"block mask)")
    if bool(kpm.all()):
        return None
    return kpm.expand(batch_size, -1)


AttentionInterface.register(IMPLEMENTATION, cog_attention_forward)
AttentionMaskInterface.register(IMPLEMENTATION, cog_mask)


def _attention_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, int, int]]:
    """(name, module, index, stack length) of the model's attention modules: the innermost `...Attention` modules
    (not a wrapper around another `...Attention`) that sit in a stack of layers (an `nn.ModuleList`
    whose entries are the layers), in module order."""
    modules = dict(model.named_modules())
    found = []
    for name, m in modules.items():
        if not type(m).__name__.endswith("Attention") or any(
            type(c).__name__.endswith("Attention") for c in m.children()
        ):
            continue
        parts = name.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            stack = modules.get(".".join(parts[:cut]))
            if isinstance(stack, torch.nn.ModuleList) and parts[cut].isdigit():
                found.append((name, m, int(parts[cut]), len(stack)))
                break
    return found


def _configs(config) -> list:
    """The config and its sub-configs (e.g. CLIP's text and vision configs), at any depth."""
    found = [config]
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            found += _configs(sub)
    return found


def _after_build(model: PreTrainedModel) -> None:
    """On a model just built: with "cog", record the implementation for `save_pretrained` and place the layers;
    with another implementation but a config that records Cog, warn."""
    config = model.config
    warned = False
    for sub in _configs(config):  # a config.json is anyone's to edit: its placement is checked as apply's argument
        try:
            if hasattr(sub, OLD_CONFIG_FIELD):  # saved before the rename: read as both ends, one warning per model
                old = check_softmax_count(getattr(sub, OLD_CONFIG_FIELD), OLD_CONFIG_FIELD)
                delattr(sub, OLD_CONFIG_FIELD)
                ends = renamed_placement(old, *(getattr(sub, f, None) for f in CONFIG_FIELDS), old=OLD_CONFIG_FIELD,
                                         where=f"{type(sub).__name__} {str(config.name_or_path)!r}", stacklevel=5,
                                         warn=not warned)
                warned = True
                for f, value in zip(CONFIG_FIELDS, ends):
                    setattr(sub, f, value)
            for f in CONFIG_FIELDS:
                if hasattr(sub, f):
                    check_softmax_count(getattr(sub, f), f)
        except ValueError as e:
            raise ValueError(f"{type(sub).__name__} {str(config.name_or_path)!r}: {e} (the config records "
                             "apply_cog_attention's placement there)") from None
        if hasattr(sub, "cog_backend"):
            check_backend(getattr(sub, "cog_backend"), f"{type(sub).__name__} {str(config.name_or_path)!r}: cog_backend")
    if config._attn_implementation == IMPLEMENTATION:
        config.attn_implementation = IMPLEMENTATION  # saved in config.json; from_pretrained reads it back
        for _, module, index, n in _attention_layers(model):
            module.cog_layer = (index, n)
    elif getattr(config, CONFIG_FIELDS[0], None) is not None:
        name = type(config).__name__.removesuffix("Config")
        recorded = ", ".join(f"{f}={getattr(config, f, None)}" for f in CONFIG_FIELDS)
        warnings.warn(f"{name} model {str(config.name_or_path)!r}: its config records Cog attention "
                      f"({recorded}), but it runs "
                      f"{config._attn_implementation!r} attention; load it with attn_implementation='cog' or call "
                      "uvic.integrations.transformers.apply_cog_attention", stacklevel=3)


def check_backend(backend: object, where: str) -> None:
    """Refuse a `uvic.attention` backend name that is not one (it was accepted, saved and failed at the first
    forward); `where` names the argument or the config field."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{where} must be one of {BACKENDS}, got {reprlib.repr(backend)}")


def _checked_post_init(post_init: Callable) -> Callable:
    @functools.wraps(post_init)
    def wrapper(self, *args, **kwargs):
        out = post_init(self, *args, **kwargs)
        _after_build(self)
        return out

    wrapper.uvic_cog_check = True
    return wrapper


# `post_init` ends every transformers model's __init__ (from_config and from_pretrained included).
if not getattr(PreTrainedModel.post_init, "uvic_cog_check", False):
    PreTrainedModel.post_init = _checked_post_init(PreTrainedModel.post_init)


def apply_cog_attention(model: PreTrainedModel, *, keep_softmax_first: int = DEFAULT_KEEP_SOFTMAX,
                        keep_softmax_last: int = DEFAULT_KEEP_SOFTMAX, backend: Backend = "auto",
                        keep_softmax: int | None = None) -> list[str]:
    """Switch a transformers model to Cog attention in the paper's placement: in each stack of layers, the first
    `keep_softmax_first` and the last `keep_softmax_last` layers keep softmax, every layer between runs Cog.

    Sets `config.cog_keep_softmax_first`, `config.cog_keep_softmax_last`, `config.cog_backend` (on sub-configs too)
    and the attention implementation "cog"; `save_pretrained` saves them, and `from_pretrained` restores them
    while this module is imported.

    Args:
        model: a transformers model whose attention goes through `AttentionInterface` (Llama, Qwen2, Gemma 2,
            ViT, CLIP, Whisper, ...).
        keep_softmax_first: layers kept on softmax at the start of each stack; 0 and 0 switch every layer.
        keep_softmax_last: layers kept on softmax at the end of each stack.
        backend: the `uvic.attention` backend.
        keep_softmax: the old name, one count for both ends (a FutureWarning); it replaces the two counts.
    Returns:
        The names of the attention modules that now run Cog attention. Warns when that is none of them.
    Raises:
        ValueError: a bad count or `backend`, or a model that cannot take the "cog" implementation (named): not a
            transformers model, one whose attention adds a position bias to the scores (T5's relative position
            bias), or one that does not use `AttentionInterface`.
    """
    if keep_softmax is not None:
        keep_softmax_first, keep_softmax_last = renamed_placement(keep_softmax, old="keep_softmax",
                                                                  where="apply_cog_attention")
    check_softmax_count(keep_softmax_first, "keep_softmax_first")
    check_softmax_count(keep_softmax_last, "keep_softmax_last")
    check_backend(backend, "backend")
    layers = _attention_layers(model)
    if not isinstance(model, PreTrainedModel) or not layers:
        raise ValueError(f"{type(model).__name__} is not a transformers model with per-layer attention modules")
    biased = [type(m).__name__ for _, m, _, _ in layers if hasattr(m, "relative_attention_bias")]
    if biased:
        raise ValueError(f"{type(model).__name__}: {biased[0]} adds a learned relative-position bias to the attention "
                         "scores; Cog attention takes only masks that remove keys, not a bias, so it does not "
                         "apply")
    model.set_attn_implementation(IMPLEMENTATION)
    if model.config._attn_implementation != IMPLEMENTATION:
        raise ValueError(f"{type(model).__name__} does not dispatch its attention through transformers' "
                         "AttentionInterface, so it cannot run Cog attention")
    for config in _configs(model.config):
        if hasattr(config, OLD_CONFIG_FIELD):
            delattr(config, OLD_CONFIG_FIELD)
        for field, count in zip(CONFIG_FIELDS, (keep_softmax_first, keep_softmax_last)):
            setattr(config, field, count)
        config.cog_backend = backend
    model.config.attn_implementation = IMPLEMENTATION
    switched = []
    for name, module, index, n in layers:
        module.cog_layer = (index, n)
        if layer_uses_cog(module.config, index, n):
            switched.append(name)
    if not switched:
        warnings.warn(f"{type(model).__name__}: keep_softmax_first={keep_softmax_first} and keep_softmax_last="
                      f"{keep_softmax_last} keep every layer of its stacks "
                      f"({', '.join(sorted({str(n) for *_, n in layers}))} layers) on softmax, so no layer runs "
                      "Cog attention (use smaller counts; 0 and 0 switch every layer)", stacklevel=2)
    return switched
