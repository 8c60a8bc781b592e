"""MS-COCO feature extraction on a tiny COCO-format folder: preprocessing, contents, resume, dataset, CLI."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from tiny_models import VAE_TINY

from uvic.data.mscoco import MSCOCOFeatures, center_crop_resize, extract_features, load_empty_context, main
from uvic.models.autoencoder import build_vae, encode_moments
from uvic.models.text_encoder import CLIPTextEncoder


RES = 16
SIZES = [(40, 24), (24, 40), (33, 33), (50, 21), (19, 30)]  # (W, H): landscape, portrait, square, odd


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    return build_vae(**VAE_TINY).eval(), CLIPTextEncoder(width=32, heads=4, layers=1).eval()


@pytest.fixture
def coco(tmp_path):
    """A COCO-2014-style folder: images with ids out of order and 1-3 captions each."""
    rng = np.random.default_rng(0)
    img_dir = tmp_path / "val2014"
    img_dir.mkdir()
    ids = [42, 7, 1000, 3, 99]
    images, anns = [], []
    for k, (image_id, (w, h)) in enumerate(zip(ids, SIZES)):
        name = f"COCO_val2014_{image_id:012d}.jpg"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(img_dir / name, quality=95)
        images.append({"id": image_id, "file_name": name, "width": w, "height": h})
        for j in range(1 + k % 3):
            anns.append({"id": 100 * image_id + j, "image_id": image_id, "caption": f"caption {j} of image {image_id}"})
    rng.shuffle(anns)
    cap = tmp_path / "captions_val2014.json"
    cap.write_text(json.dumps({"images": images, "annotations": anns}))
    return img_dir, cap, sorted(ids), anns


def test_center_crop_then_lanczos():
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (24, 40, 3), dtype=np.uint8))
    out = center_crop_resize(img, RES)
    expected = np.asarray(img.crop((8, 0, 32, 24)).resize((RES, RES), Image.LANCZOS))
    np.testing.assert_array_equal(out, expected)
    # Not torchvision's Resize + CenterCrop (bilinear, resize first): docs/conventions.md, "MS-COCO text-to-image".
    import torchvision.transforms.functional as TF

    tv = np.asarray(TF.center_crop(TF.resize(img, RES), RES))
    assert np.abs(tv.astype(int) - out.astype(int)).max() > 0


def test_extract_contents(coco, models, tmp_path):
    img_dir, cap, ids, anns = coco
    vae, te = models
    out = tmp_path / "features"
    split_dir = extract_features(img_dir, cap, out, "val", vae, te, resolution=RES, batch_size=2, text_batch_size=3,
                                 num_workers=0, device="cpu")
    ds = MSCOCOFeatures(out, "val")
    assert ds.meta["num_images"] == 5 and ds.meta["num_captions"] == len(anns)
    images = json.loads((split_dir / "images.json").read_text())
    assert [im["id"] for im in images] == ids  # sorted id order, as the official database

    # Moments of image i = VAE of its crop-and-resize; contexts = CLIP of its captions in file order.
    for i, im in enumerate(images):
        x = torch.from_numpy(center_crop_resize(Image.open(img_dir / im["file_name"]), RES).copy()).permute(2, 0, 1)
        ref = encode_moments(vae, (x.float() / 127.5 - 1)[None])[0]
        torch.testing.assert_close(torch.from_numpy(np.array(ds.moments[i])), ref, atol=1e-5, rtol=1e-5)
        caps = [a["caption"] for a in anns if a["image_id"] == im["id"]]
        rows = slice(ds.offsets[i], ds.offsets[i + 1])
        assert ds.captions[rows] == caps
        torch.testing.assert_close(ds.context(np.arange(ds.offsets[i], ds.offsets[i + 1])), te.encode_text(caps),
                                   atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(load_empty_context(out), te.encode_text([""])[0])

    assert len(ds) == len(anns)  # one item per (image, caption) pair
    item = ds[3]
    assert set(item) == {"x", "context"}
    img = int(np.searchsorted(ds.offsets, 3, side="right") - 1)
    torch.testing.assert_close(item["x"], torch.from_numpy(np.array(ds.moments[img])))
    torch.testing.assert_close(item["context"], ds.context([3])[0])
    assert item["x"].shape == (8, RES // 2, RES // 2) and item["context"].shape == (77, 32)
    assert item["x"].dtype == torch.float32 and item["context"].dtype == torch.float32
    rows = ds.draw_caption_rows(200, seed=0)
    assert rows.min() >= 0 and rows.max() < len(anns) and len(set(rows.tolist())) > 5


def test_resume_skips_finished_items(coco, models, tmp_path):
    img_dir, cap, _, _ = coco
    vae, te = models
    out = tmp_path / "features"
    kw = {"resolution": RES, "batch_size": 2, "num_workers": 0, "device": "cpu"}
    split_dir = extract_features(img_dir, cap, out, "val", vae, te, **kw)
    full = np.load(split_dir / "moments.npy").copy()

    # Simulate an interruption after 3 images: their data stays, the rest is lost.
    moments = np.load(split_dir / "moments.npy", mmap_mode="r+")
    done = np.load(split_dir / "done.npy", mmap_mode="r+")
    moments[:3], moments[3:], done[3:] = 7.0, 0.0, False
    moments.flush()
    done.flush()
    del moments, done
    with pytest.raises(ValueError, match="incomplete"):
        MSCOCOFeatures(out, "val")

    extract_features(img_dir, cap, out, "val", vae, te, **kw)
    resumed = np.load(split_dir / "moments.npy")
    assert (resumed[:3] == 7.0).all()  # finished items were not recomputed
    np.testing.assert_allclose(resumed[3:], full[3:], atol=1e-6)
    assert np.load(split_dir / "done.npy").all()

    # A different caption file in the same folder is refused, not silently mixed.
    data = json.loads(cap.read_text())
    data["annotations"][0]["caption"] = "something else"
    cap.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="different captions"):
        extract_features(img_dir, cap, out, "val", vae, te, **kw)


def test_cli_and_missing_inputs(coco, models, tmp_path):
    img_dir, cap, _, _ = coco
    vae, te = models
    vae.save_pretrained(tmp_path / "vae")
    te.save_pretrained(tmp_path / "clip")
    main(["--images", str(img_dir), "--captions", str(cap), "--out", str(tmp_path / "f"), "--split", "val",
          "--vae", str(tmp_path / "vae"), "--clip", str(tmp_path / "clip"), "--resolution", str(RES),
          "--num-workers", "0", "--device", "cpu", "--context-dtype", "float16"])
    ds = MSCOCOFeatures(tmp_path / "f", "val")
    assert ds.contexts.dtype == np.float16 and ds.meta["num_images"] == 5

    with pytest.raises(FileNotFoundError, match="caption file not found"):
        extract_features(img_dir, tmp_path / "none.json", tmp_path / "g", "val", vae, te, num_workers=0)
    with pytest.raises(FileNotFoundError, match="no extracted MS-COCO features"):
        MSCOCOFeatures(tmp_path / "g", "train")
    with pytest.raises(FileNotFoundError, match="autoencoder_kl.pth"):
        main(["--images", str(img_dir), "--captions", str(cap), "--out", str(tmp_path / "h"), "--split", "val",
              "--vae", str(tmp_path / "missing.pth")])

