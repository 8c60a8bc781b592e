"""One helper per I/O job: file hashing, atomic (fsync'd) writes, data-only loading, image quantisation.

Loading rule (docs/security.md): nothing read from a user-supplied path may run code. The two loaders here are the
only ways the package reads pickled formats:
- `load_torch_data`: `torch.load(weights_only=True)`, which rebuilds tensors and plain containers only;
- `load_data_pickle`: a restricted unpickler that accepts plain Python data and numpy arrays of listed dtypes
  (the CIFAR-10 python batches), and refuses every other global with a one-line `UnsafeFileError`.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
import stat
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from uvic.errors import DataError


__all__ = [
    "UnsafeFileError",
    "atomic_write",
    "check_weights_fit",
    "fsync_dir",
    "fsync_tree",
    "load_data_pickle",
    "load_torch_data",
    "quantize_uint8",
    "read_npz",
    "sha256_file",
    "weight_shapes",
    "weights_only_error",
]


class UnsafeFileError(DataError):
    """A file holds something a data-only loader refuses (a pickled callable or class): nothing from it was run."""


# ---------------------------------------------------------------------------------------------------------
# Hashing and atomic writes
# ---------------------------------------------------------------------------------------------------------


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so that renames and new entries in it reach the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under `root` (a directory about to be renamed into place: a checkpoint, an
    exported pipeline), and give each file the mode a new file gets there (0666 less the umask, or the folder's
    default ACL), as `open` creates them. safetensors writes its files 0600, which would keep the colleagues who
    can read the rest of a shared run from sampling it."""
    root = Path(root)
    mode = _new_file_mode(root)
    for p in sorted(root.rglob("*"), reverse=True):
        if p.is_file() and not p.is_symlink():
            if stat.S_IMODE(p.stat().st_mode) != mode:
                os.chmod(p, mode)
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        elif p.is_dir() and not p.is_symlink():
            fsync_dir(p)
    fsync_dir(root)


def _new_file_mode(folder: Path) -> int:
    """The permission bits `open` gives a new file in `folder` (found by creating one: the umask cannot be read
    without changing it, and a default ACL applies too)."""
    probe = folder / f".mode-probe-{os.getpid()}"
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        return stat.S_IMODE(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
        probe.unlink()


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file next to `path` for writing; on success it is flushed, fsync'd and renamed to `path`.

    A failure (or a kill) inside the block leaves `path` as it was: the temporary `.{name}.tmp{pid}` is removed
    on an exception, and a kill leaves only that hidden file. `mode` is "wb" or "w".

        with atomic_write(run_dir / "best.json", "w") as f:
            json.dump(record, f)
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_write mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # e.g. the file system went read-only: a hidden leftover, never read
            pass
        raise
    fsync_dir(path.parent)


# ---------------------------------------------------------------------------------------------------------
# Data-only loading
# ---------------------------------------------------------------------------------------------------------


def load_torch_data(path: str | os.PathLike, what: str = "file") -> Any:
    """`torch.load(path, weights_only=True)` on CPU: tensors and plain containers, never pickled code.

    Raises:
        UnsafeFileError: the file holds other objects (the message names the file and the refused global).
        DataError: the file is not a torch file at all (truncated, another format).
    """
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise weights_only_error(path, e, what) from e
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise DataError(f"{what} {path} is unreadable ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from e


def weights_only_error(path: str | os.PathLike, error: pickle.UnpicklingError, what: str = "file") -> DataError:
    """The one-line error for a `torch.load(weights_only=True)` refusal: `UnsafeFileError` naming the refused
    global, or `DataError` for a file that is not a torch file of tensors at all."""
    lines = [line.strip() for line in str(error).splitlines()]
    refused = next((line for line in lines if "GLOBAL" in line), None)
    if refused is not None:
        return UnsafeFileError(f"{what} {path} holds objects other than tensors and plain data, which are never "
                               f"loaded because unpickling them can run code ({refused})")
    why = next((line for line in lines if line.startswith("Unsupported")), lines[0] if lines else "")
    return DataError(f"{what} {path} is not a torch file of tensors ({why})")


class _Refused(pickle.UnpicklingError):
    """An object the data-only unpickler does not build."""


class _ArrayBeingBuilt:
    """What numpy's `_reconstruct` returns while unpickling: it becomes an array only in `__setstate__`, and only
    for an allowed plain dtype. Any other use of it fails, and `_unwrap` replaces it by the array afterwards."""

    def __init__(self, dtypes: frozenset[str]) -> None:
        self.dtypes, self.array = dtypes, None

    def __setstate__(self, state: tuple) -> None:
        if not (isinstance(state, tuple) and len(state) == 5):
            raise _Refused("numpy array with an unexpected state")
        _, shape, dtype, is_fortran, raw = state
        self.array = _array(raw, dtype, shape, "F" if is_fortran else "C", self.dtypes)


def _array(raw: Any, dtype: Any, shape: Any, order: str, dtypes: frozenset[str]) -> np.ndarray:
    """A copy of the array of `dtype` and `shape` held in `raw`, if `dtype` is one of `dtypes`."""
    if not isinstance(dtype, np.dtype) or dtype.hasobject or dtype.str.lstrip("<>|=") not in dtypes:
        raise _Refused(f"numpy array of dtype {dtype} refused (allowed: {', '.join(sorted(dtypes))})")
    if isinstance(raw, str):  # Python 2 pickles read with encoding="latin1"
        raw = raw.encode("latin1")
    if not isinstance(raw, (bytes, bytearray, pickle.PickleBuffer)):
        raise _Refused("numpy array without raw data")
    if not (isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise _Refused(f"numpy array of shape {shape!r}")
    return np.frombuffer(raw, dtype=dtype).copy().reshape(shape, order=order)


def _dtype(spec: Any, align: bool = False, copy: bool = False) -> np.dtype:
    if not isinstance(spec, str):
        raise _Refused(f"numpy dtype {spec!r} refused")
    return np.dtype(spec, align, copy)


def _latin1_bytes(text: Any, encoding: Any) -> bytes:
    # Python 3 writes bytes as _codecs.encode(str, "latin1") in protocol 2.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _Refused("_codecs.encode refused")
    return text.encode("latin1")


class _Unpickler(pickle.Unpickler):
    """Builds plain data (dict, list, tuple, str, bytes, int, float, bool, None) and numpy arrays of `dtypes`."""

    def __init__(self, file: IO[bytes], dtypes: frozenset[str], **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self.dtypes = dtypes

    def find_class(self, module: str, name: str) -> Any:
        numpy_core = module in ("numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric",
                                "numpy._core.numeric")
        if numpy_core and name == "_reconstruct":
            return lambda cls, shape, dtype: _ArrayBeingBuilt(self.dtypes)
        if numpy_core and name == "_frombuffer":  # protocol 5
            return lambda buf, dtype, shape, order: _array(buf, dtype, shape, order, self.dtypes)
        if (module, name) == ("numpy", "ndarray"):
            return np.ndarray  # only ever passed to _reconstruct above, which ignores it
        if (module, name) == ("numpy", "dtype"):
            return _dtype
        if (module, name) == ("_codecs", "encode"):
            return _latin1_bytes
        raise _Refused(f"refused global {module}.{name}")


def _unwrap(obj: Any) -> Any:
    """Replace every `_ArrayBeingBuilt` by its array, through dicts, lists and tuples."""
    if isinstance(obj, _ArrayBeingBuilt):
        if obj.array is None:
            raise _Refused("numpy array without state")
        return obj.array
    if isinstance(obj, dict):
        return {_unwrap(k): _unwrap(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unwrap(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_unwrap(v) for v in obj)
    return obj


def load_data_pickle(path: str | os.PathLike, *, dtypes: tuple[str, ...] = ("u1",), encoding: str = "bytes",
                     what: str = "file") -> Any:
    """Unpickle plain data and numpy arrays of `dtypes` (numpy `dtype.str` codes without the byte order, e.g. "u1"
    for uint8) from `path`; refuse anything else (a class, a function, `os.system`) before it is called.

    Raises:
        UnsafeFileError: the file holds a refused object; the message names the file and the object.
        DataError: the file is not a pickle (truncated, another format).
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        obj = _Unpickler(io.BytesIO(data), frozenset(dtypes), encoding=encoding).load()
    except _Refused as e:
        raise UnsafeFileError(f"{what} {path} holds objects other than plain data ({e}); it was not loaded, "
                              f"because unpickling them could run code") from e
    except pickle.UnpicklingError as e:
        raise DataError(f"{what} {path} is not a readable pickle ({e})") from e
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, MemoryError) as e:
        raise DataError(f"{what} {path} is not a readable pickle ({type(e).__name__}: {e})") from e
    return _unwrap(obj)


def read_npz(path: str | os.PathLike, keys: tuple[str, ...] | None = None, what: str = ".npz file") -> dict[str, Any]:
    """The arrays `keys` of an `.npz` (all when None; missing keys are left out), read with
    `np.load(allow_pickle=False)`. `read_npz(path, ())` lists nothing but checks that the archive opens.

    Returns:
        {name: array}, plus "__keys__": the sorted names of every array in the file.
    Raises:
        FileNotFoundError: no such file. DataError: empty, truncated or not an `.npz` (or an array needs pickle).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        f = np.load(path, allow_pickle=False)
        if not isinstance(f, np.lib.npyio.NpzFile):
            raise ValueError("a single .npy array, not an .npz archive")
        with f:
            names = sorted(f.files)
            out: dict[str, Any] = {k: f[k] for k in (names if keys is None else keys) if k in names}
    except (zipfile.BadZipFile, EOFError, ValueError, OSError, KeyError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        reason = "it is empty" if path.stat().st_size == 0 else f"{type(e).__name__}: {' '.join(str(e).split())}"
        raise DataError(f"{what} {path} is not a readable .npz archive ({reason}); it may be truncated by an "
                        f"interrupted copy") from e
    out["__keys__"] = names
    return out


# ---------------------------------------------------------------------------------------------------------
# Weights against the config that describes them
# ---------------------------------------------------------------------------------------------------------


def weight_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in a weights file, read without reading any tensor: the header of a
    `.safetensors` file, else a torch file loaded with `torch.load(weights_only=True)` onto the meta device.

    Raises:
        FileNotFoundError: no such file. UnsafeFileError: a torch file holding objects other than tensors and plain
            data. DataError: `cannot load {path}: {what failed}` for a truncated or foreign file.
    """
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file {path} does not exist")
    try:
        if path.suffix == ".safetensors":
            with safe_open(path, framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        state = torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as e:
        raise weights_only_error(path, e, "weights file") from e
    except Exception as e:  # noqa: BLE001 - safetensors and torch report a damaged file in their own types
        raise DataError(f"cannot load {path}: {type(e).__name__}: {' '.join(str(e).split())[:300]}") from e
    if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise DataError(f"cannot load {path}: it is not a dict of tensors (a state dict)")
    return {k: tuple(v.shape) for k, v in state.items()}


class _TensorBudget(TorchFunctionMode):
    """Stops a model's construction (RuntimeError) once it has created more than `budget` tensors."""

    FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.tensor,
                           torch.arange, torch.linspace, torch.eye})

    def __init__(self, budget: int) -> None:
        super().__init__()
        self.left = budget

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FACTORIES:
            self.left -= 1
            if self.left < 0:
                raise _TooManyTensors
        return func(*args, **(kwargs or {}))


class _TooManyTensors(RuntimeError):
    pass


def check_weights_fit(build: Callable[[], torch.nn.Module], shapes: Mapping[str, tuple[int, ...]], what: str) -> None:
    """Refuse a config that describes another model than its weights, before the model is built for real.

    `build` runs on the meta device (shapes only, no memory) and stops once it has made far more tensors than the
    weights hold, so a config that describes a model of terabytes (`embed_dim: 1000000`) or of a million layers
    costs nothing. A tensor the model and the weights both name (under any of its names, for tied tensors) must
    have the same shape, and the model's tensors the weights do not name must not outweigh (in elements) the
    weights' tensors the model does not name: keys of an older layout that the loader renames balance out, extra
    layers do not. Anything else (a renamed key that is really missing) is left to the loader's strict check.

    Args:
        build: makes the model the config describes (e.g. `task.build_model`).
        shapes: the weights' name -> shape (`weight_shapes`).
        what: names the model and its weights in the message, e.g. "checkpoint runs/x/checkpoints/step_000001000".
    Raises:
        DataError: one line naming the first tensor that differs, the largest one the weights lack, or why the
            config builds no model.
    """
    budget = 4 * len(shapes) + 1000  # a model makes a few tensors per stored one, plus a fixed set of temporaries
    try:
        with torch.device("meta"), _TensorBudget(budget):
            model = build()
    except _TooManyTensors:
        raise DataError(f"{what}: its config describes a model of more than {budget} tensors, far more than the "
                        f"{len(shapes)} its weights hold") from None
    except Exception as e:  # noqa: BLE001 - a config the model's constructor refuses, in whatever type it raises
        raise DataError(f"{what}: its config does not describe a model ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:300]})") from None
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():  # tied tensors: one object under several names
        names.setdefault(id(t), []).append(name)
        tensors[id(t)] = t
    missing = []  # (numel, name, shape) of the model's tensors the weights hold under none of their names
    for key, aliases in names.items():
        shape = tuple(tensors[key].shape)
        stored = [n for n in aliases if n in shapes]
        if not stored:
            missing.append((math.prod(shape), aliases[0], shape))
        for n in stored:
            if tuple(shapes[n]) != shape:
                raise DataError(f"{what}: its config describes a model whose {n} has shape {shape}, but its weights "
                                f"hold {tuple(shapes[n])}; the config does not belong to these weights")
    # Tensors under other names (an older layout the loader renames) balance out; a larger model does not.
    known = {n for aliases in names.values() for n in aliases}
    extra = sum(math.prod(shape) for n, shape in shapes.items() if n not in known)
    if missing and sum(m[0] for m in missing) > extra:
        numel, name, shape = max(missing)
        raise DataError(f"{what}: its config describes a model with tensors its weights do not hold ({len(missing)}, "
                        f"the largest {name} of shape {shape}); the config does not belong to these weights")


# ---------------------------------------------------------------------------------------------------------
# Image quantisation
# ---------------------------------------------------------------------------------------------------------


def check_model_dir(model_class: type, folder: str | os.PathLike, what: str) -> None:
    """Before `model_class.from_pretrained(folder)` (a diffusers `ModelMixin` / `ConfigMixin` class): the model its
    config.json describes has the tensor shapes its weights hold (`check_weights_fit`, on the meta device, so a
    config describing a far larger model than its weights allocates nothing). A folder without weights is left to
    `from_pretrained` to report.

    Raises:
        ValueError (DataError): an unreadable config or weights file, or a config that does not fit the weights.
    """
    from diffusers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

    folder = Path(folder)
    # Where diffusers' `ModelMixin.from_pretrained` finds a model's weights in its directory, in its order.
    shapes = model_dir_shapes(folder, (SAFETENSORS_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME,
                                       WEIGHTS_INDEX_NAME), what)
    if shapes is None:
        return
    try:
        config = model_class.load_config(folder)
    except Exception as e:  # noqa: BLE001 - diffusers reports a missing or malformed config.json in several types
        raise DataError(f"{what}: cannot read {folder / 'config.json'} ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:300]})") from e
    if not isinstance(config, dict):  # diffusers would take a list for a model id and "could not connect"
        raise DataError(f"{what}: {folder / 'config.json'} holds a JSON {_json_kind(config)}, not an object of the "
                        f"model's settings")
    check = getattr(model_class, "check_config", None)
    if check is not None:  # the model's own check of the types and ranges of its settings
        check(config, f"{what}: {folder / 'config.json'}")
    check_weights_fit(lambda: model_class.from_config(config), shapes, what)


def _json_kind(value: Any) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(type(value), "null")


def model_dir_shapes(folder: str | os.PathLike, names: Sequence[str], what: str) -> dict[str, tuple[int, ...]] | None:
    """The name -> shape of the weights of a model directory: the first of the weight files `names` (a
    `.index.json` of shards: the shards it names inside `folder`) read from their headers; None without any.

    Raises:
        DataError: an unreadable index or weights file, or an index naming files outside `folder`.
    """
    folder = Path(folder)
    found = next((folder / name for name in names if (folder / name).is_file()), None)
    if found is None:
        return None
    files = [found]
    if found.name.endswith(".index.json"):  # sharded: the files its weight map names, inside the folder
        try:
            shards = set(json.loads(found.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"{what}: {found} is unreadable ({type(e).__name__}: {e})") from e
        if not all(isinstance(f, str) and f and Path(f).name == f for f in shards):
            raise DataError(f"{what}: {found} names weight files outside {folder}")
        files = [folder / f for f in sorted(shards)]
    shapes = {}
    for file in files:
        try:
            shapes.update(weight_shapes(file))
        except DataError as e:  # truncated, foreign, or pickled objects (UnsafeFileError): nothing was run
            raise type(e)(f"{what}: {e}") from e
    return shapes


# The (low, high) of float images unless a caller says otherwise (`torchvision.utils.save_image`'s [0, 1]).
IMAGE_RANGE: tuple[float, float] = (0.0, 1.0)


def quantize_uint8(images: torch.Tensor | np.ndarray, value_range: tuple[float, float] = IMAGE_RANGE) -> Any:
    """Quantise float images to uint8 as `torchvision.utils.save_image` does: uint8(clamp(255 x + 0.5, 0, 255)).

    Args:
        images: any shape, torch or numpy, floats in `value_range` (mapped to [0, 1] first); uint8 passes through.
        value_range: (low, high) of the float input.
    Returns:
        uint8 of the same shape and kind (torch tensor on the same device, or numpy array).
    Raises:
        ValueError: non-finite values, or an integer dtype other than uint8.
    """
    is_numpy = isinstance(images, np.ndarray)
    x = torch.from_numpy(np.ascontiguousarray(images)) if is_numpy else images
    if x.dtype == torch.uint8:
        return images
    if not x.is_floating_point():
        raise ValueError(f"images must be uint8 or floating point, got {x.dtype}")
    if not torch.isfinite(x).all():
        raise ValueError("images contain NaN or Inf")
    lo, hi = value_range
    if (lo, hi) != IMAGE_RANGE:
        x = (x - lo) / (hi - lo)
    # torchvision.utils.save_image: mul(255).add_(0.5).clamp_(0, 255).to(uint8).
    out = x.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8)
    return out.numpy() if is_numpy else out
