"""A bounded TCP transfer between two nodes of an emulated cluster: is the shaping in effect?

A receiver in the destination node's namespace accepts one connection and reads
``num_bytes``; a sender in the source node's namespace writes them and waits for a one-byte
acknowledgement, so the time covers delivery, not just handing bytes to the kernel. Both
sides give up after ``timeout_s``. Source and destination may be the same node: then the
bytes go to the node's own address, over its loopback.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

from bench.cluster.netns import ClusterError, EmulatedCluster, Node

_PORT = 5201

_RECEIVER = r"""
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
num_bytes, timeout_s = int(sys.argv[3]), float(sys.argv[4])
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((host, port))
server.listen(1)
server.settimeout(timeout_s)
conn, _ = server.accept()
conn.settimeout(timeout_s)
got = 0
while got < num_bytes:
    chunk = conn.recv(1 << 20)
    if not chunk:
        sys.exit("receiver: connection closed after %d of %d bytes" % (got, num_bytes))
    got += len(chunk)
conn.sendall(b"k")
"""

_SENDER = r"""
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
num_bytes, timeout_s = int(sys.argv[3]), float(sys.argv[4])
deadline = time.monotonic() + timeout_s
while True:  # the receiver may not be listening yet
    try:
        conn = socket.create_connection((host, port), timeout=timeout_s)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
conn.settimeout(timeout_s)
block = bytes(1 << 20)
began = time.perf_counter()
sent = 0
while sent < num_bytes:
    view = block[: min(len(block), num_bytes - sent)]
    conn.sendall(view)
    sent += len(view)
if conn.recv(1) != b"k":
    sys.exit("sender: no acknowledgement")
print(time.perf_counter() - began)
"""


@dataclass(frozen=True, slots=True)
class Transfer:
    """One measured transfer.

    Attributes:
        num_bytes: payload bytes moved.
        seconds: from the first byte written to the acknowledgement of the last.
        link_bytes: bytes the shaped links of the source node sent out meanwhile
            (frames, headers included; 0 when the transfer stayed inside the node).
    """

    num_bytes: int
    seconds: float
    link_bytes: int

    @property
    def payload_gbit(self) -> float:
        """Payload rate in Gbit/s."""
        return self.num_bytes * 8 / self.seconds / 1e9


def measure_transfer(cluster: EmulatedCluster, src: Node, dst: Node, num_bytes: int,
                     timeout_s: float = 30.0) -> Transfer:
    """Move ``num_bytes`` from ``src`` to ``dst`` over TCP and time it.

    Raises:
        ClusterError: either side failed or ran past ``timeout_s``.
    """
    before = cluster.link_bytes()[src.index][0]
    python = sys.executable
    args = [dst.address, str(_PORT), str(num_bytes), str(timeout_s)]
    receiver = cluster.spawn(dst, [python, "-c", _RECEIVER, *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sender = cluster.spawn(src, [python, "-c", _SENDER, *args], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
    began = time.monotonic()
    try:
        out, err = sender.communicate(timeout=timeout_s + 5)
        receiver.communicate(timeout=max(1.0, timeout_s + 5 - (time.monotonic() - began)))
    except subprocess.TimeoutExpired:
        raise ClusterError(
            f"transfer node {src.index} -> node {dst.index} did not finish in {timeout_s:g} s"
        ) from None
    finally:
        for process in (sender, receiver):
            if process.poll() is None:
                process.kill()
                process.wait()
    if sender.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        raise ClusterError(f"transfer node {src.index} -> node {dst.index} failed: "
                           f"{lines[-1] if lines else sender.returncode}")
    after = cluster.link_bytes()[src.index][0]
    return Transfer(num_bytes, float(out.decode().strip()), after - before)
