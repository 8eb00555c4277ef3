"""The simulator's driver: a plan on a topology through SimPy (:mod:`sim`) and what it says.

``simulate`` runs every rank's plan with the shared executor on the simulated transport
(``backend`` executes the steps, ``results`` is what comes out); ``bounds`` gives the
links' lower bound for a plan; ``planner`` ranks parallel layouts and schedules by
simulated step time; ``report`` prints and plots results; ``budget`` refuses work too
large to simulate; ``sweep`` runs the paper's grid (in processes, ``fanout``);
``collective`` and ``collective_fit`` simulate one all-to-all and fit the collective
model's parameters to microbenchmarks.
"""
