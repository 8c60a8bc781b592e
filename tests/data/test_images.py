"""Image folders: files that are not readable images, and one reader shared with the FID harness."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from uvic.config import DataConfig
from uvic.data import ResizedImageFolder, build_image_dataset
from uvic.data.images import check_image
from uvic.errors import DataError


def _png_bytes(seed):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "images"
    d.mkdir()
    for i in range(4):
        (d / f"{i}.png").write_bytes(_png_bytes(i))
    return d


def test_truncated_png_is_named_when_the_dataset_is_built(folder):
    data = _png_bytes(9)
    (folder / "2_truncated.png").write_bytes(data[: len(data) - 30])  # cut inside the pixel data
    with Image.open(folder / "2_truncated.png") as img:
        assert img.size == (8, 8)  # the header alone looks fine: only reading on finds the damage
    with pytest.raises(DataError) as e:
        ResizedImageFolder(folder, 8)
    assert str(e.value).startswith(f"{folder / '2_truncated.png'} is not a readable image (")
    assert str(e.value).endswith("; remove them, or set data.skip_bad_images=true to skip them")


def test_non_image_named_png_is_named_and_counted(folder):
    (folder / "notes.png").write_text("not an image")
    (folder / "sub").mkdir()
    (folder / "sub" / "empty.png").write_bytes(b"")
    with pytest.raises(DataError, match=rf"^{folder / 'notes.png'} is not a readable image \(UnidentifiedImageError: "
                                        rf".*\); 1 more unreadable file\(s\) under {folder}; remove them"):
        build_image_dataset(DataConfig(name="image_folder", root=str(folder), image_size=8))
    assert check_image(folder / "0.png") is None and check_image(folder / "sub" / "empty.png") is not None


def test_skipping_unreadable_files_only_when_asked(folder, caplog):
    (folder / "bad.png").write_text("not an image")
    ds = build_image_dataset(DataConfig(name="image_folder", root=str(folder), image_size=8, skip_bad_images=True))
    assert [p.name for p in ds.paths] == ["0.png", "1.png", "2.png", "3.png"]
    assert f"skipping unreadable image {folder / 'bad.png'}" in caplog.text
    want = torch.from_numpy(np.array(Image.open(folder / "1.png"))).permute(2, 0, 1).float() / 127.5 - 1
    torch.testing.assert_close(ds[1]["x"], want)
    for p in folder.glob("*.png"):
        p.write_text("no images left")
    with pytest.raises(FileNotFoundError, match="no readable images under .*: all 5 were skipped"):
        ResizedImageFolder(folder, 8, skip_bad=True)


def test_a_file_damaged_after_the_check_is_named_when_read(folder):
    ds = ResizedImageFolder(folder, 8)
    (folder / "3.png").write_bytes(b"\x89PNG\r\n")
    with pytest.raises(DataError, match=rf"^{folder / '3.png'} is not a readable image"):
        ds[3]


def test_training_and_fid_read_a_folder_alike(tmp_path):
    from uvic.fid import ImageFolder

    folder = tmp_path / "samples"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(12):  # 2.png before 10.png: U-ViT's sample order
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    train_ds, fid_ds = ResizedImageFolder(folder, 8), ImageFolder(folder)
    assert [p.name for p in train_ds.paths] == [p.name for p in fid_ds.files] == [f"{i}.png" for i in range(12)]
    for i in range(12):  # the same pixels: uint8 for FID, ToTensor + Normalize(0.5, 0.5) for training
        torch.testing.assert_close(train_ds[i]["x"], fid_ds[i].float() / 127.5 - 1)
