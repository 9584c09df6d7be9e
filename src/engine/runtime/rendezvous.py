"""The rendezvous at ``MASTER_ADDR:MASTER_PORT``, checked before any rank starts.

A busy or malformed ``MASTER_PORT`` makes torch's TCP store fail after a long wait, a node started before
node 0 retries for the whole process-group timeout (30 minutes by default), then fails with C++ frames,
and several nodes with no address to meet at wait without limit. :func:`check_rendezvous` turns each
into one line, before the launch.
"""

from __future__ import annotations

import errno
import os
import socket
import time

from src.engine.runtime.launch_context import LaunchContext, launch_context
from src.engine.utils.errors import ConfigError


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


def check_rendezvous(num_nodes: int) -> None:
    """Before a launch that joins a process group: the port is a port and free, and node 0 is reachable."""
    ctx = launch_context()
    check_rendezvous_port(ctx)
    require_node_zero_address(ctx, num_nodes)
    wait_for_node_zero(ctx, num_nodes)


def require_node_zero_address(ctx: LaunchContext, num_nodes: int) -> None:
    """A plain command for several nodes must say where node 0's rendezvous is (MASTER_ADDR, MASTER_PORT).

    Without them node 0 would host a store on a port of its own choosing and wait, without limit, for nodes
    that cannot find it. torchrun, SLURM and SkyPilot's node script set them; a bare command does not.
    """
    if num_nodes < 2 or not ctx.before_launch or (ctx.master_addr and ctx.master_port):
        return
    raise ConfigError(
        f"trainer.num_nodes={num_nodes} but nothing says where node 0's rendezvous is (MASTER_ADDR and "
        "MASTER_PORT are not both set), so the nodes would wait for each other without limit; fix: start every "
        f"node with torchrun --nnodes={num_nodes} (docs/launching.md), or srun under SLURM, or export "
        "MASTER_ADDR=<node 0's address> MASTER_PORT=<a free port> NODE_RANK=<0..> on every node"
    )


def check_rendezvous_port(ctx: LaunchContext) -> None:
    """MASTER_PORT must be a port number, and free where this process will host the store.

    Only the process that will host the store checks for a busy port (node 0, not a rank another
    launcher started). When MASTER_PORT is unset, Lightning picks a free port itself.
    """
    port = ctx.master_port
    if port is None:
        return
    number = parse_port(port)
    if number is None:
        raise ConfigError(
            f"MASTER_PORT={port} is not a TCP port number (1-65535); fix: unset MASTER_PORT to pick a "
            "free port, or set it to a free port such as 29500"
        )
    if ctx.before_launch and ctx.node_rank == 0 and port_in_use(number, ctx.master_addr or "127.0.0.1"):
        raise ConfigError(
            f"MASTER_PORT={port} is already in use on this machine; fix: unset it to pick a free port, "
            "or choose another"
        )


RENDEZVOUS_TIMEOUT = "RENDEZVOUS_TIMEOUT"  # seconds a non-zero node waits for node 0's rendezvous
DEFAULT_RENDEZVOUS_TIMEOUT_S = 120.0


def rendezvous_timeout() -> float:
    """``RENDEZVOUS_TIMEOUT`` (seconds), default 120."""
    text = os.environ.get(RENDEZVOUS_TIMEOUT)
    if text is None:
        return DEFAULT_RENDEZVOUS_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(
            f"{RENDEZVOUS_TIMEOUT}={text} must be a number of seconds > 0; fix: e.g. "
            f"{RENDEZVOUS_TIMEOUT}=300, or unset it for {DEFAULT_RENDEZVOUS_TIMEOUT_S:g}"
        )
    return value


def wait_for_node_zero(ctx: LaunchContext, num_nodes: int) -> None:
    """A node started with NODE_RANK>0 waits a bounded time for node 0's rendezvous at MASTER_ADDR:MASTER_PORT.

    Nodes started by torchrun or SLURM are left to those launchers; a node's child ranks join after
    their parent has seen node 0.
    """
    if num_nodes < 2 or ctx.node_rank == 0 or not ctx.before_launch:
        return
    addr, port = ctx.master_addr, ctx.master_port  # both set: require_node_zero_address
    timeout = rendezvous_timeout()
    try:
        reachable = wait_for_listener(addr, int(port), timeout)
    except socket.gaierror as err:
        raise ConfigError(
            f"MASTER_ADDR={addr} does not resolve ({err.strerror}); fix: set MASTER_ADDR to node "
            "0's address or host name"
        ) from None
    if not reachable:
        raise ConfigError(
            f"nothing listens at MASTER_ADDR:MASTER_PORT={addr}:{port} after {timeout:g} s (node "
            f"{ctx.node_rank} of {num_nodes} waits for node 0's rendezvous there); fix: start node 0 "
            "(NODE_RANK=0) with the same MASTER_ADDR and MASTER_PORT, check that address and that the "
            f"port is open between the machines, or wait longer with {RENDEZVOUS_TIMEOUT}=<seconds>"
        )
