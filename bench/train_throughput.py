"""Training input pipeline and GPU training throughput: doeks' train.py vs the seed's recipe, in one run, on the same
ImageNet-shaped JPEGs (doeks.workload.data textures at ImageNet's typical size: short side ~270-540 px, ~100 kB).

- CPU: data-loader images/s per core (one process, one thread, no loader workers: what each worker core delivers).
  Seed recipe = the choices of pytorch/examples imagenet/main.py: ImageFolder's PIL loader, RandomResizedCrop(224),
  RandomHorizontalFlip, ToTensor, Normalize. doeks = train.py's loader: the crop box first, then a JPEG decoded by
  simplejpeg at the smallest libjpeg-turbo DCT scale that keeps the box at least 224 a side (torchvision.io for what it
  refuses), transforms v2 on uint8, normalisation of the uint8 batch (on the GPU in training; here on the CPU, so it is
  counted). Target >= 2x (docs/loader.md).
- Checkpoint stall for ResNet-50 (model + SGD momentum): a blocking DCP save to a folder vs train.py's asynchronous one
  (doeks/workload/checkpoints.py: copy, then a background write); bench/checkpoint.py measures it in S3 and over steps.
- GPU (only where CUDA is available): ResNet-50 training images/s on one GPU, doeks (bf16 autocast, channels_last,
  uint8 loader with workers) vs baseline (fp32, PIL loader, same batch and workers). Targets >= 2.5x and >= 3,500/s on
  one H100. Without CUDA it prints a skip line.

Last line: `loader speedup vs seed recipe: N.NNx (<decode path>)`: `_jpegcrop region decode` where `invoke setup` built
the module (a C compiler and libjpeg-turbo's headers), else simplejpeg's whole-image decode, and says why.
Run: python bench/train_throughput.py [--images 96] [--rounds 7]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from doeks.workload import data, loader  # noqa: E402


def make_images(root: Path, count: int, classes: int = 4, start: int = 0) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(start)
    for index in range(start, start + count):
        folder = root / data.class_names(classes)[index % classes]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(data._image(index % classes, 360, rng)).save(folder / f"{folder.name}_{index}.JPEG", quality=90)


def seed_dataset(root: Path):
    import torchvision.transforms as T
    from torchvision.datasets import ImageFolder

    return ImageFolder(str(root), T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                                              T.Normalize(loader.MEAN, loader.STD)]))


def doeks_dataset(root: Path):
    return loader.image_folder(root, loader.train_transform(224))


def loader_rates(datasets: dict, rounds: int) -> dict:
    """Best of `rounds` passes per pipeline, images per CPU-second of this process with one thread and no loader
    workers: the loader's per-core rate. CPU time, not wall time, so other processes on a shared machine do not count
    (cache and memory-bandwidth contention still do); rounds alternate between the pipelines so that hits both alike."""
    import torch

    best = {name: float("inf") for name in datasets}
    for _ in range(rounds):
        for name, (dataset, normalise) in datasets.items():
            loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=0)
            start = time.process_time()
            for images, _labels in loader:
                if normalise:  # doeks normalises the uint8 batch on the GPU; on a CPU it is work, so it is counted
                    loader.to_model_input(images, torch.device("cpu"), channels_last=False)
            best[name] = min(best[name], time.process_time() - start)
    return {name: len(datasets[name][0]) / seconds for name, seconds in best.items()}


def checkpoint_stall(folder: Path) -> tuple[float, float]:
    import torch
    import torchvision
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from doeks.workload.checkpoints import Store

    model = torchvision.models.resnet50()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()  # momentum buffers exist, as in training
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    store = Store(str(folder / "ck"))
    start = time.perf_counter()
    store.save(state, 1, {"epoch": 0}, background=False)
    synchronous = time.perf_counter() - start
    stall = store.save(state, 2, {"epoch": 0})
    store.wait()
    return synchronous, stall


def gpu_rate(root: Path, fast: bool, steps: int, batch: int, workers: int) -> float:
    import torch
    import torchvision

    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50(num_classes=4).to(device)
    if fast:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    dataset = doeks_dataset(root) if fast else seed_dataset(root)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, drop_last=True,
                                         pin_memory=True, persistent_workers=workers > 0)
    done, start = 0, None
    while done < steps:
        for images, labels in loader:
            if done == 5:  # warm-up steps (cudnn autotune, loader start) are not timed
                torch.cuda.synchronize()
                start = time.perf_counter()
            if fast:
                images = loader.to_model_input(images, device, channels_last=True)
            else:
                images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=fast):
                loss = loss_fn(model(images).float(), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            done += 1
            if done >= steps:
                break
    torch.cuda.synchronize()
    return (steps - 5) * batch / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--gpu-steps", type=int, default=60)
    parser.add_argument("--gpu-batch", type=int, default=256)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "train"
        make_images(root, args.images)
        sizes = [p.stat().st_size for p in root.rglob("*.JPEG")]
        print(f"data: {len(sizes)} JPEGs, {sum(sizes) / len(sizes) / 1000:.0f} kB on average, ImageNet-sized textures")
        fast_decode = loader._fast_decoder() is not None
        print(f"torchvision.io decode available: {fast_decode}, simplejpeg scaled decode: {loader._simplejpeg() is not None}")
        rates = loader_rates({"seed": (seed_dataset(root), False), "doeks": (doeks_dataset(root), True)}, args.rounds)
        seed, ours = rates["seed"], rates["doeks"]
        path = decode_path()
        print(f"cpu loader, images per CPU-second (one core): seed recipe (PIL, ToTensor, Normalize) {seed:.1f}, doeks {ours:.1f}")
        print(f"decode path measured: {path} (train crops decoded: {loader.CROP_DECODE['region']} by _jpegcrop, "
              f"{loader.CROP_DECODE['scaled']} whole by simplejpeg, {loader.CROP_DECODE['fallback']} by torchvision.io/PIL)")

        synchronous, stall = checkpoint_stall(Path(tmp))
        print(f"checkpoint stall, ResNet-50 + momentum: synchronous write {synchronous * 1000:.0f} ms, "
              f"doeks (copy + background write) {stall * 1000:.0f} ms ({stall / synchronous:.2f}x)")

        if torch.cuda.is_available():
            import os

            workers = max(1, min(16, (len(os.sched_getaffinity(0)) - 1)))
            make_images(root, max(0, 4 * args.gpu_batch - args.images), start=args.images)
            torch.set_num_threads(4)
            base = gpu_rate(root, False, args.gpu_steps, args.gpu_batch, workers)
            fast = gpu_rate(root, True, args.gpu_steps, args.gpu_batch, workers)
            print(f"gpu {torch.cuda.get_device_name()}: ResNet-50 training images/s, batch {args.gpu_batch}, {workers} loader "
                  f"workers: baseline (fp32, PIL) {base:.0f}, doeks (bf16, channels_last, uint8 loader) {fast:.0f} "
                  f"({fast / base:.2f}x)")
        else:
            print("gpu: skipped: no CUDA device on this machine (ResNet-50 training images/s not measured)")
    print(f"loader speedup vs seed recipe: {ours / seed:.2f}x ({path})")
    return 0


def decode_path() -> str:
    """Which decode the doeks loader measured: what most of its train crops went through."""
    counts = loader.CROP_DECODE
    if counts["region"] and counts["region"] >= counts["scaled"] + counts["fallback"]:
        return "_jpegcrop region decode"
    if loader._jpegcrop() is None:
        return "simplejpeg whole-image decode: _jpegcrop not built (`invoke setup` builds it)"
    return "simplejpeg whole-image decode"


if __name__ == "__main__":
    sys.exit(main())
