"""Cogformer language modelling: token data, the training task, the representational-collapse probes and the
loader for the official checkpoints. The model itself is `uvic.models.cogformer`."""

from uvic.lm.config import LMDataConfig, LMModelConfig, LMOptimConfig
from uvic.lm.data import TokenDataset, byte_tokenizer, load_tokenizer, load_tokens
from uvic.lm.official import load_official_checkpoint
from uvic.lm.task import build_dataset, build_model, build_optimizer, loss, train_tiny


__all__ = [
    "LMDataConfig",
    "LMModelConfig",
    "LMOptimConfig",
    "TokenDataset",
    "byte_tokenizer",
    "load_tokenizer",
    "load_tokens",
    "load_official_checkpoint",
    "build_dataset",
    "build_model",
    "build_optimizer",
    "loss",
    "train_tiny",
]
