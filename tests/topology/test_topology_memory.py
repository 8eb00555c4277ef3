"""The device's memory in a topology: ``[tile] memory_gb`` in TOML, the presets' datasheet
values, refused when it is not a physical amount."""

from __future__ import annotations

import pytest

from topology import TopologyError, load_topology
from topology.presets import get_preset
from topology.toml_format import dump_topology


@pytest.mark.parametrize(("preset", "memory_gb"), [
    ("aurora", 64.0), ("dgx-h100", 80.0), ("dgx-a100", 80.0), ("a100-nvlink", 80.0),
    ("l40-pcie", 48.0), ("cluster", 0.0),
])
def test_presets_state_their_device_memory(preset, memory_gb):
    assert get_preset(preset).tile_memory_gb == memory_gb


def test_memory_gb_is_read_written_and_checked(tmp_path):
    path = tmp_path / "m.toml"
    path.write_text('preset = "dgx-h100"\n\n[tile]\nmemory_gb = 40\n')
    spec = load_topology(path)
    assert spec.tile_memory_gb == 40.0
    again = tmp_path / "again.toml"
    again.write_text(dump_topology(spec))
    assert load_topology(again) == spec
    path.write_text('preset = "dgx-h100"\n\n[tile]\nmemory_gb = -1\n')
    with pytest.raises(TopologyError, match=r"negative device memory -1\.0 GB in "
                                            r"tile\.memory_gb of .*m\.toml"):
        load_topology(path)
