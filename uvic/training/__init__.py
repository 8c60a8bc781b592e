"""Training: `train(cfg)` and its parts (tasks, losses, EMA, data, checkpoints)."""

from uvic.training.loop import train


__all__ = ["train"]
