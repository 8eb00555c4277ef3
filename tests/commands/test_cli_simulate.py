"""`cocodiff simulate`: the table, the JSON record, trace and plot files, and one-line
errors with exit code 2 and no partial output."""

import json
import re
import subprocess
import sys

import pytest

from cocodiff.commands.cli import main
from cocodiff.schedules import DEFAULT_OPTIONS
from cocodiff.simulator import budget

JSON_KEYS = {"model", "topology", "num_nodes", "num_ranks", "resolution", "results"}
RESULT_KEYS = {"schedule", "step_time_s", "compute_s", "comm_exposed_s", "bytes_by_tier"}


def exit_code(argv):
    """main()'s return code, or argparse's exit code for usage errors."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def simulate(tmp_path, *args):
    path = tmp_path / "out.json"
    assert main(["simulate", *args, "--json", str(path)]) == 0
    return json.loads(path.read_text())


@pytest.mark.slow
def test_default_aurora_8_nodes_writes_the_stable_json_keys(tmp_path, capsys):
    record = simulate(tmp_path, "--nodes", "8")
    assert JSON_KEYS <= record.keys()
    assert record["num_ranks"] == 96 and record["topology"] == "aurora"
    result = record["results"][0]
    assert RESULT_KEYS <= result.keys()
    assert set(result["bytes_by_tier"]) == {"intra-gpu", "intra-node", "inter-node"}
    assert result["step_time_s"] == pytest.approx(result["compute_s"] + result["comm_exposed_s"])
    # 96 ranks > 24 heads: every schedule on the planner's layout, shown in a column
    out = capsys.readouterr().out
    assert "flat" in out and "layout" in out and "hold no head" not in out
    for result in record["results"]:
        assert result["layout"]["ulysses"] <= 24
        assert result["layout"]["name"] in out


def test_layout_pure_forces_pure_ulysses_with_its_idle_rank_note(tmp_path, capsys):
    record = simulate(tmp_path, "--nodes", "4", "--schedule", "flat", "--parallel-layout", "pure")
    assert record["results"][0]["layout"] is None
    out = capsys.readouterr().out
    assert "pure U48" in out and "24 ranks hold no head" in out


@pytest.mark.slow
def test_all_to_all_share_rises_with_nodes_for_flux_1024(tmp_path):
    shares = []
    for nodes in (1, 2, 4, 8):
        result = simulate(
            tmp_path, "--nodes", str(nodes), "--model", "flux1-dev", "--resolution", "1024",
            "--parallel-layout", "pure",
        )["results"][0]
        shares.append(result["comm_exposed_s"] / result["step_time_s"])
        assert result["bytes_by_tier"]["inter-node"] > 0 or nodes == 1
    assert shares == sorted(shares), shares
    assert shares[-1] > 0.5


def test_trace_and_plot_are_written(tmp_path):
    trace, plot = tmp_path / "t.json", tmp_path / "p.png"
    assert (
        main(
            [
                "simulate",
                "--topology",
                "cluster",
                "--model",
                "pixart-sigma",
                "--resolution",
                "512",
                "--trace",
                str(trace),
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"attention", "a2a q", "a2a out", "cross_attention", "busy"} <= names
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_toml_topology_and_a_config_json_model(tmp_path):
    topo = tmp_path / "two.toml"
    topo.write_text(
        'name = "two"\n[nodes]\ncount = 2\ngpus = 2\nnics = 1\n[tile]\ntflops = 10\n'
        "memory_gbps = 100\n[links.gpu]\nbandwidth_gbps = 10\nlatency_us = 1\n"
        'fabric = "switch"\n[links.host]\nbandwidth_gbps = 10\nlatency_us = 1\n'
        "[links.nic]\nbandwidth_gbps = 1\nlatency_us = 5\n"
    )
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "_class_name": "PixArtTransformer2DModel",
                "num_layers": 2,
                "num_attention_heads": 4,
                "attention_head_dim": 8,
                "patch_size": 2,
                "cross_attention_dim": 32,
                "sample_size": 32,
            }
        )
    )
    record = simulate(
        tmp_path, "--topology", str(topo), "--model", str(config), "--resolution", "256"
    )
    assert record["num_ranks"] == 4 and record["topology"] == "two"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--topology", "nope"], "unknown .*nope"),
        (["--nodes", "0"], "positive integer"),
        (["--model", "nope"], "nope"),
        (["--schedule", "nope"], "unknown schedule 'nope'"),
        (["--resolution", "abc"], "abc"),
        (["--resolution", "1000"], "1000"),
        (["--parallel-layout", "nope"], "invalid choice"),
        (["--parallel-layout", "pure", "--ulysses", "4"], "both choose the layout"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_output(tmp_path, capsys, args, message):
    out = tmp_path / "out.json"
    assert exit_code(["simulate", *args, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err), err
    assert not out.exists()


def test_malformed_toml_is_refused_in_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(
        "[nodes]\ncount = 1\ngpus = 2\n[links.gpu]\nbandwidth_gbps = -3\n"
        'latency_us = 1\nfabric = "switch"\n'
    )
    assert main(["simulate", "--topology", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.toml" in err


def test_the_console_script_exits_2_without_a_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "cocodiff", "simulate", "--topology", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_the_planners_step_is_the_one_its_layout_simulates_to(tmp_path):
    # past the head count simulate reuses the step the planner simulated for its choice
    auto = simulate(tmp_path, "--nodes", "4", "--schedule", "tapa", "--steps", "2")
    layout = auto["results"][0]["layout"]
    explicit = simulate(tmp_path, "--nodes", "4", "--schedule", "tapa", "--steps", "2",
                        "--ulysses", str(layout["ulysses"]), "--ring", str(layout["ring"]),
                        *(["--ring-inner"] if layout["name"].endswith("/ring-inner") else []))
    for record in (auto, explicit):
        for key in ("sim_wall_s", "sim_flows", "sim_events"):
            del record["results"][0][key]
    assert auto["results"] == explicit["results"]


def test_vmajors_plans_shared_out_over_workers_give_the_one_process_result(tmp_path):
    # with two workers V-Major's distinct plans (one per cache ratio) run as two jobs,
    # put together by simulate_run_plan: the same record as one process simulating all
    args = ("--nodes", "2", "--schedule", "flat,cocodiff", "--steps", "8")
    shared = simulate(tmp_path, *args, "--workers", "2")
    alone = simulate(tmp_path, *args, "--workers", "1")
    for record in (shared, alone):
        for result in record["results"]:
            for key in ("sim_wall_s", "sim_flows", "sim_events"):
                del result[key]
    assert shared == alone
    # more than one plan to share out
    assert budget.distinct_plans("cocodiff", 8, DEFAULT_OPTIONS, None) > 2
