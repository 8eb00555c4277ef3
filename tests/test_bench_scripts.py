"""The maintained benchmarks in bench/ still run: each one that has no test of its own runs
here at small settings and its output is checked (never its times). bench/README.md lists
every script that remains, with the test that runs it."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from launching import job_env

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
CALIBRATION = REPO / "results" / "measured" / "regime_search" / "gloo.toml"


def load(name: str) -> ModuleType:
    """A bench script as a module (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def script(args: list[str], tmp_path: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=job_env(tmp_path),
                          capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)


def test_the_readme_lists_every_script_and_only_scripts_that_exist() -> None:
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([\w.]+\.(?:py|sh))`", readme, flags=re.M))
    listed |= set(re.findall(r"\(\+ `([\w.]+\.py)`", readme))
    present = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh")}
    assert listed == present, (f"not in bench/README.md: {sorted(present - listed)}; "
                               f"listed but gone: {sorted(listed - present)}")
    # Each row names the test that runs it, and that test exists.
    for test in set(re.findall(r"`(tests/[\w/]+\.py)`", readme)):
        assert (REPO / test).is_file(), test


def test_sim_guard_fits_a_positive_cost_per_collective(tmp_path) -> None:
    from cocodiff.simulator import budget

    out = tmp_path / "guard.json"
    done = script(["bench/sim_guard.py", "--json", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["fit_s_per_collective"] > 0 and record["fit_s_per_rank"] > 0
    assert record["fit_s_per_gather_bundle"] > 0  # the Ring-innermost runs' gathers
    # held, not fitted: planned simulations send too few messages per collective to tell
    assert record["fit_s_per_message"] == budget.SECONDS_PER_MESSAGE
    assert {run["schedule"] for run in record["runs"]} == {"tapa", "flat"}
    assert all(run["collectives"] > 0 and run["messages"] > 0 for run in record["runs"])
    assert "fit:" in done.stdout


def test_sim_scaling_folded_and_unfolded_agree(tmp_path) -> None:
    out = tmp_path / "scaling.json"
    done = script(["bench/sim_scaling.py", "--nodes", "1,2", "--unfolded-up-to", "1",
                   "--json", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["folded"]["nodes"] for row in rows] == [1, 2]
    one = rows[0]
    assert one["unfolded"]["step_time_s"] == one["folded"]["step_time_s"] > 0
    assert rows[1]["unfolded"] is None  # past --unfolded-up-to: folded only


def test_sweep_report_tables_a_simulated_sweep(tmp_path) -> None:
    from cocodiff.commands.cli import main

    sweep = tmp_path / "sweep.json"
    assert main(["simulate", "--sweep", "--sweep-models", "flux1-dev", "--sweep-nodes", "1,2",
                 "--sweep-resolutions", "768", "--workers", "1", "--json", str(sweep)]) == 0
    plot = tmp_path / "sweep.png"
    done = script(["bench/sweep_report.py", str(sweep), "--plot", str(plot)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "flux1-dev" in done.stdout and plot.stat().st_size > 0


def test_vmajor_critical_path_splits_a_layer(tmp_path) -> None:
    out = tmp_path / "path.json"
    assert load("vmajor_critical_path").main([
        "--model", "flux1-dev", "--resolution", "768", "--nodes", "2", "--steps", "2",
        "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert (record["model"], record["nodes"]) == ("flux1-dev", 2)
    vfirst, cached = record["runs"]["vfirst"], record["runs"]["cocodiff all cached"]
    assert vfirst["per_layer"]["compute_s"] > 0
    # Every V block cached on the slow tier: V's inter-node bytes are gone, the rest stay.
    assert 0 < cached["bytes_by_tier"]["inter-node"] < vfirst["bytes_by_tier"]["inter-node"]
    assert cached["bytes_by_tier"]["intra-gpu"] == vfirst["bytes_by_tier"]["intra-gpu"]


def test_regime_search_predicts_a_configuration_from_the_kept_calibration() -> None:
    """One configuration of the grid from the calibration results/measured/ keeps (the
    whole grid takes minutes): every schedule predicted, the gains as the search writes
    them."""
    search = load("regime_search")
    calibration = search.load_calibration(f"gloo={CALIBRATION}", 0.2)
    assert calibration.num_ranks == 4 and 0 < calibration.link_fraction <= 1.5
    described = search.machine(calibration, 4, 2, 0.05, core_scaling=True)
    assert (described.num_nodes, described.gpus_per_node) == (4, 2)
    model = search.EnlargedModel(heads=search.HEADS, head_dim=64, layers=1, single_layers=1,
                                 resolution=256)
    steps = search.predict(model, described, calibration.collective)
    assert set(steps) == set(search.SCHEDULES)
    assert all(math.isfinite(s) and s > 0 for s in steps.values())
    with pytest.raises(ValueError, match="gloo=PATH.toml"):
        search.load_calibration(str(CALIBRATION), 0.2)


def test_regime_search_sets_each_configurations_fastest_rows_of_the_two_families(
        monkeypatch, tmp_path, capsys) -> None:
    """``--families``: validate's rows on the cluster, predicted; the fastest sequence row
    against the fastest pipeline row (one configuration of the grid)."""
    search = load("regime_search")
    sequence, pipeline = search.family_layouts(2, 2, 2)
    assert len(sequence) == 2 * len(search.SCHEDULES)
    assert {layout for _, layout in sequence} == {"pure", "U2xR2xB1"}
    assert pipeline == [("pipefusion", "P2xU2xM2/w1")]  # 2 layers hold no 4 stages
    assert search.family_layouts(4, 2, 6)[1] == [("pipefusion", "P2xU4xM2/w1"),
                                                 ("pipefusion", "P4xU2xM4/w1")]
    for name, value in (("SHAPES", ((2, 2),)), ("GBITS", (0.05,)), ("HEAD_DIMS", (64,)),
                        ("LAYERS", ((1, 1),)), ("RESOLUTIONS", (256,))):
        monkeypatch.setattr(search, name, value)
    calibration = search.load_calibration(f"gloo={CALIBRATION}", 0.2)
    [row] = search.search_families([calibration], core_scaling=True)
    steps, fastest = row["predicted_step_s"], row["fastest"]
    assert set(steps) == {f"{name}@{layout}" for name, layout in sequence + pipeline}
    assert all(math.isfinite(s) and s > 0 for s in steps.values())
    assert fastest["pipeline"] == "pipefusion@P2xU2xM2/w1"
    assert steps[fastest["sequence"]] == min(steps[f"{n}@{layout}"] for n, layout in sequence)
    assert row["sequence_over_pipeline"] == steps[fastest["pipeline"]] / steps[fastest["sequence"]]
    table = search.families_markdown([row], 5)
    assert table.count("\n") == 2 and f"{row['sequence_over_pipeline']:.2f}x" in table
    out = tmp_path / "families.json"
    assert search.main(["--families", "--calibration", f"gloo={CALIBRATION}",
                        "--calibrated-gbit", "0.2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["question"] == "families" and report["evaluated"] == 1
    ratio = report["configs"][0]["sequence_over_pipeline"]
    assert report["predicted_ahead_at_target"] == {
        "sequence": int(ratio >= search.GAIN_TARGET),
        "pipeline": int(1 / ratio >= search.GAIN_TARGET)}
    assert "1 configurations evaluated" in capsys.readouterr().out


def test_digits_samples_reads_the_digits(tmp_path) -> None:
    out, plot = tmp_path / "digits.json", tmp_path / "digits.png"
    assert load("digits_samples").main(["--seeds", "1", "--steps", "2", "--json", str(out),
                                        "--plot", str(plot)]) == 0
    record = json.loads(out.read_text())
    assert record["samples"] == 10 and len(record["per_digit"]) == 10
    assert 0 <= record["read_as_requested"] <= 1 and plot.stat().st_size > 0


def test_v_similarity_measures_every_model(tmp_path) -> None:
    out, plot = tmp_path / "v.json", tmp_path / "v.png"
    assert load("v_similarity").main(["--steps", "3", "--json", str(out),
                                      "--plot", str(plot)]) == 0
    record = json.loads(out.read_text())
    assert record["models"] and plot.stat().st_size > 0


def test_vmajor_tradeoff_and_calibration_stability_parse_their_flags(tmp_path) -> None:
    """These two launch multi-rank jobs for minutes: their flags, here; what they run is
    tested where it lives (tests/runtime for V-Major's exchange and quality report,
    tests/test_calibrate.py for calibrate)."""
    done = script(["bench/vmajor_tradeoff.py", "--help"], tmp_path)
    assert done.returncode == 0 and "--schedules" in done.stdout and "--seeds" in done.stdout
    done = script(["bench/calibration_stability.py", "--launchers", "nope"], tmp_path)
    assert done.returncode == 2 and "unknown launcher 'nope'" in done.stderr


def test_pipefusion_tradeoff_refuses_a_bad_warmup_in_one_line(tmp_path) -> None:
    """It launches a 2-rank job for minutes: its flags, here; the pipelined runtime it runs
    is tested in tests/runtime/test_runtime_pipefusion.py."""
    done = script(["bench/pipefusion_tradeoff.py", "--warmups", "20"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith(
        "pipefusion_tradeoff: error: --warmups '20' must be steps in [1, --steps 20)")
    assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_calibration_stability_reads_and_predicts_a_calibration(tmp_path) -> None:
    """Its two halves past calibrate on a kept calibration: the numbers it compares and
    the prediction (``cocodiff simulate`` on the topology)."""
    import argparse

    stability = load("calibration_stability")
    numbers = stability.numbers({"host": {"cpu": {"wait_spin": 0.03}}}, CALIBRATION)
    assert numbers["wait_spin"] == 0.03 and numbers["tile_tflops"] > 0
    assert numbers["cores"] is not None and numbers["intra_gbps"] > 0
    args = argparse.Namespace(model="tiny-flux", resolution="256", steps=2, schedule="flat")
    topology = tmp_path / CALIBRATION.name
    topology.write_text(CALIBRATION.read_text())
    topology.with_suffix(".json").write_text(CALIBRATION.with_suffix(".json").read_text())
    predicted = stability.predict(topology, args)
    assert set(predicted) == {"flat"} and predicted["flat"] > 0


def test_gpu_checklist_is_valid_bash() -> None:
    done = subprocess.run(["bash", "-n", str(BENCH / "gpu_checklist.sh")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def test_xdit_flux_h100_holds_every_row_against_the_published_table(tmp_path) -> None:
    out = tmp_path / "xdit.json"
    done = script(["bench/xdit_flux_h100.py", "--json", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    published = load("xdit_flux_h100").PUBLISHED
    assert set(result["rows"]) == set(published)
    for name, ((_, _), seconds) in published.items():
        for mode, published_s in zip(("eager", "compiled"), seconds, strict=True):
            row = result["rows"][name][mode]
            assert row["published_s"] == published_s and row["predicted_s"] > 0
            assert math.isclose(row["error"], row["predicted_s"] / published_s - 1)
    one = result["rows"]["1 GPU"]
    # Compiled runs fewer, fused kernels: never slower than eager in the model.
    assert one["compiled"]["predicted_s"] < one["eager"]["predicted_s"]
    assert set(result["picks"]) == {"eager", "compiled"}


def test_tapa_gap_orders_its_bounds(tmp_path) -> None:
    out = tmp_path / "gap.json"
    done = script(["bench/tapa_gap.py", "--models", "flux1-dev", "--resolutions", "1024",
                   "--nodes", "2", "--json", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    [row] = json.loads(out.read_text())["rows"]
    assert row["model"] == "flux1-dev" and row["chunks"] >= 1
    # The links alone bound everything; Aurora's model bound is below Aurora's own time,
    # and removing a price never makes the exchange slower.
    assert 0 < row["link"] <= row["model_bound"] <= row["aurora"] * (1 + 1e-9)
    for variant in ("ideal", "no_setup", "no_rate", "no_caps"):
        assert row[variant] <= row["aurora"] * (1 + 1e-9)


def test_pipefusion_attention_sets_a_patch_beside_the_ulysses_rank_of_its_flops(
        tmp_path) -> None:
    out = tmp_path / "attention.json"
    done = script(["bench/pipefusion_attention.py", "--image-tokens", "64", "--text-tokens",
                   "8", "--heads", "4", "--head-dim", "16", "--patches", "2,4", "--repeats",
                   "2", "--calls", "2", "--json", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["patches"] for row in rows] == [2, 4]
    for row in rows:
        m, patch, ulysses = row["patches"], row["patch"], row["ulysses"]
        assert (patch["queries"], patch["keys"], patch["heads"]) == (64 // m + 8, 72, 4)
        assert (ulysses["queries"], ulysses["keys"], ulysses["heads"]) == (72, 72, 4 // m)
        assert row["flops_ratio"] == patch["flops"] / ulysses["flops"]
        assert all(shape[key] > 0 for shape in (patch, ulysses)
                   for key in ("runtime_s", "contiguous_s"))
    done = script(["bench/pipefusion_attention.py", "--patches", "3"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith(
        "--patches 3 does not divide the 1024 image tokens and the 8 heads")


def test_pipefusion_patch_cost_sets_measured_patches_beside_their_flops(tmp_path) -> None:
    out = tmp_path / "patch_cost.json"
    done = script(["bench/pipefusion_patch_cost.py", "--patches", "2", "--repeats", "2",
                   "--calls", "2", "--json", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [row["patches"] for row in rows] == [1, 2]
    assert [row["image_tokens"] for row in rows] == [64, 32]
    assert all(row["measured_s"] > 0 and row["plan_flops"] > 0 for row in rows)
    assert rows[0]["measured_ratio"] == rows[0]["flops_ratio"] == 1.0
    # Half the image tokens, the whole text: more than half the FLOPs, less than all.
    assert 0.5 < rows[1]["flops_ratio"] < 1.0
    done = script(["bench/pipefusion_patch_cost.py", "--patches", "3"], tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "pipefusion_patch_cost: error: --patches 3 does not divide the 64 image tokens")
