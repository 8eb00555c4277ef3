"""Plans: what every rank does, as data, and the one executor that runs it.

``steps`` is the plan data (compute and exchange steps, a layer's plan, a rank's
program), ``file`` the plan file that ``cocodiff plan`` writes and ``simulate`` and
``run`` execute, ``phasing`` the chunk-by-phase pipeline of a phased exchange, and
``executor`` the executor that the simulator and the runtime both drive.
"""
