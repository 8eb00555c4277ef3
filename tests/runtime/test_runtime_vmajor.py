"""V-Major in the runtime (cocodiff.runtime.vmajor): the codec's selection and the
receiver's copy, selective phases on an in-process transport, and `cocodiff run
--schedule cocodiff` end to end: quality floor against the exact plan, the V cache
against the plan's bound, exactness at cache ratio 0, and an activity trace that the
simulator replays with the same bytes per tier."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from launching import launcher_prefix, needs_torchrun, run_job
from test_runtime_tapa import heads_spec, run_ranks

from cocodiff.commands.cli import main
from cocodiff.models import spec_from_config
from cocodiff.plan.executor import PlanError
from cocodiff.plan.vblocks import block_tokens, blocks_sent, message_bytes
from cocodiff.quality import psnr_db, ssim
from cocodiff.runtime.families import runtime_family
from cocodiff.runtime.tapa import PhasedHandle, plan_route
from cocodiff.runtime.tiny import TINY_DEFAULTS, build_tiny, default_resolution
from cocodiff.runtime.vmajor import VMajorCache, cache_bytes_bound, local_activity
from cocodiff.schedules import PlanOptions, RankGrid, plan_cocodiff
from cocodiff.schedules.activity import load_activity, plan_from_activity
from cocodiff.schedules.gather import output_gather
from cocodiff.simulator.simulate import simulate_plan
from topology import Placement, build_topology
from topology.presets import cluster

# -- the codec ---------------------------------------------------------------------------


def codec_pair(fraction: float, blocks_per_row: int, step: int = 0):
    sender, receiver = VMajorCache(), VMajorCache()
    return (sender.codec("v", step, 0, 0, fraction, blocks_per_row),
            receiver.codec("v", step, 0, 0, fraction, blocks_per_row), sender, receiver)


def test_block_tokens_divide_the_row():
    assert block_tokens(18) == 9 and block_tokens(64) == 16 and block_tokens(17) == 1
    assert blocks_sent(10, 0.25) == 2 and blocks_sent(10, 1.0) == 10 and blocks_sent(3, 0.0) == 0
    assert message_bytes(10, 64, 1.0) == 640  # everything: no indices
    assert message_bytes(10, 64, 0.3) == 3 * 64 + 3 * 4


def test_the_codec_sends_the_most_changed_blocks_and_the_receiver_keeps_the_rest():
    # rows (R=2, B=1, s=32, D=4): 2 blocks of 16 tokens per row, 4 blocks per message
    first = torch.randn(2, 1, 32, 4)
    encode, decode, sender, receiver = codec_pair(0.5, 2)
    payload = encode.encode(0, 1, first)
    assert payload.numel() == first.numel() * 4  # no copy on the other side: all, no index
    assert payload.numel() == decode.message_bytes(0, 1, 2, (1, 32, 4), torch.float32)
    torch.testing.assert_close(decode.decode(0, 1, payload, 2, (1, 32, 4), torch.float32), first,
                               atol=0, rtol=0)
    # Next step: blocks 1 and 2 change a lot, block 3 a little, block 0 not at all.
    second = first.clone().reshape(4, -1)
    second[1] += 5.0
    second[2] -= 3.0
    second[3] += 0.01
    second = second.reshape(first.shape)
    encode, decode, *_ = codec_pair(0.5, 2, step=1)
    encode._cache, decode._cache = sender, receiver
    payload = encode.encode(0, 1, second)
    assert payload.numel() == message_bytes(4, 16 * 4 * 4, 0.5) == 2 * 256 + 2 * 4
    assert decode.message_bytes(0, 1, 2, (1, 32, 4), torch.float32) == payload.numel()
    got = decode.decode(0, 1, payload, 2, (1, 32, 4), torch.float32).reshape(4, -1)
    expected = torch.cat([first.reshape(4, -1)[[0]], second.reshape(4, -1)[[1, 2]],
                          first.reshape(4, -1)[[3]]])
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert [s.sent for s in sender.selections[(1, 0, 0)]] == [(1, 2)]
    # Sender's mirror and receiver's copy agree; each holds the 4 blocks once.
    assert sender.num_bytes == receiver.num_bytes == first.numel() * 4


def test_a_plan_with_other_blocks_per_row_is_refused():
    encode, *_ = codec_pair(0.5, 3)
    with pytest.raises(PlanError, match="cuts a row into 3 blocks"):
        encode.encode(0, 1, torch.randn(2, 1, 32, 4))


# -- selective phases on an in-process transport -----------------------------------------

GRID = RankGrid((2, 2, 1), (0, 1, 2, 3))
STREAMS = (40, 24)  # 16 local tokens per rank: one 16-token block per row


def v_exchange(plan, rank: int):
    return next(e for e in plan.program(rank).layers[0].exchanges if e.tensor == "v")


def v_rows(plan, rank: int, step: int, change: str) -> torch.Tensor:
    """Rank's V send buffer (rows, B=1, s, D) at ``step``: deterministic per (rank,
    row); ``change`` "none" keeps step 0's values, "all" adds the step to every value."""
    rows = sum(v_exchange(plan, rank).send_rows)
    generator = torch.Generator().manual_seed(rank)
    split = plan.head_split
    base = torch.randn(rows, 1, split.local_tokens, split.head_dim, generator=generator,
                       dtype=torch.float64)
    return base + (step if change == "all" else 0)


def exchange_v(transport, plans, change: str, cache: VMajorCache) -> list[torch.Tensor]:
    """Run V's exchange of each step's plan on this rank, V-Major codecs on."""
    rank = transport.rank
    out = []
    for step, plan in enumerate(plans):
        exchange = v_exchange(plan, rank)
        groups = [transport.new_group(phase.group) for phase in exchange.phases]
        codecs = {i: cache.codec("v", step, 0, 0, phase.sent_fraction, phase.blocks_per_row,
                                 sum(exchange.chunk_tokens))
                  for i, phase in enumerate(exchange.phases) if phase.selective}
        assert codecs, "the node phase of V is selective"
        route = plan_route(exchange, GRID, plan.head_split.heads, rank)
        handle = PhasedHandle(transport, groups, route, v_rows(plan, rank, step, change),
                              exchange.chunks, codecs, chunk_tokens=exchange.chunk_tokens)
        out.append(handle.wait())
    return out


def exact_v(plan, rank: int, step_of_source) -> torch.Tensor:
    """What the flat all-to-all delivers to ``rank`` when source s sends its V of step
    ``step_of_source(s)``: rows grouped by source."""
    heads = plan.head_split.heads
    me = GRID.position(rank)
    parts = []
    for source in range(GRID.num_ranks):
        rows = v_rows(plan, source, step_of_source(source), "all")
        start = sum(heads[:me])
        parts.append(rows[start:start + heads[me]])
    return torch.cat(parts)


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_ratio_zero_is_exact_and_ratio_one_keeps_the_first_steps_v_from_other_nodes(chunks):
    spec = heads_spec(4)
    exact_plans = [plan_cocodiff(spec, GRID, STREAMS, PlanOptions(dtype="float64", chunks=chunks),
                                 cache_ratio=0.0)] * 3
    frozen = [plan_cocodiff(spec, GRID, STREAMS, PlanOptions(dtype="float64", chunks=chunks),
                            cache_ratio=r)
              for r in (0.0, 1.0, 1.0)]
    for plans, stale in ((exact_plans, False), (frozen, True)):
        caches = [VMajorCache() for _ in range(4)]
        results = run_ranks(4, lambda t, p=plans, c=caches: exchange_v(t, p, "all", c[t.rank]))
        for rank, per_step in enumerate(results):
            for step, received in enumerate(per_step):
                # A stale source: on the other node, so its V comes from the cache.
                def step_of(source, step=step, rank=rank, stale=stale):
                    other_node = GRID.coords(source)[0] != GRID.coords(rank)[0]
                    return 0 if stale and other_node else step

                torch.testing.assert_close(received, exact_v(plans[step], rank, step_of),
                                           atol=0, rtol=0)


def test_unchanged_v_arrives_exactly_with_a_partial_phase():
    spec = heads_spec(4)
    plans = [plan_cocodiff(spec, GRID, STREAMS, PlanOptions(dtype="float64"), cache_ratio=r)
             for r in (0.0, 0.5, 0.75)]
    caches = [VMajorCache() for _ in range(4)]
    results = run_ranks(4, lambda t: exchange_v(t, plans, "none", caches[t.rank]))
    for rank, per_step in enumerate(results):
        for received in per_step:
            torch.testing.assert_close(received, exact_v(plans[0], rank, lambda s: 0),
                                       atol=0, rtol=0)
        # The cache holds what the plan bounds it by (one layer, one call per step).
        assert caches[rank].num_bytes == cache_bytes_bound(plans[1].program(rank).layers[:1],
                                                           rank, calls=1) > 0
        # Steps 1 and 2 sent half and a quarter of the blocks to the other node.
        mask = local_activity(caches[rank], 3, 1)
        assert mask.shape[2] > 0
        assert [int(m.sum()) for m in mask[:, 0]] == [
            mask.shape[2], blocks_sent(mask.shape[2], 0.5), blocks_sent(mask.shape[2], 0.25)]


# -- cocodiff run ------------------------------------------------------------------------

PSNR_FLOOR_DB = 30.0  # the floor for V-Major's defaults on the tiny models, 20 steps


def cocodiff_run(tmp_path, *args: str, ranks: int = 4):
    cmd = [*launcher_prefix("torchrun", ranks), "-m", "cocodiff", "run", "--quiet",
           "--layout", "2x2x1", *args]
    job = run_job(cmd, tmp_path, timeout_s=300)
    assert job.returncode == 0, job.stderr[-3000:]
    return job


@needs_torchrun
@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["tiny-flux", "tiny-wan"])
def test_vmajor_defaults_keep_the_quality_floor_and_the_replay_moves_the_same_bytes(
        tmp_path, model):
    record_path, trace_path = tmp_path / "run.json", tmp_path / "activity.json"
    job = cocodiff_run(tmp_path, "--model", model, "--schedule", "cocodiff", "--steps", "20",
                       "--reference", "--record-activity", str(trace_path),
                       "--json", str(record_path))
    record = json.loads(record_path.read_text())
    quality, vmajor = record["quality"], record["vmajor"]
    assert quality["psnr_db"] >= PSNR_FLOOR_DB and quality["ssim"] > 0.95, quality
    assert 0 < quality["latent_max_abs_error"] < 0.1
    assert "quality against the exact plan: PSNR" in job.stdout
    # V-Major left blocks out, and the V cache is exactly what the plan bounds it by.
    assert 0.2 < vmajor["sent_fraction"] < 0.8, vmajor
    assert vmajor["cache_bytes"] == vmajor["cache_bound_bytes"] > 0
    trace = load_activity(trace_path)
    assert (trace.num_ranks, trace.num_steps) == (4, 20)
    assert replayed_bytes_by_tier(model, trace) == {
        tier: vmajor["bytes_by_tier"][tier] for tier in ("inter-node", "intra-node")}


def replayed_bytes_by_tier(model: str, trace) -> dict[str, int]:
    """The simulator's bytes per tier over every step of ``trace``, on a 2 x 2 cluster,
    for the plan the runtime made (float32, the tiny model's token streams), the output
    gather included."""
    pipe = build_tiny(model)
    transformer = pipe.transformer
    spec = spec_from_config({"_class_name": type(transformer).__name__,
                             **dict(transformer.config)})
    ops = runtime_family(type(transformer).__name__).ops
    width, height, frames = default_resolution(model)
    tokens = {"image": spec.image_tokens(width, height, frames),
              "text": TINY_DEFAULTS[model].max_sequence_length}
    streams = tuple(tokens[name] for name in ops.streams)
    topology = build_topology(cluster(num_nodes=2, ranks_per_node=2))
    placement = Placement.node_major(topology, 4)
    total: dict[str, int] = {"inter-node": 0, "intra-node": 0}
    batch = 2 if model == "tiny-wan" else 1
    options = PlanOptions(dtype="float32", batch=batch)
    gathers = output_gather(spec, GRID, streams, None, options)
    assert gathers  # the runtime counts its output gather: so must the replay
    for step in range(trace.num_steps):
        plan = plan_from_activity(spec, GRID, streams, trace, step, options)
        result = simulate_plan(plan, topology, placement, gathers=gathers)
        for tier in total:
            total[tier] += round(result.bytes_by_tier[tier])
    return total


@needs_torchrun
@pytest.mark.multiprocess
def test_cocodiff_at_cache_ratio_zero_equals_vfirst_bit_for_bit(tmp_path):
    paths = {name: tmp_path / f"{name}.pt" for name in ("vfirst", "cocodiff")}
    cocodiff_run(tmp_path, "--schedule", "vfirst", "--steps", "2",
                 "--save-latents", str(paths["vfirst"]))
    cocodiff_run(tmp_path, "--schedule", "cocodiff", "--vmajor-ratio-schedule", "constant:0",
                 "--steps", "2", "--save-latents", str(paths["cocodiff"]))
    exact, lossless = (torch.load(paths[n], weights_only=True) for n in ("vfirst", "cocodiff"))
    torch.testing.assert_close(lossless, exact, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--schedule", "cocodiff", "--vmajor-ratio-schedule", "constant:1.5"],
         r"V-Major ratio 1\.5 is outside \[0, 1\]"),
        (["--schedule", "cocodiff", "--vmajor-ratio-schedule", "cubic"],
         "unknown V-Major ratio schedule 'cubic'"),
        (["--schedule", "cocodiff", "--vmajor-warmup", "-1"], "warm-up -1 and refresh 0"),
        (["--schedule", "tapa", "--reference"], "--reference: V-Major options, for --schedule "
         "cocodiff"),
        (["--schedule", "flat", "--vmajor-refresh", "2"], "--vmajor-"),
        (["--schedule", "cocodiff", "--record-activity", "{tmp}/a.json"],
         "--record-activity: V-Major acts on the inter-node tier"),
    ],
)
def test_bad_vmajor_options_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["run", "--quiet", "--json", str(tmp_path / "r.json"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(message, err), err
    assert not list(tmp_path.iterdir())


def test_psnr_and_ssim_of_known_images():
    image = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert psnr_db(image, image) == math.inf and ssim(image, image) == pytest.approx(1.0)
    noisy = image + 0.01
    assert psnr_db(image, noisy) == pytest.approx(40.0)  # MSE 1e-4
    # A constant shift keeps the structure; noise destroys it.
    noise = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    assert ssim(image, noisy) > 0.99 > 0.2 > ssim(image, noise)
    assert ssim(image, noise) == pytest.approx(ssim(noise, image))


def test_vmajor_applies_on_a_single_tier_grid():
    # Two nodes of one GPU: the exchange needs no TAPA phases, but V-Major's tier stays a
    # phase of its own so that it can send a share of its blocks.
    grid = RankGrid((2, 1, 1), (0, 1))
    plan = plan_cocodiff(heads_spec(4), grid, STREAMS, cache_ratio=0.5)
    exchanges = {e.tensor: e for e in plan.program(0).layers[0].exchanges}
    (phase,) = exchanges["v"].phases
    assert phase.selective and phase.level == "node" and phase.sent_fraction == 0.5
    assert not exchanges["q"].phases  # exact tensors stay one flat all-to-all
