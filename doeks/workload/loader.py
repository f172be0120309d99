"""The built-in job's loader: ImageNet's files decoded to uint8 tensors, the train crop chosen before the decode so
that only the scale (and, with _jpegcrop, only the rows and columns) it needs is decoded, and the batch normalized on
the device (docs/loader.md). Beside train.py, in the training image and a SageMaker sourcedir alike.
"""
from __future__ import annotations

import math
from pathlib import Path

MEAN = (0.485, 0.456, 0.406)  # ImageNet mean/std (torchvision's weights, pytorch/examples imagenet/main.py)


STD = (0.229, 0.224, 0.225)


# --- data: torchvision.io decode (libjpeg-turbo) to uint8 tensors, PIL as the fallback -------------------------------

DECODE = {"fast": 0, "fallback": 0}  # per process (a DataLoader worker counts its own)


_FAST: list = []


def _fast_decoder():
    if not _FAST:
        try:
            from torchvision.io.image import ImageReadMode, _assert_has_image_ops, decode_image

            _assert_has_image_ops()
            _FAST.append(lambda data: decode_image(data, mode=ImageReadMode.RGB))
        except Exception:  # noqa: BLE001 - torchvision built without its image extension: PIL does it all
            _FAST.append(None)
    return _FAST[0]


def load_image(path: str):
    """Any file ImageNet holds as a 3 x H x W uint8 tensor. decode_image sniffs the bytes, so the PNG named .JPEG
    (n02105855_2933.JPEG), CMYK and grayscale JPEGs all take the fast path; PIL takes whatever it refuses."""
    return load_bytes(read_file(path))


def load_bytes(raw: bytes):
    """load_image of a file's bytes."""
    import torch

    decode = _fast_decoder()
    if decode is not None:
        try:
            image = decode(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
            DECODE["fast"] += 1
            return image
        except RuntimeError:
            pass
    DECODE["fallback"] += 1
    return pil_decode(raw)


def pil_decode(raw: bytes):
    import io

    from PIL import Image
    from torchvision.transforms.v2.functional import pil_to_tensor

    with Image.open(io.BytesIO(raw)) as image:
        return pil_to_tensor(image.convert("RGB"))


# --- train/val transforms on the file's bytes: the crop is chosen first, then only the scale it needs is decoded ---
# libjpeg-turbo decodes a JPEG at 1/2, 1/4 or 1/8 of its size in the DCT domain (SIMD IDCTs that skip the discarded
# frequencies); simplejpeg exposes it (min_height/min_width) and ships its own libjpeg-turbo. A crop that still has
# at least the output size at a smaller scale is decoded at that scale, then resized as before. For train, _jpegcrop
# (libjpeg-turbo's jpeg_skip_scanlines + jpeg_crop_scanline) decodes only the crop's rows and iMCU columns at that
# scale; where it is not built simplejpeg decodes the whole image. Files they refuse (PNG named .JPEG, CMYK, a missing
# simplejpeg) take load_image and torchvision's transforms: same distribution, full decode.

CROP_DECODE = {"region": 0, "scaled": 0, "fallback": 0}  # per process: images decoded by _jpegcrop for their crop's
# region / by simplejpeg (whole image) at their crop's scale / in full by load_image


# region / by simplejpeg (whole image) at their crop's scale / in full by load_image
SCALES: dict = {}  # per process: DCT scale denominator (1, 2, 4, 8) -> images decoded at it


DCT_SCALES = (8, 4, 2)


FAST_DCT = True  # libjpeg-turbo's fast IDCT (and, on simplejpeg's path, chroma upsampling): ~8% of a decode; pixels ~2
# levels off (docs/loader.md)


# levels off (docs/loader.md)
_SIMPLEJPEG: list = []


_JPEGCROP: list = []


def _simplejpeg():
    if not _SIMPLEJPEG:
        try:
            import simplejpeg
        except ImportError:  # not installed (a bare torch + torchvision environment): every file takes load_image
            simplejpeg = None
        _SIMPLEJPEG.append(simplejpeg)
    return _SIMPLEJPEG[0]


def read_file(path: str) -> bytes:
    """ImageFolder's loader: the file's bytes; the transform decodes them (knowing its crop, it decodes less)."""
    with open(path, "rb") as f:
        return f.read()


def jpeg_size(raw) -> tuple[int, int] | None:
    """(height, width) of a JPEG the scaled decode takes (YCbCr, RGB or grayscale); None for anything else (also
    for an image already decoded: the transforms then apply to it as they are)."""
    simplejpeg = _simplejpeg()
    if simplejpeg is None or not isinstance(raw, bytes):
        return None
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(raw)
    except ValueError:  # not a JPEG (the PNG named .JPEG), or a header libjpeg-turbo cannot read
        return None
    return (height, width) if colorspace in ("YCbCr", "RGB", "Gray") else None


def decode_scaled(raw: bytes, height: int, width: int, scale: int, bgr: bool = False):
    """H x W x 3 uint8 numpy array at 1/scale of the size (libjpeg-turbo's DCT-domain scaling), channels in B, G, R
    order with `bgr`; None when the data are broken (load_image then decides)."""
    import numpy as np

    try:
        image = _simplejpeg().decode_jpeg(raw, colorspace="BGR" if bgr else "RGB", fastdct=FAST_DCT,
                                          fastupsample=FAST_DCT, min_height=-(-height // scale),
                                          min_width=-(-width // scale))
    except ValueError:
        return None
    SCALES[scale] = SCALES.get(scale, 0) + 1
    CROP_DECODE["scaled"] += 1
    return np.asarray(image)


def _jpegcrop():
    if not _JPEGCROP:
        try:  # built next to this file (python -m doeks.workload.jpegcrop_build): as doeks.workload._jpegcrop or, when
            # train.py runs as a script (the container's command, SageMaker's entry point), as _jpegcrop
            import importlib

            module = importlib.import_module(f"{__package__}._jpegcrop" if __package__ else "_jpegcrop")
        except ImportError:  # not built (no compiler or libjpeg headers where doeks was installed): simplejpeg decodes
            module = None
        _JPEGCROP.append(module)
    return _JPEGCROP[0]


def scaled_box(height: int, width: int, scale: int, top: int, left: int, h: int, w: int) -> tuple[int, int, int, int]:
    """A box of the full image mapped onto libjpeg-turbo's 1/scale image (whose size is rounded up): (top, left, h, w)."""
    sh, sw = -(-height // scale), -(-width // scale)
    ys, xs = sh / height, sw / width
    y0, x0 = int(top * ys), int(left * xs)
    y1, x1 = max(y0 + 1, round((top + h) * ys)), max(x0 + 1, round((left + w) * xs))
    return y0, x0, min(y1, sh) - y0, min(x1, sw) - x0


def decode_box(raw: bytes, height: int, width: int, scale: int, top: int, left: int, h: int, w: int,
               bgr: bool = False):
    """The box (top, left, h, w) of a JPEG at 1/scale, as a contiguous uint8 h' x w' x 3 tensor (R, G, B; B, G, R
    with `bgr`, which resize_box's flip takes): decoded alone by _jpegcrop (only its rows and iMCU columns) where that
    module is built, else cut from simplejpeg's decode of the whole image (the same pixels, give or take
    libjpeg-turbo versions); None when the data are broken."""
    import numpy as np
    import torch

    y0, x0, bh, bw = scaled_box(height, width, scale, top, left, h, w)
    region = _jpegcrop()
    if region is not None:
        flag = getattr(region, "BGR", 0) if bgr else 0  # 0: a module built before the flag: RGB, reversed below
        try:
            pixels = region.decode_crop(raw, scale, y0, x0, bh, bw, (1 if FAST_DCT else 0) | flag)  # 1: fast IDCT
        except ValueError:
            pixels = None
        if pixels is not None:
            SCALES[scale] = SCALES.get(scale, 0) + 1
            CROP_DECODE["region"] += 1
            box = torch.frombuffer(pixels, dtype=torch.uint8).view(bh, bw, 3)
            return box.flip(-1) if bgr and not flag else box
    image = decode_scaled(raw, height, width, scale, bgr)
    if image is None:
        return None
    return torch.from_numpy(np.ascontiguousarray(image[y0:y0 + bh, x0:x0 + bw]))


def resize_box(box, size: int, flip: bool):
    """A contiguous h x w x 3 uint8 box -> 3 x size x size uint8 (channels-last memory), resized as torchvision's
    v2.functional.resize(box.permute(2, 0, 1), [size, size], antialias=True) does it (the same call of torch's
    bilinear antialiased uint8 kernel on the same channels-last view, without its ~20 us of Python per image) and,
    with `flip`, flipped left-right. For the flip the box comes in B, G, R order: the resized image's memory is H x W
    x 3, so reversing each row's bytes reverses the pixels and turns B, G, R into R, G, B in one vectorised pass
    (torch's flip of a last dimension; flipping the channels-last W dimension instead costs ~5x more). The kernel
    treats the channels alike, so the pixels are those of flip(resize(RGB box))."""
    import torch

    h, w, _ = box.shape
    if (h, w) != (size, size):  # torchvision hands an image of the output size back as it is
        # 1 x 3 x h x w, channels last, batch stride h * w * 3: the view torchvision restrides it to, so that torch
        # allocates the output channels last too (no re-packing)
        image = box.permute(2, 0, 1).unsqueeze(0).as_strided((1, 3, h, w), (h * w * 3, 1, w * 3, 3))
        box = torch.nn.functional.interpolate(image, size=[size, size], mode="bilinear", align_corners=False,
                                              antialias=True)[0].permute(1, 2, 0)
    if flip:
        box = box.reshape(size, size * 3).flip(-1).view(size, size, 3)
    return box.permute(2, 0, 1)


_LOG_RATIO: dict = {}


def crop_box(height: int, width: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a RandomResizedCrop: torchvision's v2.RandomResizedCrop.make_params (0.28), the same
    draws from torch's generator (so DataLoader workers' seeds apply), including the central-crop fallback."""
    import torch

    area = height * width
    log_ratio = _LOG_RATIO.get(ratio)
    if log_ratio is None:  # torchvision's float32 log of the ratios, as the Python floats uniform_ receives
        log_ratio = _LOG_RATIO.setdefault(ratio, tuple(torch.log(torch.tensor(ratio)).tolist()))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).exp_().item()  # float32 exp, as torch.exp
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = torch.randint(0, height - h + 1, size=(1,)).item()
            left = torch.randint(0, width - w + 1, size=(1,)).item()
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def dct_scale(box_height: int, box_width: int, size: int) -> int:
    """The largest libjpeg-turbo reduction (8, 4, 2, else 1) at which a box still has at least `size` pixels a side."""
    return next((s for s in DCT_SCALES if box_height // s >= size and box_width // s >= size), 1)


class TrainTransform:
    """RandomResizedCrop(crop) + horizontal flip, on a file's bytes, as uint8 3 x crop x crop."""

    def __init__(self, crop: int):
        from torchvision.transforms import v2

        self.crop = crop
        self.fallback = v2.Compose([v2.RandomResizedCrop(crop, antialias=True), v2.RandomHorizontalFlip()])

    def __call__(self, raw: bytes):
        import torch

        size = jpeg_size(raw)
        if size is not None:
            height, width = size
            top, left, h, w = crop_box(height, width)
            scale = dct_scale(h, w, self.crop)
            flip = torch.rand(1).item() < 0.5  # the flip's draw, right after the crop's (as torchvision's order)
            box = decode_box(raw, height, width, scale, top, left, h, w, bgr=flip)
            if box is not None:
                return resize_box(box, self.crop, flip)
        CROP_DECODE["fallback"] += 1
        return self.fallback(load_bytes(raw) if isinstance(raw, bytes) else raw)


class ValTransform:
    """Resize(resize) + CenterCrop(crop), on a file's bytes, decoded at the smallest scale whose short side is still
    at least `resize`."""

    def __init__(self, crop: int, resize: int):
        from torchvision.transforms import v2

        self.resize = resize
        self.transform = v2.Compose([v2.Resize(resize, antialias=True), v2.CenterCrop(crop)])

    def __call__(self, raw: bytes):
        import torch

        size = jpeg_size(raw)
        if size is not None:
            height, width = size
            image = decode_scaled(raw, height, width, dct_scale(height, width, self.resize))
            if image is not None:
                return self.transform(torch.from_numpy(image).permute(2, 0, 1))
        CROP_DECODE["fallback"] += 1
        return self.transform(load_bytes(raw) if isinstance(raw, bytes) else raw)


def train_transform(crop: int):
    return TrainTransform(crop)


def val_transform(crop: int, resize: int):
    return ValTransform(crop, resize)


def image_folder(root: Path, transform):
    from torchvision.datasets import ImageFolder

    return ImageFolder(str(root), transform=transform, loader=read_file)


def to_model_input(images, device, channels_last: bool):
    """uint8 N x 3 x H x W (as the loader sends it: 4x less to copy than float) -> normalised float on `device`."""
    import torch

    images = images.to(device, non_blocking=True).float()
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
    images = images.sub_(mean).div_(std)
    return images.contiguous(memory_format=torch.channels_last) if channels_last else images
