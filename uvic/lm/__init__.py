"""Cogformer language modelling helpers: token data, the representational-collapse probes, the loader for the
official checkpoints and the lm-eval entry point. The model is `uvic.models.cogformer`, its configs live in
`uvic.config` (`LMModelConfig`, `LMDataConfig`, `LMTrainConfig`) and its training task in
`uvic.training.tasks.lm`."""

from uvic.lm.data import TokenDataset, byte_tokenizer, load_tokenizer, load_tokens


__all__ = ["TokenDataset", "byte_tokenizer", "load_tokenizer", "load_tokens"]
