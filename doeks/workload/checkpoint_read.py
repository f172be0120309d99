"""How a checkpoint's files are read back: DCP's reader driven `threads` files at a time, each saved tensor decoded
where its bytes lie (torch.save's zip format, read forwards from a file or a stream) straight into the model's
memory, and the errors of checkpoints (CheckpointError: the job stops with its one line).

Beside checkpoints.py (standard library and torch only), in the training image and a SageMaker sourcedir alike.
"""
from __future__ import annotations

import collections
import contextlib
import io
import pickle
import sys


class CheckpointError(Exception):
    """A checkpoint that cannot be used: the job stops with this one line."""


def errors() -> tuple:
    """What a damaged checkpoint raises: DCP's CheckpointException is a BaseException (it carries every rank's)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _say(message: str) -> None:
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


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
