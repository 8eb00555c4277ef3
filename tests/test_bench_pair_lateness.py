"""``bench/pair_lateness.py``: cross-node pair exchanges through the real transport, every
rank on time, then the second half late (4 ranks on loopback). Times are only checked to
exist, never compared."""

import json
import sys
from pathlib import Path

import pytest
from launching import launcher_prefix, needs_torchrun, run_job

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def test_each_side_of_each_mode_is_summarised_apart() -> None:
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("bench_pair_lateness", REPO / "bench" / "pair_lateness.py")
    module = module_from_spec(spec)
    spec.loader.exec_module(module)
    per_rank = [{"on time": [1.0, 3.0], "late": [5.0, 5.0]},
                {"on time": [2.0, 2.0], "late": [6.0, 6.0]},
                {"on time": [4.0, 4.0], "late": [9.0, 7.0]},
                {"on time": [4.0, 6.0], "late": [8.0, 8.0]}]
    assert module.summarise(per_rank, 2) == {"on time": {"first": 2.0, "second": 4.0},
                                             "late": {"first": 5.5, "second": 8.0}}


@pytest.mark.multiprocess
@needs_torchrun
def test_it_times_both_sides_on_time_and_late(tmp_path) -> None:
    out = tmp_path / "lateness.json"
    job = run_job([*launcher_prefix("torchrun", 4), "bench/pair_lateness.py", "--kib", "4",
                   "--late-ms", "1", "--rounds", "2", "--json", str(out)], tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "the late node's exchange over its exchange on time" in job.stdout
    report = json.loads(out.read_text())
    assert report["world"] == 4 and len(report["per_rank_s"]) == 4
    for mode in ("on time", "late"):
        assert all(len(rank[mode]) == 2 for rank in report["per_rank_s"])
        assert report["median_s"][mode]["first"] > 0 and report["median_s"][mode]["second"] > 0
    # The late side waited its lateness before it called.
    assert report["median_s"]["late"]["second"] >= 1e-3
    assert report["late_over_on_time"] > 0
