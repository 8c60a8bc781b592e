"""uvic models: the U-ViT / U-ViC diffusion backbone, the Cogformer LM and the layers they share.

Importing this package registers the "cogformer" model type with transformers' `AutoConfig` /
`AutoModelForCausalLM` (its only import-time side effect; docs/conventions.md, "Import-time behaviour").
"""

from uvic.models.cogformer import (
    COGFORMER_PRESETS,
    CogformerConfig,
    CogformerForCausalLM,
    CogformerModel,
    cogformer_config,
    cogformer_preset,
)
from uvic.models.layers import Attention, Mlp, PatchEmbed, patchify, timestep_embedding, unpatchify
from uvic.models.uvit import (
    UVIT_PRESETS,
    UViTBlock,
    UViTModel,
    UViTOutput,
    build_preset,
    uvit_from_official,
    uvit_preset,
)


__all__ = [
    "COGFORMER_PRESETS",
    "CogformerConfig",
    "CogformerForCausalLM",
    "CogformerModel",
    "cogformer_config",
    "cogformer_preset",
    "Attention",
    "Mlp",
    "PatchEmbed",
    "patchify",
    "unpatchify",
    "timestep_embedding",
    "UViTBlock",
    "UViTModel",
    "UViTOutput",
    "UVIT_PRESETS",
    "build_preset",
    "uvit_from_official",
    "uvit_preset",
]
