"""Regression tests for issue 18: nine ways the CLI crashed or hung on input an outside
fuzzer wrote from the README's rules, the resource guard, and physically absurd numbers.

Every case runs ``cocodiff`` in-process with a strict UTF-8 stdout under an alarm (10 s of
CPU time, or ten times that on the wall clock: ``clicheck.time_limit``) and must exit 0
(valid input) or 2 with one line naming the problem.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from clicheck import Hang, call, check_outcome
from launching import LAUNCH_VARS, REPO

from cocodiff.models import REGISTRY, TINY_NAMES
from cocodiff.schedules import PlanOptions
from cocodiff.simulator import budget
from cocodiff.simulator.simulate import simulate_schedule
from cocodiff.util.jsonfile import MAX_JSON_DEPTH, json_depth
from topology import Placement, build_topology, get_preset

LIMIT_S = 10
CONFIG = REPO / "tests/data/configs/dit-xl-2.json"
# A small, quick simulation: the fuzzer's inputs spliced into it.
QUICK = ["--model", "dit-xl-2", "--resolution", "256", "--steps", "1"]


def cocodiff(*argv: str | Path) -> tuple[int, str, str]:
    args = [str(arg) for arg in argv]
    try:
        outcome = call(args, LIMIT_S)
    except Hang:
        pytest.fail(f"hang: cocodiff {args!r}")
    check_outcome(outcome, args)
    return outcome.code, outcome.out, outcome.err


def refused(*argv: str | Path, match: str) -> str:
    code, _, err = cocodiff(*argv)
    assert code == 2, err
    assert match in err, err
    return err


# ---- 1. rich markup in a topology name ------------------------------------------------------

@pytest.mark.parametrize("name", ["[/]", "[bold]x", ":smile:", "[link=x]y[/link]"])
def test_markup_in_a_topology_name_is_shown_as_written(tmp_path, name):
    path = tmp_path / "m.toml"
    path.write_text(f'preset = "aurora"\nname = {json.dumps(name)}\n')
    code, out, _ = cocodiff("simulate", "--topology", path, "--nodes", "1", "--schedule", "flat",
                            *QUICK)
    assert code == 0 and f"on {name}," in out


def test_markup_in_a_topology_name_through_plan(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('preset = "aurora"\nname = "[/]"\n')
    code, out, _ = cocodiff("plan", "--topology", path, "--nodes", "1", "--schedule", "flat",
                            "--model", "dit-xl-2", "--resolution", "256")
    assert code == 0 and "on [/]," in out


# ---- 2 and 6. deeply nested JSON ------------------------------------------------------------

def test_a_deeply_nested_activity_trace_is_refused(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "\n")
    refused("simulate", "--nodes", "1", "--schedule", "flat", "--activity-trace", path, *QUICK,
            match="nests 100000 levels deep; at most 64")


def test_a_deeply_nested_model_config_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"_class_name": ' + "[" * 5000 + "]" * 5000 + "}")
    refused("simulate", "--model", path, "--nodes", "1", match="nests 5001 levels deep")


def test_a_deeply_nested_tiny_marker_beside_a_valid_config_is_not_ours(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(CONFIG.read_text())
    (model / "cocodiff_tiny.json").write_text("[" * 100_000)
    code, _, _ = cocodiff("simulate", "--model", model, "--nodes", "1", "--schedule", "flat",
                          "--resolution", "256", "--steps", "1")
    assert code == 0


def test_json_depth_counts_brackets_outside_strings():
    assert json_depth('{"a": "[[[[", "b": [1, {"c": []}]}') == 4
    assert json_depth("3") == 0
    assert json_depth('"\\"["') == 0
    assert json_depth("[" * (MAX_JSON_DEPTH + 1)) == MAX_JSON_DEPTH + 1


# ---- 3. output names past the file system's limit ---------------------------------------------

@pytest.mark.parametrize("option", ["--json", "--trace", "--plot"])
def test_an_output_name_over_255_bytes_is_refused(tmp_path, option):
    long_name = tmp_path / ("a" * 300 + ".json")
    refused("simulate", "--nodes", "1", "--schedule", "flat", option, long_name, *QUICK,
            match="is 305 bytes long; this file system allows 255")


def test_a_long_directory_name_is_refused(tmp_path):
    refused("simulate", "--nodes", "1", "--schedule", "flat", "--json",
            tmp_path / ("d" * 300) / "x.json", *QUICK, match="is 300 bytes long")


def test_a_multibyte_name_counts_bytes(tmp_path):
    name = tmp_path / ("\u00fc" * 130 + ".json")  # 130 characters, 265 bytes
    refused("simulate", "--nodes", "1", "--json", name, *QUICK, match="is 265 bytes long")


# ---- 4. a model name over 255 bytes -----------------------------------------------------------

def test_a_model_name_over_255_bytes_is_an_unknown_model():
    refused("simulate", "--nodes", "1", "--schedule", "flat", "--model", "a" * 300,
            match="unknown model 'aaaa")


def test_a_model_path_over_the_limit_is_refused(tmp_path):
    refused("simulate", "--nodes", "1", "--model", tmp_path / ("b" * 300) / "config.json",
            match="cannot exist: a name in it")


# ---- 5. export-tiny into a file ---------------------------------------------------------------

def test_export_tiny_into_an_existing_file_is_refused(tmp_path):
    (tmp_path / "afile").touch()
    refused("export-tiny", "tiny-flux", tmp_path / "afile", match="exists and is not a directory")
    refused("export-tiny", "tiny-flux", tmp_path / "afile" / "sub",
            match="afile is not a directory")


def test_export_tiny_into_a_non_empty_directory_or_a_long_name_is_refused(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").touch()
    refused("export-tiny", "tiny-flux", tmp_path / "full", match="exists and is not empty")
    refused("export-tiny", "tiny-flux", tmp_path / ("c" * 300), match="is 300 bytes long")


def test_export_tiny_errors_are_one_line_in_a_real_process(tmp_path):
    """No library warning before the line: the name and directory are checked before
    diffusers is imported."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = str(REPO)
    (tmp_path / "afile").touch()
    for name, directory in (("tiny-nope", "new"), ("tiny-flux", "afile")):
        result = subprocess.run([sys.executable, "-m", "cocodiff", "export-tiny", name,
                                 directory], cwd=tmp_path, env=env, capture_output=True,
                                timeout=60, stdin=subprocess.DEVNULL, text=True)
        assert result.returncode == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "error:" in result.stderr, result.stderr


def test_tiny_names_match_the_built_in_models():
    from cocodiff.runtime.tiny import TINY_MODELS

    assert tuple(TINY_MODELS) == TINY_NAMES


# ---- 7. names that are not UTF-8, printed to a strict UTF-8 stdout --------------------------

def test_non_utf8_file_and_directory_names_simulate(tmp_path):
    topology = tmp_path / os.fsdecode(b"odd\xff.toml")
    topology.write_text("[nodes]\ngpus = 2\n[tile]\ntflops = 100.0\nmemory_gbps = 1000.0\n"
                        "[links.gpu]\nbandwidth_gbps = 20.0\nlatency_us = 2.0\n"
                        "[links.host]\nbandwidth_gbps = 30.0\nlatency_us = 1.0\n")
    model = tmp_path / os.fsdecode(b"model\xfe")
    model.mkdir()
    (model / "config.json").write_text(CONFIG.read_text())
    code, out, _ = cocodiff("simulate", "--topology", topology, "--model", model,
                            "--resolution", "256", "--steps", "1", "--schedule", "flat")
    assert code == 0
    assert "model\\udcfe" in out and "odd\\udcff" in out  # escaped, not a crash


def test_an_encoding_error_is_reported_as_one(tmp_path, monkeypatch):
    import cocodiff.commands.simulate as command

    def fail(args):
        "é".encode("ascii")

    monkeypatch.setattr(command, "simulate_command", fail)
    monkeypatch.setattr("cocodiff.commands.cli.simulate_command", fail)
    err = refused("simulate", match="cannot encode 'é' as ascii: ordinal not in range")
    assert "error: utf-8" not in err


def test_a_strict_stdout_in_a_real_process(tmp_path):
    (tmp_path / os.fsdecode(b"model\xfe")).mkdir()
    (tmp_path / os.fsdecode(b"model\xfe") / "config.json").write_text(CONFIG.read_text())
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env |= {"PYTHONPATH": str(REPO), "PYTHONIOENCODING": "utf-8:strict"}
    result = subprocess.run([sys.executable, "-m", "cocodiff", "simulate", *QUICK, "--model",
                             b"model\xfe", "--topology", "cluster", "--schedule", "flat"],
                            cwd=tmp_path, env=env, capture_output=True, timeout=60,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr.decode(errors="replace")
    assert b"model\\udcfe" in result.stdout


# ---- 8. many TAPA chunks ----------------------------------------------------------------------

@pytest.mark.parametrize("steps", ["1", "2"])
def test_more_chunks_than_a_rows_tokens_are_refused(steps):
    # 256 px on 12 ranks: rows of 22 image + 43 text tokens; 2 heads per rank, so 66
    # chunks cut tokens and the 66th would be empty everywhere (cocodiff.plan.chunking).
    refused("simulate", "--nodes", "1", "--schedule", "tapa", "--resolution", "256",
            "--chunks", "66", "--steps", steps,
            match="66 chunks: blocks of 2 row(s) are cut along their rows' 65 token(s)")


def test_chunks_within_the_rows_still_simulate():
    code, _, _ = cocodiff("simulate", "--topology", "cluster", "--schedule", "tapa",
                          "--chunks", "2", *QUICK)
    assert code == 0


# ---- 9. bandwidths and rates outside physical sense -------------------------------------------

@pytest.mark.parametrize(("table", "key", "value", "match"), [
    ("links.gpu", "bandwidth_gbps", "5e-324", "bandwidth 5e-324 GB/s in [links.gpu]"),
    ("tile", "memory_gbps", "5e-324", "memory bandwidth 5e-324 GB/s in tile.memory_gbps"),
    ("links.gpu", "bandwidth_gbps", "1e308", "bandwidth 1e+308 GB/s in [links.gpu]"),
    ("tile", "tflops", "1e-300", "compute rate 1e-300 TF/s in tile.tflops"),
    ("links.gpu", "latency_us", "1e300", "latency 1e+300 us in [links.gpu]"),
    ("fabric", "latency_us", "1e7", "latency 10000000.0 us in fabric.latency_us"),
])
def test_numbers_outside_physical_sense_are_refused(tmp_path, table, key, value, match):
    path = tmp_path / "absurd.toml"
    path.write_text(f'preset = "aurora"\n[{table}]\n{key} = {value}\n')
    refused("simulate", "--topology", path, "--nodes", "1", "--schedule", "flat", *QUICK,
            match=match)


def test_a_blank_name_is_refused_like_an_empty_one(tmp_path):
    for name in ("", " ", "\t"):
        path = tmp_path / "blank.toml"
        path.write_text(f'preset = "aurora"\nname = {json.dumps(name)}\n')
        refused("simulate", "--topology", path, "--nodes", "1", *QUICK,
                match="topology name must be a non-empty string")


# ---- the resource guard -----------------------------------------------------------------------

def test_5000_nodes_with_a_recorded_timeline_are_refused_in_one_line_with_the_estimate(
        tmp_path):
    # A recorded timeline keeps every rank's events: the guard counts every rank (the
    # planned, folded run of 5,000 nodes fits: docs/hardening.md).
    trace = tmp_path / "trace.json"
    err = refused("simulate", "--nodes", "5000", "--trace", str(trace),
                  match="simulating 4 schedule(s) of flux1-dev on 5000 node(s) (60000 ranks) "
                        "would need about")
    assert "GB of memory" in err and "the limit here is" in err
    assert not trace.exists()


def test_a_long_simulation_is_refused_with_its_estimate(monkeypatch):
    monkeypatch.setenv("COCODIFF_MAX_SIM_S", "0.001")
    refused("simulate", "--nodes", "1", "--schedule", "flat", *QUICK,
            match="would run for about")


def test_a_long_pipeline_ranking_is_refused_with_its_estimate(monkeypatch):
    # Pipelines are simulated rank by rank (budget.estimate_pipelines): 2 Aurora nodes'
    # 7 PipeFusion layouts come to about 23 s.
    monkeypatch.setenv("COCODIFF_MAX_SIM_S", "5")
    refused("plan", "--nodes", "2", "--schedule", "pipefusion",
            match="ranking 7 PipeFusion layout(s) of 24 ranks would run for about")


def test_a_bad_limit_in_the_environment_is_one_line(monkeypatch):
    monkeypatch.setenv("COCODIFF_MAX_SIM_S", "soon")
    refused("simulate", "--nodes", "1", *QUICK, match="COCODIFF_MAX_SIM_S='soon' is not")


def test_graph_elements_match_the_built_topology():
    for name, nodes in (("aurora", 2), ("dgx-h100", 3), ("cluster", 2)):
        spec = get_preset(name, nodes)
        graph = build_topology(spec).graph
        assert budget.graph_elements(spec) == graph.number_of_nodes() + graph.number_of_edges()


@pytest.mark.parametrize(("schedule", "nodes", "chunks"),
                         [("flat", 1, 1), ("flat", 4, 1), ("tapa", 2, 2), ("vfirst", 1, 3)])
def test_the_guard_counts_the_collectives_the_simulator_posts(monkeypatch, schedule, nodes,
                                                                 chunks):
    """The estimate's collectives are exactly the all-to-alls the simulated ranks post when
    every layer is simulated (a recorded timeline), and an upper bound when the simulator
    extrapolates a step from one and two layers
    (``cocodiff.simulator.simulate.simulate_layers``)."""
    import transports.sim as sim_transport

    posted = []
    original = sim_transport.SimWorld.post_all_to_all
    monkeypatch.setattr(sim_transport.SimWorld, "post_all_to_all",
                        lambda self, *args, **kw: posted.append(1) or original(self, *args,
                                                                                **kw))
    model = REGISTRY["dit-xl-2"]
    spec = get_preset("aurora", nodes)
    topology = build_topology(spec)
    streams = (model.image_tokens(256, 256), model.text_tokens)
    estimate = budget.estimate_simulation(spec, model.num_layers, model.num_heads,
                                          {schedule: 1}, chunks)
    for record_spans in (True, False):
        posted.clear()
        simulate_schedule(schedule, model, topology, Placement.node_major(topology), streams,
                          1, options=PlanOptions(chunks=chunks), with_bound=False,
                          record_spans=record_spans)
        if record_spans:
            assert estimate.collectives == len(posted)
        else:
            assert 0 < len(posted) < estimate.collectives
