"""A small generated image data set shaped like the ImageNet download.

Layout as in ILSVRC2012 (the Kaggle/ImageNet download): `train/<wnid>/<wnid>_<n>.JPEG`, a flat `val/` of
`ILSVRC2012_val_<8 digits>.JPEG` plus `LOC_val_solution.csv` (ImageId,PredictionString; the label is the first word
of PredictionString), which `csi.data.stage --relayout-val` (doeks.datastage.relayout_val) turns into
`val/<wnid>/...` for ImageFolder.

Images have varied sizes and aspect ratios (like ImageNet's, scaled down around `size`), and the odd files the real
set holds (list: tensorflow/models research/inception/inception/data/build_imagenet_data.py `_is_png`/`_is_cmyk`,
from github.com/cytsai/ilsvrc-cmyk-image-list): one PNG named .JPEG in train (n02105855_2933.JPEG), 22 CMYK JPEGs in
train and one in val (ILSVRC2012_val_00019877.JPEG), and grayscale (1-channel) JPEGs in both. Here: the first train
image of class 0 is a PNG, the second train image of the first classes and the first val image are CMYK, every 10th
image is grayscale.

Each class is a texture (stripes of one orientation, a checkerboard, rings...) with random colours, period, phase and
noise; the period is in pixels relative to the short side, so a RandomResizedCrop keeps a few periods and a CNN learns
the classes in about a minute on a CPU, while chance stays at 1/classes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

LAYOUT = "imagenet-download-v3"
# horizontal flip maps each of these to itself (the diagonal class takes either direction), so flips keep labels
PATTERNS = ("horizontal", "vertical", "diagonal", "checker", "rings", "dots", "grid", "plain")
CMYK_FILES = 2  # train classes with a CMYK JPEG (as index 1)
GRAY_EVERY = 10


def class_names(classes: int) -> list[str]:
    # ImageNet-like WordNet-id folder names, one per class
    return [f"n{index:08d}" for index in range(classes)]


def val_name(number: int) -> str:
    return f"ILSVRC2012_val_{number:08d}"


def _shape(size: int, rng) -> tuple[int, int]:
    """(height, width): short side 0.75..1.5 x size, aspect ratio 3:5 .. 5:3 (ImageNet's are mostly 4:3 and 3:4)."""
    short = int(round(size * rng.uniform(0.75, 1.5)))
    ratio = rng.choice([1.0, 4 / 3, 4 / 3, 3 / 2, 5 / 3]) * rng.uniform(0.95, 1.05)
    long = int(round(short * ratio))
    return (short, long) if rng.random() < 0.7 else (long, short)


def _pattern(kind: int, height: int, width: int, rng):
    import numpy as np

    side = min(height, width)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32) / side
    freq = rng.uniform(5.0, 8.0)  # periods per short side: a small random crop still holds one or two
    phase = rng.uniform(0, 2 * np.pi)
    name = PATTERNS[kind % len(PATTERNS)]
    if name == "horizontal":
        field = np.sin(2 * np.pi * freq * y + phase)
    elif name == "vertical":
        field = np.sin(2 * np.pi * freq * x + phase)
    elif name == "diagonal":
        direction = 1.0 if rng.random() < 0.5 else -1.0
        field = np.sin(2 * np.pi * freq * (x + direction * y) / 1.4 + phase)
    elif name == "checker":
        field = np.sign(np.sin(2 * np.pi * freq * x + phase)) * np.sign(np.sin(2 * np.pi * freq * y + phase))
    elif name == "rings":
        cx, cy = rng.uniform(0.3, 0.7) * width / side, rng.uniform(0.3, 0.7) * height / side
        field = np.sin(2 * np.pi * freq * np.hypot(x - cx, y - cy) * 1.5 + phase)
    elif name == "dots":
        field = np.sin(2 * np.pi * freq * x + phase) * np.sin(2 * np.pi * freq * y + phase)
    elif name == "grid":
        field = np.maximum(np.abs(np.sin(np.pi * freq * x + phase)), np.abs(np.sin(np.pi * freq * y + phase))) * 2 - 1
    else:
        field = np.zeros_like(x)
    band = kind // len(PATTERNS)  # classes beyond the base patterns differ by frequency band
    if band:
        field = np.sin(field * (2 + band))
    return field


def _image(kind: int, size: int, rng):
    import numpy as np

    height, width = _shape(size, rng)
    field = _pattern(kind, height, width, rng)
    dark, light = rng.uniform(0, 100, size=3), rng.uniform(155, 255, size=3)  # random colours, always contrasting
    fg, bg = (dark, light) if rng.random() < 0.5 else (light, dark)
    mix = (field[..., None] + 1) / 2
    image = mix * fg + (1 - mix) * bg + rng.normal(0, 12, size=(height, width, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


def _write(array, path: Path, kind: str) -> None:
    """kind: rgb, gray, cmyk (JPEGs) or png (PNG bytes under a .JPEG name, as n02105855_2933.JPEG)."""
    from PIL import Image

    image = Image.fromarray(array)
    if kind == "png":
        image.save(path, format="PNG")
    elif kind == "gray":
        image.convert("L").save(path, format="JPEG", quality=90)
    elif kind == "cmyk":
        image.convert("CMYK").save(path, format="JPEG", quality=90)
    else:
        image.save(path, format="JPEG", quality=90)


def train_kind(class_index: int, index: int) -> str:
    if class_index == 0 and index == 0:
        return "png"
    if index == 1 and class_index < CMYK_FILES:
        return "cmyk"
    return "gray" if index % GRAY_EVERY == GRAY_EVERY - 1 else "rgb"


def val_kind(number: int) -> str:
    if number == 1:
        return "cmyk"
    return "gray" if number % GRAY_EVERY == 0 else "rgb"


def generate(root: Path, classes: int = 4, train_per_class: int = 200, val_per_class: int = 50, size: int = 48,
             seed: int = 0, progress=None) -> dict:
    """Write the data set under `root` in the download's layout (flat val/ + LOC_val_solution.csv).

    Idempotent: an existing complete data set with the same spec is kept (also once its val/ has been re-laid out);
    a generated set with another spec is removed first (only train/, val/ and the CSV this generator wrote)."""
    import numpy as np

    spec = {"classes": classes, "train_per_class": train_per_class, "val_per_class": val_per_class, "size": size,
            "seed": seed, "layout": LAYOUT}
    marker = root / "dataset.json"
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == spec:
                return {**spec, "created": 0}
        except ValueError:
            pass
        marker.unlink()
        for old in ("train", "val"):
            shutil.rmtree(root / old, ignore_errors=True)
        (root / "LOC_val_solution.csv").unlink(missing_ok=True)
    rng = np.random.default_rng(seed)
    names = class_names(classes)
    total = classes * (train_per_class + val_per_class)
    created = 0

    def tick():
        nonlocal created
        created += 1
        if progress:
            progress(created, total)

    for kind, name in enumerate(names):
        folder = root / "train" / name
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(train_per_class):
            _write(_image(kind, size, rng), folder / f"{name}_{index}.JPEG", train_kind(kind, index))
            tick()
    val = root / "val"
    val.mkdir(parents=True, exist_ok=True)
    labels = [kind for kind in range(classes) for _ in range(val_per_class)]
    rng.shuffle(labels)  # the download's val/ is one folder in no class order
    rows = ["ImageId,PredictionString"]
    for number, kind in enumerate(labels, start=1):
        array = _image(kind, size, rng)
        _write(array, val / f"{val_name(number)}.JPEG", val_kind(number))
        height, width = array.shape[:2]
        box = f"{rng.integers(0, width // 4)} {rng.integers(0, height // 4)} {width - 1} {height - 1}"
        rows.append(f"{val_name(number)},{names[kind]} {box} ")  # as the real file: label and box, trailing space
        tick()
    (root / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    marker.write_text(json.dumps(spec))
    return {**spec, "created": created}
