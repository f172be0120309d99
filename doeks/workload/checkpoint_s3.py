"""Checkpoints under s3://bucket/prefix: small objects and listing through s3fs, DCP's writer and reader through
Amazon's s3torchconnector where its client can write to the endpoint (else DCP's fsspec ones with s3fs), and a
restore's files streamed by ranged GetObjects of its own (_Direct: botocore signs them), read into the model's memory
by checkpoint_read.

Beside checkpoints.py, in the training image and a SageMaker sourcedir alike.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import threading

try:
    from .checkpoint_read import READ_THREADS, CheckpointError, _fill, _read_files_in_parallel, errors
except ImportError:  # beside train.py run as a script (the image's /workspace, a SageMaker sourcedir)
    from checkpoint_read import READ_THREADS, CheckpointError, _fill, _read_files_in_parallel, errors


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
        beside the probe's waits for answers). torch is imported whole on the caller's thread before either starts:
        the probe's connector imports torch, and a caller that has not yet imported it imports torch.distributed
        (DCP, to read the metadata) meanwhile; Python's import locks break that cycle by giving the caller a torch
        half imported, and torch's _c10d_init aborts the process (SIGABRT)."""
        if self.client is None:
            try:
                import torch.distributed  # noqa: F401 - (torch's own import includes it)
            except ImportError:  # no torch: the probe finds the connector missing, a save or a load says the rest
                pass
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
