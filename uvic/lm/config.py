"""LM config dataclasses: the Cogformer hyperparameters, the token data and the paper's optimizer defaults.

Drafts for the project's config schema (`uvic/config.py` will absorb them): `LMModelConfig`'s fields are exactly
`CogformerConfig.__init__`'s architecture kwargs, so `CogformerConfig(**dataclasses.asdict(cfg))` builds the model;
`LMOptimConfig` holds the paper's training hyperparameters (Sec. 4.1) as defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class LMModelConfig:
    """Cogformer architecture; defaults are the paper's 141M model (Sec. 4.1)."""

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attention: str = "cog"  # "cog" (Cogformer) or "softmax" (the Transformer baseline)
    num_softmax_layers: int = 1  # softmax in the first and last k layers: 1 at 141M, 2 at 600M, 3 at 1B
    attention_backend: str = "auto"
    initializer_range: float = 0.02


@dataclass(frozen=True)
class LMDataConfig:
    """Token data: a `.bin` of token ids or a text file plus a tokenizer (see `uvic.lm.data.load_tokens`)."""

    path: str = ""
    format: str = "auto"  # "auto" (".bin" suffix -> "bin", else "text"), "bin" or "text"
    tokenizer: str = "byte"  # for text: "byte", a tokenizer.json, a sentencepiece .model, or a tokenizer dir
    token_dtype: str = "uint16"  # element type of a .bin file
    block_size: int = 2048  # tokens per training sequence (the paper's context length)
    val_path: str | None = None  # optional held-out data in the same format
    num_workers: int = 0  # DataLoader workers (windows are cut from an in-memory or memory-mapped array)


@dataclass(frozen=True)
class LMOptimConfig:
    """The paper's LM training hyperparameters (Sec. 4.1; App. C uses lr 3.2e-4, warm-up 4800 for 600M/1B)."""

    lr: float = 2e-4
    betas: tuple[float, float] = field(default=(0.9, 0.95))
    weight_decay: float = 0.1  # on matrices and embeddings; norm gains are not decayed
    grad_clip: float = 1.0
    warmup_steps: int = 2000  # linear warm-up, then cosine decay ...
    min_lr_ratio: float = 0.04  # ... to 4% of the peak learning rate
    batch_size: int = 64  # sequences of block_size tokens per optimizer step
    max_steps: int = 762_940  # 100B tokens / (64 * 2048 tokens per step)
