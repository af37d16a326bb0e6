"""A free TCP port on 127.0.0.1, for the rendezvous of local launches (toolkit/launch/local.py)."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
