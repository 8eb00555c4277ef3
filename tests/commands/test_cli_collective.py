"""`cocodiff collective`: nccl-tests-style rows, the JSON record, the published Aurora
cells from the command line, and one-line errors with exit code 2 and no output."""

from __future__ import annotations

import json

import pytest

from cocodiff.commands.cli import main
from cocodiff.commands.collective import parse_sizes

ROW_KEYS = {"nodes", "ranks", "bytes_per_rank", "schedule", "time_s", "algbw_gbps",
            "busbw_gbps"}


def exit_code(argv):
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def collective(tmp_path, *args):
    path = tmp_path / "rows.json"
    assert main(["collective", *args, "--json", str(path)]) == 0
    return json.loads(path.read_text())["rows"]


def test_aurora_two_nodes_reproduces_the_torch_distributed_cell(tmp_path, capsys):
    rows = collective(tmp_path, "--topology", "aurora", "--nodes", "2", "--op", "all-to-all",
                      "--bytes", "1MiB,2MiB,4MiB")
    assert [set(row) for row in rows] == [ROW_KEYS] * 3
    assert [row["ranks"] for row in rows] == [24] * 3
    # nccl-tests rounds the buffer to whole blocks: 4 MiB over 24 ranks.
    assert rows[2]["bytes_per_rank"] == (4 << 20) // 24 * 24
    assert rows[2]["busbw_gbps"] == pytest.approx(2.41, rel=0.15)  # published, 4 MiB
    for row in rows:
        assert row["algbw_gbps"] == pytest.approx(row["bytes_per_rank"] / row["time_s"] / 1e9)
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 23 / 24)
    out = capsys.readouterr().out
    assert "busbw" in out and "algbw" in out and "24 ranks" in out


def test_one_node_and_tapa(tmp_path):
    (one,) = collective(tmp_path, "--nodes", "1", "--bytes", "4MiB")
    assert one["busbw_gbps"] == pytest.approx(16.10, rel=0.15)  # published, 4 MiB
    flat = collective(tmp_path, "--nodes", "2", "--bytes", "4MiB")[0]
    tapa = collective(tmp_path, "--nodes", "2", "--bytes", "4MiB", "--schedule", "tapa")[0]
    assert tapa["schedule"] == "tapa" and tapa["time_s"] < flat["time_s"]


def test_a_topology_file(tmp_path):
    path = tmp_path / "machine.toml"
    path.write_text('preset = "aurora"\n[nodes]\ncount = 2\n[links.gpu]\nbandwidth_gbps = 28.0\n')
    (row,) = collective(tmp_path, "--topology", str(path), "--bytes", "64KiB",
                        "--collective", "ideal")
    assert (row["nodes"], row["ranks"]) == (2, 24)


def test_a_calibrated_collective_beside_the_topology_is_used_as_validate_uses_it(tmp_path):
    """plan, simulate and collective read calibrate's JSON beside a topology TOML (auto)
    or named, as validate does: a cluster is predicted with its fitted collective."""
    path = tmp_path / "machine.toml"
    path.write_text('preset = "aurora"\n[nodes]\ncount = 2\n')
    (preset,) = collective(tmp_path, "--topology", str(path), "--bytes", "64KiB",
                           "--collective", "ideal")
    path.with_suffix(".json").write_text(json.dumps(
        {"collective": {"name": "calibrated", "startup_us": 500.0}}))
    (beside,) = collective(tmp_path, "--topology", str(path), "--bytes", "64KiB")
    named = tmp_path / "other.json"
    named.write_text(path.with_suffix(".json").read_text())
    (given,) = collective(tmp_path, "--topology", str(path), "--bytes", "64KiB",
                          "--collective", str(named))
    # 23 messages per rank, each 500 us to set up, on top of what the links take.
    assert beside["time_s"] == pytest.approx(preset["time_s"] + 23 * 500e-6, rel=0.05)
    assert given["time_s"] == beside["time_s"]
    named.write_text("{}")
    assert exit_code(["collective", "--topology", str(path), "--collective", str(named)]) == 2


def test_sizes_parse_like_nccl_tests_and_si():
    assert parse_sizes("1MiB,2M,4096,1KB, 3GiB") == [1 << 20, 2 << 20, 4096, 1000, 3 << 30]


@pytest.mark.parametrize("args, message", [
    (["--op", "allreduce"], "unknown --op 'allreduce'"),
    (["--bytes", "0"], "--bytes '0'"),
    (["--bytes=-4MiB"], "--bytes '-4MiB'"),
    (["--bytes", "1MiB,x"], "cannot parse size 'x'"),
    (["--bytes", "1MiB,,2MiB"], "cannot parse size ''"),
    (["--bytes", "4QiB"], "cannot parse size '4QiB'"),
    (["--bytes", "8"], "less than one byte for each of 12 ranks"),
    (["--nodes", "0"], "expected a positive integer, got 0"),
    (["--schedule", "ring"], "unknown --schedule 'ring'"),
    (["--topology", "nope"], "unknown topology 'nope'"),
    (["--collective", "nope"], "unknown collective model 'nope'"),
])
def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, capsys, args, message):
    out = tmp_path / "rows.json"
    assert exit_code(["collective", "--nodes", "1", *args, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert not out.exists()
