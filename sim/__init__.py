"""A SimPy discrete-event simulator of flows on a topology.

:class:`Network` shares link bandwidth max-min fairly among flows; :class:`Simulation`
puts a topology's links, its tiles' compute and a :class:`Timeline` in one SimPy
environment. Knows nothing of DiTs or torch.
"""

from sim.engine import Simulation
from sim.network import LinkStats, Network
from sim.timeline import Span, Timeline

__all__ = ["LinkStats", "Network", "Simulation", "Span", "Timeline"]
