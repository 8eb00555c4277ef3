"""The ``[host]`` table: round trips, presets as bases, and one line for every bad value."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from topology import HostSpec, TopologyError, dump_topology, get_preset, load_topology
from topology.spec import validate_spec

BASE = """
preset = "cluster"

[host]
cores = 2
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "machine.toml"
    path.write_text(text)
    return path


def test_host_table_defaults(tmp_path: Path) -> None:
    spec = load_topology(write(tmp_path, BASE))
    assert spec.host == HostSpec(cores=2.0)
    assert spec.host.host_of(7) == 0  # no ranks_per_host: one host for every rank


def test_host_table_every_key_round_trips(tmp_path: Path) -> None:
    text = BASE + ("ranks_per_host = 4\ncompute_core_demand = 0.5\nmessage_cpu_us = 30\n"
                   "copy_gbps = 2.5\nbusy_poll = true\ncall_cpu_us = 400\ncall_wait_us = 900\n"
                   "diffusers_call_cpu_us = 550\nfollow_wait_us = 300\nwake_cpu_us = 150\n"
                   "late_peer_first = true\ncompute_among_calls = 1.25\n"
                   "transfer_cores = 0.75\n")
    spec = load_topology(write(tmp_path, text))
    assert spec.host == HostSpec(2.0, 4, 0.5, 30.0, 2.5, True, call_cpu_us=400.0,
                                 call_wait_us=900.0, diffusers_call_cpu_us=550.0,
                                 follow_wait_us=300.0, wake_cpu_us=150.0,
                                 late_peer_first=True, compute_among_calls=1.25,
                                 transfer_cores=0.75)
    assert spec.host.host_of(3) == 0 and spec.host.host_of(4) == 1
    again = tmp_path / "again.toml"
    again.write_text(dump_topology(spec))
    assert load_topology(again) == spec


def test_preset_host_is_a_base(tmp_path: Path) -> None:
    local = get_preset("cluster-local")
    assert local.host is not None and local.host.cores >= 1
    spec = load_topology(write(tmp_path, 'preset = "cluster-local"\n[host]\nbusy_poll = true\n'))
    assert spec.host == dataclasses.replace(local.host, busy_poll=True)


def test_no_host_table_means_no_host(tmp_path: Path) -> None:
    assert load_topology(write(tmp_path, 'preset = "cluster"\n')).host is None
    assert "[host]" not in dump_topology(get_preset("cluster"))


def test_exchange_cpu_seconds() -> None:
    host = HostSpec(cores=2, message_cpu_us=10.0, copy_gbps=1.0)
    assert host.exchange_cpu_s(3, 2e6) == pytest.approx(30e-6 + 2e-3)
    assert HostSpec(cores=2).exchange_cpu_s(5, 1e9) == 0.0
    called = HostSpec(cores=2, call_cpu_us=400.0, message_cpu_us=10.0)
    assert called.exchange_cpu_s(3, 0, calls=2) == pytest.approx(830e-6)
    assert called.charges_exchanges and not HostSpec(cores=2).charges_exchanges


BAD_HOST = {
    "zero cores": ("cores = 0", r"zero core count 0\.0 cores in host\.cores of .*machine\.toml"),
    "negative cores": ("cores = -1", r"negative core count -1\.0 cores in host\.cores"),
    "absurd cores": ("cores = 1e9", r"core count 1000000000\.0 cores in host\.cores .*above"),
    "ranks per host zero": ("ranks_per_host = 0",
                            r"non-positive count 0 in host\.ranks_per_host of"),
    "ranks per host float": ("ranks_per_host = 1.5",
                             r"expected an integer for host\.ranks_per_host of .*float 1\.5"),
    "demand above one": ("compute_core_demand = 2",
                         r"compute core demand 2\.0 in host\.compute_core_demand .*above 1"),
    "negative call cost": ("call_cpu_us = -1",
                           r"negative CPU time per exchange call -1\.0 us in host\.call_cpu_us"),
    "negative call wait": ("call_wait_us = -2",
                           r"negative wait per exchange call -2\.0 us in host\.call_wait_us"),
    "negative follow wait": (
        "follow_wait_us = -1",
        r"negative wait per exchange call made straight after another -1\.0 us in "
        r"host\.follow_wait_us"),
    "negative wake-up": (
        "wake_cpu_us = -1",
        r"negative CPU time per exchange call its rank is woken from -1\.0 us in "
        r"host\.wake_cpu_us"),
    "wake-up above the call's price": (
        "call_cpu_us = 100\nwake_cpu_us = 150",
        r"wake_cpu_us 150\.0 us exceeds call_cpu_us 100\.0 us, of which it is a part, in "
        r"host\.wake_cpu_us"),
    "negative diffusers call cost": (
        "diffusers_call_cpu_us = -4",
        r"negative CPU time per diffusers exchange call -4\.0 us in host\.diffusers_call_cpu_us"),
    "negative message cost": ("message_cpu_us = -3",
                              r"negative CPU time per message -3\.0 us in host\.message_cpu_us"),
    "zero copy rate": ("copy_gbps = 0", r"zero copy rate 0\.0 GB/s in host\.copy_gbps"),
    "busy poll string": ('busy_poll = "yes"',
                         r"expected true or false for host\.busy_poll of .*string 'yes'"),
    "zero compute factor": ("compute_among_calls = 0",
                            r"zero compute factor among exchange calls 0\.0 x in "
                            r"host\.compute_among_calls"),
    "negative transfer cores": ("transfer_cores = -0.5",
                                r"negative cores taken by transfers across nodes -0\.5 cores "
                                r"in host\.transfer_cores"),
    "transfer cores past the host's": (
        "transfer_cores = 2",
        r"transfer_cores 2\.0 leaves no core of the host's 2\.0 in host\.transfer_cores"),
    "late peer number": ("late_peer_first = 1",
                         r"expected true or false for host\.late_peer_first of .*1"),
    "unknown key": ("threads = 4", r"unknown key 'threads' in \[host\] of .*\(valid: cores,"),
}


@pytest.mark.parametrize("case", sorted(BAD_HOST))
def test_bad_host_value(tmp_path: Path, case: str) -> None:
    line, pattern = BAD_HOST[case]
    text = f'preset = "cluster"\n[host]\ncores = 2\n{line}\n'
    if line.startswith("cores"):
        text = f'preset = "cluster"\n[host]\n{line}\n'
    with pytest.raises(TopologyError, match=pattern) as info:
        load_topology(write(tmp_path, text))
    assert "\n" not in str(info.value)


def test_host_table_needs_cores(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"missing key cores in \[host\]"):
        load_topology(write(tmp_path, 'preset = "cluster"\n[host]\nbusy_poll = true\n'))


def test_validate_spec_refuses_a_bad_host_object() -> None:
    spec = dataclasses.replace(get_preset("cluster"), host=HostSpec(cores=float("nan")))
    with pytest.raises(TopologyError, match=r"core count nan cores is not finite in host\.cores"):
        validate_spec(spec)
