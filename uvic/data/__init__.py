"""Datasets. Every item is a dict of tensors; image datasets give {"x": (C, H, W) float32 in [-1, 1]}."""

from uvic.data.images import DATASETS, Cifar10, DigitsDataset, ResizedImageFolder, build_image_dataset


__all__ = ["DATASETS", "Cifar10", "DigitsDataset", "ResizedImageFolder", "build_image_dataset"]
