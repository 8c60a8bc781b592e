"""What a training run needs in memory at least, counted from its config before anything is built.

`check_memory(cfg)` runs among the preflight checks (`uvic.training.preflight.check_run_config`), before the
model is built even on the meta device: a config of `model.embed_dim: 1000000`, `data.image_size: 100000`,
`model.depth: 100000` or `model.vocab_size: 1000000000` is refused in a moment with one line giving the estimate,
where it stopped with the allocator's RuntimeError (terabytes) or built blocks for minutes.

The estimate is a lower bound, so that a run that fits is never refused:

    parameters x 16 bytes      fp32 weights, gradients and AdamW's two moments (+ 4 bytes for an EMA copy)
    + activations              what the backward pass must keep for one micro-batch per process: for each block
                               at least its input and its MLP's hidden layer (B x L x (D + hidden) values; with
                               gradient checkpointing the inputs only), and an LM's float32 logits (B x L x V)
    + one batch of images      a diffusion run's images of data.image_size, as float32 (pixels, not latents)

The parameter count is exact (`parameter_count`: counted from the config as the model's constructors make their
layers; a test checks it against built models). The machine's memory is the larger of its RAM and its first GPU's
memory. Tasks whose model section is neither U-ViT's nor Cogformer's are not estimated.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from uvic.errors import ConfigError


__all__ = ["MemoryEstimate", "check_memory", "cogformer_parameter_count", "estimate_memory", "machine_memory",
           "parameter_count", "uvit_parameter_count"]

GIB = 2**30


def uvit_parameter_count(img_size: int, patch_size: int, in_chans: int, embed_dim: int, depth: int, mlp_ratio: float,
                         qkv_bias: bool, mlp_time_embed: bool, num_classes: int, clip_dim: int | None,
                         num_clip_token: int, conv: bool, skip: bool, **_: Any) -> int:
    """The number of parameters of `UViTModel(...)` with these arguments (the others do not change it)."""
    D, p, C = embed_dim, patch_size, in_chans
    hidden = int(D * mlp_ratio)
    n = depth // 2
    count = C * p * p * D + D  # patch_embed (a p x p stride-p convolution)
    count += (D * 4 * D + 4 * D + 4 * D * D + D) if mlp_time_embed else 0
    count += num_classes * D if num_classes > 0 else 0  # label_emb
    count += clip_dim * D + D if clip_dim is not None else 0  # context_embed
    extras = 1 + (num_classes > 0) + (num_clip_token if clip_dim is not None else 0)
    count += (extras + (img_size // p) ** 2) * D  # pos_embed
    block = 2 * D + (D * 3 * D + (3 * D if qkv_bias else 0)) + D * D + D + 2 * D + D * hidden + hidden + hidden * D + D
    count += (2 * n + 1) * block + (n * (2 * D * D + D) if skip else 0)  # in, mid, out blocks; skip_linear
    count += 2 * D + D * p * p * C + p * p * C  # norm, decoder_pred
    count += C * C * 9 + C if conv else 0  # final_layer
    return count


def cogformer_parameter_count(vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                              num_attention_heads: int, head_dim: int | None = None, **_: Any) -> int:
    """The number of parameters of `CogformerForCausalLM(CogformerConfig(...))` with these settings (its output
    head is its own, never tied to the embedding)."""
    D, V = hidden_size, vocab_size
    inner = num_attention_heads * (D // num_attention_heads if head_dim is None else head_dim)
    layer = 2 * D + 3 * D * inner + inner * D + 3 * D * intermediate_size  # two RMSNorms, q k v o, SwiGLU
    return V * D + num_hidden_layers * layer + D + V * D  # embedding, layers, final norm, lm_head


def _is_uvit(model: Any) -> bool:
    return hasattr(model, "embed_dim") and hasattr(model, "img_size")


def _is_cogformer(model: Any) -> bool:
    return hasattr(model, "vocab_size") and hasattr(model, "num_hidden_layers")


def parameter_count(cfg: Any) -> int | None:
    """The parameters of the model a run config describes (U-ViT or Cogformer), None for another model section or a
    task whose config has none (a task registered with a run config of its own)."""
    if not dataclasses.is_dataclass(getattr(cfg, "model", None)):
        return None
    model = dataclasses.asdict(cfg.model)
    if _is_uvit(cfg.model):
        return uvit_parameter_count(**model)
    if _is_cogformer(cfg.model):
        return cogformer_parameter_count(**model)
    return None


@dataclass(frozen=True)
class MemoryEstimate:
    """A lower bound of a run's memory, in bytes, per process."""

    parameters: int  # count
    state: int  # weights, gradients, optimizer state, EMA
    activations: int  # one micro-batch's activations kept for the backward pass
    batch: int  # one batch of input images
    micro_batch: int

    @property
    def total(self) -> int:
        return self.state + self.activations + self.batch


def estimate_memory(cfg: Any, processes: int | None = None) -> MemoryEstimate | None:
    """`MemoryEstimate` of a run config (None for a model section that is neither U-ViT's nor Cogformer's).
    `processes`: the processes the global batch is split over (default: $WORLD_SIZE, which accelerate sets, or 1)."""
    count = parameter_count(cfg)
    if count is None:
        return None
    tc, m = cfg.train, cfg.model
    world = processes or max(1, int(os.environ.get("WORLD_SIZE", "1") or 1))
    b = max(1, tc.batch_size // (tc.grad_accum_steps * world))
    state = count * (16 + (4 if tc.ema_decay > 0 else 0))
    value = 4 if tc.mixed_precision == "no" else 2  # bytes of a kept activation (fp16/bf16 unless "no")
    batch = 0
    if _is_uvit(m):
        tokens = 1 + (m.num_classes > 0) + (m.num_clip_token if m.clip_dim is not None else 0)
        tokens += (m.img_size // m.patch_size) ** 2
        width, hidden, blocks = m.embed_dim, int(m.embed_dim * m.mlp_ratio), 2 * (m.depth // 2) + 1
        logits = 0
        size = getattr(cfg.data, "image_size", None)
        if isinstance(size, int) and getattr(cfg.data, "source", "pixels") == "pixels":  # not stored latents
            batch = b * 3 * size * size * 4
    else:
        tokens, width, hidden, blocks = cfg.data.block_size, m.hidden_size, m.intermediate_size, m.num_hidden_layers
        logits = b * tokens * m.vocab_size * 4
    per_block = width if tc.gradient_checkpointing else width + hidden
    activations = b * tokens * per_block * blocks * value + logits
    return MemoryEstimate(count, state, activations, batch, b)


def machine_memory() -> int:
    """Bytes of memory of this machine: the larger of its RAM and its first CUDA GPU's memory."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        import torch

        if torch.cuda.is_available():
            return max(ram, torch.cuda.get_device_properties(0).total_memory)
    except (ImportError, RuntimeError):
        pass
    return ram


def check_memory(cfg: Any, limit: int | None = None) -> MemoryEstimate | None:
    """Refuse a run config that cannot fit this machine's memory (`limit` bytes, default `machine_memory()`).

    Raises:
        ConfigError: one line with the estimate and its parts.
    """
    est = estimate_memory(cfg)
    if est is None:
        return None
    limit = machine_memory() if limit is None else limit
    if est.total > limit:
        raise ConfigError(
            f"config sections model/data/train: this run needs at least {est.total / GIB:,.1f} GiB per process "
            f"({est.parameters:,} parameters: {est.state / GIB:,.1f} GiB of weights, gradients, optimizer state and "
            f"EMA; {est.activations / GIB:,.1f} GiB of activations for a micro-batch of {est.micro_batch}"
            + (f"; {est.batch / GIB:,.1f} GiB for a batch of images of data.image_size" if est.batch else "")
            + f"), more than this machine's {limit / GIB:,.1f} GiB of memory")
    return est
