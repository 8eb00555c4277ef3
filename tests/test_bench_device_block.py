"""bench/device_block.py: the cost model's layer against the real blocks, on this device."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import device_block  # noqa: E402


def test_registry_model_keeps_its_mix_of_blocks():
    config, cut = device_block.model_config("flux1-dev")
    assert cut and config["_class_name"] == "FluxTransformer2DModel"
    assert (config["num_layers"], config["num_single_layers"]) == (1, 2)  # 19 : 38


def test_prices_a_layer_and_times_the_real_blocks(tmp_path):
    out = tmp_path / "block.json"
    assert device_block.main(["--model", "tiny-flux", "--dtype", "float32", "--device", "cpu",
                              "--rounds", "1", "--round-s", "0.02", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["clock"] == "process CPU" and record["blocks_timed"] == 2
    assert record["microbenchmark"]["tflops"] > 0 and record["measured_layer_s"] > 0
    assert record["error"] == record["predicted_layer_s"] / record["measured_layer_s"] - 1
