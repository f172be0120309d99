"""The generated data set is shaped like the ImageNet download, and every kind of file real ImageNet holds loads
through the training script's fast path (torchvision.io), with PIL as the fallback.

Upstream evidence for the odd files: tensorflow/models research/inception/inception/data/build_imagenet_data.py
(`_is_png`: n02105855_2933.JPEG is a PNG; `_is_cmyk`: 22 CMYK JPEGs in train, list from
github.com/cytsai/ilsvrc-cmyk-image-list; FluxML/Metalhead.jl training/imagenet.jl adds ILSVRC2012_val_00019877.JPEG);
grayscale JPEGs are in both splits. Val layout: the Kaggle ILSVRC download's flat val/ with LOC_val_solution.csv
(ImageId,PredictionString = "<wnid> xmin ymin xmax ymax ...").
"""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from doeks.datastage import relayout_val
from doeks.workload import data
from doeks.workload import loader, train


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("imagenet") / "data"
    data.generate(root, classes=3, train_per_class=12, val_per_class=4, size=40)
    return root


def _mode(path: Path) -> tuple[str, str]:
    from PIL import Image

    with Image.open(path) as image:
        return image.format, image.mode


def test_generated_set_has_the_download_layout_and_odd_files(dataset):
    names = data.class_names(3)
    assert sorted(p.name for p in (dataset / "train").iterdir()) == names
    val = sorted((dataset / "val").iterdir())
    assert len(val) == 12 and all(p.is_file() and p.name.startswith("ILSVRC2012_val_") and p.suffix == ".JPEG" for p in val)
    with open(dataset / "LOC_val_solution.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["ImageId"] for r in rows} == {p.stem for p in val}
    assert all(r["PredictionString"].split()[0] in names and len(r["PredictionString"].split()) == 5 for r in rows)
    files = [p for p in (dataset / "train").rglob("*") if p.is_file()] + val
    assert all(p.suffix == ".JPEG" for p in files)  # every name says JPEG, as in ImageNet...
    kinds = {p.name: _mode(p) for p in files}
    assert kinds[f"{names[0]}_0.JPEG"] == ("PNG", "RGB")  # ...but one is a PNG (as n02105855_2933.JPEG)
    assert kinds[f"{names[0]}_1.JPEG"] == ("JPEG", "CMYK") and kinds[f"{names[1]}_1.JPEG"] == ("JPEG", "CMYK")
    assert kinds["ILSVRC2012_val_00000001.JPEG"] == ("JPEG", "CMYK")
    assert ("JPEG", "L") in kinds.values()
    sizes = set()
    for p in files:
        from PIL import Image

        with Image.open(p) as image:
            sizes.add(image.size)
    assert len(sizes) > len(files) // 2  # many sizes and aspect ratios, not one square size
    assert any(w > h for w, h in sizes) and any(h > w for w, h in sizes)


def test_relayout_val_puts_each_file_in_its_class_and_generation_is_idempotent(dataset, tmp_path):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(dataset, root)
    labels = {r["ImageId"]: r["PredictionString"].split()[0] for r in csv.DictReader(open(root / "LOC_val_solution.csv"))}
    assert relayout_val(root) == 12
    assert {p.stem: p.parent.name for p in (root / "val").rglob("*.JPEG")} == labels
    assert relayout_val(root) == 0  # already laid out
    assert data.generate(root, classes=3, train_per_class=12, val_per_class=4, size=40)["created"] == 0
    result = data.generate(root, classes=2, train_per_class=3, val_per_class=1, size=40)  # another spec: replaced
    assert result["created"] == 8 and len(list((root / "val").iterdir())) == 2


def test_every_file_decodes_on_the_fast_path_as_rgb_uint8(dataset):
    from PIL import Image

    loader.DECODE.update(fast=0, fallback=0)
    files = sorted(p for p in dataset.rglob("*.JPEG"))
    for path in files:
        image = loader.load_image(str(path))
        with Image.open(path) as reference:
            width, height = reference.size
            rgb = reference.convert("RGB")
        assert image.dtype.is_floating_point is False and tuple(image.shape) == (3, height, width), path
        if _mode(path)[1] != "CMYK":  # same pixels as PIL (CMYK->RGB conversions differ between libraries)
            import numpy as np

            expected = np.asarray(rgb).transpose(2, 0, 1).astype(int)
            assert np.abs(image.numpy().astype(int) - expected).mean() < 2.0, path
    assert loader.DECODE == {"fast": len(files), "fallback": 0}


def test_a_file_torchvision_refuses_falls_back_to_pil(tmp_path):
    import numpy as np
    from PIL import Image

    path = tmp_path / "n00000000_7.JPEG"  # a TIFF under a JPEG name: torchvision.io cannot decode it, PIL can
    Image.fromarray(np.full((20, 30, 3), 200, dtype=np.uint8)).save(path, format="TIFF")
    loader.DECODE.update(fast=0, fallback=0)
    image = loader.load_image(str(path))
    assert tuple(image.shape) == (3, 20, 30) and int(image[0, 0, 0]) == 200
    assert loader.DECODE == {"fast": 0, "fallback": 1}


def test_the_default_recipe_batches_images_of_any_size(dataset, tmp_path):
    """The defect: without a crop, ImageNet-shaped data crashed on the first batch (`stack expects each tensor to be
    equal size`). The recipe's train and val transforms give crop x crop uint8 images from every file."""
    import shutil

    import torch

    root = tmp_path / "data"
    shutil.copytree(dataset, root)
    relayout_val(root)
    for split, transform in (("train", loader.train_transform(24)), ("val", loader.val_transform(24, 27))):
        folder = loader.image_folder(root / split, transform)
        images, labels = next(iter(torch.utils.data.DataLoader(folder, batch_size=len(folder))))
        assert images.shape == (len(folder), 3, 24, 24) and images.dtype == torch.uint8
    normalised = loader.to_model_input(images, torch.device("cpu"), channels_last=False)
    assert normalised.dtype == torch.float32 and -3 < normalised.mean().item() < 3


def test_the_script_with_its_defaults_trains_on_imagenet_shaped_data(dataset, tmp_path, capsys):
    """The issue's crash: fed ImageNet-shaped data with no flag for the size, the script died on the first batch.
    With its defaults (224 crop) it trains a step, evaluates, and writes final.json."""
    import json
    import shutil

    root = tmp_path / "data"
    shutil.copytree(dataset, root)
    relayout_val(root)
    code = train.main(["--data", str(root), "--checkpoint-dir", str(tmp_path / "ck"), "--metrics-dir", str(tmp_path / "m"),
                       "--arch", "mobilenet_v3_small", "--batch-size", "4", "--workers", "0", "--max-steps", "1"])
    assert code == 0, capsys.readouterr().out[-2000:]
    assert json.loads((tmp_path / "m" / "final.json").read_text())["step"] == 1


def test_val_still_in_the_download_layout_is_one_error_line(dataset, tmp_path, capsys):
    code = train.main(["--data", str(dataset), "--checkpoint-dir", str(tmp_path / "ck"), "--metrics-dir", str(tmp_path / "m")])
    out = capsys.readouterr().out
    assert code == 2 and out.count("error:") == 1 and "--relayout-val" in out and "Traceback" not in out
