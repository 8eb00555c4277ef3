"""Calibration: measure this machine and give the topology file the simulator uses.

What is measured (all on the real transport, between real processes):

- **Compute**, on every rank at once (so ranks that share cores are measured sharing them,
  caches and memory included): each measurement is a loop of calls long enough to span
  many of the OS's time slices, started on every rank together after a barrier, repeated
  in rounds (the median round kept), and read as the process's CPU seconds per call, i.e.
  one core's time: the time a rank waited for a core is left to the simulator's sharing
  of the host's cores (it depends on how the OS interleaved the ranks, and on whatever
  else ran on the machine; as wall-clock medians of single calls it moved the rate up to
  1.9x between calibrations). Timed this way: the matrix products of one transformer layer
  on one Ulysses rank (Q/K/V/out projections, the MLP, attention over all tokens for the
  rank's heads) at the model's shapes, giving an effective TFLOP/s (their FLOPs as
  :mod:`cocodiff.cost` counts them over their measured time), and its elementwise work
  (the adaLN-modulated layer norms) at the same shapes, giving an effective memory GB/s
  (bytes as :mod:`cocodiff.cost` counts them). These are the ``[tile]`` rates of the
  roofline model.
- **The model's real transformer blocks**, on every rank at once and timed the same way,
  when calibrate can build the model's transformer (a tiny model or a
  diffusers directory; FLUX): the diffusers modules run on one rank's local token shard,
  no communication, every block timed with forward hooks. Attention there runs over the
  local tokens with every head; the measured difference between scaled-dot-product
  attention at the true Ulysses shape (all tokens, the rank's heads) and at the local one
  is added back. The resulting seconds per layer include what a FLOP count does not see
  (RoPE, modulation, reshapes, a few dozen small ops' dispatch). They become the
  *effective* ``[tile] tflops`` written to the topology: the rate at which the simulator,
  charging every operation of a layer as :mod:`cocodiff.cost` prices it (the roofline of
  each, at the measured memory rate), takes exactly the measured seconds for one layer.
  The matrix-product rate stays in the JSON (``compute.tflops``) beside it
  (``compute.tile_tflops``, ``compute.block``). The same forwards give each rank's
  **work outside the blocks** (the forward less its blocks: embedders, RoPE's positions,
  norm_out, proj_out, all on the rank's shard) plus a scheduler step on the full latents:
  ``[tile] step_overhead_us``, which the simulator charges once per denoising step.
- **The kernel model's classes** (:mod:`~cocodiff.calibration.kernel_bench`), on every
  rank at once on the same device: GEMMs at the layer's shapes, attention by sequence
  length, elementwise work by bytes and a launch; the rates of :mod:`cocodiff.kernels`
  fitted to them alone (:mod:`~cocodiff.calibration.kernel_fit`) and checked on the real
  blocks. Written as the topology's ``[device]`` where that check holds within 10% (or on
  an accelerator with no blocks timed); else commented out beside the blocks' rate.
- **Each link tier**, with a two-rank exchange (each side sends ``n`` bytes to the other at
  once; an all-to-all over the pair) swept over message sizes, between two ranks of one
  node (intra) and two ranks of different nodes (inter), fitted as
  ``time = latency + n / bandwidth`` (least squares on relative error). The fit's latency
  is the one-way start-up of one message, software included; its bandwidth is what one
  transfer achieves per direction. These become ``[links.gpu]`` and ``[links.nic]`` of the
  ``cluster`` preset's shape.
- **The host** (``[host]``, :class:`topology.HostSpec`): the cores the ranks may run on,
  which ranks share a host (by host name: an emulated cluster's namespaces share this
  machine), and the CPU an exchange costs a rank. The process's CPU time (every thread)
  around each timed pair exchange gives ``copy_gbps`` (per byte), and the links are the
  pair fits less that CPU, so that the simulator charging CPU on the host and the rest on
  the wire takes the measured times. Loops of compute and exchange calls, every rank at
  once (:mod:`~cocodiff.calibration.loaded`), give ``call_cpu_us`` and ``message_cpu_us``
  (a step's exchanges meet busy cores: lined up, with the others idle, they cost far
  less), and their wall time beyond the simulator's ``call_wait_us``. A transport whose
  waiting rank burns a core while a late peer sleeps is written as ``busy_poll``. Whether
  a late peer's data goes first (:mod:`~cocodiff.calibration.lateness`) is
  ``late_peer_first``; the cores a transfer across nodes takes from the ranks' compute,
  every rank's loop timed with and without one (:mod:`~cocodiff.calibration.inflight`),
  ``transfer_cores``. The tile's rates are one core's (CPU time, above).
- **The collective**: flat all-to-alls over the whole world at a few sizes, reported
  next to what the fitted links predict for them (the slowest of the busiest per-rank port
  and the busiest node NIC, each with its latency) so a reader can see how far a
  collective runs from the wire. With the two-rank exchanges they are the table that
  :func:`cocodiff.simulator.collective_fit.fit_collective` fits the simulator's collective model to
  (per span: per-transfer set-up and the rate a rank's transfers reach together), the same
  fit that gives Aurora's preset; written as JSON ``collective`` (the topology file has no
  place for it).
- **A step's exchanges as the schedules issue them** (:mod:`~cocodiff.calibration.patterns`):
  at the size of one of the model's exchanges, every rank at once, back to back in rounds,
  ``flat``'s world all-to-all and TAPA's cross-node phase (every column at once, then a
  one-row sync over the node). The links come from a pair alone and a step never sends
  one alone: on a shaped link the columns' few transfers filled it far less than the
  world's many. Each is printed and written (``simulated_s``, ``error``) beside what the
  simulator gives it, timed alone (no wait per call). ``--fit-patterns`` also fits the
  world span's rate and what one cross-node transfer reaches (``transfer_cap_gbps``) on
  them; by default they are only checked (docs/changelog.md, "Measured on 2026-11-26,
  evening": on the emulated cluster the fit read fixed host costs as bandwidth).

Nodes are the ranks' (hostname, network namespace) pairs, so the ranks of an emulated
cluster's namespaces (``python -m bench.cluster run -- cocodiff calibrate``) group into their
nodes. On one machine without namespaces every rank is one node; ``--nodes K`` then
groups them ``R`` per node by rank, and the "inter-node" pair is measured on loopback too,
or taken from ``--inter-gbps`` / ``--inter-latency-us`` (e.g. an emulated cluster's ``tc``
settings). Started without a launcher, ``cocodiff calibrate`` launches itself on
``nodes x ranks-per-node`` local ranks (torch transport over loopback).

Modules, by concern: :mod:`~cocodiff.calibration.options` (what to do, the error),
:mod:`~cocodiff.calibration.fits` (fitting times), :mod:`~cocodiff.calibration.model_shapes`
(the shapes timed), :mod:`~cocodiff.calibration.compute` (operation rates),
:mod:`~cocodiff.calibration.kernel_bench` and :mod:`~cocodiff.calibration.kernel_fit` (the
kernel model's rates),
:mod:`~cocodiff.calibration.blocks` (real blocks), :mod:`~cocodiff.calibration.exchanges`
(timed exchanges), :mod:`~cocodiff.calibration.loaded` (exchanges under load),
:mod:`~cocodiff.calibration.patterns` (a step's exchanges as issued),
:mod:`~cocodiff.calibration.measure` (the whole run),
:mod:`~cocodiff.calibration.result` (the result, its topology and summary),
:mod:`~cocodiff.calibration.launch` (self-launch). The command's flags live in
:mod:`cocodiff.commands.calibrate`.
"""

from cocodiff.calibration.blocks import BlockTiming, build_transformer, measure_blocks, time_blocks
from cocodiff.calibration.compute import (
    ComputeRates,
    effective_rates,
    layer_roofline_seconds,
    measure_compute,
)
from cocodiff.calibration.exchanges import measure_exchanges, predict_all_to_all
from cocodiff.calibration.fits import (
    CpuFit,
    LinkFit,
    fit_exchange_cpu,
    fit_latency_bandwidth,
    wire_points,
)
from cocodiff.calibration.launch import self_launch
from cocodiff.calibration.measure import calibrate
from cocodiff.calibration.model_shapes import (
    LayerShapes,
    layer_shapes,
    model_tokens,
    tiny_transformer_config,
)
from cocodiff.calibration.options import CalibrateOptions, CalibrationError, check_options
from cocodiff.calibration.result import (
    Calibration,
    HostMeasurement,
    fit_calibrated_collective,
    summary,
    unconstrained_host_links,
    write_outputs,
)

__all__ = [
    "BlockTiming", "CalibrateOptions", "Calibration", "CalibrationError", "ComputeRates",
    "CpuFit", "HostMeasurement", "LayerShapes", "LinkFit", "build_transformer", "calibrate",
    "check_options", "effective_rates", "fit_calibrated_collective", "fit_exchange_cpu",
    "fit_latency_bandwidth", "layer_roofline_seconds", "layer_shapes", "measure_blocks",
    "measure_compute", "measure_exchanges", "model_tokens", "predict_all_to_all",
    "self_launch", "summary", "time_blocks", "tiny_transformer_config",
    "unconstrained_host_links", "wire_points", "write_outputs",
]
