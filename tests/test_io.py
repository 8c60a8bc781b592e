"""uvic.io: atomic writes, the data-only loaders, .npz reading and the uint8 quantisation."""

import hashlib
import io
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from uvic.errors import DataError
from uvic.io import (
    UnsafeFileError,
    atomic_write,
    load_data_pickle,
    load_torch_data,
    quantize_uint8,
    read_npz,
    sha256_file,
)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_fsync_tree_gives_safetensors_files_the_mode_of_the_rest(tmp_path, umask):
    """safetensors writes 0600 whatever the umask; a directory about to be renamed into place (a checkpoint, an
    export) gets 0666 less the umask for every file, as files written with `open` have."""
    from safetensors.torch import save_file

    from uvic.io import fsync_tree

    old = os.umask(umask)
    try:
        (tmp_path / "sub").mkdir()
        save_file({"w": torch.zeros(2)}, str(tmp_path / "sub" / "model.safetensors"))
        (tmp_path / "config.json").write_text("{}")
        fsync_tree(tmp_path)
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in tmp_path.rglob("*") if p.is_file()}
    assert modes == {"model.safetensors": oct(0o666 & ~umask), "config.json": oct(0o666 & ~umask)}


def test_sha256_file_matches_hashlib(tmp_path):
    data = os.urandom(3 << 20)  # several 1 MiB chunks
    (tmp_path / "f").write_bytes(data)
    assert sha256_file(tmp_path / "f") == hashlib.sha256(data).hexdigest()


def test_atomic_write_replaces_only_on_success(tmp_path, monkeypatch):
    path = tmp_path / "stats.json"
    path.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_write(path, "w") as f:
            f.write("new, half")
            raise RuntimeError("killed midway")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"]
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    with atomic_write(path, "w") as f:
        f.write("new")
    assert path.read_text() == "new"
    assert events == ["fsync", "replace", "fsync"]  # the file, its rename, then the folder


def _official_style_batch(path, data, protocol):
    with open(path, "wb") as f:
        pickle.dump({b"batch_label": b"training batch 1 of 5", b"labels": [3, 1], b"data": data,
                     b"filenames": [b"a.png", b"b.png"]}, f, protocol=protocol)


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_data_pickle_reads_plain_data_and_uint8_arrays(tmp_path, protocol):
    data = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    _official_style_batch(tmp_path / "b", data, protocol)
    out = load_data_pickle(tmp_path / "b")
    assert out[b"labels"] == [3, 1] and out[b"filenames"] == [b"a.png", b"b.png"]
    assert out[b"data"].dtype == np.uint8 and np.array_equal(out[b"data"], data)
    assert out == {**pickle.loads((tmp_path / "b").read_bytes()), b"data": out[b"data"]}  # pickle's own result


@pytest.mark.parametrize("payload, refused", [
    (np.zeros(3, dtype=np.float64), "numpy array of dtype float64 refused"),
    (np.array([None, 1], dtype=object), "refused"),
    (pickle.PickleBuffer, "refused global pickle.PickleBuffer"),
    (os.getcwd, "refused global posix.getcwd"),
])
def test_data_pickle_refuses_everything_else(tmp_path, payload, refused):
    with open(tmp_path / "b", "wb") as f:
        pickle.dump({"data": payload}, f, protocol=2)
    with pytest.raises(UnsafeFileError, match=rf"^file {tmp_path / 'b'} holds objects other than plain data \(.*"
                                              rf"{refused}"):
        load_data_pickle(tmp_path / "b")


def test_data_pickle_names_a_truncated_file(tmp_path):
    _official_style_batch(tmp_path / "b", np.zeros((2, 3072), np.uint8), 2)
    (tmp_path / "b").write_bytes((tmp_path / "b").read_bytes()[:100])
    with pytest.raises(DataError, match=rf"^file {tmp_path / 'b'} is not a readable pickle"):
        load_data_pickle(tmp_path / "b")


def test_torch_data_loads_tensors_and_names_garbage(tmp_path):
    torch.save({"w": torch.arange(3), "step": 7}, tmp_path / "ok.pt")
    assert load_torch_data(tmp_path / "ok.pt")["step"] == 7
    (tmp_path / "bad.pt").write_bytes(b"\x00not a torch file" * 10)
    with pytest.raises(DataError, match=rf"^state {tmp_path / 'bad.pt'} is not a torch file of tensors"):
        load_torch_data(tmp_path / "bad.pt", what="state")


def test_read_npz(tmp_path):
    np.savez(tmp_path / "a.npz", mu=np.ones(3), sigma=np.eye(3))
    out = read_npz(tmp_path / "a.npz", ("mu", "n"))
    assert out["__keys__"] == ["mu", "sigma"] and set(out) == {"__keys__", "mu"} and (out["mu"] == 1).all()
    np.save(tmp_path / "b.npy", np.ones(3))
    with pytest.raises(DataError, match="not a readable .npz archive"):
        read_npz(tmp_path / "b.npy")
    with pytest.raises(FileNotFoundError):
        read_npz(tmp_path / "missing.npz")


def test_quantize_uint8_matches_torchvision_save_image():
    from torchvision.utils import save_image

    x = torch.rand(2, 3, 5, 7, generator=torch.Generator().manual_seed(0)) * 1.2 - 0.1  # beyond [0, 1] too
    x[0, 0, 0, :3] = torch.tensor([0.5 / 255, 1.5 / 255, 254.5 / 255])  # rounding boundaries
    buffer = io.BytesIO()
    save_image(x[1], buffer, format="png")
    reference = torch.from_numpy(np.array(Image.open(buffer))).permute(2, 0, 1)
    assert torch.equal(quantize_uint8(x)[1], reference)
    as_numpy = quantize_uint8(x.permute(0, 2, 3, 1).numpy())  # numpy in, numpy out, same layout
    assert isinstance(as_numpy, np.ndarray) and np.array_equal(as_numpy, quantize_uint8(x).permute(0, 2, 3, 1).numpy())
    y = x * 2 - 1
    assert torch.equal(quantize_uint8(y, (-1.0, 1.0)), quantize_uint8((y + 1) / 2))  # U-ViT's unpreprocess, then quantised
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_uint8(torch.full((1, 3, 2, 2), float("nan")))


class _Tied(torch.nn.Module):
    """An embedding tied to the output head (one tensor under two names), as language models often have."""

    def __init__(self, vocab=10, width=4, depth=1):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight


def test_check_weights_fit_compares_the_described_model_with_the_weights(tmp_path):
    from safetensors.torch import save_model

    from uvic.io import check_weights_fit, weight_shapes

    save_model(_Tied(), str(tmp_path / "w.safetensors"))  # the tied tensor is stored once
    shapes = weight_shapes(tmp_path / "w.safetensors")
    assert len(shapes) == 3
    check_weights_fit(_Tied, shapes, "m")
    check_weights_fit(_Tied, {("old." + k if k.startswith("blocks") else k): v for k, v in shapes.items()}, "m")
    with pytest.raises(DataError, match=r"^m: its config describes a model whose embed.weight has shape \(10, 8\), "
                                        r"but its weights hold \(10, 4\); the config does not belong"):
        check_weights_fit(lambda: _Tied(width=8), shapes, "m")
    with pytest.raises(DataError, match=r"^m: its config describes a model with tensors its weights do not hold "
                                        r"\(4, the largest blocks.\d.weight of shape \(4, 4\)\)"):
        check_weights_fit(lambda: _Tied(depth=3), shapes, "m")
    with pytest.raises(DataError, match=r"^m: its config describes a model of more than 1012 tensors, far more "
                                        r"than the 3 its weights hold$"):
        check_weights_fit(lambda: _Tied(depth=10**6), shapes, "m")
    with pytest.raises(DataError, match=r"^m: its config does not describe a model \(RuntimeError: "):
        check_weights_fit(lambda: _Tied(vocab=-1), shapes, "m")
