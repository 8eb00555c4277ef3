"""The one exception the topology package raises for bad user input."""


class TopologyError(ValueError):
    """A topology, topology file, preset name or placement the user got wrong.

    The message is one line and names the offending value (and, for a TOML file, the
    file and the key), so a CLI can print it as is and exit non-zero.
    """
