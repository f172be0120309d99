"""The loader picks the RandomResizedCrop box first and decodes a JPEG only at the scale that box needs
(libjpeg-turbo's DCT-domain scaling) and, where doeks' _jpegcrop module is built, only the box's rows and iMCU columns
(libjpeg-turbo's jpeg_skip_scanlines / jpeg_crop_scanline); without it simplejpeg decodes the whole image at that scale.
The augmentation is still torchvision's, on both paths.

The statistics test reads each crop back from the pixels: the source is a JPEG whose red channel is the column and
whose green channel is the row, so the first and last column/row of a 32 x 32 output tell the box's width and height
(and a reversed red gradient tells a flip). The same reading of torchvision's v2.RandomResizedCrop + flip on the same
image is the reference.
"""
from __future__ import annotations

import math

import pytest

from doeks.workload import data
from doeks.workload import loader

WIDTH, HEIGHT, OUT = 512, 384, 32


def _gradient_jpeg(path) -> bytes:
    import numpy as np
    from PIL import Image

    x = np.round(np.arange(WIDTH) * 255 / (WIDTH - 1))
    y = np.round(np.arange(HEIGHT) * 255 / (HEIGHT - 1))
    image = np.zeros((HEIGHT, WIDTH, 3), dtype=np.uint8)
    image[..., 0], image[..., 1], image[..., 2] = x[None, :], y[:, None], 128
    Image.fromarray(image).save(path, format="JPEG", quality=95, subsampling=0)
    return path.read_bytes()


def _boxes(outputs) -> dict:
    """Area fraction, log aspect ratio (w/h) and flips of the crops the outputs were resized from."""
    import torch

    o = torch.stack(outputs).float()
    left, right = o[:, 0, :, 0].mean(1), o[:, 0, :, -1].mean(1)  # red = column
    top, bottom = o[:, 1, 0, :].mean(1), o[:, 1, -1, :].mean(1)  # green = row
    w = (right - left).abs() * (WIDTH - 1) / 255 * OUT / (OUT - 1)
    h = (bottom - top) * (HEIGHT - 1) / 255 * OUT / (OUT - 1)
    area = w * h / (WIDTH * HEIGHT)
    log_ratio = torch.log(w / h)
    return {"area": (area.mean().item(), area.std().item()), "log_ratio": (log_ratio.mean().item(), log_ratio.std().item()),
            "flipped": (right < left).float().mean().item()}


@pytest.fixture(scope="module")
def jpegcrop():
    """doeks' region decode module, built here (python -m doeks.workload.jpegcrop_build) when it is missing and a C
    compiler and libjpeg's headers are: a test that needs it is skipped only where it cannot be built."""
    if loader._jpegcrop() is None:
        import shutil
        import subprocess

        from doeks.workload import jpegcrop_build

        if shutil.which("cc") is None:
            pytest.skip("no C compiler: doeks.workload._jpegcrop cannot be built here")
        try:
            jpegcrop_build.build()
        except subprocess.CalledProcessError as error:
            pytest.skip(f"doeks.workload._jpegcrop does not build here (libjpeg headers?): {error}")
        loader._JPEGCROP.clear()
    assert loader._jpegcrop() is not None
    return loader._jpegcrop()


@pytest.fixture(params=["region", "scaled"])
def decode_path(request, monkeypatch):
    """Both decodes of the train crop: _jpegcrop's region decode and simplejpeg's whole image (_jpegcrop not built)."""
    if request.param == "region":
        request.getfixturevalue("jpegcrop")
    else:
        monkeypatch.setattr(loader, "_JPEGCROP", [None])
    return request.param


def _reset_counters():
    loader.CROP_DECODE.update(region=0, scaled=0, fallback=0)
    loader.SCALES.clear()


def test_crop_area_and_aspect_ratio_statistics_match_torchvision(tmp_path, decode_path):
    import torch
    from torchvision.transforms import v2

    raw = _gradient_jpeg(tmp_path / "gradient.JPEG")
    samples = 1500
    transform = loader.train_transform(OUT)
    loader.CROP_DECODE.update(region=0, scaled=0, fallback=0)
    loader.SCALES.clear()
    torch.manual_seed(1)
    ours = _boxes([transform(raw) for _ in range(samples)])

    reference = v2.Compose([v2.RandomResizedCrop(OUT, antialias=True), v2.RandomHorizontalFlip()])
    image = loader.load_bytes(raw)
    torch.manual_seed(2)
    theirs = _boxes([reference(image) for _ in range(samples)])

    # scale=(0.08, 1) of the area, log-uniform aspect ratio in [3/4, 4/3] (read back a little small: the resize's
    # edge pixels average inwards; wide boxes fit a 4:3 image better): area ~0.43 +- 0.21, log ratio ~0.03 +- 0.17
    assert 0.35 < theirs["area"][0] < 0.55 and abs(theirs["log_ratio"][0]) < 0.06, theirs
    for key, tolerance in (("area", 0.03), ("log_ratio", 0.02)):  # ~3.5 standard errors of the difference
        (mean, std), (ref_mean, ref_std) = ours[key], theirs[key]
        assert abs(mean - ref_mean) < tolerance and abs(std - ref_std) < tolerance, (key, ours, theirs)
    assert abs(ours["flipped"] - 0.5) < 0.05 and abs(theirs["flipped"] - 0.5) < 0.05
    assert loader.CROP_DECODE == {"region": samples if decode_path == "region" else 0,
                                 "scaled": samples if decode_path == "scaled" else 0, "fallback": 0}, loader.CROP_DECODE
    assert set(loader.SCALES) == {2, 4, 8}, loader.SCALES  # every crop has >= 64 px a side: decoded at 1/2 or less
    assert loader.SCALES[8] > samples // 10


def test_crop_box_is_torchvisions_draw_for_draw():
    """Same generator state, same box: crop_box makes torchvision's draws in torchvision's order (also the central
    fallback of a very long image)."""
    import torch
    from torchvision.transforms import v2

    reference = v2.RandomResizedCrop(OUT)
    for height, width in ((375, 500), (500, 333), (40, 48), (20, 400)):
        for seed in range(20):
            torch.manual_seed(seed)
            ours = loader.crop_box(height, width)
            torch.manual_seed(seed)
            theirs = reference.make_params([torch.empty(3, height, width)])
            assert ours == (theirs["top"], theirs["left"], theirs["height"], theirs["width"])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from doeks.datastage import relayout_val

    root = tmp_path_factory.mktemp("imagenet") / "data"
    data.generate(root, classes=3, train_per_class=12, val_per_class=4, size=40)
    relayout_val(root)
    return root


def test_normal_jpegs_take_the_scaled_decode_and_odd_files_fall_back(dataset, decode_path):
    from PIL import Image

    for split, transform in (("train", loader.train_transform(24)), ("val", loader.val_transform(24, 27))):
        fast = "region" if split == "train" and decode_path == "region" else "scaled"  # val: simplejpeg, scaled
        folder = loader.image_folder(dataset / split, transform)
        kinds = []
        for path, _ in folder.samples:
            with Image.open(path) as image:
                kinds.append((image.format, image.mode))
        _reset_counters()
        for index in range(len(folder)):
            image, _ = folder[index]
            assert tuple(image.shape) == (3, 24, 24) and not image.dtype.is_floating_point
        normal = sum(kind in (("JPEG", "RGB"), ("JPEG", "L")) for kind in kinds)
        odd = len(kinds) - normal  # the PNG named .JPEG and the CMYK JPEGs
        assert ("JPEG", "L") in kinds and odd >= 1 and loader.CROP_DECODE == {"region": 0, "scaled": 0, **{fast: normal}, "fallback": odd}, (split, kinds, loader.CROP_DECODE)


def test_a_large_jpeg_is_decoded_at_a_fraction_of_its_size_and_looks_the_same(tmp_path):
    """Val of a 512 x 384 JPEG to Resize(36) + CenterCrop(32): a short side of 384 needs only 1/8 (48 >= 36). The
    pixels are those of the full decode through the same transforms, give or take the resampling."""
    import numpy as np
    import torch
    from torchvision.transforms import v2

    rng = np.random.default_rng(0)
    path = tmp_path / "big.JPEG"
    from PIL import Image

    Image.fromarray(data._image(3, 400, rng)[:HEIGHT, :WIDTH]).save(path, quality=90)
    raw = path.read_bytes()
    height, width = loader.jpeg_size(raw)
    loader.SCALES.clear()
    fast = loader.val_transform(OUT, 36)(raw)
    assert loader.SCALES == {8: 1} and tuple(fast.shape) == (3, OUT, OUT)
    full = v2.Compose([v2.Resize(36, antialias=True), v2.CenterCrop(OUT)])(loader.load_bytes(raw))
    assert (fast.float() - full.float()).abs().mean().item() < 10, (fast.float() - full.float()).abs().mean()
    assert loader.dct_scale(height, width, 36) == 8 and loader.dct_scale(height, width, 100) == 2
    assert loader.dct_scale(height, width, 200) == 1 and loader.dct_scale(100, 1000, 60) == 1
    torch.manual_seed(0)
    assert tuple(loader.train_transform(224)(raw).shape) == (3, 224, 224)


def test_without_simplejpeg_every_file_takes_the_full_decode(monkeypatch, tmp_path):
    raw = _gradient_jpeg(tmp_path / "gradient.JPEG")
    monkeypatch.setattr(loader, "_SIMPLEJPEG", [None])
    _reset_counters()
    assert tuple(loader.train_transform(OUT)(raw).shape) == (3, OUT, OUT)
    assert tuple(loader.val_transform(OUT, 36)(raw).shape) == (3, OUT, OUT)
    assert loader.CROP_DECODE == {"region": 0, "scaled": 0, "fallback": 2}
    assert not math.isnan(loader.to_model_input(loader.val_transform(OUT, 36)(raw)[None], "cpu", False).mean().item())


def test_region_decode_is_the_box_of_the_whole_decode(tmp_path, jpegcrop):
    """_jpegcrop's box (its rows only, its iMCU columns only) has the pixels of the same box cut from the whole image
    decoded at the same scale (simplejpeg, another libjpeg-turbo: a level or two apart where the chroma upsampling
    at the box's edge differs), for colour and grayscale JPEGs, 4:2:0 and 4:4:4, boxes at every edge, every scale."""
    import numpy as np
    import simplejpeg
    from PIL import Image

    rng = np.random.default_rng(1)
    picture = data._image(1, 400, rng)[:301, :457]  # odd sizes: partial iMCUs at the right and bottom
    files = {}
    for name, image, options in (("420", picture, {}), ("444", picture, {"subsampling": 0}),
                                 ("gray", picture.mean(2).astype(np.uint8), {})):
        Image.fromarray(image).save(tmp_path / f"{name}.JPEG", quality=90, **options)
        files[name] = (tmp_path / f"{name}.JPEG").read_bytes()
    for name, raw in files.items():
        height, width = loader.jpeg_size(raw)
        for scale in (1, 2, 4, 8):
            whole = simplejpeg.decode_jpeg(raw, colorspace="RGB", fastdct=True, fastupsample=False,
                                           min_height=-(-height // scale), min_width=-(-width // scale))
            sh, sw = whole.shape[:2]
            assert (sh, sw) == (-(-height // scale), -(-width // scale))
            for top, left, h, w in ((0, 0, sh, sw), (sh // 3, sw // 5, sh // 2, sw // 3), (sh - 1, sw - 1, 1, 1),
                                    (1, 17 % sw, sh - 1, sw - 17 % sw), (0, sw - 9 if sw > 9 else 0, 9 if sh > 9 else sh, 9 if sw > 9 else sw)):
                box = np.frombuffer(jpegcrop.decode_crop(raw, scale, top, left, h, w, 1), np.uint8).reshape(h, w, 3)
                difference = np.abs(box.astype(int) - whole[top:top + h, left:left + w].astype(int))
                assert difference.mean() < 0.5 and difference.max() <= 16, (name, scale, (top, left, h, w), difference.mean(), difference.max())
                bgr = jpegcrop.decode_crop(raw, scale, top, left, h, w, 1 | jpegcrop.BGR)  # the flip's order
                assert np.array_equal(np.frombuffer(bgr, np.uint8).reshape(h, w, 3), box[..., ::-1])
    with pytest.raises(ValueError):
        jpegcrop.decode_crop(files["420"], 1, 0, 0, 302, 10, 1)  # outside the image
    with pytest.raises(ValueError):
        jpegcrop.decode_crop(files["420"][:200] + b"x" * 50, 1, 0, 0, 10, 10, 1)  # not a JPEG libjpeg can read
    with pytest.raises(ValueError):
        jpegcrop.decode_crop(b"\x89PNG\r\n\x1a\n" + bytes(100), 1, 0, 0, 10, 10, 1)


def test_region_decode_refuses_cmyk_and_the_train_crop_falls_back(tmp_path, jpegcrop):
    import numpy as np
    import torch
    from PIL import Image

    Image.fromarray(np.full((64, 80, 4), 100, np.uint8), mode="CMYK").save(tmp_path / "cmyk.JPEG")
    raw = (tmp_path / "cmyk.JPEG").read_bytes()
    assert jpegcrop.decode_crop(raw, 1, 0, 0, 8, 8, 1) is None
    _reset_counters()
    torch.manual_seed(0)
    assert tuple(loader.train_transform(OUT)(raw).shape) == (3, OUT, OUT)
    assert loader.CROP_DECODE == {"region": 0, "scaled": 0, "fallback": 1}


def _picture_jpeg(path) -> bytes:
    """A textured 4:2:0 JPEG of odd size whose RandomResizedCrop(224) boxes are smaller and larger than 224 and some
    large enough for a decode at 1/2."""
    import numpy as np
    from PIL import Image

    Image.fromarray(data._image(2, 900, np.random.default_rng(2))[:601, :857]).save(path, quality=90)
    return path.read_bytes()


def _torchvision_train_crop(raw: bytes, size: int):
    """TrainTransform spelled out with torchvision: the crop's draws, the flip's draw, the box decoded in R, G, B
    order, v2.functional.resize (bilinear, antialiased) and flip."""
    import torch
    from torchvision.transforms.v2 import functional as F

    height, width = loader.jpeg_size(raw)
    top, left, h, w = loader.crop_box(height, width)
    flip = torch.rand(1).item() < 0.5
    box = loader.decode_box(raw, height, width, loader.dct_scale(h, w, size), top, left, h, w)
    out = F.resize(box.permute(2, 0, 1), [size, size], antialias=True)
    return (out.flip(-1) if flip else out), flip


def _assert_train_crops_are_torchvisions(raw: bytes, size: int = 224, seeds: int = 40) -> None:
    import torch

    transform = loader.train_transform(size)
    flips = 0
    for seed in range(seeds):
        torch.manual_seed(seed)
        ours = transform(raw)
        after = torch.rand(1)
        torch.manual_seed(seed)
        theirs, flip = _torchvision_train_crop(raw, size)
        assert torch.equal(ours, theirs), (seed, flip, (ours.int() - theirs.int()).abs().max())
        assert torch.equal(after, torch.rand(1))  # the same draws, no more
        flips += flip
    assert 0 < flips < seeds


def test_train_crop_is_torchvisions_resize_and_flip_of_the_rgb_box(tmp_path, decode_path):
    """Pixel for pixel: the loader's resize (torch's kernel called as torchvision calls it) and its flip (the box
    decoded B, G, R and each resized row's bytes reversed) are v2 resize + flip of the R, G, B box, on both paths,
    and an image of the output size is not resized."""
    import torch
    from torchvision.transforms.v2 import functional as F

    raw = _picture_jpeg(tmp_path / "picture.JPEG")
    _assert_train_crops_are_torchvisions(raw)
    box = torch.randint(0, 256, (224, 224, 3), dtype=torch.uint8)
    for flip in (False, True):
        ours = loader.resize_box(box.flip(-1).contiguous() if flip else box, 224, flip)
        theirs = F.resize(box.permute(2, 0, 1), [224, 224], antialias=True)
        assert torch.equal(ours, theirs.flip(-1) if flip else theirs)


def test_a_region_module_built_before_the_bgr_flag_gives_the_same_crops(tmp_path, jpegcrop, monkeypatch):
    """A _jpegcrop .so built from the previous source (no BGR flag) next to a newer train.py: same pixels."""

    class Stale:
        @staticmethod
        def decode_crop(raw, scale, top, left, h, w, flags):
            assert flags in (0, 1)
            return jpegcrop.decode_crop(raw, scale, top, left, h, w, flags)

    monkeypatch.setattr(loader, "_JPEGCROP", [Stale])
    _reset_counters()
    _assert_train_crops_are_torchvisions(_picture_jpeg(tmp_path / "picture.JPEG"), seeds=10)
    assert loader.CROP_DECODE["region"] > 0
