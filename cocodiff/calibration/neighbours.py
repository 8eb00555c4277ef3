"""Other work on the ranks' hosts: the CPU a host spent beyond the ranks' own.

calibrate and validate time this machine; a job sharing its cores slows every measured
step and not the model, so the simulator then looks wrong. Neither a rank's CPU time per
layer (validate's drift check) nor a load average taken at two instants sees it reliably:
in issue 38's third mpiexec run another job started between calibrate and validate, every
row came out ~50% slow and the blocks' CPU per layer moved +3%. What does see it is the
host's own account: the busy time of all its CPUs (``/proc/stat``, hypervisor steal
included) less the CPU time of the ranks on it is what other processes used.

Everything here is collective: every rank of the transport calls it.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections import defaultdict
from dataclasses import dataclass

# /proc/stat's first line: cpu user nice system idle iowait irq softirq steal guest
# guest_nice (guest time is already counted in user). Busy = all but idle and iowait.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
# Past this share of a host's cores used by other processes, the measured steps are
# not this machine's: a quiet host's daemons take ~1%, the launcher's agent a little more.
FOREIGN_WARNING = 0.10


@dataclass(frozen=True, slots=True)
class CpuSnapshot:
    """One rank's clocks at an instant.

    Attributes:
        wall_s: a monotonic clock.
        host_busy_s: busy time of all the host's CPUs since boot; None where the
            platform does not say (no ``/proc/stat``).
        own_cpu_s: this process's CPU time, all its threads.
    """

    wall_s: float
    host_busy_s: float | None
    own_cpu_s: float


def snapshot() -> CpuSnapshot:
    return CpuSnapshot(time.monotonic(), _host_busy_s(), time.process_time())


def _host_busy_s() -> float | None:
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(value) for value in fields[1:]]
    return sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks)) / os.sysconf("SC_CLK_TCK")


def _host_key() -> float:
    """The same number on ranks of one host (one ``/proc/stat``): its hostname and boot.
    The emulated cluster's namespaces share both, as they share the CPUs."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = ""
    digest = hashlib.sha256(f"{socket.gethostname()}|{boot_id}".encode()).digest()
    return float(int.from_bytes(digest[:6], "big"))  # 48 bits: exact in a float64


def foreign_share(transport, began: CpuSnapshot) -> float | None:
    """The largest share, over the ranks' hosts, of a host's cores that processes other
    than the ranks used since ``began`` (every rank's own snapshot); None where a host
    does not account its CPUs. Collective; every rank gets the answer."""
    from cocodiff.calibration.collect import gather_floats

    now = snapshot()
    known = now.host_busy_s is not None and began.host_busy_s is not None
    row = [_host_key(), float(known),
           (now.host_busy_s - began.host_busy_s) if known else 0.0,  # type: ignore[operator]
           now.own_cpu_s - began.own_cpu_s, now.wall_s - began.wall_s,
           float(os.cpu_count() or 1)]
    return foreign_of_rows(gather_floats(transport, row))


def foreign_of_rows(rows: list[list[float]]) -> float | None:
    """:func:`foreign_share` from the gathered rows ``[host, known, host busy s, own CPU s,
    wall s, cores]``: per host, (its busy time - its ranks' CPU) / (wall x cores); the
    ranks of a host read the same busy time, so one of them counts it."""
    hosts: dict[float, list[list[float]]] = defaultdict(list)
    for row in rows:
        hosts[row[0]].append(row)
    shares = []
    for members in hosts.values():
        if not all(member[1] for member in members):
            return None
        busy = max(member[2] for member in members)
        own = sum(member[3] for member in members)
        capacity = max(member[4] for member in members) * members[0][5]
        if capacity > 0:
            shares.append(max(0.0, (busy - own) / capacity))
    return max(shares) if shares else None


def foreign_text(share: float | None) -> str | None:
    """The line a report prints past :data:`FOREIGN_WARNING`, else None."""
    if share is None or share <= FOREIGN_WARNING:
        return None
    return (f"other processes used {share:.0%} of the host's cores meanwhile: the measured "
            "times are slower than this machine's (measure on a quiet machine)")
