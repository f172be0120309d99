"""A small synthetic image data set in the ImageNet folder layout (train/<class>/*.JPEG, val/<class>/*.JPEG).

Each class is a texture (stripes of one orientation, a checkerboard, rings...) drawn with random colours, frequency,
phase and noise, so a CNN learns it in about a minute on a CPU while chance stays at 1/classes. Loaded by the real
torchvision ImageFolder code, exactly like ImageNet.
"""
from __future__ import annotations

import json
from pathlib import Path

PATTERNS = ("horizontal", "vertical", "diagonal", "checker", "rings", "antidiagonal", "dots", "plain")


def class_names(classes: int) -> list[str]:
    # ImageNet-like synset folder names, one per class
    return [f"n{index:08d}" for index in range(classes)]


def _pattern(kind: int, size: int, rng):
    import numpy as np

    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    freq = rng.uniform(3.0, 6.0)
    phase = rng.uniform(0, 2 * np.pi)
    name = PATTERNS[kind % len(PATTERNS)]
    if name == "horizontal":
        field = np.sin(2 * np.pi * freq * y + phase)
    elif name == "vertical":
        field = np.sin(2 * np.pi * freq * x + phase)
    elif name == "diagonal":
        field = np.sin(2 * np.pi * freq * (x + y) / 1.4 + phase)
    elif name == "checker":
        field = np.sign(np.sin(2 * np.pi * freq * x + phase)) * np.sign(np.sin(2 * np.pi * freq * y + phase))
    elif name == "rings":
        cx, cy = rng.uniform(0.3, 0.7, size=2)
        field = np.sin(2 * np.pi * freq * np.hypot(x - cx, y - cy) * 1.5 + phase)
    elif name == "antidiagonal":
        field = np.sin(2 * np.pi * freq * (x - y) / 1.4 + phase)
    elif name == "dots":
        field = np.sin(2 * np.pi * freq * x + phase) * np.sin(2 * np.pi * freq * y + phase)
    else:
        field = np.zeros_like(x)
    # classes beyond the base patterns differ by frequency band
    band = kind // len(PATTERNS)
    if band:
        field = np.sin(field * (2 + band))
    return field


def generate(root: Path, classes: int = 4, train_per_class: int = 200, val_per_class: int = 50, size: int = 32,
             seed: int = 0, progress=None) -> dict:
    """Write the data set under `root` (idempotent: an existing complete data set with the same spec is kept)."""
    import numpy as np
    from PIL import Image

    spec = {"classes": classes, "train_per_class": train_per_class, "val_per_class": val_per_class, "size": size, "seed": seed}
    marker = root / "dataset.json"
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == spec:
                return {**spec, "created": 0}
        except ValueError:
            pass
    rng = np.random.default_rng(seed)
    names = class_names(classes)
    total = classes * (train_per_class + val_per_class)
    created = 0
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for kind, name in enumerate(names):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                field = _pattern(kind, size, rng)
                fg, bg = rng.uniform(0, 255, size=3), rng.uniform(0, 255, size=3)
                mix = (field[..., None] + 1) / 2
                image = mix * fg + (1 - mix) * bg + rng.normal(0, 12, size=(size, size, 3))
                image = np.clip(image, 0, 255).astype(np.uint8)
                Image.fromarray(image).save(folder / f"{name}_{index:06d}.JPEG", quality=90)
                created += 1
                if progress:
                    progress(created, total)
    marker.write_text(json.dumps(spec))
    return {**spec, "created": created}
