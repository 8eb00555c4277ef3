"""``[tile] step_overhead_us`` and ``step_overhead_sequence_us``: read, written back only
when set, one line when bad."""

from __future__ import annotations

from pathlib import Path

import pytest

from topology import TopologyError, dump_topology, get_preset, load_topology


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "machine.toml"
    path.write_text(text)
    return path


def test_step_overhead_round_trips(tmp_path: Path) -> None:
    spec = load_topology(write(tmp_path, 'preset = "cluster"\n[tile]\nstep_overhead_us = 4500\n'))
    assert spec.tile_step_overhead_us == 4500.0
    assert spec.tile_tflops == get_preset("cluster").tile_tflops  # the rest from the preset
    again = tmp_path / "again.toml"
    again.write_text(dump_topology(spec))
    assert load_topology(again) == spec


def test_the_sequence_part_round_trips(tmp_path: Path) -> None:
    spec = load_topology(write(tmp_path, 'preset = "cluster"\n[tile]\nstep_overhead_us = 2000\n'
                                         'step_overhead_sequence_us = 9000.5\n'))
    assert (spec.tile_step_overhead_us, spec.tile_step_overhead_sequence_us) == (2000.0, 9000.5)
    again = tmp_path / "again.toml"
    again.write_text(dump_topology(spec))
    assert load_topology(again) == spec


def test_without_the_key_nothing_is_charged_or_written(tmp_path: Path) -> None:
    spec = load_topology(write(tmp_path, 'preset = "cluster"\n'))
    assert spec.tile_step_overhead_us == 0.0
    assert spec.tile_step_overhead_sequence_us == 0.0
    assert "step_overhead" not in dump_topology(spec)


BAD = {
    "negative": ("step_overhead_us = -1",
                 r"negative step overhead -1\.0 us in tile\.step_overhead_us of .*machine\.toml"),
    "absurd": ("step_overhead_us = 1e12",
               r"step overhead 1000000000000\.0 us in tile\.step_overhead_us .*above 1 s"),
    "string": ('step_overhead_us = "5 ms"',
               r"expected a number for tile\.step_overhead_us of .*string '5 ms'"),
    "nan": ("step_overhead_us = nan", r"step overhead nan us is not finite in tile\."),
    "negative sequence": ("step_overhead_sequence_us = -5",
                          r"negative step overhead per sequence -5\.0 us in "
                          r"tile\.step_overhead_sequence_us of .*machine\.toml"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_step_overhead(tmp_path: Path, case: str) -> None:
    line, pattern = BAD[case]
    with pytest.raises(TopologyError, match=pattern) as info:
        load_topology(write(tmp_path, f'preset = "cluster"\n[tile]\n{line}\n'))
    assert "\n" not in str(info.value)
