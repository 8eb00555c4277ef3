"""Device memory per rank (cocodiff.memory): a pipeline stage holds its share of the
weights plus its K/V buffer; the sequence family the whole model; a layout that does not
fit the device is refused in one line."""

from __future__ import annotations

import json

import pytest

from cocodiff.commands.cli import main
from cocodiff.layout import LayoutError, ParallelLayout, PipelineLayout
from cocodiff.memory import (
    check_fits,
    pipeline_memory,
    sequence_memory,
    transformer_params,
)
from cocodiff.models import REGISTRY
from cocodiff.schedules.pipefusion import buffer_tokens
from topology.presets import get_preset

FLUX = REGISTRY["flux1-dev"]  # 57 layers, 24 heads of 128, 12e9 parameters
STREAMS = (4096, 512)  # 1024 px image tokens, the joint text


@pytest.mark.parametrize(("stages", "ulysses", "patches"), [(3, 1, 3), (3, 2, 4), (19, 1, 2)])
def test_a_pipeline_rank_holds_weights_over_n_plus_its_kv_buffer(stages, ulysses, patches):
    layout = PipelineLayout(stages, ulysses, patches)
    memory = pipeline_memory(FLUX, STREAMS, layout, dtype_bytes=2, batch=1)
    assert memory.weights_bytes == pytest.approx(12e9 * 2 / stages)  # 57 layers divide
    layers = 57 // stages
    kv_tokens = buffer_tokens(FLUX, STREAMS, layout, patches)
    # K and V of every buffered token, the rank's heads, each of its stage's layers.
    assert memory.buffer_bytes == 2 * layers * kv_tokens * (24 // ulysses) * 128 * 2
    assert memory.total_bytes == pytest.approx(memory.weights_bytes + memory.buffer_bytes
                                               + memory.activation_bytes)
    assert 0 < memory.activation_bytes < memory.weights_bytes


def test_a_synchronous_pipeline_keeps_no_buffer_and_the_sequence_family_the_whole_model():
    assert pipeline_memory(FLUX, STREAMS, PipelineLayout(3, 1, 1), 2, 1).buffer_bytes == 0
    memory = sequence_memory(FLUX, STREAMS, 8, ParallelLayout(4, 2), 2, 1)
    assert memory.weights_bytes == 12e9 * 2
    assert memory.buffer_bytes == 0
    # V-Major keeps every layer's V over the rank's heads: 57 x S x 6 heads x 128 x 2 B.
    cached = sequence_memory(FLUX, STREAMS, 4, None, 2, 1, v_cache=True)
    assert cached.buffer_bytes == 57 * 4608 * 6 * 128 * 2


def test_a_model_without_a_card_is_counted_from_its_shape():
    tiny = REGISTRY["flux1-dev"].__class__(
        name="no-card", family="pixart", num_layers=2, num_heads=4, head_dim=8, text_tokens=0,
        cross_attention_tokens=0, patch_size=2)
    assert transformer_params(tiny) == 2 * (4 + 8 + 6) * 32 * 32


def test_a_layout_that_exceeds_device_memory_is_refused_in_one_line():
    flux2 = REGISTRY["flux2-dev"]  # 32e9 parameters: 64 GB of bf16, more than an L40's 48
    memory = sequence_memory(flux2, STREAMS, 8, None, 2, 1)
    with pytest.raises(LayoutError) as caught:
        check_fits(memory, get_preset("l40-pcie").tile_memory_gb, "U8xR1xB1", "l40-pcie")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("layout U8xR1xB1 does not fit: a rank needs 64.")
    assert "weights 64.0" in message and "a l40-pcie device holds 48 GB" in message
    # Two pipeline stages halve the weights: it fits.
    check_fits(pipeline_memory(flux2, STREAMS, PipelineLayout(2, 4, 2), 2, 1), 48.0, "P2", "x")
    check_fits(memory, 0.0, "U8xR1xB1", "unknown")  # memory not known: nothing refused


def test_plan_refuses_what_does_not_fit_and_ranks_what_does(tmp_path, capsys):
    """FLUX.2-dev on 8 L40s: no sequence layout fits (whole model per rank); the planner
    says so and names a pipeline layout."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--topology", "l40-pcie", "--model", "flux2-dev", "--resolution",
                 "256", "--steps", "4", "--schedule", "flat,pipefusion", "--pipefusion", "2",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "note: refused: layout U8xR1xB1 does not fit" in text
    record = json.loads(out.read_text())
    assert {c["schedule"] for c in record["candidates"]} == {"pipefusion"}
    assert record["candidates"][0]["memory_per_rank"]["total_gb"] < 48


def test_plan_with_nothing_that_fits_fails_in_one_line(capsys):
    assert main(["plan", "--topology", "l40-pcie", "--model", "flux2-dev", "--resolution",
                 "256", "--schedule", "flat"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "does not fit" in err and "Traceback" not in err
