"""Loopback-only networking for tests that start servers or process groups on this machine."""

from __future__ import annotations

import socket


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS), or None if missing.

    Set as ``GLOO_SOCKET_IFNAME`` so gloo's connections between ranks never leave the machine.
    """
    for _, name in socket.if_nameindex():
        if name in ("lo", "lo0"):
            return name
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, for a server the test starts."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
