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

S3: Amazon's s3torchconnector (S3StorageWriter/S3StorageReader) where it can write to the endpoint; its client is
probed once per process with a small object, and where the endpoint does not answer a multipart upload the way the
connector's CRT client needs (moto: `Header "ETag" not found`, see docs/testing.md) DCP's fsspec writer and reader
with s3fs take its place. A restore streams each file with ranged GetObjects of its own (botocore signs them; _Direct),
every tensor's bytes read from the socket into the model's memory, and reads a file through that reader where
this fails. `latest`, listing and pruning go through s3fs. The endpoint is AWS_ENDPOINT_URL (empty:
AWS), the region AWS_REGION.

Self-contained (torch; for S3 s3fs and, optionally, s3torchconnector), so it sits next to train.py in the training
image and in a SageMaker source archive; `doeks.checkpoints()` gives the same Store to a user's script.
"""
from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import re
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

LATEST = "latest"
METADATA = ".metadata"
STEP = re.compile(r"^step-(\d+)(?:\.(\d+))?$")  # step-50, or step-50.1 for a second save at step 50


class CheckpointError(Exception):
    """A checkpoint that cannot be used: the job stops with this one line."""


def errors() -> tuple:
    """What a damaged checkpoint raises: DCP's CheckpointException is a BaseException (it carries every rank's)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _say(message: str) -> None:
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


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


class _S3:
    def __init__(self, uri: str):
        try:
            import s3fs
        except ImportError:
            raise CheckpointError(f"checkpoints in {uri} need s3fs (pip install s3fs), which is not installed") from None
        self.uri = uri.rstrip("/")
        self.bucket_path = self.uri[len("s3://"):]
        self.endpoint = os.environ.get("AWS_ENDPOINT_URL") or None
        self.region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self.fs = s3fs.S3FileSystem(endpoint_url=self.endpoint, client_kwargs={"region_name": self.region},
                                    skip_instance_cache=True, use_listings_cache=False)
        self.client = None  # "s3torchconnector" or "s3fs", chosen at the first write (probe)
        self.why = ""
        self._choosing = threading.Lock()  # one probe per process (choose_soon's thread and a caller may meet)
        self._connectors: dict = {}  # "write"/"read" -> the connector's S3Client, kept for every save/restore after
        self._direct = None  # the client of a restore's direct reads (_Direct), made once per process
        self._directing = threading.Lock()

    def join(self, *parts: str) -> str:
        return "/".join([self.uri, *parts])

    def _key(self, *parts: str) -> str:
        return "/".join([self.bucket_path, *parts])

    def names(self) -> list[str]:
        try:
            entries = self.fs.ls(self.bucket_path, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory"]

    def exists(self, *parts: str) -> bool:
        """One HeadObject (s3fs's exists() also lists the key as a folder when the object is not there)."""
        bucket, _, key = self._key(*parts).partition("/")
        try:
            self.fs.call_s3("head_object", Bucket=bucket, Key=key)
            return True
        except FileNotFoundError:
            return False

    def having(self, names: list[str], file: str) -> list[str]:
        """Those of `names` (prefixes) that hold `file`, in their order: one HeadObject each, all at once (one request
        round trip for all, not one per checkpoint kept)."""
        if len(names) <= 1:
            return [n for n in names if self.exists(n, file)]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(16, len(names)), thread_name_prefix="checkpoint-head") as pool:
            found = list(pool.map(lambda n: self.exists(n, file), names))
        return [n for n, there in zip(names, found) if there]

    def read_text(self, name: str) -> str | None:
        """One GetObject: through the client of direct reads where it is made (botocore on the caller's thread: s3fs
        goes through its event loop's thread: 3 ms more here), else s3fs (its cat_file asks for the size first, a
        HeadObject, where it may read in parallel: a second request round trip at every resume)."""
        direct = self.made_direct()
        if direct is not None:
            bucket, _, key = self._key(name).partition("/")
            try:
                return direct.read(bucket, key).decode()
            except FileNotFoundError:
                return None
            except Exception:  # noqa: BLE001 - s3fs asks again below, and says its own error if it has one
                pass
        try:
            return self.fs.cat_file(self._key(name), max_concurrency=1).decode()
        except FileNotFoundError:
            return None

    def write_text(self, name: str, text: str) -> None:
        """One PutObject: S3 makes a whole object visible at once, never part of one."""
        self.fs.pipe_file(self._key(name), text.encode())

    def remove(self, name: str) -> None:
        try:
            self.fs.rm(self._key(name), recursive=True)
        except FileNotFoundError:
            pass

    def claim(self, name: str) -> bool:
        """Create the empty object `name` unless it exists (a conditional PutObject, If-None-Match: *: of several
        processes exactly one gets True); False also when S3 cannot be asked."""
        bucket, _, key = self._key(name).partition("/")
        try:
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=b"", IfNoneMatch="*")
            return True
        except Exception:  # noqa: BLE001 - 412 PreconditionFailed: another process has it; or S3 unreachable
            return False

    def unclaim(self, name: str) -> None:
        self.remove(name)

    # s3torchconnector where it works here, else DCP's fsspec writer and reader with s3fs
    def _connector_fs(self, reader_constructor=None, use: str | None = None):
        """The connector's file system on a client of its own (`use` None: the probe's), or on the one client kept for
        every save ("write") or every restore ("read") of this process: its connections and threads are made once, not
        per checkpoint (new connections to S3 each time). The write's client is first used by a save's background
        thread, so its threads are made there, at that thread's lower priority (_at_lower_priority); a restore's, at
        the caller's."""
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        return S3FileSystem(self.region, s3_client=self._connector(use), reader_constructor=reader_constructor)

    def _connector(self, use: str | None = None):
        """The connector's S3 client: a new one (`use` None), or the one kept for `use` ("write"/"read")."""
        from s3torchconnector._s3client import S3Client, S3ClientConfig

        client = self._connectors.get(use)
        if client is None:
            config = S3ClientConfig(force_path_style=bool(self.endpoint), max_attempts=3)
            client = S3Client(self.region, endpoint=self.endpoint, s3client_config=config)
            if use:
                self._connectors[use] = client
        return client

    def choose_soon(self) -> None:
        """Start choose()'s probe on a thread of its own (a store made to resume: the probe's four requests go on
        beside the listing and the reads of `latest` and the metadata, instead of before the first restore), and
        the making of the client of direct reads on another (botocore reads its S3 model: 0.07-0.09 s of CPU here,
        beside the probe's waits for answers)."""
        if self.client is None:
            threading.Thread(target=self.choose, name="checkpoint-probe").start()
            threading.Thread(target=self.direct, name="checkpoint-direct").start()

    def choose(self) -> str:
        with self._choosing:
            return self._choose()

    def _choose(self) -> str:
        if self.client is None:
            try:
                fs = self._connector_fs()
                probe = self.join(f".doeks-probe-{os.uname().nodename}-{os.getpid()}")
                with fs.create_stream(probe, "wb") as stream:
                    stream.write(b"probe")
                fs.rm_file(probe)
                self.client = "s3torchconnector"
            except ImportError:
                self.client, self.why = "s3fs", "s3torchconnector is not installed"
            except errors() as error:  # noqa: BLE001 - the connector's client cannot write to this endpoint
                self.client = "s3fs"
                self.why = f"s3torchconnector cannot write to {self.endpoint or 'S3'}: {str(error).splitlines()[0][:160]}"
                # a failed probe may have left its object (moto completes the upload, the connector rejects the answer)
                try:
                    self.fs.rm(self._key(f".doeks-probe-{os.uname().nodename}-{os.getpid()}"))
                except Exception:  # noqa: BLE001 - not there; or S3 unreachable, which the first save will say
                    pass
        return self.client

    def writer(self, name: str):
        if self.choose() == "s3torchconnector":
            from s3torchconnector.dcp import S3StorageWriter

            writer = S3StorageWriter(self.region, self.join(name), thread_count=4)
            writer.fs = self._connector_fs(use="write")
            return writer
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(self.join(name), sync_files=False, thread_count=4, overwrite=False,
                              endpoint_url=self.endpoint, client_kwargs={"region_name": self.region})
        # S3 has no folders: s3fs's makedirs checks the bucket and tries CreateBucket where it cannot see it, which a
        # role with rights on the job's prefix alone is refused (tests/test_job_role.py)
        writer.fs.mkdir = lambda path: None
        # and one HeadObject for DCP's "is there a .metadata already" (s3fs's exists() lists the key as a folder too,
        # a ListObjectsV2 that moto's IAM check answers SignatureDoesNotMatch for some prefixes)
        writer.fs.exists = lambda path: self.exists(str(path)[len(self.uri) + 1:])
        return writer

    def prefetch(self, name: str, sizes: dict[str, int]) -> dict | None:
        """Start reading each of the checkpoint's files whole, on threads of their own, with the client of direct
        reads (one ranged GetObject each, its body read from the socket into memory of this process): {file: a Future
        of its bytes}; None where that client cannot be made (nothing started)."""
        from concurrent.futures import ThreadPoolExecutor

        direct = self.direct()
        if direct is None:
            return None

        def fetch(file: str, size: int):
            import mmap

            bucket, _, key = self._key(name, file).partition("/")
            buffer = mmap.mmap(-1, max(size, 1))
            if not size:
                return buffer
            body = direct.get(bucket, key, 0, size)
            try:
                body.fill(memoryview(buffer)[:size])
            finally:
                body.close()
            return buffer

        pool = ThreadPoolExecutor(min(READ_THREADS, max(1, len(sizes))), thread_name_prefix="checkpoint-prefetch")
        try:
            return {file: pool.submit(fetch, file, size) for file, size in sizes.items()}
        finally:
            pool.shutdown(wait=False)

    def direct(self):
        """The client of a restore's direct reads (_Direct: a file's bytes from S3 straight into the model's tensors),
        made at the first call and kept for the process; None where it cannot be made (no botocore)."""
        with self._directing:
            if self._direct is None:
                try:
                    self._direct = _Direct(self.endpoint, self.region, 2 * READ_THREADS)
                except ImportError:
                    self._direct = False
        return self._direct or None

    def made_direct(self):
        """The client of direct reads where it is made already, else None (nobody waits for its making)."""
        return self._direct or None

    def _read_metadata_directly(self, reader, name: str):
        """The reader's read_metadata through the client of direct reads where it is made (one GetObject, the
        connector's client not made for it), else as it was; as it was also where that read fails (it says the
        error, if there is one)."""
        read = reader.read_metadata

        def read_metadata(*args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            direct = self.made_direct()
            if direct is not None:
                file = str(reader._get_metadata_path(kwargs.get("rank"))).rsplit("/", 1)[-1]
                bucket, _, key = self._key(name, file).partition("/")
                try:
                    metadata = pickle.loads(direct.read(bucket, key))
                except Exception:  # noqa: BLE001 - as it was, below
                    pass
                else:
                    if getattr(metadata, "storage_meta", None) is None:
                        metadata.storage_meta = StorageMeta()
                    metadata.storage_meta.load_id = reader.load_id  # (as DCP's FileSystemReader.read_metadata)
                    return metadata
            return read(*args, **kwargs)

        reader.read_metadata = read_metadata
        return reader

    def reader(self, name: str, prefetched: dict | None = None):
        def read(file: str, start: int, end: int) -> "_Body":
            direct = self.direct()  # (made at the first file that is not prefetched)
            if direct is None:
                raise CheckpointError("botocore is not installed")
            bucket, _, key = self._key(name, file).partition("/")
            return direct.get(bucket, key, start, end)

        if self.choose() == "s3torchconnector":
            from s3torchconnector.dcp import S3StorageReader

            reader = S3StorageReader(self.region, self.join(name))
            # the reader's own constructor (DCP-optimized: the byte ranges of the plan's items, coalesced, kept as the
            # client's chunks); a file system without it reads each file through the generic sequential reader, which
            # copies the whole object into a growing BytesIO before torch.load copies it again
            reader.fs = self._connector_fs(reader._reader_constructor, use="read")
            return _read_files_in_parallel(self._read_metadata_directly(reader, name), prefetched=prefetched,
                                           direct=read)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        # (s3fs: a read that jumps within a file is another GetObject, so each item is read whole, in order)
        reader = FsspecReader(self.join(name), endpoint_url=self.endpoint, client_kwargs={"region_name": self.region})
        return _read_files_in_parallel(self._read_metadata_directly(reader, name), random_access=False, direct=read)


READ_THREADS = 4  # = the writers' thread_count: a checkpoint has up to 4 files per rank


def _read_files_in_parallel(reader, threads: int = READ_THREADS, random_access: bool = True,
                            prefetched: dict | None = None, direct=None):
    """DCP's FileSystemReader reads a rank's files one after the other; this reads them `threads` at a time (each
    file's items still in order, into their own tensors), so S3's time to first byte overlaps, as the writer's threads
    overlap it on save. Each tensor is decoded where its bytes lie (_read_file), not through torch.load, which makes a
    new storage of every tensor (fresh memory, a page fault per 4 kB) to copy it into the target after.
    random_access: the reader's stream answers a read anywhere in an item at no cost (a local file; the connector's
    reader, which holds the item's bytes once asked); False: each item is read whole, in order. prefetched: {file: a
    Future of its bytes} (Store.prefetch): such a file is read from memory, or as usual where its read failed.
    direct(file, start, end) -> _Body: where given, each file not prefetched is streamed through it (_stream_file),
    and read as usual where that fails."""
    from collections import defaultdict
    from concurrent.futures import ThreadPoolExecutor

    import torch

    def read_data(plan, planner):
        by_file = defaultdict(list)
        for item in plan.items:
            by_file[reader.storage_data[item.storage_index].relative_path].append(item)
        with ThreadPoolExecutor(max(1, min(threads, len(by_file))), thread_name_prefix="checkpoint-read") as pool:
            parts = [pool.submit(_read_file, reader, path, items, planner, random_access, (prefetched or {}).get(path),
                                 direct) for path, items in by_file.items()]
            for part in parts:
                part.result()
        done = torch.futures.Future()
        done.set_result(None)
        return done

    reader.read_data = read_data
    return reader


def _read_file(reader, path: str, items: list, planner, random_access: bool = True, prefetched=None,
               direct=None) -> None:
    """DCP's FileSystemReader.read_data for one file's items (in the order of their bytes, as the S3 connector's
    reader needs them). A tensor item's storage is read straight into its target where it is the same plain CPU
    tensor (one copy: from the page cache or the S3 client's chunks into the model), else into a buffer kept for the
    file's items and decoded where it lies (a view of the buffer, copied once into the target); torch.load where
    that decoding does not apply (an item with transforms, a tensor that is not a plain dense one)."""
    import mmap

    items = sorted(items, key=lambda i: reader.storage_data[i.storage_index].offset)
    buffer = None

    def read_into(piece, at: int, size: int, what: str) -> memoryview:
        """`size` bytes of the item from byte `at`, into the buffer (pages made as it is first filled, then reused;
        the one before goes with its last view): valid until the next read."""
        nonlocal buffer
        if buffer is None or len(buffer) < size:
            buffer = mmap.mmap(-1, max(size, 1 << 20))
        view = memoryview(buffer)[:size]
        piece.seek(at)
        _fill(piece, view, what)
        return view

    fetched = None
    if prefetched is not None:
        try:
            fetched = prefetched.result()
        except errors():  # noqa: BLE001 - read it as usual: its error, if it has one, is said there
            fetched = None
    if fetched is None and direct is not None:
        try:
            _stream_file(direct, reader, path, items, planner)
            return
        except errors() as error:  # noqa: BLE001 - read again the usual way, which says its error if it has one
            _say(f"checkpoint: {path} is read again through {type(reader).__name__} ({str(error).splitlines()[0][:200]})")
    whole = not random_access and fetched is None  # (memory answers a read anywhere at no cost)
    try:
        with (contextlib.nullcontext(_Bytes(memoryview(fetched))) if fetched is not None else
              reader.fs.create_stream(reader.fs.concat_path(reader.path, path), "rb")) as stream:
            for req in items:
                info = reader.storage_data[req.storage_index]
                _load_item(reader, req, info, reader._slice_file(stream, info), planner, read_into,
                           f"{path}: the item at byte {info.offset}", whole)
    finally:
        if buffer is not None:
            try:
                buffer.close()
            except BufferError:  # a view of it still held (an error's traceback): it goes with that
                pass


def _load_item(reader, req, info, piece, planner, read_into, what: str, whole: bool) -> None:
    """One item of the plan from `piece` (a stream of the item's bytes, read by range): a tensor's storage straight
    into its target where it is the same plain CPU tensor, else decoded in the buffer read_into fills (copied once
    into the target) or through torch.load; BYTE_IO items and items with transforms as DCP's reader reads them."""
    import torch
    from torch.distributed.checkpoint.filesystem import narrow_tensor_by_index
    from torch.distributed.checkpoint.planner import LoadItemType

    transforms = getattr(info, "transform_descriptors", None)  # (torch >= 2.7: compression and the like)
    if req.type == LoadItemType.BYTE_IO or transforms:
        if hasattr(reader, "transforms"):
            piece = reader.transforms.transform_load_stream(req, transforms or (), piece)
        if req.type == LoadItemType.BYTE_IO:
            data = io.BytesIO(piece.read(-1))
            data.seek(0)
            planner.load_bytes(req, data)
            return
        tensor = torch.load(piece if piece.seekable() else io.BytesIO(piece.read(-1)), map_location="cpu",
                            weights_only=True)
    else:
        item = _Item(piece, info.length, read_into, what, whole)
        layout = _saved_layout(item.read, info.length)
        target = planner.resolve_tensor(req).detach()
        if layout is not None and _fits(target, layout, req):
            item.copy_to(layout[4], _memory_of(target))
            planner.commit_tensor(req, target)
            item = target = None
            return
        tensor = (_tensor_at(item.read, layout) if layout is not None else
                  torch.load(_Bytes(item.read(0, info.length)), map_location="cpu", weights_only=True))
        item = None
    tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if target.size() != tensor.size():
        raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
    target.copy_(tensor)
    planner.commit_tensor(req, target)
    tensor = target = None  # nothing of the buffer is held before the next item reads into it


GAP = 8 << 20  # items of a file further apart than this are asked in GETs of their own (a resharded read's slices)
HEAD = 4096  # an item's first bytes read before its storage: torch.save's zip headers and pickle of one tensor


def _stream_file(direct, reader, path: str, items: list, planner) -> None:
    """One file's items streamed in the order of their bytes: one ranged GET per run of items (those less than GAP
    apart; the bytes between read and dropped), each tensor's storage read from the socket straight into its target
    where it is the same plain CPU tensor (_stream_item), every other item into a buffer and loaded from there."""
    import mmap

    items = sorted(items, key=lambda i: reader.storage_data[i.storage_index].offset)
    runs: list[list] = []  # [start, end, items]
    for req in items:
        info = reader.storage_data[req.storage_index]
        if runs and info.offset - runs[-1][1] <= GAP:
            runs[-1][1] = max(runs[-1][1], info.offset + info.length)
            runs[-1][2].append(req)
        else:
            runs.append([info.offset, info.offset + info.length, [req]])
    buffers: dict[str, mmap.mmap] = {}

    def buffer(use: str, size: int) -> memoryview:
        """A buffer kept for the file's reads of one use (an item whole, the reads of its decode): valid until the
        next of that use."""
        if use not in buffers or len(buffers[use]) < size:
            buffers[use] = mmap.mmap(-1, max(size, 1 << 20))
        return memoryview(buffers[use])[:size]

    def read_into(piece, at: int, size: int, what: str) -> memoryview:
        view = buffer("decode", size)
        piece.seek(at)
        _fill(piece, view, what)
        return view

    head = memoryview(bytearray(HEAD))
    try:
        for start, end, run in runs:
            body = direct(path, start, end)
            try:
                at = start
                for req in run:
                    info = reader.storage_data[req.storage_index]
                    body.skip(info.offset - at)
                    _stream_item(body, reader, req, info, planner, head, buffer, read_into,
                                 f"{path}: the item at byte {info.offset}")
                    at = info.offset + info.length
                body.skip(end - at)
            finally:
                body.close()
    finally:
        for kept in buffers.values():
            try:
                kept.close()
            except BufferError:  # a view of it still held (an error's traceback): it goes with that
                pass


def _stream_item(body, reader, req, info, planner, head: memoryview, buffer, read_into, what: str) -> None:
    """One item from `body`, which stands at its first byte; its last byte read when this returns."""
    from torch.distributed.checkpoint.planner import LoadItemType

    if req.type != LoadItemType.BYTE_IO and not getattr(info, "transform_descriptors", None):
        seen = head[:min(info.length, HEAD)]
        body.fill(seen)
        found = _head_layout(seen, info.length)
        target = planner.resolve_tensor(req).detach()
        if found is not None and _fits(target, found[0], req):
            first, stored = found[0][4], found[0][5]
            memory = _memory_of(target)
            have = max(0, min(len(seen) - first, stored))
            memory[:have] = seen[first:first + have]
            body.fill(memory[have:])
            after = bytes(seen[first + stored:first + stored + 24])  # (a storage that ends in the head)
            rest = buffer("whole", info.length - max(len(seen), first + stored))
            body.fill(rest)
            after = (after + bytes(rest[:24]))[:24]
            if found[1] and not (after[:4] == b"PK\x07\x08" and stored in (int.from_bytes(after[8:12], "little"),
                                                                            int.from_bytes(after[8:16], "little"))):
                raise ValueError(f"{what}: its storage's data descriptor is not where its size puts it")
            planner.commit_tensor(req, target)
            return
        whole = buffer("whole", info.length)
        whole[:len(seen)] = seen
        body.fill(whole[len(seen):])
    else:
        whole = buffer("whole", info.length)
        body.fill(whole)
    _load_item(reader, req, info, _Bytes(whole), planner, read_into, what, False)


def _head_layout(head: memoryview, length: int):
    """(_saved_layout's layout, whether a data descriptor follows the storage) of the tensor torch.save wrote into an
    item of `length` bytes that begins with `head`, read forwards (a stream cannot ask for the zip's central directory
    at the item's end first): the first entry's pickle, the byte order, and the local header of the storage's entry,
    found by its name. None where it is not the plain case, or where the storage does not begin within `head`."""
    import struct

    data = bytes(head)
    try:
        if data[:4] != b"PK\x03\x04":
            return None
        method, = struct.unpack_from("<H", data, 8)
        names, extras = struct.unpack_from("<HH", data, 26)
        name = data[30:30 + names]
        if method != 0 or not name.endswith(b"data.pkl"):
            return None
        prefix = name[:-len(b"data.pkl")]
        found = _pickled_tensor(data[30 + names + extras:])
        if found is None:
            return None
        dtype, key, numel, offset, size, stride = found
        stored = numel * dtype.itemsize
        at = 0
        while True:
            at = data.find(b"PK\x03\x04", at + 1)
            if at < 0 or at + 30 > len(data):
                return None
            flags, method = struct.unpack_from("<HH", data, at + 6)
            declared, = struct.unpack_from("<I", data, at + 18)
            names, extras = struct.unpack_from("<HH", data, at + 26)
            name, first = data[at + 30:at + 30 + names], at + 30 + names + extras
            if name == prefix + b"byteorder" and data[first:first + 6] != b"little":
                return None
            if name == prefix + f"data/{key}".encode():
                if method != 0 or first > len(data) or first + stored > length or (not flags & 8 and declared != stored):
                    return None
                return (dtype, size, stride, offset, first, stored), bool(flags & 8)
    except _NOT_PLAIN + (struct.error,):
        return None


class _Direct:
    """Ranged GetObject requests through botocore (the credentials it finds, SigV4, the endpoint, its retries of a
    request that was not answered), each answer's body read from the socket straight into the caller's memory
    (http.client's readinto under urllib3's response): one copy of every byte, where s3torchconnector hands its
    chunks over as new Python bytes and urllib3's own read() makes new bytes too (fresh memory, a page fault per
    4 kB, then a second copy)."""

    def __init__(self, endpoint: str | None, region: str, connections: int):
        import botocore.session
        from botocore.config import Config

        config = Config(max_pool_connections=connections, retries={"max_attempts": 3, "mode": "standard"},
                        s3={"addressing_style": "path"} if endpoint else None)
        self.client = botocore.session.get_session().create_client("s3", region_name=region, endpoint_url=endpoint,
                                                                  config=config)

    def read(self, bucket: str, key: str) -> bytes:
        """A whole (small) object, one GetObject; FileNotFoundError where there is no such key."""
        try:
            answer = self.client.get_object(Bucket=bucket, Key=key)
        except self.client.exceptions.NoSuchKey:
            raise FileNotFoundError(f"s3://{bucket}/{key}") from None
        with contextlib.closing(answer["Body"]) as body:
            return body.read()

    def get(self, bucket: str, key: str, start: int, end: int) -> "_Body":
        answer = self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
        body = _Body(answer["Body"], end - start, f"s3://{bucket}/{key}")
        if answer.get("ContentLength") != end - start:
            body.close()
            raise OSError(f"s3://{bucket}/{key}: {answer.get('ContentLength')} bytes answered for {end - start} asked")
        return body


class _Body:
    """The rest of one answer's body, read in order into the caller's memory."""

    def __init__(self, body, length: int, what: str):
        self.raw = getattr(body, "_raw_stream", body)  # urllib3's response
        self.stream = getattr(self.raw, "_fp", None) or self.raw  # http.client's: readinto fills the memory given
        self.left, self.what, self.dropped = length, what, None

    def fill(self, view: memoryview) -> None:
        if len(view) > self.left:
            raise OSError(f"{self.what}: {len(view)} bytes asked where {self.left} are left")
        _fill(self.stream, view, self.what)
        self.left -= len(view)

    def skip(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"{self.what}: items overlap")
        while size:
            if self.dropped is None:
                self.dropped = memoryview(bytearray(1 << 20))
            part = min(size, len(self.dropped))
            self.fill(self.dropped[:part])
            size -= part

    def close(self) -> None:
        """Its connection back to the pool where the whole body was read, else closed."""
        if self.left == 0 and hasattr(self.raw, "release_conn"):
            self.raw.release_conn()
        else:
            self.raw.close()


class _Item:
    """One item's bytes, asked by range: through the stream (its reads go where they are asked), or, `whole`, read
    once into the buffer, in order, and answered from there; a stream over memory (_Bytes) from that memory."""

    def __init__(self, piece, length: int, read_into, what: str, whole: bool):
        self.piece, self.read_into, self.what = piece, read_into, what
        if isinstance(piece, _Bytes):  # the item's bytes in memory already (a streamed item): answered from there
            self.bytes = piece.view[:length]
        else:
            self.bytes = read_into(piece, 0, length, what) if whole else None

    def read(self, at: int, size: int) -> memoryview:
        """Valid until the next read."""
        if self.bytes is not None:
            return self.bytes[at:at + size]
        return self.read_into(self.piece, at, size, self.what)

    def copy_to(self, at: int, memory: memoryview) -> None:
        """The item's bytes from `at` into `memory`, straight from the stream."""
        if self.bytes is not None:
            memory[:] = self.bytes[at:at + len(memory)]
        elif len(memory):
            self.piece.seek(at)
            _fill(self.piece, memory, self.what)


def _fill(piece, view: memoryview, what: str) -> None:
    read = 0
    while read < len(view):
        got = piece.readinto(view[read:])
        if not got:
            raise OSError(f"{what} ends after {read} of {len(view)} bytes")
        read += got


def _fits(target, layout, req) -> bool:
    """Whether the saved storage is, byte for byte, the target's memory: a dense CPU tensor of the same dtype and
    shape, the saved one contiguous from its storage's first byte and read whole (not a slice of it, as a resharded
    restore reads)."""
    import torch

    dtype, size, stride, offset, first, stored = layout
    if (target.device.type != "cpu" or target.layout != torch.strided or target.dtype != dtype
            or tuple(target.shape) != tuple(size) or not target.is_contiguous() or offset
            or stored != target.numel() * dtype.itemsize or any(req.storage_offsets)
            or tuple(req.lengths) != tuple(size)):
        return False
    step = 1
    for n, s in reversed(list(zip(size, stride))):
        if n != 1 and s != step:
            return False
        step *= n
    return True


def _memory_of(tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, writable, in place (the tensor must outlive the view)."""
    import ctypes

    size = tensor.numel() * tensor.element_size()
    if not size:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * size).from_address(tensor.data_ptr())).cast("B")


class _Bytes:
    """A read-only file over a memoryview: torch.load and zipfile read from it, nothing copied but what they read."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def read(self, size: int | None = -1) -> bytes:
        end = len(self.view) if size is None or size < 0 else min(len(self.view), self.pos + size)
        out = self.view[self.pos:end].tobytes()
        self.pos = end
        return out

    def readinto(self, target) -> int:
        out = memoryview(target).cast("B")
        n = min(len(out), len(self.view) - self.pos)
        out[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else len(self.view) + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


def _saved_tensor(view: memoryview):
    """The tensor torch.save wrote into `view` (one DCP item), as a view of that memory: no new storage, nothing
    copied. None where it is not the plain case (_saved_layout): the caller then uses torch.load."""
    def read(at: int, size: int) -> memoryview:
        return view[at:at + size]

    layout = _saved_layout(read, len(view))
    return None if layout is None else _tensor_at(read, layout)


def _tensor_at(read, layout):
    """The saved tensor as a view of its storage's bytes, read(first byte, length) (_saved_layout's layout)."""
    import torch

    dtype, size, stride, offset, first, stored = layout
    storage = torch.frombuffer(read(first, stored), dtype=dtype) if stored else torch.empty(0, dtype=dtype)
    return storage.as_strided(size, stride, offset)


def _saved_layout(read, length: int):
    """Where the tensor torch.save wrote into one DCP item of `length` bytes lies: (dtype, size, stride, storage
    offset, the first byte of its storage in the item, the storage's length), the item's bytes asked through
    read(at, size) -> bytes-like (a few hundred bytes: the zip's central directory, the pickle, the byte order), so
    the storage can be read straight to where it goes. None where it is not the plain case: a tensor of one dense
    storage, little-endian, stored uncompressed in a zip without zip64 records. The pickle is read with a restricted
    unpickler that knows only torch's tensor rebuild, its storage types and OrderedDict (as torch.load's weights_only
    does)."""
    import struct

    try:
        end = length - 22  # the end of central directory record (torch writes no comment)
        if end < 0:
            return None
        tail = read(end, 22)
        if tail[:4] != b"PK\x05\x06":
            return None
        count, size, at = struct.unpack_from("<HII", tail, 10)
        if count == 0xFFFF or at == 0xFFFFFFFF or at + size > end:  # zip64: leave it to torch.load
            return None
        directory, records, at = read(at, size), {}, 0
        for _ in range(count):  # central directory: name -> (method, size, local header's offset)
            if directory[at:at + 4] != b"PK\x01\x02":
                return None
            method, = struct.unpack_from("<H", directory, at + 10)
            size, = struct.unpack_from("<I", directory, at + 20)
            names, extras, comments = struct.unpack_from("<HHH", directory, at + 28)
            local, = struct.unpack_from("<I", directory, at + 42)
            name = bytes(directory[at + 46:at + 46 + names]).decode()
            records[name.split("/", 1)[-1]] = (method, size, local)
            at += 46 + names + extras + comments

        def place(name: str) -> tuple[int, int]:
            method, size, local = records[name]
            header = read(local, 30)
            if method != 0 or header[:4] != b"PK\x03\x04":
                raise ValueError(name)
            names, extras = struct.unpack_from("<HH", header, 26)
            first = local + 30 + names + extras
            if first + size > length:
                raise ValueError(name)
            return first, size

        if "byteorder" in records and bytes(read(*place("byteorder"))).strip() != b"little":
            return None
        found = _pickled_tensor(read(*place("data.pkl")))
        if found is None:
            return None
        dtype, key, numel, offset, size, stride = found
        first, stored = place(f"data/{key}")
        if stored != numel * dtype.itemsize:
            return None
        return dtype, size, stride, offset, first, stored
    except _NOT_PLAIN + (KeyError, struct.error):
        return None


# what a zip or a pickle that is not torch.save's plain tensor raises while it is read
_NOT_PLAIN = (ValueError, TypeError, AttributeError, RuntimeError, EOFError, UnicodeDecodeError, pickle.UnpicklingError)


def _pickled_tensor(data) -> tuple | None:
    """(dtype, storage key, numel, storage offset, size, stride) of the one tensor torch.save pickled in `data` (its
    data.pkl; bytes after the pickle's end are not read), None where it pickled anything else; raises _NOT_PLAIN."""
    found = _TensorUnpickler(io.BytesIO(data)).load()
    if not (isinstance(found, tuple) and len(found) == 5 and found[0] == "tensor"):
        return None
    _, (dtype, key, numel), offset, size, stride = found
    return dtype, key, numel, offset, size, stride


class _StorageName(str):
    """A torch storage type's name in a pickle (torch.FloatStorage -> "FloatStorage")."""


class _TensorUnpickler(pickle.Unpickler):
    """torch.save's pickle of one tensor, read as ("tensor", (dtype, storage key, numel), offset, size, stride); it
    knows only torch's tensor rebuild, its storage types (by name) and OrderedDict, and refuses anything else."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuilt
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name.endswith("Storage") and name != "UntypedStorage":
            return _StorageName(name)  # its dtype by name, as torch.load finds it (the class's own warns)
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        from torch.storage import _get_dtype_from_pickle_storage_type

        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageName)):
            raise pickle.UnpicklingError(f"persistent id {pid!r}")
        return _get_dtype_from_pickle_storage_type(pid[1]), str(pid[2]), int(pid[4])


def _rebuilt(storage, offset, size, stride, *rest):
    return "tensor", storage, offset, tuple(size), tuple(stride)


def location(uri: str):
    return _S3(uri) if is_s3(uri) else _Folder(uri)


# --- the store ----------------------------------------------------------------------------------------------------------

def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


class Store:
    """A job's checkpoints at `uri` (a folder or s3://bucket/prefix): save (async), the newest complete one, load.

    `state` is what DCP saves: a dict of tensors, state_dicts and plain values (every rank passes the same keys).
    `meta` is a small JSON-able dict saved with it (step, epoch, ...), read back without loading the tensors."""

    def __init__(self, uri: str, keep: int = 3, log=_say):
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
