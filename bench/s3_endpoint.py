"""An S3 endpoint that behaves like S3 at scale, for benchmarks: 127.0.0.1 only, objects from memory.

GetObject (with Range), HeadObject and ListObjectsV2 (paged, at most 1000 keys, prefix, delimiter, start-after,
continuation token) over plain HTTP/1.1 keep-alive, path-style addressing. Writes too, kept in memory (bench/checkpoint.py
saves checkpoints here): PutObject, multipart uploads (create, upload part, complete with S3's
CompleteMultipartUploadResult, abort), CopyObject, DeleteObject and DeleteObjects; aws-chunked bodies (the CRT client's
trailing checksums) are decoded. Each request waits `--latency-ms` (default
20 ms, S3's typical time to first byte for small objects) on a timer before its answer, so throughput grows with
requests in flight, as on S3; an asyncio server serves thousands of requests at once on one core, so a client's own
concurrency and CPU cost per request, not the server, set its rate. Signatures are not checked.

Objects: `--files` keys `PREFIX/train/nCCCCCCCC/img_IIIIIII.JPEG` (100 classes) of `--size` bytes +-20 %
(deterministic per key), all slices of one random buffer, so 20,000 objects take no memory of their own.

Faults for the clients' tests: `--fail-every N` answers every Nth request 503 SlowDown; `--reset-every N` resets the
connection (TCP RST) on every Nth request, alternately before any byte of the answer and after its head and half its
body (a connection S3 or a middlebox drops mid-request), which a client must retry on a new connection.

Bounded: it serves at most `--max-requests` requests and runs at most `--max-seconds`, then exits by itself (also
when its parent dies: stdin closes). Prints `port N` once it listens.

Run: python bench/s3_endpoint.py [--files 20000] [--size 110000] [--latency-ms 20] [--bucket bench] [--prefix imagenet]
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import socket
import struct
import sys
import time
from email.utils import formatdate
from urllib.parse import parse_qsl, quote, unquote
from xml.sax.saxutils import escape

LAST_MODIFIED = formatdate(1_700_000_000, usegmt=True).encode()
LAST_MODIFIED_ISO = "2023-11-14T22:13:20.000Z"


class Store:
    def __init__(self, bucket: str, prefix: str, files: int, size: int, seed: int = 7):
        rng = random.Random(seed)
        self.bucket = bucket
        self.buffer = memoryview(rng.randbytes(2 * size + 4096))  # the same bytes in every process
        self.objects: dict[str, tuple[int, int, bytes]] = {}  # key -> (offset, size, etag)
        for i in range(files):
            key = f"{prefix}/train/n{i % 100:08d}/img_{i:07d}.JPEG" if prefix else f"train/n{i % 100:08d}/img_{i:07d}.JPEG"
            length = max(1, int(size * rng.uniform(0.8, 1.2)))
            offset = rng.randrange(0, len(self.buffer) - length)
            self.objects[key] = (offset, length, b'"' + hashlib.md5(key.encode()).hexdigest().encode() + b'"')
        self.keys = sorted(self.objects)
        self.total_bytes = sum(v[1] for v in self.objects.values())
        self.written: dict[str, bytes] = {}  # objects put by clients
        self.uploads: dict[str, dict[int, tuple[bytes, bytes]]] = {}  # upload id -> part number -> (bytes, MD5)
        self.upload_keys: dict[str, str] = {}

    def body(self, key: str) -> memoryview:
        if key in self.written:
            return memoryview(self.written[key])
        offset, length, _ = self.objects[key]
        return self.buffer[offset:offset + length]

    def put(self, key: str, data: bytes, etag: bytes | None = None) -> bytes:
        import bisect

        etag = etag or b'"' + hashlib.md5(data).hexdigest().encode() + b'"'
        if key not in self.objects:
            bisect.insort(self.keys, key)
        self.written[key] = data
        self.objects[key] = (0, len(data), etag)
        return etag

    def delete(self, key: str) -> None:
        import bisect

        if key in self.objects:
            del self.objects[key]
            self.written.pop(key, None)
            self.keys.pop(bisect.bisect_left(self.keys, key))

    def list_v2(self, query: dict[str, str]) -> bytes:
        import bisect

        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter", "")
        max_keys = min(1000, int(query.get("max-keys", "1000") or 1000))
        start = query.get("continuation-token") or query.get("start-after") or ""
        index = bisect.bisect_right(self.keys, start) if start else bisect.bisect_left(self.keys, prefix)
        contents, prefixes, last = [], [], None
        while index < len(self.keys) and len(contents) + len(prefixes) < max_keys:
            key = self.keys[index]
            if not key.startswith(prefix):
                break
            if delimiter and delimiter in key[len(prefix):]:
                common = key[:len(prefix) + key[len(prefix):].index(delimiter) + len(delimiter)]
                prefixes.append(common)
                last = common + "\uffff"  # skip every key under this common prefix
                index = bisect.bisect_right(self.keys, last)
                continue
            contents.append(key)
            last = key
            index += 1
        truncated = index < len(self.keys) and self.keys[index].startswith(prefix)
        encode = query.get("encoding-type") == "url"
        name = (lambda k: quote(k, safe="/")) if encode else escape
        parts = [f'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                 f"<Name>{escape(self.bucket)}</Name><Prefix>{name(prefix)}</Prefix><KeyCount>{len(contents) + len(prefixes)}</KeyCount>"
                 f"<MaxKeys>{max_keys}</MaxKeys><IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]
        if delimiter:
            parts.append(f"<Delimiter>{name(delimiter)}</Delimiter>")
        if encode:
            parts.append("<EncodingType>url</EncodingType>")
        if query.get("continuation-token"):
            parts.append(f"<ContinuationToken>{escape(query['continuation-token'])}</ContinuationToken>")
        if truncated:
            parts.append(f"<NextContinuationToken>{escape(last)}</NextContinuationToken>")
        for key in contents:
            _, length, etag = self.objects[key]
            parts.append(f"<Contents><Key>{name(key)}</Key><LastModified>{LAST_MODIFIED_ISO}</LastModified>"
                         f"<ETag>{escape(etag.decode())}</ETag><Size>{length}</Size><StorageClass>STANDARD</StorageClass></Contents>")
        for common in prefixes:
            parts.append(f"<CommonPrefixes><Prefix>{name(common)}</Prefix></CommonPrefixes>")
        parts.append("</ListBucketResult>")
        return "".join(parts).encode()


class Limits:
    def __init__(self, max_requests: int, stop: asyncio.Event, fail_every: int = 0, log=None, reset_every: int = 0):
        self.served = 0
        self.max_requests = max_requests
        self.stop = stop
        self.fail_every = fail_every    # every Nth request answers 503 SlowDown (clients must retry)
        self.reset_every = reset_every  # every Nth request's connection is reset (clients must retry)
        self.resets = 0
        self.log = log                  # a file: one "METHOD target" line per request, "RESET METHOD target" per reset


class S3Protocol(asyncio.Protocol):
    def __init__(self, store: Store, latency: float, limits: Limits):
        self.store, self.latency, self.limits = store, latency, limits
        self.buffer = bytearray()  # appended in place: a request body of many MB arrives in 64 kB pieces
        self.busy = False
        self.continued = False
        self.waiting = 0  # bytes the request being received needs in all (its head parsed once)
        self.transport = None
        self.reset_mid_answer = False  # this request's answer stops after half its body, with a reset
        self.sending = None  # the rest of an answer's body (see _pump)
        self.paused = False  # the transport's buffer is over its limit (pause_writing) until resume_writing

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        self.buffer += data
        if not self.busy and len(self.buffer) >= self.waiting:
            self._next()

    def _next(self):
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buffer[:end].decode("latin-1").split("\r\n")
        headers = {}
        for line in head[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0") or 0)
        if len(self.buffer) < end + 4 + length:
            if headers.get("expect", "").lower() == "100-continue" and not self.continued:
                self.continued = True  # botocore's PutObject waits for it before it sends the body
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.waiting = end + 4 + length
            return  # wait for the request body
        self.continued = False
        self.waiting = 0
        body = bytes(self.buffer[end + 4:end + 4 + length])
        if "aws-chunked" in headers.get("content-encoding", "") or headers.get("x-amz-content-sha256", "").startswith("STREAMING"):
            body = _dechunk(body)
        headers[":body"] = body
        del self.buffer[:end + 4 + length]
        self.busy = True
        limits = self.limits
        limits.served += 1
        if limits.served >= limits.max_requests:
            limits.stop.set()
        if limits.log is not None:
            limits.log.write(head[0].rsplit(" ", 1)[0] + "\n")
        if limits.fail_every and limits.served % limits.fail_every == 0:
            self._send(b"503 Slow Down", b"", _error("SlowDown", "please reduce your request rate"), 0, later=True)
            return
        if limits.reset_every and limits.served % limits.reset_every == 0:
            limits.resets += 1
            if limits.log is not None:
                limits.log.write("RESET " + head[0].rsplit(" ", 1)[0] + "\n")
            if limits.resets % 2:  # before any byte of the answer, after the latency
                asyncio.get_running_loop().call_later(self.latency, self._reset)
                return
            self.reset_mid_answer = True  # the head and half the body, then the reset
        asyncio.get_running_loop().call_later(self.latency, self._answer, head[0], headers)

    def _answer(self, request_line: str, headers: dict[str, str]):
        if self.transport is None or self.transport.is_closing():
            return
        method, _, rest = request_line.partition(" ")
        target = rest.rsplit(" ", 1)[0]
        path, _, query_string = target.partition("?")
        bucket, _, key = unquote(path).lstrip("/").partition("/")
        query = dict(parse_qsl(query_string, keep_blank_values=True))
        store = self.store
        extra = b""
        if bucket != store.bucket:
            status, body = b"404 Not Found", _error("NoSuchBucket", bucket)
        elif not key and method == "GET" and query.get("list-type") == "2":
            status, body = b"200 OK", store.list_v2(query)
            extra = b"Content-Type: application/xml\r\n"
        elif not key and method == "HEAD":
            status, body = b"200 OK", b""
        elif method in ("PUT", "POST", "DELETE"):
            status, body, extra = self._write(method, key, query, headers)
        elif key in store.objects and method in ("GET", "HEAD"):
            _, length, etag = store.objects[key]
            body = store.body(key)
            status = b"200 OK"
            extra = b"ETag: " + etag + b"\r\nLast-Modified: " + LAST_MODIFIED + b"\r\nAccept-Ranges: bytes\r\nContent-Type: image/jpeg\r\n"
            ranged = headers.get("range", "")
            if ranged.startswith("bytes="):
                first, _, last = ranged[6:].partition("-")
                first_i = int(first) if first else max(0, length - int(last))
                last_i = min(length - 1, int(last)) if first and last else length - 1
                body = body[first_i:last_i + 1]
                status = b"206 Partial Content"
                extra += f"Content-Range: bytes {first_i}-{last_i}/{length}\r\n".encode()
            if method == "HEAD":
                self._send(status, extra, b"", len(body))
                return
        elif method in ("GET", "HEAD"):
            status, body = b"404 Not Found", _error("NoSuchKey", key)
        else:
            status, body = b"501 Not Implemented", _error("NotImplemented", method)
        if method == "HEAD":  # a HEAD answer has no body, an error's neither (s3fs's next request read it as its status)
            body = b""
        self._send(status, extra, body, len(body))

    def _write(self, method: str, key: str, query: dict[str, str], headers: dict) -> tuple[bytes, bytes, bytes]:
        store, data = self.store, headers[":body"]
        ns = 'xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'
        if method == "POST" and not key and "delete" in query:  # DeleteObjects
            import re

            from xml.sax.saxutils import unescape

            keys = [unescape(k.decode()) for k in re.findall(rb"<Key>(.*?)</Key>", data)]
            for each in keys:
                store.delete(each)
            deleted = "".join(f"<Deleted><Key>{escape(k)}</Key></Deleted>" for k in keys)
            return b"200 OK", f'<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult {ns}>{deleted}</DeleteResult>'.encode(), b""
        if method == "POST" and "uploads" in query:  # CreateMultipartUpload
            upload = hashlib.md5(f"{key}{time.monotonic()}".encode()).hexdigest()
            store.uploads[upload], store.upload_keys[upload] = {}, key
            return b"200 OK", (f'<?xml version="1.0" encoding="UTF-8"?>\n<InitiateMultipartUploadResult {ns}><Bucket>{store.bucket}'
                               f"</Bucket><Key>{escape(key)}</Key><UploadId>{upload}</UploadId></InitiateMultipartUploadResult>").encode(), b""
        if method == "PUT" and "uploadId" in query:  # UploadPart
            parts = store.uploads.get(query["uploadId"])
            if parts is None:
                return b"404 Not Found", _error("NoSuchUpload", query["uploadId"]), b""
            digest = hashlib.md5(data).digest()
            parts[int(query["partNumber"])] = (data, digest)
            return b"200 OK", b"", b'ETag: "' + digest.hex().encode() + b'"\r\n'
        if method == "POST" and "uploadId" in query:  # CompleteMultipartUpload
            parts = store.uploads.pop(query["uploadId"], None)
            store.upload_keys.pop(query["uploadId"], None)
            if parts is None:
                return b"404 Not Found", _error("NoSuchUpload", query["uploadId"]), b""
            # S3's ETag of a multipart object: the MD5 of its parts' MD5s, "-" their count (not a second MD5 pass over
            # every byte, which cost this process 0.3 s of CPU per 200 MB checkpoint)
            order = sorted(parts)
            etag = b'"' + hashlib.md5(b"".join(parts[n][1] for n in order)).hexdigest().encode() + f'-{len(order)}"'.encode()
            etag = store.put(key, b"".join(parts[n][0] for n in order), etag)
            return b"200 OK", (f'<?xml version="1.0" encoding="UTF-8"?>\n<CompleteMultipartUploadResult {ns}><Location>/{store.bucket}/'
                               f"{escape(key)}</Location><Bucket>{store.bucket}</Bucket><Key>{escape(key)}</Key>"
                               f"<ETag>{escape(etag.decode())}</ETag></CompleteMultipartUploadResult>").encode(), b""
        if method == "DELETE" and "uploadId" in query:  # AbortMultipartUpload
            store.uploads.pop(query["uploadId"], None)
            return b"204 No Content", b"", b""
        if method == "DELETE":
            store.delete(key)
            return b"204 No Content", b"", b""
        if method == "PUT" and headers.get("x-amz-copy-source"):  # CopyObject
            source = unquote(headers["x-amz-copy-source"]).lstrip("/").partition("/")[2].split("?")[0]
            if source not in store.objects:
                return b"404 Not Found", _error("NoSuchKey", source), b""
            etag = store.put(key, bytes(store.body(source)))
            return b"200 OK", (f'<?xml version="1.0" encoding="UTF-8"?>\n<CopyObjectResult {ns}><ETag>{escape(etag.decode())}</ETag>'
                               f"<LastModified>{LAST_MODIFIED_ISO}</LastModified></CopyObjectResult>").encode(), b""
        if method == "PUT" and key:  # PutObject
            return b"200 OK", b"", b"ETag: " + store.put(key, data) + b"\r\n"
        return b"501 Not Implemented", _error("NotImplemented", method), b""

    def _send(self, status: bytes, extra: bytes, body, length: int, later: bool = False):
        if later:  # answer after the latency, like every other answer
            asyncio.get_running_loop().call_later(self.latency, self._send, status, extra, body, len(body))
            return
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: " + str(length).encode() + b"\r\n" + extra +
                             b"x-amz-request-id: DOEKSBENCH\r\nServer: AmazonS3\r\n\r\n")
        if self.reset_mid_answer:
            self.transport.write(body[:len(body) // 2])
            self._reset()
            return
        self.sending = memoryview(body) if body else None
        self._pump()

    SLICE = 256 * 1024

    def _pump(self):
        """The answer's body in slices, each handed to the socket while the transport's buffer is below its limit: a
        slice the socket takes whole is not copied (one large write() copies all the socket does not take at once into
        the transport's buffer: 0.75 s of this process's CPU per GB served, S3's CPU that the bench would charge to
        the node); the next request is read once the body is out."""
        while self.sending is not None and not self.paused:
            if self.transport is None or self.transport.is_closing():
                self.sending = None
                return
            piece, self.sending = self.sending[:self.SLICE], self.sending[self.SLICE:]
            self.transport.write(piece)
            if not len(self.sending):
                self.sending = None
        if self.sending is None and self.busy and not self.paused:
            self.busy = False
            if self.buffer:
                self._next()

    def pause_writing(self):
        self.paused = True

    def resume_writing(self):
        self.paused = False
        self._pump()

    def _reset(self):
        """Close with a TCP RST (SO_LINGER 0): the client reads ECONNRESET, as from a dropped connection."""
        if self.transport is None or self.transport.is_closing():
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.transport.abort()

    def connection_lost(self, exc):
        self.transport = None


def _dechunk(body: bytes) -> bytes:
    """An aws-chunked body (`size;chunk-signature=...\\r\\ndata\\r\\n` ... `0\\r\\n` trailers) as its data."""
    out, at = [], 0
    while at < len(body):
        line_end = body.index(b"\r\n", at)
        size = int(body[at:line_end].split(b";", 1)[0], 16)
        if size == 0:
            break
        out.append(body[line_end + 2:line_end + 2 + size])
        at = line_end + 2 + size + 2
    return b"".join(out)


def _error(code: str, what: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{escape(what)}</Message>'
            f"<RequestId>DOEKSBENCH</RequestId></Error>").encode()


async def serve(store: Store, latency: float, max_requests: int, max_seconds: float, port: int = 0,
                fail_every: int = 0, log=None, tls=None, reset_every: int = 0) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    limits = Limits(max_requests, stop, fail_every, log, reset_every)
    server = await loop.create_server(lambda: S3Protocol(store, latency, limits), "127.0.0.1", port, backlog=4096, ssl=tls)
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
    loop.add_reader(sys.stdin.fileno(), lambda: stop.set() if not os.read(sys.stdin.fileno(), 4096) else None)
    start = time.monotonic()
    try:
        await asyncio.wait_for(stop.wait(), max_seconds)
    except asyncio.TimeoutError:
        pass
    server.close()
    cpu = os.times()
    print(f"served {limits.served} requests ({limits.resets} reset) in {time.monotonic() - start:.1f} s, "
          f"{cpu.user + cpu.system:.1f} CPU s", file=sys.stderr, flush=True)
    return 0


class _Drain(asyncio.Protocol):
    """The trivial client: one GET at a time per connection, the body counted and dropped."""

    def __init__(self):
        self.head, self.left, self.waiter, self.buffer = False, 0, None, b""

    def connection_made(self, transport):
        self.transport = transport

    def get(self, path: str):
        self.head, self.left, self.buffer = False, 0, b""
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
        return self.waiter

    def data_received(self, data):
        if not self.head:
            self.buffer += data
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            start = self.buffer.index(b"Content-Length: ") + 16
            self.left = int(self.buffer[start:self.buffer.index(b"\r\n", start)]) - (len(self.buffer) - end - 4)
            self.head = True
        else:
            self.left -= len(data)
        if self.left <= 0 and not self.waiter.done():
            self.waiter.set_result(None)

    def connection_lost(self, exc):
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("closed"))


async def ceiling(port: int, bucket: str, keys: list[str], connections: int) -> float:
    """GET every key (path-style, unsigned) over `connections` keep-alive connections; returns seconds."""
    loop = asyncio.get_running_loop()
    queue = list(reversed(keys))

    async def worker():
        _, conn = await loop.create_connection(_Drain, "127.0.0.1", port)
        while queue:
            await conn.get(f"/{bucket}/{queue.pop()}")
        conn.transport.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(connections)))
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=110_000)
    parser.add_argument("--latency-ms", type=float, default=20.0, help="time to first byte of every request")
    parser.add_argument("--bucket", default="bench")
    parser.add_argument("--prefix", default="imagenet")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-requests", type=int, default=1_000_000)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--ceiling", type=int, metavar="PORT", help="be the trivial client of the endpoint on PORT instead: "
                        "GET every object over --connections connections, print files/s")
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--fail-every", type=int, default=0, help="every Nth request answers 503 SlowDown")
    parser.add_argument("--reset-every", type=int, default=0, help="reset the connection (TCP RST) of every Nth request")
    parser.add_argument("--log", help="append one 'METHOD target' line per request to this file")
    parser.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"), help="serve HTTPS with this certificate (PEM files)")
    args = parser.parse_args(argv)
    store = Store(args.bucket, args.prefix.strip("/"), args.files, args.size)
    if args.ceiling:
        seconds = asyncio.run(ceiling(args.ceiling, args.bucket, store.keys, args.connections))
        print(f"{len(store.keys)} files in {seconds:.2f} s: {len(store.keys) / seconds:.0f} files/s", flush=True)
        return 0
    log = open(args.log, "a", buffering=1) if args.log else None
    tls = None
    if args.tls:
        import ssl

        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(*args.tls)
    try:
        return asyncio.run(serve(store, args.latency_ms / 1000, args.max_requests, args.max_seconds, args.port,
                                 args.fail_every, log, tls, args.reset_every))
    finally:
        if log is not None:
            log.close()


if __name__ == "__main__":
    sys.exit(main())
