"""The value rules of settings, below every layer that reads settings: `coerce` checks a value against its type
hint, `RANGES` holds the allowed range of every numeric setting by dotted key.

`uvic.config` applies them to run configs (YAML and overrides); `uvic.models.config_check` to the settings of a
saved model's `config.json` (key `model.<name>`), before `from_pretrained` allocates anything. It imports nothing
of uvic but `uvic.errors`.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

from uvic.errors import ConfigError


__all__ = ["RANGES", "coerce"]


def coerce(value: Any, hint: Any, key: str) -> Any:
    """Return `value` checked against the type `hint` (ints are accepted for floats, lists for tuples)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"config key {key}: {value!r} is not one of {list(args)}")
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in args:
            try:
                return coerce(value, option, key)
            except ValueError as e:
                errors.append(str(e))
        raise ConfigError(f"config key {key}: {value!r} does not match {hint} ({'; '.join(errors)})")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]: a list of any length
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key {key}: expected a list, got {value!r}")
        return tuple(coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"config key {key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if hint is type(None):
        if value is not None:
            raise ConfigError(f"config key {key}: expected null, got {value!r}")
        return None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        # YAML 1.1 reads `2e-4` (no dot) as a string; accept any spelling Python reads as a float.
        try:
            return float(value)
        except ValueError:
            pass
    if hint in (int, float, str, bool):
        if type(value) is not hint:
            raise ConfigError(f"config key {key}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
        return value
    raise ValueError(f"config key {key}: unsupported type {hint}")  # a schema bug, not a user error


# ---------------------------------------------------------------------------------------------------------
# Value ranges
# ---------------------------------------------------------------------------------------------------------


def _rule(ok: Any, text: str) -> tuple[Any, str]:
    return ok, text


_AT_LEAST_1 = _rule(lambda v: v >= 1, ">= 1")
_AT_LEAST_0 = _rule(lambda v: v >= 0, ">= 0")
_POSITIVE = _rule(lambda v: v > 0, "> 0")
_FRACTION = _rule(lambda v: 0 <= v <= 1, "in [0, 1]")
_OPEN_FRACTION = _rule(lambda v: 0 < v < 1, "in (0, 1)")
_SEED = _rule(lambda v: 0 <= v < 2**32, "in [0, 2**32)")

# The allowed range of every numeric config field, by dotted key (tuples: each element). A test checks that every
# numeric field of every config class has an entry, so a new field cannot skip the check.
RANGES: dict[str, tuple[Any, str]] = {
    # U-ViT (model.* of diffusion tasks)
    "model.img_size": _AT_LEAST_1, "model.patch_size": _AT_LEAST_1, "model.in_chans": _AT_LEAST_1,
    "model.embed_dim": _AT_LEAST_1, "model.depth": _AT_LEAST_1, "model.num_heads": _AT_LEAST_1,
    "model.mlp_ratio": _POSITIVE, "model.clip_dim": _AT_LEAST_1, "model.num_clip_token": _AT_LEAST_1,
    # Cog placement, U-ViT and Cogformer (the models check that the two ends do not overlap)
    "model.keep_softmax_first": _AT_LEAST_0, "model.keep_softmax_last": _AT_LEAST_0,
    "model.num_classes": _rule(lambda v: v == -1 or v >= 1, "-1 (unconditional) or >= 1"),
    # Cogformer (model.* of the lm task)
    "model.vocab_size": _AT_LEAST_1, "model.hidden_size": _AT_LEAST_1, "model.intermediate_size": _AT_LEAST_1,
    "model.num_hidden_layers": _AT_LEAST_1, "model.num_attention_heads": _AT_LEAST_1, "model.head_dim": _AT_LEAST_1,
    "model.max_position_embeddings": _AT_LEAST_1, "model.rms_norm_eps": _POSITIVE, "model.rope_theta": _POSITIVE,
    "model.initializer_range": _POSITIVE,
    # diffusion
    "diffusion.beta_min": _AT_LEAST_0, "diffusion.beta_max": _POSITIVE, "diffusion.time_scale": _POSITIVE,
    "diffusion.num_train_timesteps": _AT_LEAST_1, "diffusion.beta_start": _OPEN_FRACTION,
    "diffusion.beta_end": _OPEN_FRACTION,
    # data (images, MS-COCO features, LM tokens)
    "data.image_size": _AT_LEAST_1, "data.num_workers": _AT_LEAST_0, "data.p_uncond": _FRACTION,
    "data.latent_scale": _POSITIVE, "data.block_size": _AT_LEAST_1, "data.num_classes": _AT_LEAST_1,
    "data.val_fraction": _OPEN_FRACTION, "data.num_sequences": _AT_LEAST_1, "data.num_kv_pairs": _AT_LEAST_1,
    # train
    "train.seed": _SEED, "train.max_steps": _AT_LEAST_1, "train.batch_size": _AT_LEAST_1,
    "train.grad_accum_steps": _AT_LEAST_1, "train.lr": _POSITIVE, "train.weight_decay": _AT_LEAST_0,
    "train.betas": _rule(lambda v: 0 <= v < 1, "in [0, 1)"), "train.adam_eps": _POSITIVE,
    "train.warmup_steps": _AT_LEAST_0, "train.min_lr_ratio": _FRACTION, "train.grad_clip": _AT_LEAST_0,
    "train.ema_decay": _FRACTION, "train.cpu_threads": _AT_LEAST_0, "train.log_every": _AT_LEAST_1,
    "train.sample_every": _AT_LEAST_0, "train.save_every": _AT_LEAST_0, "train.keep_checkpoints": _AT_LEAST_0,
    "train.eval_every": _AT_LEAST_0, "train.eval_num_images": _rule(lambda v: v >= 2, ">= 2 (a covariance)"),
    "train.eval_steps": _AT_LEAST_1, "train.eval_fid_dims": _AT_LEAST_1, "train.val_every": _AT_LEAST_0,
    "train.val_examples": _AT_LEAST_0, "train.val_batch_size": _AT_LEAST_1, "train.val_timesteps": _AT_LEAST_1,
    "train.val_probe_examples": _AT_LEAST_0,
    # sample
    "sample.num_inference_steps": _AT_LEAST_1, "sample.guidance_scale": _AT_LEAST_0,
    "sample.num_images": _AT_LEAST_1, "sample.seed": _SEED, "sample.batch_size": _AT_LEAST_1,
}
