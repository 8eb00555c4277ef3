"""A bounded TCP transfer between two nodes of an emulated cluster: is the shaping in effect?

A receiver in the destination node's namespace accepts one connection and reads
``num_bytes``; a sender in the source node's namespace writes them and waits for a one-byte
acknowledgement, so the time covers delivery, not just handing bytes to the kernel. With
``both_ways`` the receiver sends as many bytes back over the same connection at the same
time (as a pair of ranks exchanging does): each direction should keep its link's rate.
Both sides give up after ``timeout_s``. Source and destination may be the same node: then
the bytes go to the node's own address, over its loopback.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass

from bench.cluster.netns import ClusterError, EmulatedCluster, Node

_PORT = 5201

_RECEIVER = r"""
import socket, sys, threading
host, port = sys.argv[1], int(sys.argv[2])
num_bytes, timeout_s, both = int(sys.argv[3]), float(sys.argv[4]), sys.argv[5] == "1"
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((host, port))
server.listen(1)
server.settimeout(timeout_s)
conn, _ = server.accept()
conn.settimeout(timeout_s)
if both:  # the same bytes back, while receiving
    back = threading.Thread(target=conn.sendall, args=(bytes(num_bytes),))
    back.start()
got = 0
while got < num_bytes:
    chunk = conn.recv(1 << 20)
    if not chunk:
        sys.exit("receiver: connection closed after %d of %d bytes" % (got, num_bytes))
    got += len(chunk)
if both:
    back.join()
conn.sendall(b"k")
"""

_SENDER = r"""
import socket, sys, threading, time
host, port = sys.argv[1], int(sys.argv[2])
num_bytes, timeout_s, both = int(sys.argv[3]), float(sys.argv[4]), sys.argv[5] == "1"
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
expected = num_bytes + 1 if both else 1  # the bytes sent back, then the acknowledgement
received = bytearray()

def receive():
    while len(received) < expected:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        received.extend(chunk)

block = bytes(1 << 20)
began = time.perf_counter()
reader = threading.Thread(target=receive)
reader.start()
sent = 0
while sent < num_bytes:
    view = block[: min(len(block), num_bytes - sent)]
    conn.sendall(view)
    sent += len(view)
reader.join()
if len(received) != expected or received[-1:] != b"k":
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
                     timeout_s: float = 30.0, both_ways: bool = False) -> Transfer:
    """Move ``num_bytes`` from ``src`` to ``dst`` over TCP (and, ``both_ways``, as many back
    at the same time over the same connection) and time it.

    Raises:
        ClusterError: either side failed or ran past ``timeout_s``.
    """
    before = cluster.link_bytes()[src.index][0]
    python = sys.executable
    args = [dst.address, str(_PORT), str(num_bytes), str(timeout_s), "1" if both_ways else "0"]
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
