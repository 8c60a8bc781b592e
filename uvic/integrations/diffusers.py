"""Cog attention in diffusers models through diffusers' own attention-processor API.

    from uvic.integrations.diffusers import apply_cog_attention, load
    switched = apply_cog_attention(unet, keep_softmax_first=1, keep_softmax_last=1)  # the modules now on Cog
    unet.save_pretrained("run")                           # the placement is saved in config.json
    unet = load(UNet2DConditionModel, "run")              # from_pretrained + the saved placement

The processors (`uvic.integrations.diffusers_processors`) each compute what one stock processor computes, with
`cog_attention` in place of softmax attention on switched layers and the stock call on kept ones. The placement
(`keep_softmax_first`, `keep_softmax_last`, `backend`) is recorded in the model's config under CONFIG_KEY, so
`save_pretrained` keeps it (one saved with the old single count `keep_softmax` loads with a FutureWarning);
plain `from_pretrained` gives stock processors back (diffusers does not save processors), `load` and
`restore_cog_attention` re-apply it. After `apply_cog_attention` the model checks at each forward that its attention
modules still run the processors it placed, and warns (naming them) where diffusers replaced one: an IP-adapter's
cross-attention processors, custom-diffusion processors, `set_attn_processor`.
"""

from __future__ import annotations

import reprlib
import warnings
from collections.abc import Mapping
from os import PathLike

import torch

from uvic.attention import BACKENDS, Backend, attention_placement, check_softmax_count, renamed_placement
from uvic.integrations.diffusers_processors import (
    FAMILIES,
    LAYER_SCALED,
    REFUSED,
    CogAddedKVAttnProcessor,
    CogAttnProcessor,
    CogAuraFlowAttnProcessor,
    CogCogVideoXAttnProcessor,
    CogFluxAttnProcessor,
    CogHunyuanAttnProcessor,
    CogJointAttnProcessor,
    CogLTXAttnProcessor,
    CogWanAttnProcessor,
    KeptSoftmaxAddedKVAttnProcessor,
    KeptSoftmaxAttnProcessor,
    KeptSoftmaxAuraFlowAttnProcessor,
    KeptSoftmaxCogVideoXAttnProcessor,
    KeptSoftmaxFluxAttnProcessor,
    KeptSoftmaxHunyuanAttnProcessor,
    KeptSoftmaxJointAttnProcessor,
    KeptSoftmaxLTXAttnProcessor,
    KeptSoftmaxWanAttnProcessor,
    key_padding_mask_from,
)
from uvic.integrations.diffusers_processors.base import LayerScale


__all__ = ["CONFIG_KEY", "CogAddedKVAttnProcessor", "CogAttnProcessor", "CogAuraFlowAttnProcessor",
           "CogCogVideoXAttnProcessor", "CogFluxAttnProcessor", "CogHunyuanAttnProcessor", "CogJointAttnProcessor",
           "CogLTXAttnProcessor", "CogWanAttnProcessor", "KeptSoftmaxAddedKVAttnProcessor", "KeptSoftmaxAttnProcessor",
           "KeptSoftmaxAuraFlowAttnProcessor", "KeptSoftmaxCogVideoXAttnProcessor", "KeptSoftmaxFluxAttnProcessor",
           "KeptSoftmaxHunyuanAttnProcessor", "KeptSoftmaxJointAttnProcessor", "KeptSoftmaxLTXAttnProcessor",
           "KeptSoftmaxWanAttnProcessor", "apply_cog_attention", "key_padding_mask_from", "load",
           "restore_cog_attention"]

# The model-config entry that records the placement: {"keep_softmax_first": int, "keep_softmax_last": int,
# "backend": str} (saved before the rename: {"keep_softmax": int, "backend": str}). A private ("_") key, so diffusers
# saves it and gives it back on from_pretrained without passing it to __init__.
CONFIG_KEY = "_cog_attention"
_RECORD_KEYS = ("keep_softmax_first", "keep_softmax_last", "backend")

# Each stock or uvic processor class -> (Cog class, kept-softmax class) of its family.
_FAMILY = {member: (cog, kept) for stock, cog, kept in FAMILIES for member in (*stock, cog, kept)}


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """(name, module, block) of every attention module (anything with a diffusers `processor`), in forward order.

    A block is the enclosing `...Block` module (e.g. a transformer block: its self- and cross-attention count as one
    block), or the attention module itself outside such blocks (e.g. the attention layers of a UNet2DModel or of a
    VAE). Forward order is module order, except that a UNet runs down_blocks, mid_block, up_blocks (registered as
    down, up, mid).
    """
    modules = dict(model.named_modules())
    stage = {"down_blocks": 0, "mid_block": 1, "up_blocks": 2}
    found = []
    for position, (name, module) in enumerate(modules.items()):
        if not (hasattr(module, "processor") and hasattr(module, "set_processor")):
            continue
        parent = name.rpartition(".")[0]
        block = parent if type(modules.get(parent)).__name__.endswith("Block") else name
        found.append((stage.get(name.split(".")[0], -1), position, name, module, block))
    found.sort(key=lambda row: row[:2])
    return [row[2:] for row in found]


class _ProcessorCheck:
    """A forward pre-hook that warns when an attention module no longer runs the processor class placed on it.
    A class rather than a closure, so a switched model still pickles and deep-copies.

    Args:
        placed: module name -> the processor class `apply_cog_attention` placed on it.
    """

    def __init__(self, placed: dict[str, type]):
        self.placed = placed

    def __call__(self, model: torch.nn.Module, args) -> None:
        modules = dict(model.named_modules())
        running = {name: type(getattr(modules.get(name), "processor", None)) for name in self.placed}
        replaced = [f"{name} ({running[name].__name__})" for name, cls in self.placed.items() if running[name] is not cls]
        if replaced:
            warnings.warn(f"{type(model).__name__}: {len(replaced)} attention module(s) no longer run the processor "
                          f"apply_cog_attention placed on them, so they do not follow the Cog placement: "
                          f"{', '.join(replaced[:4])}{', ...' if len(replaced) > 4 else ''}. Something replaced "
                          "them after apply_cog_attention (load_ip_adapter's cross-attention processors, "
                          "custom-diffusion load_attn_procs, set_attn_processor); call apply_cog_attention again "
                          "if their processors have Cog counterparts", stacklevel=2)


def apply_cog_attention(model: torch.nn.Module, *, keep_softmax_first: int = 1, keep_softmax_last: int = 1,
                        backend: Backend = "auto", keep_softmax: int | None = None) -> list[str]:
    """Switch a diffusers model to Cog attention in the paper's placement: every attention block on Cog except the
    first `keep_softmax_first` and the last `keep_softmax_last` blocks in forward order, which keep softmax (the
    stock computation).

    Blocks: a transformer block's attention layers (self-, cross- or joint attention) form one block; for a
    UNet2DConditionModel that is each BasicTransformerBlock, in down, mid, up order. Processors are installed
    with diffusers' `set_processor`: `Cog...Processor` on switched layers, `KeptSoftmax...Processor` on kept ones.
    Call this again (other counts) to change the placement. The placement is recorded in the model's
    config (CONFIG_KEY) when it has one, so `save_pretrained` saves it and `load` restores it.

    Args:
        model: a diffusers model (DiTTransformer2DModel, UNet2DConditionModel, SD3Transformer2DModel, ...).
        keep_softmax_first: blocks kept on softmax at the start; 0 and 0 switch every block.
        keep_softmax_last: blocks kept on softmax at the end.
        backend: the `cog_attention` backend of the switched layers.
        keep_softmax: the old name, one count for both ends (a FutureWarning); it replaces the two counts.
    Returns:
        The names of the attention modules switched to Cog, in forward order. Warns when that is none of them
        (the model has at most keep_softmax_first + keep_softmax_last attention blocks).
    Raises:
        ValueError: a bad count or `backend`, a model without attention modules, or an attention module whose
            processor has no Cog counterpart (the message names the module, its processor and, where Cog does
            not apply, why). Nothing is changed then.
    """
    if keep_softmax is not None:
        keep_softmax_first, keep_softmax_last = renamed_placement(keep_softmax, old="keep_softmax",
                                                                  where="apply_cog_attention")
    check_softmax_count(keep_softmax_first, "keep_softmax_first")
    check_softmax_count(keep_softmax_last, "keep_softmax_last")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    layers = _attention_modules(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no diffusers attention modules to switch")
    for name, module, _ in layers:
        processor = type(module.processor)
        if processor in REFUSED:
            raise ValueError(f"attention module {name!r} uses {processor.__name__}: {REFUSED[processor]}, so Cog "
                             "attention does not apply to it")
        if processor not in _FAMILY:
            known = ", ".join(sorted({c.__name__ for stock, _, _ in FAMILIES for c in stock}))
            raise ValueError(f"attention module {name!r} uses {processor.__name__}, which uvic cannot switch to "
                             f"Cog attention (supported processors: {known})")
    blocks = list(dict.fromkeys(block for _, _, block in layers))
    # A model with no more blocks than the two ends keeps them all (warned below).
    kinds = dict(zip(blocks, attention_placement(len(blocks), keep_softmax_first, keep_softmax_last,
                                                 allow_overlap=True)))
    switched, placed = [], {}
    for name, module, block in layers:
        old = module.processor
        cog, kept = _FAMILY[type(old)]
        cls = cog if kinds[block] == "cog" else kept
        kwargs = {}
        if issubclass(cls, LayerScale):  # AttnProcessor-style stock processors read attn.scale
            kwargs["layer_scale"] = getattr(old, "layer_scale", type(old) in LAYER_SCALED)
        module.set_processor(cls(backend, name, **kwargs))
        placed[name] = cls
        if cls is cog:
            switched.append(name)
    if not switched:
        warnings.warn(f"{type(model).__name__} has {len(blocks)} attention block(s), and keep_softmax_first="
                      f"{keep_softmax_first} and keep_softmax_last={keep_softmax_last} keep all of them on softmax, "
                      "so no layer runs Cog attention (use smaller counts; 0 and 0 switch every block)",
                      stacklevel=2)
    if hasattr(model, "register_to_config"):
        model.register_to_config(**{CONFIG_KEY: {"keep_softmax_first": keep_softmax_first,
                                                 "keep_softmax_last": keep_softmax_last, "backend": backend}})
    # One check per model: re-applying replaces the previous one.
    previous = getattr(model, "_cog_attention_check", None)
    if previous is not None:
        previous.remove()
    model._cog_attention_check = model.register_forward_pre_hook(_ProcessorCheck(placed))
    return switched


def restore_cog_attention(model: torch.nn.Module) -> list[str] | None:
    """Re-apply the placement recorded in a loaded model's config (what `apply_cog_attention` saved).

    Args:
        model: a diffusers model, e.g. from `from_pretrained`, or a pipeline (each of its components is restored).
    Returns:
        The names of the modules switched to Cog (for a pipeline: "component.module" names), or None when nothing
        is recorded (then warns: the model runs its stock attention).
    Raises:
        ValueError: a recorded entry that is not what `apply_cog_attention` records (the message names the model,
            the component and CONFIG_KEY), or what `apply_cog_attention` raises.
    """
    components = getattr(model, "components", None)
    if isinstance(components, dict):  # a DiffusionPipeline
        modules = [(key, part) for key, part in components.items() if isinstance(part, torch.nn.Module)]
        found = [(key, _recorded_placement(part, key, warn=i == 0)) for i, (key, part) in enumerate(modules)]
        recorded = [(key, placement) for key, placement in found if placement is not None]
        if not recorded:
            warnings.warn(f"{type(model).__name__}: no component records a Cog placement in its config (saved "
                          "without apply_cog_attention?); it runs its stock attention", stacklevel=2)
            return None
        return [f"{key}.{name}" for key, placement in recorded
                for name in apply_cog_attention(components[key], **placement)]
    placement = _recorded_placement(model)
    if placement is None:
        warnings.warn(f"{type(model).__name__}: its config records no Cog placement (saved without "
                      "apply_cog_attention?); it runs its stock attention", stacklevel=2)
        return None
    return apply_cog_attention(model, **placement)


def _recorded_placement(model: torch.nn.Module, component: str | None = None, warn: bool = True) -> dict | None:
    """The placement recorded in `model`'s config (CONFIG_KEY) as `apply_cog_attention` kwargs, None when there is
    none; a ValueError naming the config entry when it is not what `apply_cog_attention` records (a saved config.json
    is anyone's to edit). A record of the old single count `keep_softmax` is read as both ends, with a FutureWarning
    unless `warn` is False (the pipeline's components after the first)."""
    placement = getattr(model, "config", {}).get(CONFIG_KEY)
    if placement is None:
        return None
    where = f"{type(model).__name__}{'' if component is None else f' ({component!r})'} config entry {CONFIG_KEY!r}"
    if not isinstance(placement, Mapping) or not set(placement) <= {*_RECORD_KEYS, "keep_softmax"}:
        raise ValueError(f"{where} must be a mapping {{'keep_softmax_first': int, 'keep_softmax_last': int, "
                         f"'backend': str}} (what apply_cog_attention saves), got "
                         f"{reprlib.repr(placement)}")
    if placement.get("backend", "auto") not in BACKENDS:
        raise ValueError(f"{where}: backend must be one of {BACKENDS}, got {reprlib.repr(placement['backend'])}")
    placement = dict(placement)
    if "keep_softmax" in placement:  # saved before the rename: one count for both ends
        count = check_softmax_count(placement.pop("keep_softmax"), f"{where}: keep_softmax")
        ends = renamed_placement(count, placement.get("keep_softmax_first"), placement.get("keep_softmax_last"),
                                 old="keep_softmax", where=where, stacklevel=4, warn=warn)
        placement.update(zip(("keep_softmax_first", "keep_softmax_last"), ends))
    for key in ("keep_softmax_first", "keep_softmax_last"):
        if key in placement:
            check_softmax_count(placement[key], f"{where}: {key}")
    return placement


def load(cls, path: str | PathLike, **kwargs):
    """`cls.from_pretrained(path, **kwargs)` with the saved Cog placement re-applied (`restore_cog_attention`).

    Args:
        cls: a diffusers model or pipeline class (UNet2DConditionModel, DiTPipeline, ...).
        path: a directory or hub id, as `from_pretrained` takes it.
        kwargs: passed to `from_pretrained`.
    Returns:
        The loaded model or pipeline; warns when nothing was recorded (it then runs its stock attention).
    """
    model = cls.from_pretrained(path, **kwargs)
    restore_cog_attention(model)
    return model
