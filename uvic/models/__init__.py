"""uvic models: the U-ViT / U-ViC diffusion backbone and the layers shared with the Cogformer LM."""

from uvic.models.layers import Attention, Mlp, PatchEmbed, patchify, timestep_embedding, unpatchify
from uvic.models.uvit import (
    UVIT_PRESETS,
    UViTBlock,
    UViTModel,
    UViTOutput,
    build_preset,
    load_official_checkpoint,
    uvit_from_official,
)


__all__ = [
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
    "load_official_checkpoint",
    "uvit_from_official",
]
