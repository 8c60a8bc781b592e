"""Tiny Fashion-MNIST idx files written by the tests (CI has no real ones): LeCun's idx format, gzipped or not."""

import gzip
import struct

import numpy as np


def idx_bytes(array: np.ndarray) -> bytes:
    """LeCun's idx format: 0, 0, 0x08 (ubyte), ndim; each dimension as a big-endian int32; the data."""
    return bytes([0, 0, 8, array.ndim]) + b"".join(struct.pack(">i", d) for d in array.shape) + array.tobytes()


def write_split(folder, prefix, images, labels, gz=True):
    """`folder/{prefix}-images-idx3-ubyte[.gz]` and `-labels-idx1-ubyte[.gz]` of (N, 28, 28) images, (N,) labels."""
    folder.mkdir(parents=True, exist_ok=True)
    for stem, arr in ((f"{prefix}-images-idx3-ubyte", images), (f"{prefix}-labels-idx1-ubyte", labels)):
        data = idx_bytes(np.asarray(arr).astype(np.uint8))
        if gz:
            (folder / (stem + ".gz")).write_bytes(gzip.compress(data))
        else:
            (folder / stem).write_bytes(data)
