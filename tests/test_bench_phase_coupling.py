"""``bench/phase_coupling.py``: TAPA's phases and the flat all-to-all through the real
transport (4 ranks as 2 "nodes" of 2 on loopback), the simulator's time beside each. Times
are only checked to exist, never compared."""

import json
import sys
from pathlib import Path

import pytest
from launching import launcher_prefix, needs_torchrun, run_job

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cocodiff.simulator.collective import PATTERN_CALLS, PATTERNS, pattern_groups  # noqa: E402

TOPOLOGY = """\
preset = "cluster"
name = "two-by-two"

[nodes]
count = 2
gpus = 2
tiles_per_gpu = 1

[host]
cores = 2.0
call_cpu_us = 100.0
message_cpu_us = 20.0
"""


def test_the_patterns_are_tapas_phases_and_the_world() -> None:
    # Rank 5 of 4 nodes x 2: node 2 = (4, 5), its column = the second rank of each node.
    groups = pattern_groups(4, 2, 5)
    assert groups == {"world": tuple(range(8)), "node": (4, 5), "column": (1, 3, 5, 7)}
    assert PATTERN_CALLS["tapa"] == (("node", False), ("column", False))
    assert PATTERN_CALLS["column+sync"] == (("column", False), ("node", True))


@pytest.mark.multiprocess
@needs_torchrun
def test_it_measures_and_simulates_every_pattern(tmp_path) -> None:
    topology = tmp_path / "topology.toml"
    topology.write_text(TOPOLOGY)
    out = tmp_path / "coupling.json"
    job = run_job([*launcher_prefix("torchrun", 4), "bench/phase_coupling.py",
                   "--ranks-per-node", "2", "--kib", "16", "--rounds", "1", "--repeats", "2",
                   "--topology", str(topology), "--json", str(out)], tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "tapa / (node + column)" in job.stdout
    report = json.loads(out.read_text())
    assert (report["num_nodes"], report["ranks_per_node"]) == (2, 2)
    for pattern in PATTERNS:
        assert len(report["measured_s"][pattern]) == 1 and report["median_s"][pattern] > 0
        assert report["simulated_s"][pattern] > 0
        # The ranks' process CPU per call, beside the wall time: every call costs some.
        assert len(report["cpu_s"][pattern]) == 1
        assert 0 < report["cpu_median_s"][pattern]
    # On the simulator, TAPA's second phase alone cannot take longer than both phases.
    assert report["simulated_s"]["column"] <= report["simulated_s"]["tapa"]


@pytest.mark.multiprocess
@needs_torchrun
def test_a_rank_count_the_nodes_cannot_split_is_refused(tmp_path) -> None:
    job = run_job([*launcher_prefix("torchrun", 2), "bench/phase_coupling.py",
                   "--ranks-per-node", "3"], tmp_path)
    assert job.returncode != 0
    assert "cannot sit 3 per node" in job.stderr
