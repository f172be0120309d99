"""Checkpoints with PyTorch Distributed Checkpoint (DCP) in a folder or under s3://bucket/prefix.

Layout under the job's location (CHECKPOINT_URI/<job>, or the shared volume's checkpoints/<job>):

    step-40/.metadata, step-40/__0_0.distcp, ...   one DCP checkpoint per save, each in a prefix of its own
    step-50/...
    latest                                         "step-50": written by rank 0 after step-50/.metadata exists

A checkpoint is complete exactly when its `.metadata` exists: DCP's coordinator writes it last, after every rank's
data. A resume reads the newest complete one (a save that died left no `.metadata`, so it is skipped); `latest` is
moved only after that, so it never names an incomplete checkpoint. DCP's `finish()` deletes an older `.metadata`
before writing its own, so a prefix is never written twice: at a resume, rank 0 removes whatever lies after the
checkpoint it resumed from (an incomplete or unusable one) before the job can reach that step again. Old checkpoints
are pruned to `keep`.

Saving is asynchronous (dcp.async_save): the step stalls only while the state is copied to CPU memory, the write runs
on a thread, at most one is in flight (the next save first waits for it). Every rank takes part (DDP's replicated
tensors are written once, by one rank, and read by every rank, so a checkpoint resumes with any world size).

S3 (checkpoint_s3.py): Amazon's s3torchconnector (S3StorageWriter/S3StorageReader) where it can write to the
endpoint; its client is probed once per process with a small object, and where the endpoint does not answer a
multipart upload the way the connector's CRT client needs (moto: `Header "ETag" not found`, see docs/testing.md) DCP's
fsspec writer and reader with s3fs take its place. A restore streams each file with ranged GetObjects of its own
(botocore signs them; checkpoint_s3._Direct), every tensor's bytes read from the socket into the model's memory
(checkpoint_read.py), and reads a file through that reader where this fails. `latest`, listing and pruning go through
s3fs. The endpoint is AWS_ENDPOINT_URL (empty: AWS), the region AWS_REGION.

Self-contained with checkpoint_read.py and checkpoint_s3.py beside it (torch; for S3 s3fs and, optionally,
s3torchconnector), so the three sit next to train.py in the training image and in a SageMaker source archive;
`doeks.checkpoints()` gives the same Store to a user's script.
"""
from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import threading
import time
import warnings
from pathlib import Path

try:
    from .checkpoint_read import CheckpointError, _read_files_in_parallel, _say, errors
    from .checkpoint_s3 import _S3
except ImportError:  # beside train.py run as a script (the image's /workspace, a SageMaker sourcedir)
    from checkpoint_read import CheckpointError, _read_files_in_parallel, _say, errors
    from checkpoint_s3 import _S3

LATEST = "latest"
METADATA = ".metadata"
STEP = re.compile(r"^step-(\d+)(?:\.(\d+))?$")  # step-50, or step-50.1 for a second save at step 50


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def order(name: str) -> tuple[int, int]:
    """(step, generation) of a checkpoint's name: step-50 -> (50, 0), step-50.1 -> (50, 1)."""
    match = STEP.match(name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else (-1, -1)


# --- where the files go: a folder, or S3 (small objects and listing through s3fs) -------------------------------------

class _Folder:
    def __init__(self, root: str):
        self.root = Path(root)

    def join(self, *parts: str) -> str:
        return str(self.root.joinpath(*parts))

    def names(self) -> list[str]:
        return [p.name for p in self.root.iterdir() if p.is_dir()] if self.root.is_dir() else []

    def exists(self, *parts: str) -> bool:
        return self.root.joinpath(*parts).exists()

    def having(self, names: list[str], file: str) -> list[str]:
        """Those of `names` (folders) that hold `file`, in their order."""
        return [n for n in names if self.exists(n, file)]

    def read_text(self, name: str) -> str | None:
        try:
            return (self.root / name).read_text()
        except OSError:
            return None

    def write_text(self, name: str, text: str) -> None:
        """Atomic: a temp file, fsync, rename, fsync of the folder."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{name}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / name)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)

    def claim(self, name: str) -> bool:
        """Create the empty file `name` unless it exists (O_EXCL: of several processes exactly one gets True)."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(self.root / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return True
        except FileExistsError:
            return False

    def unclaim(self, name: str) -> None:
        try:
            os.remove(self.root / name)
        except OSError:
            pass

    def writer(self, name: str):
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(self.join(name), sync_files=True, overwrite=False)

    def reader(self, name: str, prefetched: dict | None = None):
        from torch.distributed.checkpoint import FileSystemReader

        return _read_files_in_parallel(FileSystemReader(self.join(name)))

    def prefetch(self, name: str, sizes: dict[str, int]) -> dict | None:
        """Ask the kernel to read the checkpoint's files into the page cache now (readahead: a shared volume's files
        come over the network), from a thread of its own (a network file system may read before it answers); nothing
        is held here ({})."""
        def ahead():
            for file in sizes:
                try:
                    fd = os.open(self.join(name, file), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                except (OSError, AttributeError):
                    pass
                finally:
                    os.close(fd)

        threading.Thread(target=ahead, name="checkpoint-prefetch", daemon=True).start()
        return {}

    client = "folder"


def location(uri: str):
    return _S3(uri) if is_s3(uri) else _Folder(uri)


# --- the store ----------------------------------------------------------------------------------------------------------

def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


_TORCH_CHECKED = False


def _check_torch() -> None:
    """CheckpointError, in one line, where the running torch lacks a private name this module reads (doeks.pod.torchcompat:
    staged beside it in the training image; a copy of this file alone skips the check)."""
    global _TORCH_CHECKED
    if _TORCH_CHECKED:
        return
    try:
        from doeks.pod import torchcompat
    except ImportError:
        try:  # a SageMaker sourcedir: beside this file (doeks.sagemaker.source_archive)
            import torchcompat  # type: ignore[no-redef]
        except ImportError:
            _TORCH_CHECKED = True
            return
    try:
        torchcompat.check(("checkpoints",))
    except torchcompat.TorchMismatch as error:
        raise CheckpointError(str(error)) from None
    _TORCH_CHECKED = True


class Store:
    """A job's checkpoints at `uri` (a folder or s3://bucket/prefix): save (async), the newest complete one, load.

    `state` is what DCP saves: a dict of tensors, state_dicts and plain values (every rank passes the same keys).
    `meta` is a small JSON-able dict saved with it (step, epoch, ...), read back without loading the tensors."""

    def __init__(self, uri: str, keep: int = 3, log=_say):
        _check_torch()
        self.uri = str(uri).rstrip("/")
        self.keep = max(1, int(keep))
        self.at = location(self.uri)
        self.log = log
        self.stalls: list[float] = []
        self.skipped = 0  # saves passed over (when_busy="skip") while one was in flight
        self.saved: list[str] = []
        self._done: threading.Event | None = None
        self._pending_step: int | None = None
        self._error: BaseException | None = None
        self._group = None  # a gloo group of its own for the background writes (training's collectives go on beside it)
        self._told = False
        self._skip: set[str] = set()
        self._stager = None  # the CPU copy the async saves write from, made once and reused (see _ReusedStager)
        self._metadata: dict = {}  # (name, rank) -> a checkpoint's DCP metadata, pickled (see _reader)
        self._prefetched: dict = {}  # name -> {file: a Future of its bytes} (see prefetch)
        if hasattr(self.at, "choose_soon"):  # S3: the connector's probe beside the listing below and a resume's reads
            self.at.choose_soon()
        self._used: set[str] = set(self.names())  # listed once, at start, on every rank (see name_for)

    # reading
    def names(self) -> list[str]:
        """Every checkpoint's name (complete or not), oldest first."""
        return sorted((n for n in self.at.names() if STEP.match(n)), key=order)

    def complete(self) -> list[str]:
        """The complete checkpoints (`.metadata` written), oldest first."""
        return self.at.having(self.names(), METADATA)

    def latest(self) -> str | None:
        """The checkpoint `latest` names, or None."""
        text = (self.at.read_text(LATEST) or "").strip()
        return text if STEP.match(text) else None

    def read_meta(self, name: str) -> dict:
        """The meta saved with a checkpoint (one small item of it; no tensors read). Raises on a damaged one."""
        import torch.distributed.checkpoint as dcp

        holder = {"doeks_meta": ""}
        with _quiet():
            dcp.load(holder, storage_reader=self._reader(name), no_dist=True)
        return json.loads(holder["doeks_meta"])

    def newest(self, check=None) -> tuple[str, dict] | None:
        """(name, meta) of the newest complete checkpoint whose meta reads (and passes `check`, which raises
        CheckpointError to stop), falling back to older ones with a warning; None when there is none; CheckpointError
        when every complete one is unusable."""
        bad = []
        for name in reversed([n for n in self.complete() if n not in self._skip]):
            try:
                meta = self.read_meta(name)
                if check is not None:
                    check(name, meta)
            except CheckpointError:
                raise
            except errors() as error:  # noqa: BLE001 - truncated, garbage, not a DCP checkpoint of doeks...
                bad.append((name, _short(error)))
                continue
            if bad:
                self.log(f"warning: checkpoint {self.at.join(bad[0][0])} ({bad[0][1]}) is partial or corrupt: "
                         f"resuming from {name} instead")
            return name, meta
        if bad:
            raise CheckpointError(f"checkpoint {self.at.join(bad[0][0])} is partial or corrupt and there is no "
                                  f"earlier one ({bad[0][1]}): move {self.uri} away to start from scratch")
        return None

    def load(self, state: dict, name: str, process_group=None) -> None:
        """Load checkpoint `name` into `state` in place (every rank, together when a process group is up)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        distributed = dist.is_available() and dist.is_initialized()
        prefetched = self._prefetched.pop(name, None)
        self._prefetched.clear()  # one another than this, left unused: its memory goes
        with _quiet():
            dcp.load(state, storage_reader=self._reader(name, prefetched), process_group=process_group,
                     no_dist=not distributed)

    def prefetch(self, name: str) -> bool:
        """Start reading checkpoint `name` for a load() that comes later, beside what the caller does until then: a
        resuming job calls it as soon as it knows what it resumes from (newest()), so the download goes on while it
        joins its process group, reads its data and builds its model. S3 (the connector): each file whole, on threads
        of their own, into this process's memory until load() reads it from there (or as usual, where a file's read
        failed); only where the checkpoint's files, times the ranks on this node (every rank reads them all: DDP),
        take at most a quarter of the memory available now. A folder: the kernel asked to read the files ahead into
        its page cache (a shared volume's come over the network), where they take at most that quarter. Returns
        whether anything was started."""
        try:
            metadata = self._reader(name).read_metadata()
        except errors():  # noqa: BLE001 - load() will say what is wrong with it
            return False
        sizes: dict[str, int] = {}
        for info in metadata.storage_data.values():
            sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), info.offset + info.length)
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1) if is_s3(self.uri) else 1  # (one page cache for all)
        if sum(sizes.values()) * ranks > _available_memory() // 4:
            return False
        try:
            started = self.at.prefetch(name, sizes)
        except errors():  # noqa: BLE001 - an older connector without the ranged reader, a client that cannot start
            return False
        if started:
            self._prefetched[name] = started
        return started is not None

    def _reader(self, name: str, prefetched: dict | None = None):
        """The location's DCP reader of checkpoint `name`, reading its `.metadata` once per process: a resume reads
        the meta (newest) and then the state of the same checkpoint, and a checkpoint's files never change once it is
        complete (its prefix is never written again), so the second read would be one more request round trip to S3
        for the same bytes. Kept pickled: each load gets its own copy, as from the storage."""
        reader = self.at.reader(name, prefetched)
        read = reader.read_metadata

        def read_metadata(*args, **kwargs):
            key = (name, kwargs.get("rank"))
            if key not in self._metadata:
                self._metadata[key] = pickle.dumps(read(*args, **kwargs))
            metadata = pickle.loads(self._metadata[key])
            if getattr(metadata, "storage_meta", None) is not None and hasattr(reader, "load_id"):
                metadata.storage_meta.load_id = reader.load_id  # as read_metadata sets it, for this load
            return metadata

        reader.read_metadata = read_metadata
        return reader

    def resume(self, state: dict) -> dict | None:
        """For a script of your own: load the newest complete checkpoint into `state` (a dict of state_dicts, tensors
        and Stateful objects such as a model or an optimizer, in place) and return its meta (with "step"), or None
        when there is none. A damaged newest one falls back to the one before, with a warning."""
        while True:
            found = self.newest()
            if found is None:
                return None
            name, meta = found
            try:
                self.load(_stateful(state), name)
                return meta
            except errors() as error:  # noqa: BLE001 - fall back to the previous complete one
                earlier = [n for n in self.complete() if order(n) < order(name)]
                if not earlier:
                    raise CheckpointError(f"checkpoint {self.at.join(name)} is partial or corrupt and there is no "
                                          f"earlier one ({_short(error)}): move {self.uri} away to start from scratch")
                self.log(f"warning: checkpoint {self.at.join(name)} ({_short(error)}) is partial or corrupt: "
                         f"resuming from {earlier[-1]} instead")
                self._skip.add(name)

    def clear_after(self, name: str | None) -> list[str]:
        """Rank 0, at a resume: remove what lies after checkpoint `name` (incomplete saves, unusable checkpoints). Their
        names stay used: a later save at the same step goes to step-N.1, so no prefix is ever written twice."""
        removed = [n for n in self.names() if name is None or order(n) > order(name)]
        for each in removed:
            self.at.remove(each)
        return removed

    # writing
    def save(self, state: dict, step: int, meta: dict | None = None, background: bool = True,
             when_busy: str = "wait") -> float | None:
        """Start saving `state` as step-<step>/ (every rank calls it, with the same step). Returns the stall: the
        seconds the caller waited (the previous save, the copy to CPU memory). `latest` moves when it is complete.

        A background save while the one before it is still being written: `when_busy="wait"` waits for it (the step
        stalls for the rest of that write); "skip" saves nothing and returns None at once (a periodic checkpoint due
        before the storage took the last one: training goes on, the next due one is taken). Every rank decides the
        same (one small all-reduce on the job's process group: a rank whose write ended and one whose did not would
        otherwise disagree, and a save is collective)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', not {when_busy!r}")
        start = time.perf_counter()
        distributed = dist.is_available() and dist.is_initialized()
        if background and when_busy == "skip" and self.pass_if_busy():
            return None
        self.wait()
        if distributed and self._group is None:
            self._group = dist.new_group(backend="gloo")
        if not self._told and is_s3(self.uri):
            self._told = True
            client = self.at.choose()
            if _rank() == 0:
                self.log(f"checkpoints in {self.uri} through {client}" + (f" ({self.at.why})" if self.at.why else ""))
        payload = _stateful(state)
        payload["doeks_meta"] = json.dumps({**(meta or {}), "step": step})
        name = self.name_for(step)
        self._used.add(name)
        writer = self.at.writer(name)
        if background:
            _at_lower_priority(writer, WRITE_NICE)
            if self._stager is None:
                self._stager = _ReusedStager()
            future = dcp.async_save(payload, storage_writer=writer, process_group=self._group, no_dist=not distributed,
                                    async_stager=self._stager)
            done = threading.Event()

            def finished(result, name=name):  # on the writer's thread: `latest` moves as soon as the save is complete
                try:
                    result.result()
                    self._commit(name)
                except BaseException as error:  # noqa: BLE001 - raised by wait()
                    self._error = error
                finally:
                    done.set()

            self._pending_step, self._done = name, done
            future.add_done_callback(finished)
            stall = time.perf_counter() - start
        else:
            dcp.save(payload, storage_writer=writer, process_group=self._group, no_dist=not distributed)
            stall = time.perf_counter() - start
            self._commit(name)
        self.stalls.append(stall)
        return stall

    def save_alone(self, state: dict, step: int, meta: dict | None = None) -> str | None:
        """After the job lost a peer (its collectives fail), the state this process holds at `step`, saved by this
        process alone, so the restart resumes from this step instead of the last periodic checkpoint (the steps since
        it were trained again: half the interval on average, at every failure). Only for state every rank holds whole
        (DistributedDataParallel: each replica's model and optimizer are the same), never while an optimizer step was
        half applied. One survivor saves: the first to claim the name in the store (a file made with O_EXCL, an S3
        PutObject with If-None-Match) while it saves; the claim goes when the save ends, saved or not, and a survivor
        that comes later finds the checkpoint's .metadata and never writes the same prefix again. The others return
        None at once, as does a step saved already. No collective: a save of one process (DCP's no_dist) of the whole
        state, readable with any world size. Returns the name, with `latest` moved to it."""
        import torch.distributed.checkpoint as dcp

        if any(order(n)[0] >= step for n in self.saved):
            return None
        name = self.name_for(step)
        claim = f".alone-{name}"
        if self.at.exists(name, METADATA) or not self.at.claim(claim):
            return None
        try:
            if self.at.exists(name, METADATA):  # saved, and its claim gone, between the look and the claim
                return None
            self._used.add(name)
            payload = _stateful(state)
            payload["doeks_meta"] = json.dumps({**(meta or {}), "step": step, "alone": True})
            with _quiet():
                dcp.save(payload, storage_writer=self.at.writer(name), no_dist=True)
            if not self.at.exists(name, METADATA):
                return None
            self.saved.append(name)
            self.at.write_text(LATEST, name + "\n")
            self.prune(name)
            return name
        finally:  # no empty claim object outlives its save (a failed one too); the .metadata guards the name now
            self.at.unclaim(claim)

    def pass_if_busy(self) -> bool:
        """True (and counted in `skipped`) when a save is still being written on any rank: every rank gets the same
        answer (one small all-reduce where a process group is up). For a periodic checkpoint: ask before building the
        state, save only when this is False."""
        if _anyone(self.in_flight is not None):
            self.skipped += 1
            return True
        return False

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight (if any; `latest` has moved to it when this returns True); False if it is still
        running at `timeout`. Raises the save's error."""
        if self._done is not None:
            if not self._done.wait(timeout):
                return False
            self._done, self._pending_step = None, None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return True

    def name_for(self, step: int) -> str:
        """step-N, or step-N.G when step-N was used before (seen at start or saved by this process): every rank has
        the same history, so every rank picks the same name, and no prefix is written twice."""
        name, generation = f"step-{step}", 0
        while name in self._used:
            generation += 1
            name = f"step-{step}.{generation}"
        return name

    @property
    def in_flight(self) -> str | None:
        return self._pending_step if self._done is not None and not self._done.is_set() else None

    def _commit(self, name: str) -> None:
        self.saved.append(name)
        if _rank() != 0:
            return
        if not self.at.exists(name, METADATA):  # never name an incomplete checkpoint
            raise CheckpointError(f"checkpoint {self.at.join(name)} has no {METADATA} after its save")
        self.at.write_text(LATEST, name + "\n")
        self.prune(name)

    def prune(self, newest: str) -> None:
        """Keep the newest `keep` complete checkpoints up to `newest`; remove older ones and any incomplete one
        before `newest` (a save that died)."""
        complete = [n for n in self.complete() if order(n) <= order(newest)]
        keep = set(complete[-self.keep:])
        for name in self.names():
            if order(name) < order(newest) and name not in keep:
                self.at.remove(name)
                self.at.unclaim(f".alone-{name}")  # save_alone's claim, where it made one


def _available_memory() -> int:
    """Bytes of memory available now (Linux: MemAvailable), 0 where not known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _anyone(mine: bool) -> bool:
    """True on every rank when `mine` is True on any (an all-reduce of one number on the default process group, from
    the caller's thread; the background saves use a gloo group of their own); `mine` where no group is up."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return mine
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if mine else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


WRITE_NICE = 10  # how much lower the background write's threads run than training's (Linux nice, per thread)


def _at_lower_priority(writer, nice: int = WRITE_NICE):
    """The background write at a lower CPU priority than the training it runs beside: every thread but the caller's
    that runs one of `writer`'s methods (DCP's async executor, a thread of its own per save) is lowered by `nice`
    before it goes on, and the threads it creates inherit that (the writer's file threads; the S3 client's event loop
    threads, made where its first request goes: the executor's check for an existing .metadata). Where the CPU is
    short, the step's threads come first and the write takes the rest (on a busy 2-core machine a write at the same
    priority slowed the steps during it about 3x). At most one save is in flight and the next checkpoint waits for
    it, so a write that got no CPU would stall there instead: nice 10 (about a tenth of a core against one busy thread
    at 0), not 19 or SCHED_IDLE. The blocking part (the copy to CPU memory) stays on the caller's thread, as it was;
    a blocking save (background=False) is left alone."""
    if nice <= 0 or not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"):
        return writer
    caller = threading.get_native_id()
    try:
        lowest = min(19, os.getpriority(os.PRIO_PROCESS, caller) + nice)
    except OSError:
        return writer

    def lowering(method):
        def lowered(*args, **kwargs):
            tid = threading.get_native_id()
            if tid != caller:
                try:
                    if os.getpriority(os.PRIO_PROCESS, tid) < lowest:
                        os.setpriority(os.PRIO_PROCESS, tid, lowest)
                except OSError:  # not allowed here: as it was
                    pass
            return method(*args, **kwargs)

        return lowered

    for name in ("set_up_storage_writer", "prepare_local_plan", "write_data", "finish"):
        if callable(getattr(writer, name, None)):
            setattr(writer, name, lowering(getattr(writer, name)))
    return writer


def _ReusedStager():
    """DCP's staging (the copy of the state to CPU memory the background write reads), into buffers made at the first
    save and reused: fresh buffers cost page faults on every save (ResNet-50's 200 MB: 0.6-1.4 s to fresh memory vs
    0.1 s into the same buffers here), pinned where there is a GPU. Safe to reuse: a save first waits for the one
    before it. A state of another shape (an optimizer's state appearing) makes new buffers."""
    import torch
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.staging import AsyncStager

    class Stager(AsyncStager):
        _synchronize_after_execute = False

        def __init__(self):
            self.cache = None

        def stage(self, state_dict):
            if self.cache is not None:
                try:
                    return _copy_state_dict(state_dict, self.cache, type_check=False)
                except Exception:  # noqa: BLE001 - another structure or shape: new buffers
                    self.cache = None
            self.cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            return _copy_state_dict(state_dict, self.cache, type_check=False)

        def synchronize_staging(self) -> None:
            pass

        def close(self) -> None:
            pass

    return Stager()


def _stateful(state: dict) -> dict:
    """`state` for DCP: a model under "model" with its optimizer under "optimizer" become one Stateful pair through
    torch.distributed.checkpoint.state_dict (parameter names as keys, the optimizer's state made before loading, a
    DDP wrapper's `module.` dropped), so they load into any world size; everything else is passed as it is."""
    import torch

    model, optimizer = state.get("model"), state.get("optimizer")
    if not isinstance(model, torch.nn.Module):
        return dict(state)
    from torch.distributed.checkpoint.stateful import Stateful

    class Pair(Stateful):
        def state_dict(self):
            from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict

            if optimizer is None:
                return {"model": get_model_state_dict(model)}
            model_state, optim_state = get_state_dict(model, optimizer)
            return {"model": model_state, "optimizer": optim_state}

        def load_state_dict(self, loaded):
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

            if optimizer is None:
                set_model_state_dict(model, loaded["model"])
            else:
                set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])

    out = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    out["app"] = Pair()
    return out


class _DropLoaderWarnings:
    """DCP's loader logs a damaged .metadata to the root logger with its traceback ("Global metadata is not found",
    then a FileNotFoundError for the rank-local one it tries next), which Python prints to stderr: in a job's log that
    reads as a missing file, not as the unusable checkpoint the job then names in one line."""

    def filter(self, record) -> bool:
        return not record.pathname.endswith("state_dict_loader.py")


@contextlib.contextmanager
def _quiet():
    import logging

    root, drop = logging.getLogger(), _DropLoaderWarnings()
    root.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            yield
    finally:
        root.removeFilter(drop)


def _short(error: BaseException) -> str:
    text = str(error).strip()
    # DCP wraps every rank's exception: the first line of the first one says what happened
    match = re.search(r"(?:Traceback[^\n]*\n(?:.*\n)*?)?(\w+(?:Error|Exception)): ([^\n]+)", text)
    if match and type(error).__name__ == "CheckpointException":
        return f"{match.group(1)}: {match.group(2)[:100]}"
    return f"{type(error).__name__}: {text.splitlines()[0][:100] if text else 'unreadable'}"


# --- saving a model (the final one) -------------------------------------------------------------------------------------

def save_file(uri: str, name: str, obj) -> str:
    """torch.save(obj) as `name` in a folder or under s3:// (written to a temp name and renamed in a folder; one
    PutObject in S3). Returns where it went."""
    import io

    import torch

    at = location(uri)
    if isinstance(at, _Folder):
        at.root.mkdir(parents=True, exist_ok=True)
        tmp = at.root / f".{name}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, at.root / name)
        return str(at.root / name)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    at.fs.pipe_file(at._key(name), buffer.getvalue())
    return at.join(name)
