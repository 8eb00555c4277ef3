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
    # The kernel model at the rates its microbenchmarks measured here, beside the preset's.
    measured = record["kernel_model_measured_rates"]
    assert measured["rates"]["sm_count"] == 1 and measured["rates"]["host_us"] == 0.0
    assert measured["error"] == measured["layer_s"] / record["measured_layer_s"] - 1
    assert {p["op"] for p in measured["points"]["elementwise"]} == {"mul", "layer_norm", "gelu"}
    # What the blocks dispatch per layer, beside the kernels the model counts: tiny-flux's
    # 1 double + 1 single block run more ATen ops (views included) than the model's launches.
    dispatch = record["dispatch"]
    assert dispatch["aten_ops_per_layer"] > dispatch["kernel_model_launches_per_layer"] > 0


def test_small_checks_a_topology_files_rates_and_refuses_a_bad_one(tmp_path, capsys):
    import dataclasses

    import pytest

    from topology import DEVICES, dump_topology
    from topology.presets import PRESETS

    mine = dataclasses.replace(DEVICES["h100-sxm"], name="mine", gemm_tflops=1.0)
    topology = tmp_path / "m.toml"
    topology.write_text(dump_topology(dataclasses.replace(PRESETS["cluster"](), device=mine)))
    out = tmp_path / "block.json"
    assert device_block.main(["--small", "--device", "cpu", "--rates", str(topology),
                              "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert (record["model"], record["dtype"]) == ("tiny-flux", "float32")
    assert record["kernel_model"]["rates"] == str(topology)
    roofline = tmp_path / "roofline.toml"
    roofline.write_text(dump_topology(PRESETS["cluster"]()))
    with pytest.raises(SystemExit, match="no device rates"):
        device_block.main(["--small", "--rates", str(roofline)])
