"""One rank of the check that calibrate's TAPA-phase CPU (``[host] phase_cpu_us``,
``cocodiff.calibration.routing``) is one value shared by every rank when timed through
the real transport: tiny-flux's phased exchanges of one layer on a 2 x 2 grid.

Usage: phase_cpu.py OUT_PREFIX   (each rank writes OUT_PREFIX.RANK: its rank and value)
"""

import json
import sys

from ending import exit_rank

from cocodiff.calibration.routing import measure_phase_cpu_s
from topology import HostSpec
from transports.registry import create_transport


def main() -> int:
    transport = create_transport("torch")
    try:
        host = HostSpec(cores=2, call_cpu_us=50.0, message_cpu_us=5.0)
        value = measure_phase_cpu_s(transport, "tiny-flux", None, None, "float32", 2, 2, host)
        with open(f"{sys.argv[1]}.{transport.rank}", "w") as out:
            json.dump({"rank": transport.rank, "phase_cpu_s": value}, out)
        transport.barrier()  # every rank past its file before any tears its groups down
    finally:
        transport.close()
    return 0


if __name__ == "__main__":
    # Without the interpreter's teardown: every rank closed cleanly, then one now and then
    # aborted in gloo's threads as the interpreter ended ("terminate called without an
    # active exception"; CI on 1acd0a9, and 2 of 14 runs beside a busy loop).
    exit_rank(main())
