"""Training: `train(cfg)` and its parts (tasks, losses, EMA, data, checkpoints).

`train` is imported on first use: the loop imports every task (diffusers, transformers: seconds), which readers of
a run dir (`uvic.training.logs`, `uvic.training.checkpoint`, `uvic.compare`) do not need.
"""

from typing import Any


__all__ = ["train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from uvic.training.loop import train

        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
