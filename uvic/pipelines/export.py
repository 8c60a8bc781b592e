"""Exported pipeline directories that diffusers' generic loader can open.

`DiffusionPipeline.from_pretrained(dir)` looks the class up as `getattr(diffusers, model_index["_class_name"])`,
which fails for a class that lives outside diffusers. diffusers' own escape hatch (0.42,
`pipeline_loading_utils._resolve_custom_pipeline_and_cls`): when `_class_name` is a `[module, class]` pair and
`{module}.py` sits in the directory, the class is taken from that file. Running a file from the directory always
needs `trust_remote_code=True` (`dynamic_modules_utils.get_cached_module_file` refuses local code without it,
and there is no other route for a class outside diffusers), so the simplest generic load is

    DiffusionPipeline.from_pretrained(dir, trust_remote_code=True)

The file written here is a single import of the installed `uvic` class, so the flag runs nothing but that import.
Loading through the class itself (`UViCPipeline.from_pretrained(dir)`) needs no flag: `load_config` below
turns the pair back into the plain class name for the class that wrote it, so diffusers uses that class directly.
"""

from __future__ import annotations

import json
import os
from typing import Any

from uvic.io import atomic_write


class ExportedPipelineMixin:
    """Mix into a `DiffusionPipeline` subclass (before it) that lives in `uvic.pipelines.{_module_file}`.

    `save_pretrained` also writes `{_module_file}.py` and records `_class_name` as `[_module_file, class name]`.
    """

    _module_file: str  # the module under uvic/pipelines/ that defines the class, e.g. "pipeline_uvic"

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> None:
        """diffusers' `save_pretrained`, plus the one-line `{_module_file}.py` and the `[module, class]` name."""
        super().save_pretrained(save_directory, **kwargs)
        name = type(self).__name__
        with atomic_write(os.path.join(save_directory, f"{self._module_file}.py"), "w") as f:
            f.write(f'"""Lets DiffusionPipeline.from_pretrained find {name} (needs uvic installed)."""\n')
            f.write(f"from uvic.pipelines.{self._module_file} import {name}  # noqa: F401\n")
        index_path = os.path.join(save_directory, "model_index.json")
        with open(index_path) as f:
            index = json.load(f)
        index["_class_name"] = [self._module_file, name]
        with atomic_write(index_path, "w") as f:  # never a half-written index, even outside an atomic export dir
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def load_config(cls, *args: Any, **kwargs: Any) -> Any:
        """`ConfigMixin.load_config`; a `[_module_file, cls.__name__]` class name becomes `cls.__name__`.

        The pair only tells the generic loader where to find the class; the class itself is already imported.
        """
        out = super().load_config(*args, **kwargs)
        config = out[0] if isinstance(out, tuple) else out
        if config.get("_class_name") == [cls._module_file, cls.__name__]:
            config["_class_name"] = cls.__name__
        return out


def pipeline_class_name(model_index: dict[str, Any]) -> str | None:
    """The class name in a `model_index.json` dict: a plain string, or the class of a `[module, class]` pair."""
    name = model_index.get("_class_name")
    return name[-1] if isinstance(name, (list, tuple)) else name
