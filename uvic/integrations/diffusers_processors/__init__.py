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

The package: `base.py` holds what every processor shares (the attention step, the mask reading, the kept-softmax
twin), `sdpa.py` the processors of diffusers' `attention_processor.py` (SDPA layout), `dispatch.py` those diffusers
keeps beside their models (`dispatch_attention_fn` layout). A new processor is one `Cog...` class in the module of
its layout, its one-line `kept_softmax` twin beside it, and its row in `FAMILIES`.

Shapes: B batch, L tokens, C channels, nh heads, hd head dim.
"""

from __future__ import annotations

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
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from uvic.integrations.diffusers_processors.base import REMOVED_KEY_BIAS, key_padding_mask_from
from uvic.integrations.diffusers_processors.dispatch import (
    CogFluxAttnProcessor,
    CogLTXAttnProcessor,
    CogWanAttnProcessor,
    KeptSoftmaxFluxAttnProcessor,
    KeptSoftmaxLTXAttnProcessor,
    KeptSoftmaxWanAttnProcessor,
)
from uvic.integrations.diffusers_processors.sdpa import (
    CogAddedKVAttnProcessor,
    CogAttnProcessor,
    CogAuraFlowAttnProcessor,
    CogCogVideoXAttnProcessor,
    CogHunyuanAttnProcessor,
    CogJointAttnProcessor,
    KeptSoftmaxAddedKVAttnProcessor,
    KeptSoftmaxAttnProcessor,
    KeptSoftmaxAuraFlowAttnProcessor,
    KeptSoftmaxCogVideoXAttnProcessor,
    KeptSoftmaxHunyuanAttnProcessor,
    KeptSoftmaxJointAttnProcessor,
)


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

# Stock processors that scale q k^T by the layer's `attn.scale` (their SDPA twins use hd ** -0.5): see `LayerScale`.
LAYER_SCALED = (AttnProcessor, AttnAddedKVProcessor)

# Stock processors whose attention is not softmax attention, so Cog attention has nothing to replace.
REFUSED = {
    SanaLinearAttnProcessor2_0: "linear attention (ReLU feature maps, no softmax over the scores), which has no "
    "signed-softmax counterpart",
}

__all__ = [
    "FAMILIES", "LAYER_SCALED", "REFUSED", "REMOVED_KEY_BIAS", "key_padding_mask_from",
    "CogAddedKVAttnProcessor", "CogAttnProcessor", "CogAuraFlowAttnProcessor", "CogCogVideoXAttnProcessor",
    "CogFluxAttnProcessor", "CogHunyuanAttnProcessor", "CogJointAttnProcessor", "CogLTXAttnProcessor",
    "CogWanAttnProcessor", "KeptSoftmaxAddedKVAttnProcessor", "KeptSoftmaxAttnProcessor",
    "KeptSoftmaxAuraFlowAttnProcessor", "KeptSoftmaxCogVideoXAttnProcessor", "KeptSoftmaxFluxAttnProcessor",
    "KeptSoftmaxHunyuanAttnProcessor", "KeptSoftmaxJointAttnProcessor", "KeptSoftmaxLTXAttnProcessor",
    "KeptSoftmaxWanAttnProcessor",
]
