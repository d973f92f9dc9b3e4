"""Free TCP ports on the loopback interface."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that nobody listens on now. The caller binds it later, so another process may
    win it meanwhile: ``DevCluster.up`` starts once more when a component reports the address in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
