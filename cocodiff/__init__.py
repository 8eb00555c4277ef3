"""CoCoDiff: topology-aware Ulysses sequence parallelism for Diffusion Transformers.

The engine's rooms (below ``topology``, ``sim`` and ``transports``, which it builds on):

* ``commands``: the command line (``cocodiff simulate | plan | run | ...``); the only
  place that parses flags.
* ``schedules``: the schedulers, pure functions from a model, a rank grid and options to
  a plan (flat Ulysses, TAPA, V-First, V-Major, hybrid Ulysses x Ring x batch).
* ``plan``: the plan as data, the plan file, and the one executor both sides drive.
* ``simulator``: a plan on a topology through SimPy; the planner that ranks layouts.
* ``runtime``: a plan on real diffusers models over a real transport.
* ``util``: errors, console, paths, JSON files, atomic writes.
* ``models``, ``cost``, ``layout``, ``quality``, ``calibrate``: model specs, the cost
  model, parallel layouts, quality measures, and calibration of a machine.
"""
