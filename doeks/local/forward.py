"""A TCP forwarder: `python -m doeks.local.forward LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT`. The EKS
rehearsal runs one on doeks' bridge address so that pods reach the moto server, which listens on loopback (it
outlives the cluster and its bridge: `invoke audit` reads it after `down`). Both ends are on this machine."""
from __future__ import annotations

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def main(listen_host: str, listen_port: int, target_host: str, target_port: int) -> None:
    async def handle(reader, writer):
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))

    server = await asyncio.start_server(handle, listen_host, listen_port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    host, port, target, target_port = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    if not (target.startswith("127.") or target == "localhost"):
        sys.exit("forward: the target must be on loopback")
    asyncio.run(main(host, port, target, target_port))
