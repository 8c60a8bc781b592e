"""U-ViT and U-ViC: a ViT diffusion backbone with long skips, with softmax or Cog attention.

U-ViT (Bao et al., "All are Worth Words: A ViT Backbone for Diffusion Models", CVPR 2023,
https://arxiv.org/abs/2209.12152) treats the time, the condition and the image patches all as tokens and
joins shallow and deep blocks with long skips. U-ViC (Lv et al., "More Expressive Attention with Negative
Weights", ICML 2025, Sec. 4.2) is the same network with Cog attention in every block but the first and the last
executed one (`in_blocks[0]` and `out_blocks[-1]` keep softmax; `mid_block` is Cog). `keep_softmax_first` and
`keep_softmax_last` (1 and 1 for U-ViC) move that placement: blocks are counted in execution order, `in_blocks`,
`mid_block`, `out_blocks`, and the rule is `uvic.attention.attention_placement`.

Parameter names, shapes and token orders are those of the official code (baofff/U-ViT `libs/uvit.py`,
`libs/uvit_t2i.py`; trestad/CogAttn `U-ViC/libs/uvit_t2i.py`), so released checkpoints load with
`load_state_dict(torch.load("nnet_ema.pth"), strict=True)`. Softmax and Cog weights look the same, which is why
the config records `attention`; see `uvit_from_official` for building a model from an official config.

Conditioning modes (token order as the official code; the first `extras` tokens are dropped at the output):
    unconditional      `[time, patches]`                       num_classes=-1, clip_dim=None
    class-conditional  `[label, time, patches]`                num_classes > 0
    text-conditional   `[time, context x num_clip_token, patches]`  clip_dim set

Presets (`UVIT_PRESETS` of `uvic.presets`, name -> constructor kwargs; `build_preset(name, **overrides)`, or
`model: {preset: name}` in a run config): every entry exists as
`uvit-<size>-<data>` (softmax) and `uvic-<size>-<data>` (Cog). Sizes follow the U-ViT paper (Table 1): S (D 512,
depth 12 = 13 blocks), S-Deep (depth 16), M (D 768, depth 16), L (D 1024, depth 20), H (D 1152, depth 28); the
digit after the size is the patch size. `tiny-*` presets are for tests, `demo` for the CPU demo.

Shape letters: B batch, C channels, H W spatial, L tokens, D width, p patch size.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from diffusers.utils import BaseOutput

from uvic.attention import BACKENDS, attention_placement
from uvic.models.layers import Attention, Mlp, PatchEmbed, timestep_embedding, unpatchify
from uvic.presets import UVIT_PRESETS, uvit_preset  # noqa: F401  (re-exported)


logger = logging.getLogger(__name__)


@dataclass
class UViTOutput(BaseOutput):
    """Output of `UViTModel`.

    Args:
        sample: (B, C, H, W) the network prediction (noise for the official models).
    """

    sample: torch.Tensor


class UViTBlock(nn.Module):
    """Pre-LN transformer block, with an optional long-skip input (U-ViT Sec. 3).

    `x = skip_linear(cat([x, skip]))` (out blocks only), then `x + attn(norm1(x))`, then `x + mlp(norm2(x))`.

    Args:
        dim: D.
        num_heads: attention heads.
        mlp_ratio: MLP hidden width / D.
        qkv_bias: bias on the fused qkv projection.
        skip: give the block a `skip_linear` (2D -> D) for a long skip.
        attention: "cog" or "softmax" for this block.
        attention_backend: the `uvic.attention` backend.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        skip: bool = False,
        attention: str = "softmax",
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        # Creation order = the official state_dict order (skip_linear last).
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, qkv_bias=qkv_bias, attention=attention, backend=attention_backend)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.skip_linear = nn.Linear(2 * dim, dim) if skip else None

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        """x: (B, L, D); skip: (B, L, D) output of the paired in-block, used only if the block has `skip_linear`."""
        if self.skip_linear is not None:
            # Long skip: concatenation order [current, skip] as the official code.
            x = self.skip_linear(torch.cat([x, skip], dim=-1))
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class UViTModel(ModelMixin, ConfigMixin):
    """U-ViT / U-ViC noise-prediction network (the official `UViT` classes, with one `attention` switch).

    Args (official U-ViT names and defaults):
        img_size: side of the square input (pixels, or latents for latent diffusion).
        patch_size: p; `img_size` must be divisible by it.
        in_chans: C of input and output.
        embed_dim: D.
        depth: number of in + out blocks; there are `depth // 2` of each plus one mid block.
        num_heads: attention heads.
        mlp_ratio: MLP hidden width / D.
        qkv_bias: bias on the qkv projections.
        mlp_time_embed: a Linear-SiLU-Linear MLP on the time sinusoid (False in every released config).
        num_classes: > 0 for a class-conditional model (a label token; ids in [0, num_classes)), -1 otherwise.
        clip_dim: width of the text-encoder tokens for a text-conditional model; None for no text.
        num_clip_token: number of context tokens of a text-conditional model.
        conv: a 3x3 conv `final_layer` on the output image.
        skip: long skips (`skip_linear` in the out blocks).
        attention: "softmax" (U-ViT) or "cog" (U-ViC: Cog in all blocks but `in_blocks[0]` and `out_blocks[-1]`).
        keep_softmax_first: with attention="cog", how many blocks keep softmax at the start of the execution order
            (`in_blocks`, `mid_block`, `out_blocks`): 1 for U-ViC, 0 for Cog everywhere.
        keep_softmax_last: the same at the end: 1 for U-ViC; 1 and 0 is the paper's "softmax in the first block
            only" ablation. The two may not overlap (first + last <= 2 * (depth // 2) + 1 blocks); they are
            checked with attention="softmax" too, where every block is softmax.
        attention_backend: `uvic.attention` backend for every block; not a weight, recorded so that every
            number traces back to a backend.
    """

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = False,
        mlp_time_embed: bool = False,
        num_classes: int = -1,
        clip_dim: int | None = None,
        num_clip_token: int = 77,
        conv: bool = True,
        skip: bool = True,
        attention: str = "cog",
        keep_softmax_first: int = 1,
        keep_softmax_last: int = 1,
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        if attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {attention_backend!r}")
        if img_size % patch_size:
            raise ValueError(f"img_size={img_size} is not divisible by patch_size={patch_size}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}")
        if num_classes > 0 and clip_dim is not None:
            raise ValueError("a model is class-conditional (num_classes > 0) or text-conditional (clip_dim), not both")
        if depth < 2:
            raise ValueError(f"depth must be at least 2 (one in-block and one out-block), got {depth}")
        # Each block's attention kind in execution order: n in-blocks, the mid block, n out-blocks.
        n = depth // 2
        kinds = attention_placement(2 * n + 1, keep_softmax_first, keep_softmax_last, attention)
        self.gradient_checkpointing = False

        # 1. Input tokens. Creation order = the official state_dict order.
        self.patch_embed = PatchEmbed(patch_size, in_chans, embed_dim)
        if mlp_time_embed:
            self.time_embed = nn.Sequential(
                nn.Linear(embed_dim, 4 * embed_dim), nn.SiLU(), nn.Linear(4 * embed_dim, embed_dim)
            )
        else:
            self.time_embed = nn.Identity()
        if num_classes > 0:
            self.label_emb = nn.Embedding(num_classes, embed_dim)
        if clip_dim is not None:
            self.context_embed = nn.Linear(clip_dim, embed_dim)
        self.extras = 1 + (num_classes > 0) + (num_clip_token if clip_dim is not None else 0)
        num_patches = (img_size // patch_size) ** 2
        self.pos_embed = nn.Parameter(torch.zeros(1, self.extras + num_patches, embed_dim))

        # 2. Blocks. U-ViC keeps softmax in the first and last executed blocks (CogAttn U-ViC/libs/uvit_t2i.py).
        def block(position: int, **kwargs: Any) -> UViTBlock:
            return UViTBlock(embed_dim, num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, attention=kinds[position],
                             attention_backend=attention_backend, **kwargs)

        self.in_blocks = nn.ModuleList([block(i) for i in range(n)])
        self.mid_block = block(n)
        self.out_blocks = nn.ModuleList([block(n + 1 + i, skip=skip) for i in range(n)])

        # 3. Output head.
        self.norm = nn.LayerNorm(embed_dim)
        self.patch_dim = patch_size**2 * in_chans
        self.decoder_pred = nn.Linear(embed_dim, self.patch_dim, bias=True)
        self.final_layer = nn.Conv2d(in_chans, in_chans, 3, padding=1) if conv else nn.Identity()

        # Official init: trunc-normal(0.02) pos_embed and Linear weights (absolute bounds +-2), zero biases,
        # unit LayerNorms; the convolutions and the label embedding keep PyTorch's default init.
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.apply(_init_weights)

    # ---------------------------------------------------------------------------------------------------------

    def _check_inputs(
        self,
        x: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None,
        class_labels: torch.Tensor | None,
    ) -> None:
        """Raise a ValueError naming the problem for inputs the model cannot take."""
        cfg = self.config
        want = (cfg.in_chans, cfg.img_size, cfg.img_size)
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or tuple(x.shape[1:]) != want:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"hidden_states must have shape (B, {', '.join(map(str, want))}), got {got}")
        B = x.shape[0]
        if cfg.clip_dim is not None:
            if encoder_hidden_states is None:
                raise ValueError("this is a text-conditional model: encoder_hidden_states is required")
            want_ctx = (B, cfg.num_clip_token, cfg.clip_dim)
            got = getattr(encoder_hidden_states, "shape", type(encoder_hidden_states).__name__)
            if not isinstance(encoder_hidden_states, torch.Tensor) or tuple(got) != want_ctx:
                raise ValueError(f"encoder_hidden_states must be a tensor of shape {want_ctx}, got {got}")
        elif encoder_hidden_states is not None:
            raise ValueError("encoder_hidden_states given, but the model has no text conditioning (clip_dim=None)")
        if cfg.num_classes > 0:
            if class_labels is None:
                raise ValueError("this is a class-conditional model: class_labels is required")
            is_tensor = isinstance(class_labels, torch.Tensor)
            if not is_tensor or class_labels.shape != (B,) or class_labels.is_floating_point():
                got = f"{class_labels.dtype} {tuple(class_labels.shape)}" if is_tensor else type(class_labels).__name__
                raise ValueError(f"class_labels must be an integer tensor of shape ({B},), got {got}")
            # A data-dependent check (a host sync on GPU); skipped while torch.compile traces.
            if not torch.compiler.is_compiling() and ((class_labels < 0) | (class_labels >= cfg.num_classes)).any():
                raise ValueError(
                    f"class_labels must lie in [0, {cfg.num_classes}), got min {int(class_labels.min())} "
                    f"max {int(class_labels.max())}"
                )
        elif class_labels is not None:
            raise ValueError("class_labels given, but the model is not class-conditional (num_classes <= 0)")

    @staticmethod
    def _timesteps(timestep: torch.Tensor | float | int, B: int, device: torch.device) -> torch.Tensor:
        """A scalar, (), (1,) or (B,) timestep -> (B,) tensor on `device`."""
        t = timestep if isinstance(timestep, torch.Tensor) else torch.tensor(timestep, device=device)
        if t.dim() == 0 or t.shape == (1,):
            return t.reshape(()).expand(B).to(device)
        if t.shape != (B,):
            raise ValueError(f"timestep must be a scalar or have shape ({B},), got {tuple(t.shape)}")
        return t.to(device)

    def _block(self, block: UViTBlock, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            args = (x,) if skip is None else (x, skip)
            return self._gradient_checkpointing_func(block, *args)
        return block(x, skip)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor | float | int,
        encoder_hidden_states: torch.Tensor | None = None,
        class_labels: torch.Tensor | None = None,
        return_dict: bool = True,
    ) -> UViTOutput | tuple[torch.Tensor]:
        """
        Args:
            hidden_states: (B, C, H, W) noisy input, H = W = `img_size`, C = `in_chans`.
            timestep: (B,) or a scalar, int or float; embedded exactly as given (the official models take
                `999 t` for CIFAR-10's continuous time and `n = diffusers_t + 1` for MS-COCO; converting is
                the pipeline's job).
            encoder_hidden_states: (B, num_clip_token, clip_dim) text tokens; text-conditional models only.
            class_labels: (B,) integer class ids in [0, num_classes); class-conditional models only.
            return_dict: return a `UViTOutput` instead of a tuple.
        Returns:
            UViTOutput with `sample` of shape (B, C, H, W), or the tuple `(sample,)`.
        """
        self._check_inputs(hidden_states, encoder_hidden_states, class_labels)
        D = self.config.embed_dim
        B = hidden_states.shape[0]
        t = self._timesteps(timestep, B, hidden_states.device)

        # 1. Tokens: patches, time, condition, then the learned position embedding.
        x = self.patch_embed(hidden_states)  # (B, L, D)
        # The sinusoid is float32; it takes the parameters' dtype, so under autocast the token stream stays float32
        # up to the first block as in the official code (torch.cat promotes the half-precision patch tokens).
        time_token = self.time_embed(timestep_embedding(t, D).to(self.pos_embed.dtype)).unsqueeze(1)  # (B, 1, D)
        if self.config.num_classes > 0:
            label_token = self.label_emb(class_labels).unsqueeze(1)  # (B, 1, D)
            x = torch.cat([label_token, time_token, x], dim=1)  # [label, time, patches]
        elif self.config.clip_dim is not None:
            context = self.context_embed(encoder_hidden_states.to(x.dtype))  # (B, num_clip_token, D)
            x = torch.cat([time_token, context, x], dim=1)  # [time, context, patches]
        else:
            x = torch.cat([time_token, x], dim=1)  # [time, patches]
        x = x + self.pos_embed

        # 2. Blocks with long skips (U-ViT Sec. 3): out_blocks[i] takes the output of in_blocks[n-1-i] (LIFO).
        skips = []
        for block in self.in_blocks:
            x = self._block(block, x)
            skips.append(x)
        x = self._block(self.mid_block, x)
        for block in self.out_blocks:
            x = self._block(block, x, skips.pop())

        # 3. Output: drop the condition tokens, tokens -> image, 3x3 conv.
        x = self.decoder_pred(self.norm(x))  # (B, L, p*p*C)
        x = unpatchify(x[:, self.extras :, :], self.config.in_chans)  # (B, C, H, W)
        x = self.final_layer(x)
        return UViTOutput(sample=x) if return_dict else (x,)

    def cog_block_names(self) -> list[str]:
        """Names of the blocks that use Cog attention, in execution order (empty for U-ViT)."""
        return [name for name, m in self.named_modules() if isinstance(m, UViTBlock) and m.attn.attention == "cog"]

    @classmethod
    def check_config(cls, config: Mapping[str, Any], where: str) -> None:
        """Check the types and ranges of the settings of a saved config (`uvic.models.config_check`).

        Raises:
            ValueError: one line naming `where` and the key, e.g. "config key depth: expected int, got str 'x'".
        """
        from uvic.models.config_check import check_settings

        check_settings(config, UViTModel.__init__, where)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any, **kwargs: Any) -> UViTModel:
        """diffusers' `from_pretrained`; a local directory is checked first (`uvic.io.check_model_dir`): its
        config.json must be an object of settings of the right types and ranges that describes a model of the
        shapes its weights hold, else one ValueError, before anything is allocated."""
        folder = Path(pretrained_model_name_or_path, kwargs.get("subfolder") or "")
        if folder.is_dir():
            from uvic.io import check_model_dir

            check_model_dir(cls, folder, f"UViTModel {folder}")
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


# -------------------------------------------------------------------------------------------------------------
# Official configs and presets
# -------------------------------------------------------------------------------------------------------------

_OFFICIAL_NAMES = ("uvit", "uvit_t2i", "uvit_t2i_np")


def uvit_from_official(
    config_nnet: Mapping[str, Any],
    checkpoint_path: str | os.PathLike | None = None,
    *,
    attention_backend: str = "auto",
) -> UViTModel:
    """Build a `UViTModel` from an official U-ViT / U-ViC config's `nnet` section and load its weights strictly.

    `config_nnet` is the `config.nnet` dict of a baofff/U-ViT or trestad/CogAttn config (an ml_collections
    ConfigDict works too), for example U-ViT's `configs/mscoco_uvit_small.py`'s
    `dict(name="uvit_t2i", img_size=32, in_chans=4, patch_size=2, embed_dim=512, depth=12, num_heads=8,
    mlp_ratio=4, qkv_bias=False, mlp_time_embed=False, clip_dim=768, num_clip_token=77)`.

    - `name`: "uvit" (`libs/uvit.py`: unconditional or class-conditional), "uvit_t2i" or "uvit_t2i_np"
      (`libs/uvit_t2i.py`: text-conditional; `clip_dim` / `num_clip_token` default to 768 / 77 as there).
    - `np=True` selects U-ViC (`attention="cog"`); without it the model is softmax U-ViT.
    - `use_checkpoint=True` turns on gradient checkpointing.

    Args:
        config_nnet: the official `nnet` config.
        checkpoint_path: a bare state dict saved with `torch.save` (`nnet_ema.pth`); None builds a randomly
            initialised model.
        attention_backend: the `uvic.attention` backend of the model.
    Returns:
        The model (in train mode, as `from_config` returns it; call `.eval()` for sampling).
    """
    cfg = dict(config_nnet.to_dict() if hasattr(config_nnet, "to_dict") else config_nnet)
    name = cfg.pop("name", None)
    if name not in _OFFICIAL_NAMES:
        raise ValueError(f"unknown official nnet name {name!r}; expected one of {_OFFICIAL_NAMES}")
    cog = bool(cfg.pop("np", False))
    if name == "uvit_t2i_np" and not cog:
        logger.warning("nnet name is 'uvit_t2i_np' but np is not True: building softmax U-ViT as the code does")
    use_checkpoint = bool(cfg.pop("use_checkpoint", False))
    if cfg.pop("qk_scale", None) is not None:
        raise ValueError("qk_scale is not supported: uvic attention always scales by head_dim ** -0.5")
    if name == "uvit":
        if "clip_dim" in cfg or "num_clip_token" in cfg:
            raise ValueError("nnet name 'uvit' (libs/uvit.py) has no text conditioning; use 'uvit_t2i'")
    else:
        if "num_classes" in cfg:
            raise ValueError(f"nnet name {name!r} (libs/uvit_t2i.py) has no class conditioning")
        cfg.setdefault("clip_dim", 768)
        cfg.setdefault("num_clip_token", 77)
    unknown = sorted(set(cfg) - _init_keys())
    if unknown:
        raise ValueError(f"unknown keys in the official nnet config: {unknown}")
    model = UViTModel(**cfg, attention="cog" if cog else "softmax", attention_backend=attention_backend)
    if use_checkpoint:
        model.enable_gradient_checkpointing()
    if checkpoint_path is not None:
        _load_official_state_dict(model, checkpoint_path)
    return model


def _load_official_state_dict(model: UViTModel, checkpoint_path: str | os.PathLike) -> None:
    """Load an official `nnet.pth` / `nnet_ema.pth` (a bare state dict) into `model` with strict key matching."""
    path = os.fspath(checkpoint_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"checkpoint {path!r} not found: download the official nnet_ema.pth (U-ViT README / CogAttn readme) "
            "and pass its path"
        )
    from uvic.io import load_torch_data

    state_dict = load_torch_data(path, what="checkpoint")  # tensors and plain data only: nothing in it runs
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"{path!r} does not hold a state dict (got {type(state_dict).__name__})")
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint {path!r} does not match the model built from the config:\n{e}") from e


def _init_keys() -> set[str]:
    # Not in official configs: the kind comes from `np`, its placement is U-ViC's (the defaults).
    placement = {"attention", "keep_softmax_first", "keep_softmax_last", "attention_backend"}
    return set(inspect.signature(UViTModel.__init__).parameters) - {"self", *placement}


def build_preset(name: str, **overrides: Any) -> UViTModel:
    """Build a model from preset `name` (`uvit_preset`) with keyword overrides (e.g. `attention_backend="torch"`)."""
    return UViTModel(**{**uvit_preset(name), **overrides})
