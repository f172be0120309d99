"""Elastic, fault-tolerant image-classification training: one script for local torchrun, EKS and SageMaker.

DDP over an ImageNet-layout folder with the standard recipe by default: train RandomResizedCrop + flip, val Resize +
CenterCrop, ImageNet mean/std, SGD (nesterov) with the LR scaled to the global batch, warmup then cosine decay,
label smoothing, top-1/top-5. Data: the crop is chosen first and a JPEG decoded at the smallest libjpeg-turbo DCT
scale that keeps it at least the output size, for train only the crop's rows and columns (_jpegcrop, built from
_jpegcrop.c against libjpeg-turbo where a compiler is; simplejpeg; torchvision.io and PIL for the rest: docs/loader.md),
transforms v2 on uint8 tensors in DataLoader workers; on GPU bf16 autocast and channels_last (optional torch.compile).
Each logged step says how long it waited for data.

Checkpoints (checkpoints.py: PyTorch Distributed Checkpoint in a folder or under s3://): every --checkpoint-every
steps, every epoch and at the end every rank saves its part of step-N/ asynchronously (the step stalls only for the
copy to CPU memory); `latest` moves once step-N/.metadata exists, and a SIGTERM waits for a save in flight. At start
every rank resumes from the newest complete one, whatever the new world size; a finished job deployed again reports
its recorded result at once; an unusable checkpoint is one error line. Rank 0 writes metrics as CSV and TensorBoard
events, and the final model to --model-dir (a folder or s3://).

Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK) and SageMaker's (SM_CHANNEL_TRAINING, SM_MODEL_DIR,
SM_OUTPUT_DATA_DIR, SM_HOSTS, SM_CURRENT_HOST). Self-contained on purpose: it needs torch and torchvision only (and
checkpoints.py and loader.py next to it; s3fs or s3torchconnector for checkpoints in S3), so the same file is the SageMaker entry
point and the container command (loader.py, the data's decode and transforms, next to it; simplejpeg and
the _jpegcrop module, in the training image, only speed the loader up: without _jpegcrop simplejpeg decodes whole images, without simplejpeg every
file takes the torchvision.io path).
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

try:
    from .loader import image_folder, to_model_input, train_transform, val_transform
except ImportError:  # run as a script (the container's command, SageMaker's entry point): loader.py beside it
    from loader import image_folder, to_model_input, train_transform, val_transform

ARCHES = ("resnet18", "resnet34", "resnet50", "efficientnet_b0", "efficientnet_b7", "mobilenet_v3_small")


def _workers(raw: str) -> int:
    """'auto' = what the machine has: its CPUs over the processes on this node, one left for the trainer, at most 16."""
    if raw == "auto":
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(0, min(16, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) - 1))
    if not raw.isdigit():
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number, got {raw!r}")
    return int(raw)


def build_parser() -> argparse.ArgumentParser:
    """The script's arguments (doeks also parses --train-args with it before a job starts)."""
    env = os.environ
    p = argparse.ArgumentParser(prog="train.py", description=__doc__.splitlines()[0])
    p.add_argument("--data", default=env.get("SM_CHANNEL_TRAINING", "/fsx-shared/data"), help="folder with train/ and val/")
    p.add_argument("--arch", default="resnet18", help=f"torchvision model: {', '.join(ARCHES)}")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate for a global batch of 256 (scaled linearly)")
    p.add_argument("--warmup-epochs", type=float, default=-1.0, help="linear warmup (-1 = min(5, epochs / 10))")
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--crop-size", type=int, default=224, help="train RandomResizedCrop / val CenterCrop side")
    p.add_argument("--val-resize", type=int, default=0, help="val Resize of the short side (0 = crop * 256 / 224)")
    p.add_argument("--workers", type=_workers, default="auto", help="DataLoader workers per process ('auto' = the machine's CPUs)")
    p.add_argument("--amp", choices=("auto", "bf16", "off"), default="auto", help="autocast (auto = bf16 on GPU, off on CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--checkpoint-dir", default=env.get("DOEKS_CHECKPOINT_URI") or env.get("SM_CHECKPOINT_DIR", "/opt/ml/checkpoints" if "SM_MODEL_DIR" in env else "/fsx-shared/checkpoints"),
                   help="a folder or s3://bucket/prefix: step-N/ (DCP) per checkpoint and `latest`")
    p.add_argument("--checkpoint-every", type=int, default=10, help="optimizer steps between checkpoints")
    p.add_argument("--checkpoint-when-busy", choices=("wait", "skip"), default="wait",
                   help="a periodic checkpoint due while the last is still being written: wait for it, or skip this one")
    p.add_argument("--keep-checkpoints", type=int, default=int(env.get("DOEKS_KEEP_CHECKPOINTS", "3") or 3),
                   help="complete checkpoints kept (older ones are removed)")
    p.add_argument("--term-grace", type=float, default=25.0,
                   help="on SIGTERM, seconds to wait for a checkpoint being written before leaving")
    p.add_argument("--metrics-dir", default=env.get("SM_OUTPUT_DATA_DIR", "/fsx-shared/metrics"))
    p.add_argument("--model-dir", default=env.get("DOEKS_MODEL_URI") or env.get("SM_MODEL_DIR", ""),
                   help="where the final model is saved (a folder or s3://bucket/prefix)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many optimizer steps (0 = all epochs)")
    p.add_argument("--log-every", type=int, default=5, help="log (and record metrics) every N steps")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (tests: slow training down)")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv=None, p: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    p = p or build_parser()
    args = p.parse_args(argv)
    if args.arch not in ARCHES:
        p.error(f"unknown --arch {args.arch!r}: expected one of {', '.join(ARCHES)}")
    if args.warmup_epochs < 0:
        args.warmup_epochs = min(5.0, args.epochs / 10)
    if not args.val_resize:
        args.val_resize = round(args.crop_size * 256 / 224)
    return args


class Heartbeat:
    """This rank's progress for its node's watchdog (doeks.pod.watchdog, in the agent that started it): its last step and
    when, written to DOEKS_PROGRESS_DIR/<rank> at most once a second; and its stacks on SIGUSR1 (faulthandler), which
    the watchdog asks for when the rank made no progress. Nothing without DOEKS_PROGRESS_DIR (plain torchrun)."""

    def __init__(self):
        self.folder = os.environ.get("DOEKS_PROGRESS_DIR", "")
        self.last = 0.0
        self.step = 0
        if self.folder:
            import faulthandler
            import signal

            faulthandler.register(signal.SIGUSR1, all_threads=True)

    def __call__(self, step: int | None = None, force: bool = False) -> None:
        """A step done (or, without one, still working on the last: a validation batch)."""
        now = time.time()
        self.step = self.step if step is None else step
        if not self.folder or (not force and now - self.last < 1.0):
            return
        self.last = now
        step = self.step
        path = os.path.join(self.folder, os.environ.get("RANK", "0"))
        try:
            with open(path + ".tmp", "w") as f:
                f.write(f"{step} {now:.3f}\n")
            os.replace(path + ".tmp", path)
        except OSError:
            pass


BEAT = Heartbeat()


def log(message: str) -> None:
    rank = os.environ.get("RANK", "0")
    now = time.time()
    # one write of the whole line: print() writes the text and the newline separately, and with PYTHONUNBUFFERED
    # two ranks sharing a node's log interleaved them ("process started16:22:49.658 [rank 0] ...", an empty line)
    sys.stdout.write(f"{time.strftime('%H:%M:%S', time.localtime(now))}.{int(now % 1 * 1000):03d} [rank {rank}] {message}\n")
    sys.stdout.flush()


class ResumableSampler:
    """Shards a per-epoch permutation across ranks, skipping the first `start` samples (already trained on).

    The permutation depends only on (seed, epoch), so after a restart with another world size the remaining samples
    of the epoch are still each seen once. `set_epoch` re-targets it, so one DataLoader (persistent workers) serves
    every epoch.
    """

    def __init__(self, size: int, rank: int, world: int, seed: int, epoch: int, start: int, batch_size: int):
        self.size, self.rank, self.world, self.seed, self.batch_size = size, rank, world, seed, batch_size
        self.set_epoch(epoch, start)

    def set_epoch(self, epoch: int, start: int) -> None:
        import torch

        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        order = torch.randperm(self.size, generator=g).tolist()[start:]
        per_rank = len(order) // self.world  # drop the ragged tail so every rank takes the same number of steps
        per_rank -= per_rank % self.batch_size if per_rank >= self.batch_size else 0
        self.indices = order[self.rank:per_rank * self.world:self.world]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self):
        return len(self.indices)


def learning_rate(base_lr: float, global_batch: int, progress: float, epochs: int, warmup: float) -> float:
    """Linear scaling with the global batch (Goyal et al. 2017: lr = base * batch / 256), linear warmup, then cosine
    decay to 0 at `epochs`. `progress` is in epochs (fractional), so the schedule is the same whatever the world size
    and a resized job continues it with the peak of its new global batch."""
    peak = base_lr * global_batch / 256
    if warmup > 0 and progress < warmup:
        return peak * progress / warmup
    span = max(1e-9, epochs - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / span)))


# --- checkpoints: PyTorch Distributed Checkpoint in a folder or S3 (checkpoints.py, next to this file) -----------------

def checkpoints_module():
    """checkpoints.py next to this file: as doeks.workload.checkpoints, or as `checkpoints` when train.py runs as a
    script (the container's command, SageMaker's entry point)."""
    import importlib

    return importlib.import_module(f"{__package__}.checkpoints" if __package__ else "checkpoints")


_MISMATCH = ("Missing key", "Size mismatch", "Unexpected key", "size mismatch", "shape")


def _first_line(error: BaseException) -> str:
    text = str(error)
    for marker in _MISMATCH:  # DCP wraps every rank's error: the line that says what does not fit
        if marker in text:
            return next(line.strip() for line in text.splitlines() if marker in line)[:160]
    return (text.strip().splitlines() or [type(error).__name__])[0][:160]


# --- training -----------------------------------------------------------------------------------------------------------

def build_model(arch: str, classes: int):
    import torchvision

    return torchvision.models.get_model(arch, weights=None, num_classes=classes)


def write_final(metrics_dir: Path, result: dict) -> None:
    metrics_dir.mkdir(parents=True, exist_ok=True)
    (metrics_dir / "final.json").write_text(json.dumps(result, indent=2))


def main(argv=None) -> int:
    log("process started")
    args = parse_args(argv)
    data = Path(args.data)
    for split in ("train", "val"):
        folder = data / split
        if not folder.is_dir() or not any(folder.iterdir()):
            log(f"error: data folder {folder} is missing or empty (make it with `invoke elasticjob.data`)")
            return 2
    if any(p.is_file() for p in (data / "val").iterdir()):
        log(f"error: {data / 'val'} holds files, not class folders: re-lay it out with `invoke csi.data.stage --relayout-val` "
            "(LOC_val_solution.csv)")
        return 2

    import torch

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    metrics_dir = Path(args.metrics_dir)
    ck = checkpoints_module()

    def same_model(name, meta):
        if meta.get("arch", args.arch) != args.arch:
            raise ck.CheckpointError(f"checkpoint {store.at.join(name)} is of a {meta['arch']}, this job "
                                     f"trains a {args.arch}: use another checkpoint folder or move it away")

    try:
        store = ck.Store(args.checkpoint_dir, keep=args.keep_checkpoints, log=log)
        found = store.newest(same_model)  # (name, meta) of the newest complete checkpoint whose meta reads
    except ck.CheckpointError as error:
        log(f"error: {error}")
        return 2
    checkpoint = found[1] if found else None
    if checkpoint is not None and "result" in checkpoint and _nothing_left(args, checkpoint):
        # deployed again after it finished: the recorded result, at once, no process group, no tensors, no data
        if rank == 0:
            write_final(metrics_dir, checkpoint["result"])
        log(f"training already finished at step={checkpoint['step']} epoch={checkpoint['epoch']}: "
            f"val_acc={checkpoint['result']['val_accuracy']:.4f} (recorded in {store.at.join(found[0])})")
        return 0

    if found:  # its download goes on while the process group, the data and the model are made
        store.prefetch(found[0])
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(args.seed + rank)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    amp = args.amp == "bf16" or (args.amp == "auto" and use_cuda)
    distributed = world > 1 or "MASTER_ADDR" in os.environ
    if distributed:
        # device_id binds NCCL to this rank's GPU: barrier() needs no guess (torch warns at every barrier without it)
        if use_cuda:
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    host = os.environ.get("SM_CURRENT_HOST", socket.gethostname())
    log(f"start host={host} world_size={world} local_rank={local_rank} device={device} workers={args.workers} "
        f"crop={args.crop_size} amp={'bf16' if amp else 'off'} restart={os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")

    train_set = image_folder(data / "train", train_transform(args.crop_size))
    val_set = image_folder(data / "val", val_transform(args.crop_size, args.val_resize))
    classes = len(train_set.classes)

    raw_model = build_model(args.arch, classes).to(device)
    if use_cuda:
        raw_model = raw_model.to(memory_format=torch.channels_last)
    decay, no_decay = [], []
    for name, param in raw_model.named_parameters():
        (no_decay if param.ndim <= 1 else decay).append(param)  # no weight decay on BN and biases
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=args.lr, momentum=0.9, nesterov=True)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    while checkpoint is not None:  # every rank reads the whole state (DDP's replicated tensors: any world size)
        resumed = found[0]
        model_state, optim_state = get_state_dict(raw_model, optimizer)
        loaded = {"model": model_state, "optimizer": optim_state}
        try:
            store.load(loaded, resumed)
        except ck.errors() as error:  # noqa: BLE001 - DCP raises the same CheckpointException on every rank
            where = store.at.join(resumed)
            if any(marker in str(error) for marker in _MISMATCH):
                log(f"error: checkpoint {where} does not fit this model ({_first_line(error)}): "
                    "use another checkpoint folder or move it away")
                return _leave(distributed, 2)
            earlier = [n for n in store.complete() if ck.order(n) < ck.order(resumed)]
            if not earlier:
                log(f"error: checkpoint {where} is partial or corrupt and there is no earlier one ({_first_line(error)}): "
                    f"move {store.uri} away to start from scratch")
                return _leave(distributed, 2)
            log(f"warning: checkpoint {where} ({_first_line(error)}) is partial or corrupt: resuming from "
                f"{earlier[-1]} instead")
            try:
                found = (earlier[-1], store.read_meta(earlier[-1]))
            except ck.errors() as again:  # noqa: BLE001 - that one is damaged too
                log(f"error: checkpoint {store.at.join(earlier[-1])} is partial or corrupt too ({_first_line(again)}): "
                    f"move {store.uri} away to start from scratch")
                return _leave(distributed, 2)
            checkpoint = found[1]
            continue
        set_state_dict(raw_model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
        break
    if rank == 0:  # nothing after the checkpoint resumed from (a save that died, an unusable one): no prefix is reused
        removed = store.clear_after(found[0] if found else None)
        if removed:
            log(f"removed {', '.join(sorted(removed))} from {store.uri}: incomplete or unusable")
    model = DDP(raw_model, device_ids=[local_rank] if use_cuda else None) if distributed else raw_model
    if args.compile:
        model = torch.compile(model)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    if rank == 0:
        metrics_dir.mkdir(parents=True, exist_ok=True)
    epoch, consumed, step = 0, 0, 0  # consumed: samples of `epoch` already trained on (all ranks together)
    # productive step time: the seconds spent on the steps this state holds (a checkpoint carries it, so steps done
    # again after a restart count once): goodput = productive / the run's wall time (docs/benchmarks.md)
    productive = 0.0
    if checkpoint is not None:
        epoch, consumed, step = checkpoint["epoch"], checkpoint["consumed"], checkpoint["step"]
        productive = float(checkpoint.get("productive", 0.0))
        was = checkpoint.get("world", world)
        log(f"resumed from checkpoint step={step} epoch={epoch} consumed={consumed}"
            + (f" (written by world size {was}, now {world})" if was != world else ""))
        if consumed >= len(train_set):  # written at the very end of an epoch's samples (the ragged tail is dropped)
            epoch, consumed = epoch + 1, 0

    writer = _Metrics(metrics_dir) if rank == 0 else None
    term = _TermGuard(store, args.term_grace)
    global_batch = args.batch_size * world
    workers = args.workers
    loader_options = dict(num_workers=workers, pin_memory=use_cuda, persistent_workers=workers > 0,
                          prefetch_factor=4 if workers else None)
    sampler = ResumableSampler(len(train_set), rank, world, args.seed, epoch, consumed, args.batch_size)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True, **loader_options)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=args.batch_size, sampler=list(range(rank, len(val_set), world)),
                                             **loader_options)

    last_saved = [None]

    def state_and_meta() -> tuple[dict, dict]:
        """What a checkpoint holds at this step: the model and optimizer (DCP's state dicts), and its meta."""
        model_state, optim_state = get_state_dict(raw_model, optimizer)
        return {"model": model_state, "optimizer": optim_state}, {
            "epoch": epoch, "consumed": consumed, "step": step, "world": world, "arch": args.arch,
            "classes": train_set.classes, "time": time.time(), "productive": productive}

    def checkpoint_now(result=None, background=True, periodic=False):
        """Every rank, at the same step: step-N/ with DCP (asynchronously), `latest` moved by rank 0 once complete. With
        --checkpoint-when-busy skip, a periodic one due while the last is still being written is passed over (training
        does not wait for storage; the next due one is taken), said in the log the first time; else it waits."""
        if periodic and background and args.checkpoint_when_busy == "skip" and store.pass_if_busy():  # every rank agrees
            if rank == 0 and store.skipped == 1:
                log(f"checkpoint step={step} skipped: {store.in_flight or 'the last one'} is still being written "
                    f"(CHECKPOINT_EVERY={args.checkpoint_every} steps is shorter than a save here; CHECKPOINT_WHEN_BUSY="
                    f"skip: training goes on, the next due checkpoint is taken)")
            return
        state, meta = state_and_meta()
        if result is not None:
            meta["result"] = result
        stall = store.save(state, step, meta, background=background)
        last_saved[0] = step
        if background:
            term.guard()
        if rank == 0:
            log(f"checkpoint step={step} stall={stall * 1000:.1f}ms")

    def save_alone(error) -> None:
        """The job lost a peer (or anything else raised between steps): the model and optimizer this replica holds are
        those of `step` on every replica (DistributedDataParallel), so one survivor saves them by itself and the
        restart resumes here, not at the last periodic checkpoint (Store.save_alone). Never fails the exit it is on."""
        try:
            state, meta = state_and_meta()
            started = time.perf_counter()
            name = store.save_alone(state, step, meta)
            if name:
                log(f"checkpoint step={step} saved by this rank alone in {time.perf_counter() - started:.1f}s after "
                    f"{type(error).__name__}: the restart resumes from it")
        except BaseException as failed:  # noqa: BLE001 - the error being raised is the one to report
            log(f"warning: no checkpoint of step {step} after {type(error).__name__} ({_first_line(failed)})")

    done = bool(args.max_steps and step >= args.max_steps)
    accuracy = top5 = None
    beat = BEAT
    beat.step = step
    updating = False  # an optimizer step half applied: the state is not that of any step (see save_alone below)
    try:
        while epoch < args.epochs and not done:
            sampler.set_epoch(epoch, consumed)
            model.train()
            window_start, window_samples, window_wait, window_steps = time.perf_counter(), 0, 0.0, 0
            ready = step_began = time.perf_counter()
            last_batch = len(loader) - 1
            for batch, (images, labels) in enumerate(loader):
                window_wait += time.perf_counter() - ready
                lr = learning_rate(args.lr, global_batch, epoch + (consumed + global_batch) / len(train_set), args.epochs,
                                   args.warmup_epochs)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                images = to_model_input(images, device, use_cuda)
                labels = labels.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                    output = model(images)
                loss = loss_fn(output.float(), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                updating = True
                optimizer.step()
                step += 1
                consumed += global_batch
                updating = False
                term.release_when_saved()
                window_samples += global_batch
                window_steps += 1
                if args.step_delay:
                    time.sleep(args.step_delay)
                productive += time.perf_counter() - step_began
                beat(step, force=step % args.log_every == 0 or step == 1)
                if step % args.log_every == 0 or step == 1:
                    elapsed = time.perf_counter() - window_start
                    rate = window_samples / elapsed if elapsed > 0 else 0.0
                    accuracy_now = (output.argmax(1) == labels).float().mean().item()
                    wait = window_wait / window_steps
                    log(f"step={step} epoch={epoch} loss={loss.item():.4f} acc={accuracy_now:.3f} samples/s={rate:.1f} world={world} "
                        f"data_wait={wait:.4f}s ({100 * window_wait / elapsed if elapsed > 0 else 0:.0f}%) lr={lr:.5f} "
                        f"productive={productive:.1f}s")
                    if writer:
                        writer.train(step, epoch, loss.item(), accuracy_now, rate, world, wait)
                    window_start, window_samples, window_wait, window_steps = time.perf_counter(), 0, 0.0, 0
                if args.max_steps and step >= args.max_steps:
                    done = True
                if step % args.checkpoint_every == 0 and not done and not (batch == last_batch and epoch == args.epochs - 1):
                    checkpoint_now(periodic=True)  # (at the very end the final checkpoint, with the result, is the one)
                if done:
                    break
                ready = step_began = time.perf_counter()
            if not done:
                epoch, consumed = epoch + 1, 0
            accuracy, top5 = evaluate(raw_model, val_loader, device, distributed, amp, use_cuda)
            log(f"epoch={epoch - (0 if done else 1)} val_acc={accuracy:.4f} val_top5={top5:.4f} step={step}")
            if writer:
                writer.evaluation(step, epoch, accuracy)
            if epoch < args.epochs and not done and last_saved[0] != step:  # (a periodic one at this step resumes the same)
                checkpoint_now()
    except Exception as error:
        if distributed and not updating and not isinstance(error, ck.CheckpointError):
            save_alone(error)
        raise
    if accuracy is None:  # a checkpoint with nothing left to train but no recorded result: evaluate it
        accuracy, top5 = evaluate(raw_model, val_loader, device, distributed, amp, use_cuda)
    result = {"step": step, "epochs": args.epochs, "val_accuracy": accuracy, "val_top5": top5, "arch": args.arch,
              "classes": train_set.classes, "crop_size": args.crop_size, "productive_s": round(productive, 1)}
    checkpoint_now(result, background=False)  # the final state, with the result a later deploy reports at once
    if rank == 0:
        write_final(metrics_dir, result)
        if args.model_dir:
            where = ck.save_file(args.model_dir, "model.pt", raw_model.state_dict())
            log(f"model saved to {where}")
        stalls = sorted(store.stalls)
        log(f"done final_val_acc={accuracy:.4f} val_top5={top5:.4f} steps={step} "
            f"checkpoint_stall_max={stalls[-1] * 1000 if stalls else 0:.1f}ms checkpoints_skipped={store.skipped} "
            f"productive={productive:.1f}s")
    if writer:
        writer.close()
    term.release()
    for each in (loader, val_loader):  # persistent loader workers: stopped now, not left to notice the exit
        iterator = getattr(each, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
    return _leave(distributed, 0)


def _on_sigterm(store, grace: float):
    """SIGTERM (a pod evicted, a node drained, a spot interruption; torchrun passes it on) while a checkpoint is being
    written: the save gets up to `grace` seconds to finish, which moves `latest` to it; otherwise `latest` stays where
    it was (it is written last). Then the process leaves with 143, as a SIGTERM'd one would. Returns the handler it
    replaced (None off the main thread)."""
    import signal

    def leave(signum, frame):
        pending = store.in_flight
        if pending is not None:
            log(f"SIGTERM: waiting up to {grace:g}s for checkpoint {pending}")
            try:
                finished = store.wait(timeout=grace)
            except BaseException as error:  # noqa: BLE001 - the save failed: latest stays at the previous one
                finished = False
                log(f"SIGTERM: checkpoint {pending} failed ({_first_line(error)}): latest is unchanged")
            else:
                log(f"SIGTERM: checkpoint {pending} " + ("complete" if finished else "not finished: latest is unchanged"))
        leave_now(128 + signal.SIGTERM)

    return signal.signal(signal.SIGTERM, leave) if threading_main() else None


class _TermGuard:
    """The SIGTERM handler above, only while a save is in flight. A Python handler runs between bytecodes of the main
    thread, so a process blocked in a collective would not die on SIGTERM while it is installed: outside saves
    SIGTERM keeps its default (the process ends at once)."""

    def __init__(self, store, grace: float):
        self.store, self.grace, self.previous, self.active = store, grace, None, False

    def guard(self) -> None:
        if not self.active:
            self.previous = _on_sigterm(self.store, self.grace)
            self.active = self.previous is not None

    def release_when_saved(self) -> None:
        if self.active and self.store.in_flight is None:
            self.release()

    def release(self) -> None:
        if self.active:
            import signal

            signal.signal(signal.SIGTERM, self.previous)
            self.active = False


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _nothing_left(args, checkpoint) -> bool:
    return checkpoint["epoch"] >= args.epochs or bool(args.max_steps and checkpoint["step"] >= args.max_steps)


def _leave(distributed: bool, code: int) -> int:
    if distributed:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
        leave_now(code)
    return code


def leave_now(code: int) -> None:
    """Exit without running destructors. torch's gloo process group can deadlock in its destructor: it joins its
    worker threads while holding the GIL, and one of them may still be waiting for the GIL to free the tensors of the
    last collective (seen with torch 2.13, with and without doeks' preloaded workers). Everything this script writes
    is closed (checkpoints fsynced) by the time it is called."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def evaluate(model, loader, device, distributed, amp, channels_last) -> tuple[float, float]:
    """Top-1 and top-5 accuracy over the whole val set (each rank takes every world-th image). `model` is the model
    itself, not its DDP wrapper: DDP's forward broadcasts the buffers, a collective per batch, and ranks with fewer
    val batches than others (6 ranks, 4 val images) left the rest waiting in it for ever; the counts are the one
    collective."""
    import torch
    import torch.distributed as dist

    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # top-1 right, top-5 right, images
    with torch.no_grad():
        for images, labels in loader:
            images, labels = to_model_input(images, device, channels_last), labels.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                output = model(images)
            top = output.topk(min(5, output.shape[1]), dim=1).indices
            counts[0] += (top[:, 0] == labels).sum()
            counts[1] += (top == labels[:, None]).any(dim=1).sum()
            counts[2] += len(labels)
            BEAT()  # validation is progress too
    if distributed:
        dist.all_reduce(counts)
    total = counts[2].clamp(min=1)
    return (counts[0] / total).item(), (counts[1] / total).item()


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

    def train(self, step, epoch, loss, accuracy, rate, world, data_wait=0.0) -> None:
        self._row(kind="train", step=step, epoch=epoch, loss=f"{loss:.5f}", accuracy=f"{accuracy:.4f}",
                  samples_per_s=f"{rate:.2f}", world_size=world)
        if self.tb:
            self.tb.add_scalar("train/loss", loss, step)
            self.tb.add_scalar("train/accuracy", accuracy, step)
            self.tb.add_scalar("train/samples_per_s", rate, step)
            self.tb.add_scalar("train/data_wait_s", data_wait, step)

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
