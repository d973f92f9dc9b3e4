"""A TCP forwarder, run as its own process: ``python tcpforward.py LISTEN_HOST:PORT TARGET_HOST:PORT``.

The dev cluster's kube-apiserver serves on 127.0.0.1 only (kwok-only clusters need nothing else, and the
apiserver takes one bind address). With a real node, pods must reach it as they do in any cluster: through
the ``kubernetes`` Service (in-cluster config). This process listens on the node's bridge address and
passes the bytes through to the apiserver, TLS untouched (clients still verify its certificate, which
names the Service's address); the Service's EndpointSlice points at it (addons.kubernetes_endpoints, started by realnode_wiring.py).

Standard library only, run by path: it does not import the package.
"""

from __future__ import annotations

import asyncio
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # half-close: the other direction may still be sending
    except (ConnectionError, OSError):
        writer.close()


async def _serve(listen: tuple[str, int], target: tuple[str, int]) -> None:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*target)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(_pipe(client_r, server_w), _pipe(server_r, client_w))
        for w in (client_w, server_w):
            w.close()

    server = await asyncio.start_server(handle, *listen, reuse_address=True)
    print(f"forwarding {listen[0]}:{listen[1]} -> {target[0]}:{target[1]}", flush=True)  # once listening
    async with server:
        await server.serve_forever()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: tcpforward.py LISTEN_HOST:PORT TARGET_HOST:PORT", file=sys.stderr)
        return 2
    listen, target = _addr(argv[0]), _addr(argv[1])
    asyncio.run(_serve(listen, target))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
