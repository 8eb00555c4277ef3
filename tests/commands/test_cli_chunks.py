"""`--chunks`: auto (the default) takes the planner's fastest count per layout, which
`simulate` and `plan` print and the plan file records; a count that splits nothing is
refused in one line (exit 2)."""

import json

import pytest

from cocodiff.commands.cli import main

# FLUX.1-dev at 1024 px on 2 Aurora nodes, pure Ulysses: one head per rank.
PURE_2 = ["--nodes", "2", "--schedule", "tapa", "--parallel-layout", "pure", "--workers", "1"]


def test_auto_chunks_is_the_fastest_count_and_is_printed_and_recorded(tmp_path, capsys):
    path = tmp_path / "auto.json"
    assert main(["simulate", *PURE_2, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith("note: tapa chunks:"))
    record = json.loads(path.read_text())["results"][0]
    chosen = record["chunks"]
    assert line.startswith(f"note: tapa chunks: {chosen} (auto; step time at 1, 2, 3"), line
    # The planner's pick is the count that simulates fastest, and the step is that count's.
    times = {}
    for chunks in (1, 2, 3):
        given = tmp_path / f"{chunks}.json"
        assert main(["simulate", *PURE_2, "--chunks", str(chunks), "--json", str(given)]) == 0
        times[chunks] = json.loads(given.read_text())["results"][0]["step_time_s"]
    assert len(set(times.values())) == 3  # one head per rank: every count is its own plan
    assert record["step_time_s"] <= min(times.values()) * (1 + 1e-12)
    if chosen in times:
        assert record["step_time_s"] == pytest.approx(times[chosen], rel=1e-12)


def test_plan_prints_the_chunks_and_the_plan_file_records_them(tmp_path, capsys):
    out_file = tmp_path / "plan.json"
    assert main(["plan", "--nodes", "2", "--schedule", "tapa", "--ulysses", "24",
                 "--out", str(out_file)]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines()
                if row.startswith("note: chunks of"))
    recorded = json.loads(out_file.read_text())["options"]["chunks"]
    assert f"tapa: {recorded} (auto;" in line


@pytest.mark.parametrize(("args", "message"), [
    (["--nodes", "2", "--schedule", "tapa", "--parallel-layout", "pure", "--resolution",
      "256", "--chunks", "64"], "64 chunks: .* would be empty on every rank"),
    (["--topology", "dgx-h100", "--nodes", "1", "--schedule", "tapa", "--chunks", "2"],
     "2 chunks: tapa's exchanges here have one phase"),
])
def test_chunks_that_split_nothing_are_refused_in_one_line(capsys, args, message):
    import re

    assert main(["simulate", *args, "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
