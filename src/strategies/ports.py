"""Rendezvous port helpers shared by every launcher in the project."""

from __future__ import annotations

import errno
import socket
import time


def find_free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a TCP port that is free right now on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something already listens on ``host:port`` (a rendezvous would hang or fail there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


def parse_port(value: str) -> int | None:
    """``value`` as a TCP port (1-65535), or None when it is not one."""
    text = value.strip()
    if not text.isdigit():
        return None
    port = int(text)
    return port if 1 <= port <= 65535 else None


def wait_for_listener(host: str, port: int, timeout: float, interval: float = 0.5) -> bool:
    """True once something accepts TCP connections on ``host:port``; False when ``timeout`` seconds pass first.

    Used by a non-zero node before it joins the rendezvous: torch's store client would retry for the whole
    process-group timeout (30 minutes by default). The probe connects and closes at once; torch's TCP store
    ignores such a connection. Raises ``socket.gaierror`` when ``host`` does not resolve.
    """
    socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)  # a bad name fails now, not after the timeout
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(min(left, 5.0), 0.1)):
                return True
        except OSError:
            pass
        if deadline - time.monotonic() <= 0:
            return False
        time.sleep(min(interval, max(deadline - time.monotonic(), 0)))
