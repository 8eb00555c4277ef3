"""Calibrate without a launcher: start ``nodes x ranks-per-node`` local ranks (torch
transport over loopback) and wait for them, killing them all if one fails."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from cocodiff.calibration.options import CalibrateOptions, CalibrationError


def self_launch(options: CalibrateOptions) -> int:
    """No launcher: run this command on ``nodes x ranks-per-node`` local ranks (torch
    transport, loopback rendezvous) and wait for them, killing them all if one fails."""
    num_nodes = options.nodes or 2
    world = num_nodes * options.ranks_per_node
    if world < 2:
        raise CalibrationError("calibration needs at least 2 ranks (--nodes x --ranks-per-node)")
    if options.transport not in ("auto", "torch"):
        raise CalibrationError(
            f"--transport {options.transport} needs its launcher (e.g. mpiexec -n 4 cocodiff "
            "calibrate); without one, calibrate launches itself with the torch transport"
        )
    argv = [sys.executable, "-m", "cocodiff", "calibrate", *_argv_of(options, num_nodes)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
    env["MASTER_ADDR"] = "127.0.0.1"
    env["MASTER_PORT"] = str(_free_port())
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    processes = []
    try:
        for rank in range(world):
            # Every rank is a process of this machine: devices are dealt over all of them
            # (ranks sharing a GPU then exchange through gloo, as nccl refuses them).
            rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(world))
            processes.append(subprocess.Popen(argv, env=rank_env, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
        deadline = time.monotonic() + options.timeout_s + 60  # + start-up of the ranks
        while True:
            codes = [p.poll() for p in processes]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                rank, code = bad[0]
                raise CalibrationError(f"calibration rank {rank} exited with code {code}")
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                raise CalibrationError(
                    f"calibration did not finish in {options.timeout_s + 60:g} s"
                )
            time.sleep(0.05)
    finally:
        for process in processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()


def _argv_of(options: CalibrateOptions, num_nodes: int) -> list[str]:
    argv = ["--model", options.model, "--dtype", options.dtype, "--nodes", str(num_nodes),
            "--ranks-per-node", str(options.ranks_per_node), "--inter-latency-us",
            str(options.inter_latency_us), "--max-kib", str(options.max_kib),
            "--transport", "torch",
            "--timeout", str(options.timeout_s), "--output", str(options.output.resolve())]
    for flag, value in (("--tokens", options.tokens), ("--resolution", options.resolution),
                        ("--inter-gbps", options.inter_gbps)):
        if value is not None:
            argv += [flag, str(value)]
    if options.json is not None:
        argv += ["--json", str(options.json.resolve())]
    if options.quick:
        argv.append("--quick")
    if options.fit_patterns:
        argv.append("--fit-patterns")
    if options.strict:
        argv.append("--strict")
    return argv


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
