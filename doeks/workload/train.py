"""Elastic, fault-tolerant image-classification training: one script for local torchrun, EKS and SageMaker.

DDP with a resumable sampler over an ImageFolder data set, a torchvision model chosen by --arch, gloo on CPU and nccl on
GPU. Every --checkpoint-every steps rank 0 writes a checkpoint atomically (temp file, fsync, rename); at start every
rank resumes from the latest one, whatever the new world size. Rank 0 writes metrics as CSV and TensorBoard events.

Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and SageMaker's (SM_CHANNEL_TRAINING, SM_MODEL_DIR,
SM_OUTPUT_DATA_DIR, SM_HOSTS, SM_CURRENT_HOST). Self-contained on purpose: it needs torch and torchvision only, so the
same file is the SageMaker entry point and the container command.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import socket
import sys
import time
from pathlib import Path

ARCHES = ("resnet18", "resnet34", "resnet50", "efficientnet_b0", "efficientnet_b7", "mobilenet_v3_small")


def parse_args(argv=None) -> argparse.Namespace:
    env = os.environ
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=env.get("SM_CHANNEL_TRAINING", "/fsx-shared/data"), help="folder with train/ and val/")
    p.add_argument("--arch", default="resnet18", help=f"torchvision model: {', '.join(ARCHES)}")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per process")
    p.add_argument("--image-size", type=int, default=0, help="resize to this side (0 = keep)")
    p.add_argument("--checkpoint-dir", default=env.get("SM_CHECKPOINT_DIR", "/opt/ml/checkpoints" if "SM_MODEL_DIR" in env else "/fsx-shared/checkpoints"))
    p.add_argument("--checkpoint-every", type=int, default=10, help="optimizer steps between checkpoints")
    p.add_argument("--metrics-dir", default=env.get("SM_OUTPUT_DATA_DIR", "/fsx-shared/metrics"))
    p.add_argument("--model-dir", default=env.get("SM_MODEL_DIR", ""), help="where the final model is saved")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0 = all epochs)")
    p.add_argument("--log-every", type=int, default=5, help="log (and record metrics) every N steps")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (tests: slow training down)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.arch not in ARCHES:
        p.error(f"unknown --arch {args.arch!r}: expected one of {', '.join(ARCHES)}")
    return args


def log(message: str) -> None:
    rank = os.environ.get("RANK", "0")
    now = time.time()
    print(f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now % 1 * 1000):03d} [rank {rank}] {message}", flush=True)


class ResumableSampler:
    """Shards a per-epoch permutation across ranks, skipping the first `start` samples (already trained on).

    The permutation depends only on (seed, epoch), so after a restart with another world size the remaining samples
    of the epoch are still each seen once.
    """

    def __init__(self, size: int, rank: int, world: int, seed: int, epoch: int, start: int, batch_size: int):
        import torch

        g = torch.Generator()
        g.manual_seed(seed + epoch)
        order = torch.randperm(size, generator=g).tolist()[start:]
        per_rank = len(order) // world  # drop the ragged tail so every rank takes the same number of steps
        per_rank -= per_rank % batch_size if per_rank >= batch_size else 0
        self.indices = order[rank:per_rank * world:world]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def atomic_save(obj, path: Path) -> None:
    import torch

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_checkpoint(directory: Path):
    import torch

    path = directory / "checkpoint.pt"
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


def build_model(arch: str, classes: int):
    import torchvision

    return torchvision.models.get_model(arch, weights=None, num_classes=classes)


def main(argv=None) -> int:
    log("process started")
    args = parse_args(argv)
    data = Path(args.data)
    for split in ("train", "val"):
        folder = data / split
        if not folder.is_dir() or not any(folder.iterdir()):
            log(f"error: data folder {folder} is missing or empty (make it with `invoke elasticjob.data`)")
            return 2

    import torch
    import torch.distributed as dist
    import torchvision.transforms as T
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torchvision.datasets import ImageFolder

    torch.manual_seed(args.seed)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    distributed = world > 1 or "MASTER_ADDR" in os.environ
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    host = os.environ.get("SM_CURRENT_HOST", socket.gethostname())
    log(f"start host={host} world_size={world} local_rank={local_rank} device={device} restart={os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")

    steps = [T.ToTensor(), T.Normalize([0.5] * 3, [0.25] * 3)]
    if args.image_size:
        steps.insert(0, T.Resize((args.image_size, args.image_size)))
    train_set = ImageFolder(str(data / "train"), T.Compose([T.RandomHorizontalFlip()] + steps))
    val_set = ImageFolder(str(data / "val"), T.Compose(steps))
    classes = len(train_set.classes)

    model = build_model(args.arch, classes).to(device)
    model = DDP(model, device_ids=[local_rank] if use_cuda else None) if distributed else model
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()

    ckpt_dir = Path(args.checkpoint_dir)
    metrics_dir = Path(args.metrics_dir)
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        metrics_dir.mkdir(parents=True, exist_ok=True)
    epoch, consumed, step = 0, 0, 0  # consumed: samples of `epoch` already trained on (all ranks together)
    checkpoint = load_checkpoint(ckpt_dir)
    if checkpoint is not None:
        (model.module if distributed else model).load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        epoch, consumed, step = checkpoint["epoch"], checkpoint["consumed"], checkpoint["step"]
        log(f"resumed from checkpoint step={step} epoch={epoch} consumed={consumed}")

    writer = _Metrics(metrics_dir) if rank == 0 else None
    total_steps_per_epoch = math.ceil(len(train_set) / (args.batch_size * world))
    done = False
    while epoch < args.epochs and not done:
        sampler = ResumableSampler(len(train_set), rank, world, args.seed, epoch, consumed, args.batch_size)
        loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=list(sampler),
                                             num_workers=args.workers, drop_last=True)
        model.train()
        window_start, window_samples = time.perf_counter(), 0
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            output = model(images)
            loss = loss_fn(output, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            consumed += args.batch_size * world
            window_samples += args.batch_size * world
            if args.step_delay:
                time.sleep(args.step_delay)
            if step % args.log_every == 0 or step == 1:
                elapsed = time.perf_counter() - window_start
                rate = window_samples / elapsed if elapsed > 0 else 0.0
                accuracy = (output.argmax(1) == labels).float().mean().item()
                log(f"step={step} epoch={epoch} loss={loss.item():.4f} acc={accuracy:.3f} samples/s={rate:.1f} world={world}")
                if writer:
                    writer.train(step, epoch, loss.item(), accuracy, rate, world)
                window_start, window_samples = time.perf_counter(), 0
            if step % args.checkpoint_every == 0 and rank == 0:
                save_checkpoint(model, optimizer, epoch, consumed, step, ckpt_dir, distributed)
            if args.max_steps and step >= args.max_steps:
                done = True
                break
        if not done:
            epoch, consumed = epoch + 1, 0
        accuracy = evaluate(model, val_set, rank, world, device, args.batch_size, distributed)
        log(f"epoch={epoch - (0 if done else 1)} val_acc={accuracy:.4f} step={step}")
        if writer:
            writer.evaluation(step, epoch, accuracy)
        if rank == 0:
            save_checkpoint(model, optimizer, epoch, consumed, step, ckpt_dir, distributed)

    if rank == 0:
        final = {"step": step, "epochs": args.epochs, "val_accuracy": accuracy, "arch": args.arch, "classes": train_set.classes}
        (metrics_dir / "final.json").write_text(json.dumps(final, indent=2))
        if args.model_dir:
            Path(args.model_dir).mkdir(parents=True, exist_ok=True)
            atomic_save((model.module if distributed else model).state_dict(), Path(args.model_dir) / "model.pt")
        log(f"done final_val_acc={accuracy:.4f} steps={step}")
    if writer:
        writer.close()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
        leave_now(0)
    return 0


def leave_now(code: int) -> None:
    """Exit without running destructors. torch's gloo process group can deadlock in its destructor: it joins its
    worker threads while holding the GIL, and one of them may still be waiting for the GIL to free the tensors of the
    last collective (seen with torch 2.13, with and without doeks' preloaded workers). Everything this script writes
    is closed (checkpoints fsynced) by the time it is called."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def save_checkpoint(model, optimizer, epoch, consumed, step, directory: Path, distributed: bool) -> None:
    state = {"model": (model.module if distributed else model).state_dict(), "optimizer": optimizer.state_dict(),
             "epoch": epoch, "consumed": consumed, "step": step, "time": time.time()}
    atomic_save(state, directory / "checkpoint.pt")


def evaluate(model, dataset, rank, world, device, batch_size, distributed) -> float:
    import torch
    import torch.distributed as dist

    indices = list(range(rank, len(dataset), world))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=indices)
    model.eval()
    correct = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for images, labels in loader:
            output = model(images.to(device))
            correct[0] += (output.argmax(1).cpu() == labels).sum().item()
            correct[1] += len(labels)
    if distributed:
        dist.all_reduce(correct)
    return (correct[0] / correct[1].clamp(min=1)).item()


class _Metrics:
    """Rank 0's metrics: metrics.csv (one row per logged step or evaluation) and TensorBoard events when available."""

    FIELDS = ["time", "kind", "step", "epoch", "loss", "accuracy", "samples_per_s", "world_size"]

    def __init__(self, directory: Path):
        self.path = directory / "metrics.csv"
        new = not self.path.exists()
        self.file = open(self.path, "a", newline="")
        self.csv = csv.DictWriter(self.file, fieldnames=self.FIELDS)
        if new:
            self.csv.writeheader()
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(directory / "tensorboard"))
        except Exception:  # noqa: BLE001 - tensorboard is optional
            self.tb = None

    def _row(self, **row) -> None:
        self.csv.writerow({"time": f"{time.time():.3f}", **row})
        self.file.flush()

    def train(self, step, epoch, loss, accuracy, rate, world) -> None:
        self._row(kind="train", step=step, epoch=epoch, loss=f"{loss:.5f}", accuracy=f"{accuracy:.4f}",
                  samples_per_s=f"{rate:.2f}", world_size=world)
        if self.tb:
            self.tb.add_scalar("train/loss", loss, step)
            self.tb.add_scalar("train/accuracy", accuracy, step)
            self.tb.add_scalar("train/samples_per_s", rate, step)

    def evaluation(self, step, epoch, accuracy) -> None:
        self._row(kind="val", step=step, epoch=epoch, loss="", accuracy=f"{accuracy:.4f}", samples_per_s="", world_size="")
        if self.tb:
            self.tb.add_scalar("val/accuracy", accuracy, step)

    def close(self) -> None:
        self.file.close()
        if self.tb:
            self.tb.close()


if __name__ == "__main__":
    sys.exit(main())
