"""Checks of a saved model directory before anything is allocated: the types and ranges of the settings its
`config.json` holds, and that they describe a model of the shapes its weights hold.

`UViTModel.from_pretrained` and `CogformerForCausalLM.from_pretrained` call these on a local directory (and
`uvic.io.check_model_dir`, before a pipeline is loaded, calls `UViTModel.check_config`), so that a `config.json`
edited into `depth: "x"`, `num_heads: -2` or a model of terabytes is one ValueError naming the key or the tensor,
not a TypeError from inside the constructor, a shape error at sampling time or the allocator's RuntimeError.

A setting's type is the one its constructor annotates (`typing.get_type_hints` of the constructor), its range the run config's (`uvic.values.RANGES`, key `model.<name>`).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from uvic.errors import DataError


__all__ = ["check_cogformer_dir", "check_settings"]

# Where transformers' `PreTrainedModel.from_pretrained` finds safetensors weights in a model directory, in its order.
TRANSFORMERS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def check_settings(settings: Mapping[str, Any], constructor: Callable[..., Any], where: str) -> None:
    """Check each setting of `settings` that `constructor` (e.g. `UViTModel.__init__`) takes
    against its annotated type and its range; other keys (diffusers' `_class_name`, transformers' own) are left.

    Raises:
        DataError (a ValueError): `"{where}: config key {name}: ..."` for the first setting of a wrong type or out of
            range, e.g. "config key depth: expected int, got str 'x'".
    """
    import inspect
    import math
    import typing

    from uvic.values import RANGES, coerce

    hints = typing.get_type_hints(constructor)
    for name in inspect.signature(constructor).parameters:
        if name not in settings or name not in hints:
            continue
        hint = hints[name]
        try:
            value = coerce(settings[name], hint, name)
        except ValueError as e:
            raise DataError(f"{where}: {e}") from None
        ok, text = RANGES.get(f"model.{name}", (lambda v: True, ""))
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if isinstance(v, float) and not math.isfinite(v):
                raise DataError(f"{where}: config key {name}: must be a finite number, got {v!r}")
            if not ok(v):
                raise DataError(f"{where}: config key {name}: must be {text}, got {v!r}")


def read_config_json(folder: str | os.PathLike, what: str) -> dict[str, Any] | None:
    """The object `folder/config.json` holds, or None without the file.

    Raises:
        DataError: not JSON, or JSON that is not an object (a list would reach transformers and diffusers as a model
            id and come back as "could not connect to huggingface.co").
    """
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{what}: cannot read {path} ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise DataError(f"{what}: {path} holds a JSON {type(config).__name__}, not an object of the model's settings")
    return config


def check_cogformer_dir(folder: str | os.PathLike, what: str, config_class: type, model_class: type) -> None:
    """Before `CogformerForCausalLM.from_pretrained(folder)` (`config_class` / `model_class`: `CogformerConfig` /
    `CogformerForCausalLM`, passed in so that this module imports no model): `config.json` is an object whose settings have their
    types and ranges (`check_settings`), and the model it describes has the tensor shapes of the safetensors weights
    (`uvic.io.check_weights_fit`, on the meta device). A folder without config.json or weights is left to
    transformers to report.

    Raises:
        DataError (a ValueError): one line naming the file and the key or tensor.
    """
    from uvic.io import check_weights_fit, model_dir_shapes

    config = read_config_json(folder, what)
    if config is None:
        return
    # An end saved as null (configs written before the placement rename) means "the old count's": the config class
    # reads it so, as it does an end left out.
    ends = ("keep_softmax_first", "keep_softmax_last")
    check_settings({k: v for k, v in config.items() if not (k in ends and v is None)}, config_class.__init__, f"{what}: {Path(folder) / 'config.json'}")
    shapes = model_dir_shapes(folder, TRANSFORMERS_WEIGHTS, what)
    if shapes is None:
        return
    def build():
        with warnings.catch_warnings():  # an old placement name warns once, when from_pretrained builds the model
            warnings.simplefilter("ignore", FutureWarning)
            return model_class(config_class.from_dict(config))

    check_weights_fit(build, shapes, what)
