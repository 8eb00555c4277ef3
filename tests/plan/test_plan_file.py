"""The plan file: one run's plan written by ``cocodiff plan --out``, executed as is by
``cocodiff simulate --plan`` and ``cocodiff run --plan``."""

import json
import re

import pytest
from launching import (
    launcher_prefix,
    needs_mpi,
    needs_torchrun,
    plan_simulate_run,
    run_job,
)

from cocodiff.commands.cli import main
from cocodiff.layout import RING_INNER_ORDER, LayoutError, ParallelLayout
from cocodiff.models import REGISTRY
from cocodiff.schedules import PlanOptions, RankGrid, VMajorOptions, plan_for_step
from cocodiff.schedules.run_plan import (
    PlanFileError,
    RunPlan,
    build_run_plan,
    check_plan_fits_call,
    check_plan_fits_model,
    load_run_plan,
)
from cocodiff.simulator.simulate import simulate_run_plan, simulate_schedule
from topology import Placement, build_topology
from topology.presets import cluster

FLUX = REGISTRY["flux1-dev"]
GRID = RankGrid((2, 2, 2), tuple(range(8)))
STREAMS = (1024, 512)


@pytest.mark.parametrize(("schedule", "parallel", "options"), [
    ("flat", None, PlanOptions()),
    ("tapa", None, PlanOptions(dtype="float32", chunks=3)),
    ("vfirst", ParallelLayout(4, 2), PlanOptions(batch=2)),
    ("cocodiff", None, PlanOptions(vmajor=VMajorOptions("linear", 1.0, warmup=1, refresh=3))),
    ("cocodiff", ParallelLayout(2, 2, 2), PlanOptions(batch=2, chunks=2, vmajor=None)),
])
def test_written_read_and_written_again_is_byte_identical(schedule, parallel, options):
    run_plan = build_run_plan(schedule, FLUX, GRID, STREAMS, 6, options, parallel=parallel,
                              resolution=(512, 512), machine={"topology": "x", "nodes": 2})
    text = run_plan.to_json()
    again = RunPlan.from_json(text)
    assert again.to_json() == text
    assert again.sha256 == run_plan.sha256
    assert again.plans == run_plan.plans  # the same plans, not merely the same text
    assert (again.grid, again.parallel, again.options) == (run_plan.grid, parallel, options)


def test_a_file_from_before_the_head_split_rename_still_loads():
    run_plan = build_run_plan("tapa", FLUX, GRID, STREAMS, 2, PlanOptions())
    data = json.loads(run_plan.to_json())
    for plan in data["plans"]:  # the key the head split had before it was renamed
        plan["layout"] = plan.pop("head_split")
    again = RunPlan.from_json(json.dumps(data))
    assert again.plans == run_plan.plans
    assert again.to_json() == run_plan.to_json()  # written again under the new key


def test_a_file_from_before_the_double_stream_share_still_loads():
    # A model field added later with a default may be missing; one without a default may
    # not, nor may a field the spec does not have.
    run_plan = build_run_plan("flat", FLUX, GRID, STREAMS, 2, PlanOptions())
    assert run_plan.spec.double_stream_share == pytest.approx(19 / 57)
    data = json.loads(run_plan.to_json())
    del data["model"]["double_stream_share"]
    assert RunPlan.from_json(json.dumps(data)).spec.double_stream_share is None
    without_heads, with_colour = json.loads(run_plan.to_json()), json.loads(run_plan.to_json())
    del without_heads["model"]["num_heads"]
    with_colour["model"]["colour"] = 1
    for broken in (without_heads, with_colour):
        with pytest.raises(PlanFileError, match="model must hold the fields"):
            RunPlan.from_json(json.dumps(broken))


def test_a_pure_ulysses_layout_is_recorded_as_none_and_the_machine_is_not_hashed():
    """A plan names pure Ulysses one way, whether a layout said so or none was given,
    and where it was made for is a note beside the plan, not part of its hash."""
    pure = build_run_plan("tapa", FLUX, GRID, STREAMS, 2, PlanOptions(),
                          parallel=ParallelLayout(8, order=RING_INNER_ORDER),
                          machine={"topology": "cluster", "nodes": 2})
    unnamed = build_run_plan("tapa", FLUX, GRID, STREAMS, 2, PlanOptions())
    assert pure.parallel is None and pure.plans == unnamed.plans
    assert pure.to_json() != unnamed.to_json()  # the machine is written...
    assert pure.sha256 == unnamed.sha256  # ...but not hashed
    with pytest.raises(LayoutError, match="= 4 ranks, but the run has 8"):
        build_run_plan("tapa", FLUX, GRID, STREAMS, 2, PlanOptions(), parallel=ParallelLayout(4))


def test_a_step_dependent_schedule_has_one_plan_per_planned_ratio():
    options = PlanOptions(vmajor=VMajorOptions("linear", 1.0, warmup=1))
    run_plan = build_run_plan("cocodiff", FLUX, GRID, STREAMS, 6, options)
    # linear after one warm-up step over 6 steps: 0, 0.25, 0.5, 0.75, 1, 1 (quarters)
    assert run_plan.step_plans == (0, 1, 2, 3, 4, 4)
    for step in range(6):
        assert run_plan.plan_at(step) == plan_for_step("cocodiff", FLUX, GRID, STREAMS, options,
                                                       step, 6)
    flat = build_run_plan("flat", FLUX, GRID, STREAMS, 6, options)
    assert len(flat.plans) == 1 and flat.step_plans == (0,) * 6


def test_the_stream_order_does_not_change_the_plan():
    one = build_run_plan("tapa", FLUX, GRID, (1024, 512), 2, PlanOptions())
    other = build_run_plan("tapa", FLUX, GRID, (512, 1024), 2, PlanOptions())
    assert one.to_json() == other.to_json()


def test_simulating_the_file_is_simulating_the_schedule():
    topology = build_topology(cluster(num_nodes=2, ranks_per_node=4))
    placement = Placement.node_major(topology)
    grid = RankGrid.from_placement(topology, placement)
    options = PlanOptions(vmajor=VMajorOptions("linear", 1.0))
    direct = simulate_schedule("cocodiff", FLUX, topology, placement, (256, 64), 4,
                               options=options)
    run_plan = RunPlan.from_json(build_run_plan("cocodiff", FLUX, grid, (256, 64), 4,
                                                options).to_json())
    from_file = simulate_run_plan(run_plan, topology, placement)
    assert len(set(run_plan.step_plans)) > 1  # V-Major's steps differ
    assert from_file.step_times_s == direct.step_times_s
    assert from_file.bytes_by_tier == direct.bytes_by_tier
    # q, k, v and out on every rank and layer, every step
    assert from_file.exchanges_per_step == direct.exchanges_per_step == [4 * 8 * 57] * 4


@pytest.mark.parametrize(("text", "message"), [
    ("{", "not a JSON plan file"),
    ('{"format": "cocodiff-plan/0"}', "not a cocodiff-plan/1 file"),
    ('{"format": "cocodiff-plan/1"}', "malformed plan file: missing field"),
])
def test_a_bad_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(PlanFileError, match=message):
        load_run_plan(path)


def test_a_damaged_field_is_named(tmp_path):
    data = json.loads(build_run_plan("flat", FLUX, RankGrid.line(2), STREAMS, 1,
                                     PlanOptions()).to_json())
    data["options"]["dtype"] = "int3"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="unknown dtype 'int3'"):
        load_run_plan(path)


def test_plan_writes_what_simulate_executes(tmp_path, capsys):
    plan, sim = tmp_path / "p.json", tmp_path / "s.json"
    assert main(["plan", "--topology", "cluster", "--nodes", "2", "--model", "flux1-dev",
                 "--resolution", "256", "--steps", "3", "--out", str(plan)]) == 0
    run_plan = load_run_plan(plan)
    assert plan.read_text() == run_plan.to_json()
    assert run_plan.machine == {"topology": "cluster", "nodes": 2}
    assert main(["simulate", "--plan", str(plan), "--json", str(sim)]) == 0
    record = json.loads(sim.read_text())
    assert record["plan_sha256"] == run_plan.sha256
    [result] = record["results"]
    topology = build_topology(cluster(num_nodes=2))
    expected = simulate_run_plan(run_plan, topology)
    assert result["schedule"] == run_plan.schedule
    assert result["bytes_by_tier"] == expected.bytes_by_tier


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "sd35-large"], r"--plan fixes --model: drop it"),
    (["--steps", "5", "--schedule", "tapa"], r"--plan fixes --steps, --schedule: drop them"),
    # given at their default values: still what the plan fixes
    (["--schedule", "flat,tapa,vfirst,cocodiff"], r"--plan fixes --schedule: drop it"),
    (["--steps", "28", "--batch-size", "1"], r"--plan fixes --steps, --batch-size: drop them"),
    (["--layout", "pure"], r"--plan fixes --parallel-layout: drop it"),
    (["--topology", "aurora"], r"the plan has 4 ranks, the machine aurora .* 12"),
])
def test_simulate_refuses_what_contradicts_the_plan(tmp_path, capsys, args, message):
    plan = tmp_path / "p.json"
    assert main(["plan", "--topology", "cluster", "--nodes", "2", "--resolution", "256",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["simulate", "--plan", str(plan), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert re.search(message, err), err


@pytest.mark.parametrize(("args", "message"), [
    (["--schedule", "tapa"], r"--plan fixes --schedule: drop it"),
    # given at their default values (or falsy ones): still what the plan fixes
    (["--schedule", "flat", "--steps", "4"], r"--plan fixes --schedule, --steps: drop them"),
    (["--dtype", "float32"], r"--plan fixes --dtype: drop it"),
    (["--vmajor-warmup", "0"], r"--plan fixes --vmajor-warmup: drop it"),
    (["--ring-inner"], r"--plan fixes --ring-inner: drop it"),
    (["--layout", "1x4x1"], r"--plan fixes --layout: drop it"),
    # nothing the plan fixes: accepted, up to the launch's rank count
    ([], r"is for 4 ranks, the launch has 1"),
    (["--model", "tiny-flux", "--seed", "3"], r"is for 4 ranks, the launch has 1"),
])
def test_run_refuses_a_plan_that_does_not_fit(tmp_path, capsys, args, message):
    plan = tmp_path / "p.json"
    assert main(["plan", "--topology", "cluster", "--nodes", "2", "--resolution", "256",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", "--plan", str(plan), "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert re.search(message, err), err


@pytest.mark.multiprocess
@pytest.mark.parametrize(("launcher", "transport"), [
    pytest.param("torchrun", "torch", marks=needs_torchrun),
    pytest.param("mpiexec", "mpi", marks=needs_mpi),
])
def test_one_plan_file_moves_the_same_bytes_in_simulate_and_run(tmp_path, launcher, transport):
    """A V-Major plan (per-step choices, selective phases on the inter-node tier, 2
    pipeline chunks) on 2 nodes x 2 ranks: the runtime's bytes per tier and exchanges per
    step are the simulator's."""
    plan, simulated, measured = plan_simulate_run(tmp_path, launcher, transport, [
        "--topology", "cluster", "--nodes", "2", "--model", "tiny-flux", "--resolution", "128",
        "--dtype", "float32", "--steps", "4", "--schedule", "cocodiff",
        "--vmajor-ratio-schedule", "linear:0.5", "--chunks", "2", "--ulysses", "4"])
    [predicted] = simulated["results"]
    assert measured["plan_sha256"] == simulated["plan_sha256"] == load_run_plan(plan).sha256
    assert measured["schedule"] == predicted["schedule"] == "cocodiff"
    assert measured["exchanges_per_step"] == predicted["exchanges_per_step"]
    assert measured["bytes_by_tier"] == predicted["bytes_by_tier"]
    assert predicted["bytes_by_tier"]["inter-node"] > 0


@pytest.mark.multiprocess
@needs_torchrun
@pytest.mark.parametrize(("model", "size", "layout"), [
    ("tiny-flux", ["--resolution", "128"], ["--ulysses", "2", "--ring", "2"]),
    ("tiny-pixart", ["--resolution", "128", "--batch-size", "2"],
     ["--ulysses", "2", "--batch", "2"]),
])
def test_a_hybrid_plan_file_moves_the_same_bytes_in_simulate_and_run(tmp_path, model, size,
                                                                     layout):
    """Hybrid layouts on 2 nodes x 2 ranks: Ulysses x Ring (the output gathered over the
    whole sequence group) and Ulysses x batch (tiny-pixart's guidance batch split in two,
    the output gathered over each Ulysses group, then whole samples over the batch groups):
    the runtime's bytes per tier, output gathers included, are the simulator's."""
    _, simulated, measured = plan_simulate_run(tmp_path, "torchrun", "torch", [
        "--topology", "cluster", "--nodes", "2", "--model", model, *size, "--dtype", "float32",
        "--steps", "2", "--schedule", "vfirst", *layout])
    [predicted] = simulated["results"]
    assert measured["bytes_by_tier"] == predicted["bytes_by_tier"]
    assert predicted["bytes_by_tier"]["inter-node"] > 0


@pytest.mark.multiprocess
@needs_torchrun
def test_run_builds_and_hashes_the_plan_that_plan_writes_for_the_same_flags(tmp_path):
    """`run` without --plan (2 ranks, one node) and `plan --out` for the same model, size,
    schedule, layout, steps and dtype on a machine of 2 ranks on one node: one plan, one
    sha256 (the model's name and text length, the image size and the pure-Ulysses layout
    are recorded alike)."""
    plan, ran = tmp_path / "p.json", tmp_path / "r.json"
    same = ["--model", "tiny-flux", "--resolution", "128", "--steps", "2", "--dtype", "float32",
            "--schedule", "vfirst", "--ulysses", "2"]
    assert main(["plan", "--topology", "cluster", "--nodes", "1", *same, "--out", str(plan)]) == 0
    cmd = launcher_prefix("torchrun", 2) + ["-m", "cocodiff", "run", *same, "--transport",
                                            "torch", "--quiet", "--json", str(ran)]
    result = run_job(cmd, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert json.loads(ran.read_text())["plan_sha256"] == load_run_plan(plan).sha256


@pytest.mark.parametrize(("path", "value", "message"), [
    (("layers", 0, "attention", 0, "op"), "nap", "unknown compute op 'nap'"),
    (("layers", 0, "attention", 1, "tensor"), "z", "unknown tensor 'z'"),
    (("layers", 0, "attention", 1, "group"), [0, 7], "an exchange group that is not the grid"),
    (("layers", 0, "attention", 1, "phases", 0, "sent_fraction"), 2.0, "sent_fraction"),
    (("plans", 0, "programs", 0, 0), -1, "names a layer that is not in the table"),
    (("steps",), [5], "steps must name plans by index"),
    (("model", "family"), "unet", "unknown model family 'unet'"),
])
def test_an_edited_file_is_refused_in_one_line(tmp_path, path, value, message):
    options = PlanOptions(vmajor=VMajorOptions("constant", 0.5))
    data = json.loads(build_run_plan("cocodiff", FLUX, RankGrid((2, 1, 1), (0, 1)), STREAMS, 2,
                                     options).to_json())
    where = data
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    file = tmp_path / "p.json"
    file.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=re.escape(message)) as caught:
        load_run_plan(file)
    assert "\n" not in str(caught.value)


def test_a_plan_for_another_model_layout_or_call_is_refused():
    run_plan = build_run_plan("vfirst", FLUX, GRID, STREAMS, 2, PlanOptions(),
                              parallel=ParallelLayout(4, 2))
    other = REGISTRY["sd35-large"]
    with pytest.raises(PlanFileError, match="the plan is for flux1-dev .*num_heads 24.*"
                       "the model loaded has .*num_heads 38"):
        check_plan_fits_model(run_plan, other, 8, ParallelLayout(4, 2))
    with pytest.raises(PlanFileError, match="the plan is for 8 ranks, the launch has 4"):
        check_plan_fits_model(run_plan, FLUX, 4)
    with pytest.raises(PlanFileError, match="layout is U4xR2xB1, the runtime's pure Ulysses"):
        check_plan_fits_model(run_plan, FLUX, 8, ParallelLayout(8))
    check_plan_fits_model(run_plan, FLUX, 8, ParallelLayout(4, 2))
    check_plan_fits_call(run_plan, (512, 1024), 1, "bfloat16", 2)  # stream order is free
    with pytest.raises(PlanFileError, match=r"token streams \(1024, 512\), batch 1, bfloat16; "
                       r"the model runs \(1024, 64\), batch 2, float32"):
        check_plan_fits_call(run_plan, (64, 1024), 2, "float32", 2)
    with pytest.raises(PlanFileError, match="covers 2 denoising steps, the run has 3"):
        check_plan_fits_call(run_plan, STREAMS, 1, "bfloat16", 3)
