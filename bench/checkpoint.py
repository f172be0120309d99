"""Checkpoints to S3 vs a folder, in one run: the stall training sees, save and restore throughput.

The built-in job's checkpoints (doeks/workload/checkpoints.py: PyTorch Distributed Checkpoint, step-N/ + `latest`,
asynchronous save, its write at a lower CPU priority than training) of two states, each written to and read from
- S3: bench/s3_endpoint.py on 127.0.0.1, every request answered after --latency-ms (20 ms: S3's typical time to first
  byte), written through s3torchconnector (the client the job uses where the endpoint answers as S3 does), read
  through the job's direct reads (ranged GetObjects, the bytes from the socket into the tensors). The endpoint is
  S3's stand-in: its CPU (HTTP parsing, MD5 of every part, copies) is S3's, which a node does not pay, so it runs at
  the lowest CPU priority (--endpoint-nice 19; 0 charges it to the training as before), and
- a folder on this machine's disk (what a shared volume is to the job). Its restore reads the files after they were
  evicted from this machine's page cache (fsync + POSIX_FADV_DONTNEED per file): a resume runs on a replaced pod or
  node, whose page cache does not hold the checkpoint, and FSx/EFS are network storage. The restore from the page
  cache (right after) is printed beside it, not used for the ratio,
in the same run, alternating, several rounds, medians:
- ResNet-50 training (model + SGD momentum, ~205 MB of state) on this machine's CPU, per round and store --due (3)
  checkpoints due, one after every --every optimizer steps (CHECKPOINT_EVERY's default, 10), taken as the job takes
  them: the save asynchronous, and one due while the last is still being written passed over (--when-busy skip, the
  job's way: Store.pass_if_busy, every rank agreeing; `wait` waits for it instead, as the job did before). The stall
  over a round = the time the caller is blocked (asking, building the state dict, `save()`: the copy to CPU memory,
  and with `wait` the rest of the last write) + what the steps during a write lose to it (their median time over the
  median time of steps without a write in flight, times their number; a step counts as during a write when one was
  in flight at its start or its end), over the round's steps: `checkpoint stall: N% of a step` (the share of every
  step lost, on average, to checkpointing), with how many of the due checkpoints were written. The wait for the last
  write after the round's last step is printed, not counted (a run's end; the job's final save blocks anyway).
  Medians of per-step times, so a shared machine's load spikes count little. The step uses all the
  cores by default (torch's threads): the worst case, where the write's CPU comes out of the step's own; a GPU node's
  step leaves its CPU cores mostly to the data loader and the write (--threads 1 on 2 cores is nearer that).
  --device cuda runs the step on a GPU (batch 64 at 224 px, ImageNet's crop; the step waits for its kernels): save()
  copies the state into pinned CPU memory, and the write's CPU is not the step's, as on a GPU node.
- A ~1 GB state (--big-gb: a stack of Linear layers, parameters + momentum): save and restore throughput.
Save MB/s: a blocking save (the write the background thread does); restore MB/s: a load into a fresh state.
Resumes (--resumes, 3): the ResNet-50 checkpoint resumed as a job resumes it, in a new process each time (its first
restore: fresh memory, new clients and connections), `newest()` (the newest complete checkpoint and its meta) then
`load()` into a model and optimizer made there, on the CPU; timed inside that process, its imports and model aside;
alternating, the folder evicted before each.
The load average is printed with every round: on a shared machine compare ratios within one run, not across runs.

Prints per model and store, then the ratios:
  checkpoint stall: N% of a step         (ResNet-50, S3; target <= 5%)
  save MB/s / restore MB/s
  restore S3 vs folder: N.NNx             (restore throughput S3 / folder, evicted; target >= 0.8x at 20 ms)
  resume S3 vs folder: N.NNx              (a new process's newest() + load(): folder seconds / S3 seconds)

Run: python bench/checkpoint.py [--rounds 3] [--latency-ms 20] [--every 10] [--due 3] [--when-busy skip|wait]
                                [--big-gb 1.0] [--device cpu|cuda] [--resumes 3]
                                [--batch 8] [--crop 96] [--threads 0] [--endpoint-nice 19]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def start_endpoint(latency_ms: float, nice: int = 0) -> tuple[subprocess.Popen, str]:
    """The S3 stand-in in a process of its own, at `nice` (19: its CPU is S3's, not the node's; it takes what the
    training and the checkpoint's client leave)."""
    server = subprocess.Popen([sys.executable, str(ROOT / "bench" / "s3_endpoint.py"), "--files", "0", "--bucket", "bench",
                               "--latency-ms", str(latency_ms), "--max-seconds", "3600"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              preexec_fn=(lambda: os.nice(nice)) if nice else None)
    port = int(server.stdout.readline().split()[1])
    return server, f"http://127.0.0.1:{port}"


def state_bytes(state) -> int:
    import torch

    total = 0
    for value in state.values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            total += state_bytes(value)
    return total


def resnet50(batch: int, crop: int, device: str = "cpu"):
    import torch
    import torchvision

    model = torchvision.models.resnet50(num_classes=1000).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    images = torch.randn(batch, 3, crop, crop, device=device)
    labels = torch.randint(0, 1000, (batch,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step():  # on a GPU, to the end of its kernels (a training loop's loss.item() waits the same way)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(images), labels).backward()
        optimizer.step()
        synchronize()

    step()  # momentum buffers exist
    return model, optimizer, step


def big(gigabytes: float, device: str = "cpu"):
    """Linear layers of 4096 x 4096 (64 MiB each) to half the size, SGD momentum the other half."""
    import torch

    layers = max(1, round(gigabytes * 1024 / 2 / 64))
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)]).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    model(torch.randn(2, 4096, device=device)).sum().backward()
    optimizer.step()
    return model, optimizer


def app_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


def fresh_like(state):
    """A state to restore into, its memory written once before (zeros): a resuming job loads into a model it has
    built and initialised and an optimizer state made (get_state_dict makes it), not into memory never touched,
    whose page faults would be charged to the restore (0.5 M faults for the 1 GB state, either store)."""
    import torch

    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else fresh_like(v) if isinstance(v, dict) else v)
            for k, v in state.items()}


def evict(root: Path) -> None:
    """Drop a folder's files from this machine's page cache (fsync, then POSIX_FADV_DONTNEED per file): a resume runs
    on a replaced pod or node, whose page cache does not hold the checkpoint (and FSx/EFS is network storage)."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure_io(store, state, step: int) -> tuple[float, float, float | None]:
    """(save seconds, restore seconds, restore seconds from the page cache) of one blocking save and loads into a fresh
    state. A folder's restore reads the files after they were evicted from the page cache (a resume's new node), then
    once more from the page cache (the restore this machine would see right after its own save: reported, not the
    ratio's); S3's: one restore (the endpoint holds the objects in its memory, as S3 serves them)."""
    start = time.perf_counter()
    store.save(state, step, {"bench": True}, background=False)
    saved = time.perf_counter() - start
    folder = store.at.client == "folder"
    if folder:
        evict(store.at.root)
    target = fresh_like(state)
    start = time.perf_counter()
    store.load(target, store.latest())
    restored = time.perf_counter() - start
    cached = None
    if folder:
        target = fresh_like(state)
        start = time.perf_counter()
        store.load(target, store.latest())
        cached = time.perf_counter() - start
    return saved, restored, cached


def interval(step, every: int, store=None, state_fn=None, at: int = 0, due: int = 1,
             when_busy: str = "skip") -> dict:
    """`every * due` steps; with a store, a checkpoint due after every `every`-th step, as the job takes them
    (doeks/workload/train.py): `when_busy="skip"` passes over one due while the last is still being written (every rank
    agreeing: Store.pass_if_busy), "wait" waits for it in save(). Returns the seconds the caller was blocked (asking,
    building the state dict, save(): the copy to CPU memory, and in "wait" the rest of the last write), the times of
    the steps while a write was in flight (at its start or its end) and of the others, the checkpoints due and
    written, and the wait for the last write after the last step (the end of a run: not counted as stall)."""
    out = {"blocked": 0.0, "during": [], "other": [], "due": 0, "written": 0, "end": 0.0}
    for i in range(every * due):
        busy = store is not None and store.in_flight is not None
        start = time.perf_counter()
        step()
        took = time.perf_counter() - start
        (out["during"] if store is not None and (busy or store.in_flight is not None) else out["other"]).append(took)
        if store is not None and (i + 1) % every == 0:
            out["due"] += 1
            start = time.perf_counter()
            if not (when_busy == "skip" and store.pass_if_busy()):
                at += 1
                store.save(state_fn(), at, {"bench": True})
                out["written"] += 1
            out["blocked"] += time.perf_counter() - start
    if store is not None:
        start = time.perf_counter()
        store.wait()
        out["end"] = time.perf_counter() - start
    out["at"] = at
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints (CHECKPOINT_EVERY)")
    parser.add_argument("--due", type=int, default=3, help="checkpoints due per round and store")
    parser.add_argument("--when-busy", choices=("skip", "wait"), default="skip",
                        help="a checkpoint due while the last is being written: skip it (the job's way) or wait")
    parser.add_argument("--big-gb", type=float, default=1.0, help="size of the big state (0 = leave it out)")
    parser.add_argument("--device", default="cpu",
                        help="where the model trains: cpu, or cuda (a GPU node: the state copied to pinned CPU memory)")
    parser.add_argument("--batch", type=int, default=None, help="default: 8 on cpu, 64 on cuda")
    parser.add_argument("--crop", type=int, default=None, help="default: 96 on cpu, 224 (ImageNet's) on cuda")
    parser.add_argument("--threads", type=int, default=0, help="torch threads for the step (0: torch's default, all cores)")
    parser.add_argument("--resumes", type=int, default=3,
                        help="ResNet-50 resumes per store, each in a new process (newest() + load(), as a job resumes)")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="resumes without Store.prefetch (the download starts at load())")
    parser.add_argument("--resume-child", metavar="URI", help=argparse.SUPPRESS)  # one resume, in this process
    parser.add_argument("--endpoint-nice", type=int, default=19,
                        help="the S3 stand-in's nice (19: its CPU is S3's, not the node's; 0: as the training)")
    args = parser.parse_args(argv)
    gpu = args.device.startswith("cuda")
    args.batch = args.batch or (64 if gpu else 8)
    args.crop = args.crop or (224 if gpu else 96)
    if args.resume_child:
        return resume_child(args.resume_child, args.batch, args.crop, not args.no_prefetch)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from doeks.workload.checkpoints import Store

    server, endpoint = start_endpoint(args.latency_ms, args.endpoint_nice)
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_REGION="us-west-2", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench")
    folder = Path(tempfile.mkdtemp(prefix="doeks-bench-ckpt-"))
    results: dict = {}
    try:
        stores = {"s3": lambda name: Store(f"s3://bench/{name}", keep=1),
                  "folder": lambda name: Store(str(folder / name), keep=1)}
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads for the step on {os.cpu_count()} cores, "
              f"load {load()}; S3: {endpoint} with {args.latency_ms:g} ms per request, the endpoint process at nice "
              f"{args.endpoint_nice}; folder: {folder}, its restore read after the files were evicted from the page "
              f"cache (a resume's new node), then from the page cache", flush=True)

        # ResNet-50: stall over a window of --every steps, and I/O
        model, optimizer, step = resnet50(args.batch, args.crop, args.device)
        state_fn = lambda: app_state(model, optimizer)  # noqa: E731
        size = state_bytes(state_fn())
        print(f"resnet50: {size / 1e6:.0f} MB of state, batch {args.batch} at {args.crop}px on {args.device}"
              + (f" ({torch.cuda.get_device_name()})" if gpu else ""), flush=True)
        per = {name: make("resnet50") for name, make in stores.items()}
        counter = 0
        quiet: list[float] = []  # step times with no write in flight
        runs = {k: [] for k in per}
        io = {k: [] for k in per}
        for round_ in range(args.rounds):
            quiet += interval(step, args.every)["other"]
            for name, store in per.items():
                run = interval(step, args.every, store, state_fn, counter, args.due, args.when_busy)
                counter = run["at"] + 1
                runs[name].append(run)
                quiet += run["other"]
                io[name].append(measure_io(store, state_fn(), counter))
            print(f"  round {round_ + 1}: step {statistics.median(quiet):.3f}s; " + ", ".join(
                f"{n}: {runs[n][-1]['written']} of {runs[n][-1]['due']} due checkpoints written, blocked "
                f"{runs[n][-1]['blocked']:.2f}s, {len(runs[n][-1]['during'])} steps during a write (median "
                f"{statistics.median(runs[n][-1]['during']) if runs[n][-1]['during'] else 0:.3f}s), the last write's "
                f"end {runs[n][-1]['end']:.2f}s; save {io[n][-1][0]:.2f}s, restore {io[n][-1][1]:.2f}s"
                + (f" (page cache {io[n][-1][2]:.2f}s)" if io[n][-1][2] else "")
                for n in per) + f"; load {load()}", flush=True)
        step_s = statistics.median(quiet)
        results["resnet50"] = {"size": size, "step": step_s, "client": per["s3"].at.client}
        for name in per:
            lost, written, due = [], 0, 0
            for run in runs[name]:  # per round: what the checkpoints cost over that round's steps
                slower = (statistics.median(run["during"]) - step_s) * len(run["during"]) if run["during"] else 0.0
                lost.append((run["blocked"] + max(0.0, slower)) / (args.every * args.due) / step_s)
                written, due = written + run["written"], due + run["due"]
            results["resnet50"][name] = {"stall": statistics.median(lost), "written": written, "due": due,
                                         **throughput(size, io[name], name)}
        resumes = {name: [] for name in per}
        for _ in range(args.resumes):  # alternating; the folder evicted before each, as a new node finds it
            for name, store in per.items():
                if name == "folder":
                    evict(store.at.root)
                resumes[name].append(resume(store.uri, args.batch, args.crop, not args.no_prefetch))
        if args.resumes:
            results["resnet50"]["resume"] = {n: statistics.median(r["total"] for r in runs_) for n, runs_ in resumes.items()}
            print(f"  resumes in a new process (newest() + {'' if args.no_prefetch else 'prefetch, '}the model made + load()): "
                  + "; ".join(f"{n} " + ", ".join(f"{r['total']:.2f}s ({r['newest']:.2f} + {r['made']:.2f} + "
                                                  f"{r['load']:.2f})" for r in runs_)
                              for n, runs_ in resumes.items()) + f"; load {load()}", flush=True)
        del model, optimizer, step, per

        if args.big_gb > 0:
            model, optimizer = big(args.big_gb, args.device)
            state = app_state(model, optimizer)
            size = state_bytes(state)
            print(f"big: {size / 1e9:.2f} GB of state", flush=True)
            per = {name: make("big") for name, make in stores.items()}
            io = {k: [] for k in per}
            for round_ in range(args.rounds):
                for name, store in per.items():
                    counter += 1
                    io[name].append(measure_io(store, state, counter))
                print(f"  round {round_ + 1}: " + ", ".join(
                    f"{n} save {io[n][-1][0]:.2f}s restore {io[n][-1][1]:.2f}s"
                    + (f" (page cache {io[n][-1][2]:.2f}s)" if io[n][-1][2] else "") for n in per)
                    + f"; load {load()}", flush=True)
            results["big"] = {"size": size, "client": per["s3"].at.client}
            for name in per:
                results["big"][name] = throughput(size, io[name], name)
            del model, optimizer, state, per
    finally:
        server.stdin.close()
        server.wait(30)
        shutil.rmtree(folder, ignore_errors=True)

    print()
    for model_name, result in results.items():
        for name in ("s3", "folder"):
            line = f"{model_name} {name}: save MB/s: {result[name]['save']:.0f}, restore MB/s: {result[name]['restore']:.0f}"
            if result[name].get("cached"):
                line += f" ({result[name]['cached']:.0f} from the page cache)"
            if "stall" in result[name]:
                line += (f", checkpoint stall: {100 * result[name]['stall']:.1f}% of a step, {result[name]['written']} of "
                         f"{result[name]['due']} due checkpoints written")
            print(line)
        print(f"{model_name}: restore S3 vs folder: {result['s3']['restore'] / result['folder']['restore']:.2f}x, "
              f"save S3 vs folder: {result['s3']['save'] / result['folder']['save']:.2f}x (S3 written through "
              f"{result['client']}, read through direct reads)")
    r = results["resnet50"]
    print(f"checkpoint stall: {100 * r['s3']['stall']:.1f}% of a step (ResNet-50, S3, a checkpoint due every {args.every} "
          f"steps of {r['step']:.3f}s, {r['s3']['written']} of {r['s3']['due']} written, when busy: {args.when_busy}; "
          f"folder {100 * r['folder']['stall']:.1f}%, {r['folder']['written']} of {r['folder']['due']} written)")
    print(f"save MB/s: {r['s3']['save']:.0f} (S3), {r['folder']['save']:.0f} (folder)")
    print(f"restore MB/s: {r['s3']['restore']:.0f} (S3), {r['folder']['restore']:.0f} (folder, evicted from the page "
          f"cache; {r['folder']['cached']:.0f} from it)")
    print(f"restore S3 vs folder: {r['s3']['restore'] / r['folder']['restore']:.2f}x (ResNet-50 at {args.latency_ms:g} ms)"
          + (f", {results['big']['s3']['restore'] / results['big']['folder']['restore']:.2f}x "
             f"({results['big']['size'] / 1e9:.1f} GB state)" if "big" in results else "")
          + f"; from the folder's page cache: {r['s3']['restore'] / r['folder']['cached']:.2f}x"
          + (f", {results['big']['s3']['restore'] / results['big']['folder']['cached']:.2f}x" if "big" in results else ""))
    if "resume" in r:
        print(f"resume S3 vs folder: {r['resume']['folder'] / r['resume']['s3']:.2f}x (ResNet-50, a new process's "
              f"newest(), {'' if args.no_prefetch else 'prefetch, '}the model made, load(), as a resuming job: S3 "
              f"{r['resume']['s3']:.2f}s, the folder {r['resume']['folder']:.2f}s evicted; medians of {args.resumes})")
    print(f"the S3 stand-in at nice {args.endpoint_nice}, {torch.get_num_threads()} threads for the step; load {load()}")
    return 0


def resume(uri: str, batch: int, crop: int, prefetch: bool = True) -> dict:
    """One resume of the checkpoint at `uri`, as the job resumes (doeks/workload/train.py): in a new process (its
    first restore: fresh memory, new clients, the connections made), the newest complete checkpoint found and its
    meta read (newest()), its download started (Store.prefetch, unless `prefetch` is False), the model and optimizer
    made (the job also joins its process group and reads its data there), then the state loaded into them; timed
    inside that process from newest() to the end of load(), its imports aside."""
    import json

    out = subprocess.run([sys.executable, __file__, "--resume-child", uri, "--batch", str(batch), "--crop", str(crop)]
                         + ([] if prefetch else ["--no-prefetch"]), capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode or not lines:
        raise SystemExit(f"a resume of {uri} failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]}")
    return json.loads(lines[-1])


def resume_child(uri: str, batch: int, crop: int, prefetch: bool) -> int:
    import json
    import warnings

    warnings.simplefilter("ignore")
    import torchvision  # noqa: F401 - imported before the clock starts, as the job has it by then
    from doeks.workload.checkpoints import Store

    store = Store(uri, keep=1, log=lambda message: None)
    start = time.perf_counter()
    name, _ = store.newest()
    found = time.perf_counter()
    if prefetch:
        store.prefetch(name)
    model, optimizer, _ = resnet50(batch, crop)
    target = app_state(model, optimizer)
    made = time.perf_counter()
    store.load(target, name)
    done = time.perf_counter()
    print(json.dumps({"newest": found - start, "made": made - found, "load": done - made, "total": done - start}))
    return 0


def throughput(size: int, runs: list, name: str) -> dict:
    """MB/s of the median save and restore of `runs` ((save, restore, page-cache restore) seconds each); the page-cache
    restore for the folder only."""
    def rate(i: int) -> float:
        return size / statistics.median(run[i] for run in runs) / 1e6

    return {"save": rate(0), "restore": rate(1), "cached": rate(2) if name == "folder" else None}


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
