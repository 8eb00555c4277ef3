"""The kernel compute model (cocodiff.kernels) against its closed forms."""

import dataclasses
import math
import subprocess
import sys

import pytest

from cocodiff import kernels as kn
from cocodiff.cost import LayerShape, compute_seconds, op_cost, ring_block_cost
from cocodiff.models import load_model_spec
from topology import DEVICES, get_preset, load_topology

H100 = DEVICES["h100-sxm"]


def test_a_gemm_takes_flops_over_rate_plus_its_fixed_time_and_launch():
    g = kn.gemm(4608, 3072, 3072, 2)
    expected = g.flops / (H100.gemm_tflops * 1e12) + H100.gemm_fixed_us * 1e-6
    assert kn.kernel_seconds(g, H100, "eager") == pytest.approx(expected)
    gpu = expected + H100.launch_us * 1e-6
    assert kn.device_seconds((g,), H100, "eager") == pytest.approx(max(gpu, H100.host_us * 1e-6))
    # A matrix-vector product is bound by reading its weight.
    v = kn.gemm(1, 3072, 18432, 2)
    assert kn.kernel_seconds(v, H100, "eager") == pytest.approx(
        v.memory_bytes / (H100.memory_gbps * 1e9) + H100.gemm_fixed_us * 1e-6)


def test_attention_follows_the_table_and_pays_a_partial_wave():
    a = kn.attention(4096, 4096, 24, 128, 2)
    blocks = 32 * 24  # 128-query tiles x heads
    waves = math.ceil(blocks / 132) / (blocks / 132)
    assert kn.kernel_seconds(a, H100, "eager") == pytest.approx(a.flops / 368e12 * waves)
    assert kn.attention_tflops(H100, 100) == 309.0 and kn.attention_tflops(H100, 1 << 20) == 370.0


def test_fewer_queries_than_keys_pay_the_query_factor_read_on_log2_of_the_queries():
    rates = dataclasses.replace(H100, attention_query_factor=((128, 1.4), (512, 1.2),
                                                              (2048, 1.0)))
    square = kn.attention(4096, 4096, 24, 128, 2)
    assert kn.kernel_seconds(square, rates, "eager") == kn.kernel_seconds(square, H100, "eager")
    # 256 queries: halfway between 128 and 512 on log2, so 1.3; the same FLOPs'
    # time at the key length's rate and the partial wave (2 tiles x 24 heads on 132 SMs).
    patch = kn.attention(256, 4096, 24, 128, 2)
    waves = math.ceil(48 / 132) / (48 / 132)
    assert kn.kernel_seconds(patch, rates, "eager") == pytest.approx(
        patch.flops / 368e12 * waves * 1.3)
    assert kn.kernel_seconds(patch, H100, "eager") == pytest.approx(patch.flops / 368e12 * waves)
    # Flat past the ends: below the fewest queries timed, and from the last up to the keys.
    assert kn.attention_query_factor(rates, 16, 4096) == 1.4
    assert kn.attention_query_factor(rates, 3000, 4096) == 1.0
    assert kn.attention_query_factor(rates, 5000, 4096) == 1.0


def test_a_pipelined_patch_pays_the_query_factor_and_a_ulysses_layer_does_not():
    from cocodiff.plan.steps import Compute
    from cocodiff.schedules.pipefusion import patch_attention

    spec = load_model_spec("flux1-dev")
    ulysses = op_cost(spec, "attention", LayerShape(1152, 4608, 6))
    patch = patch_attention(Compute("attention", ulysses), 1152, 4608, 24, 128, 2, 1).cost
    plain = dataclasses.replace(get_preset("dgx-h100"), device=H100)
    factored = dataclasses.replace(plain, device=dataclasses.replace(
        H100, attention_query_factor=((1152, 1.5), (4608, 1.0))))
    assert compute_seconds(ulysses, factored) == compute_seconds(ulysses, plain)
    attention = [k for k in patch.kernels if k.kind == "attention"]
    extra = 0.5 * kn.kernel_seconds(attention[0], H100, "eager")
    assert compute_seconds(patch, factored) == pytest.approx(
        compute_seconds(patch, plain) + extra)


def test_eager_and_compiled_differ_only_in_elementwise_bytes_and_launches():
    e = kn.elementwise(1000.0, 10, 4, 6, 2)
    assert kn.kernel_seconds(e, H100, "eager") == pytest.approx(10_000 / (H100.memory_gbps * 1e9))
    assert kn.kernel_seconds(e, H100, "compiled") == pytest.approx(4000 / (H100.memory_gbps * 1e9))
    g = kn.gemm(4608, 3072, 3072, 2)
    assert kn.kernel_seconds(g, H100, "eager") == kn.kernel_seconds(g, H100, "compiled")
    host = kn.device_seconds((e,), H100, "eager")
    assert host == pytest.approx(max(10_000 / (H100.memory_gbps * 1e9) + 6e-6, 6 * 9e-6))


def test_ring_chunks_cost_more_than_one_attention_by_the_merges_and_the_waves():
    spec = load_model_spec("flux1-dev")
    whole = op_cost(spec, "attention", LayerShape(4608, 4608, 24))
    block = op_cost(spec, "attention", LayerShape(2304, 2304, 24))
    chunks = [ring_block_cost(block, i, 2) for i in range(2)]
    assert sum(c.flops for c in chunks) == pytest.approx(whole.flops / 2)  # per rank
    merge = kn.ring_merge(block.kernels[0], 2, first=False)
    assert merge.memory_bytes == 2304 * 24 * 128 * 2 * kn.RING_MERGE.eager
    for mode in kn.COMPUTE_MODES:
        spent = sum(kn.device_seconds(c.kernels, H100, mode) for c in chunks)
        # Two ranks share the whole attention: the Ring takes more than half of it.
        assert spent > kn.device_seconds(whole.kernels, H100, mode) / 2


def test_compute_seconds_keeps_the_roofline_without_device_rates():
    spec = load_model_spec("flux1-dev")
    cost = op_cost(spec, "mlp", LayerShape(4608, 4608, 24))
    cluster = get_preset("cluster")
    assert compute_seconds(cost, cluster) == pytest.approx(
        max(cost.flops / (cluster.tile_tflops * 1e12),
            cost.memory_bytes / (cluster.tile_memory_gbps * 1e9)))
    h100 = get_preset("dgx-h100")
    eager = compute_seconds(cost, h100)
    compiled = compute_seconds(cost, dataclasses.replace(h100, compute_mode="compiled"))
    assert eager > compiled > cost.flops / (h100.tile_tflops * 1e12)


@pytest.mark.parametrize("name", ["aurora", "dgx-h100", "dgx-a100"])
def test_presets_carry_device_rates(name):
    assert get_preset(name).device is not None


def test_a_topology_file_names_its_device(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('preset = "dgx-h100"\n[nodes]\ngpus = 1\nnics = 0\n'
                    '[tile]\ndevice = "a100-sxm"\n')
    assert load_topology(path).device == DEVICES["a100-sxm"]
    path.write_text('preset = "dgx-h100"\n[tile]\ndevice = "roofline"\n')
    assert load_topology(path).device is None
    path.write_text('preset = "dgx-h100"\n[tile]\ndevice = "tpu"\n')
    with pytest.raises(Exception, match="unknown device 'tpu'"):
        load_topology(path)


def test_compute_mode_flag_refuses_a_bad_value_in_one_line():
    done = subprocess.run([sys.executable, "-m", "cocodiff", "simulate", "--compute-mode", "jit"],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "--compute-mode" in done.stderr


def test_a_plan_file_keeps_the_kernels(tmp_path):
    """simulate --plan prices a plan file's steps as the direct simulation does."""
    import json

    topo = tmp_path / "h.toml"
    topo.write_text('preset = "dgx-h100"\n[nodes]\ngpus = 2\nnics = 0\n')
    common = ["--topology", str(topo), "--compute-mode", "compiled"]
    run = [sys.executable, "-m", "cocodiff"]
    subprocess.run([*run, "plan", "--model", "flux1-dev", "--resolution", "512", "--steps", "2",
                    "--schedule", "flat", "--ulysses", "1", "--ring", "2", "--batch", "1",
                    "--out", str(tmp_path / "p.json"), *common], check=True, capture_output=True)
    subprocess.run([*run, "simulate", "--plan", str(tmp_path / "p.json"), "--json",
                    str(tmp_path / "a.json"), *common], check=True, capture_output=True)
    subprocess.run([*run, "simulate", "--model", "flux1-dev", "--resolution", "512", "--steps",
                    "2", "--schedule", "flat", "--ulysses", "1", "--ring", "2", "--batch", "1",
                    "--json", str(tmp_path / "b.json"), *common], check=True, capture_output=True)
    a, b = (json.loads((tmp_path / n).read_text())["results"][0]["step_time_s"]
            for n in ("a.json", "b.json"))
    assert a == pytest.approx(b, rel=1e-9)


def test_the_sweep_refuses_a_compute_mode_in_one_line():
    done = subprocess.run([sys.executable, "-m", "cocodiff", "simulate", "--sweep",
                           "--compute-mode", "compiled"], capture_output=True, text=True)
    assert done.returncode != 0 and done.stderr.strip().count("\n") == 0
    assert "drop --compute-mode" in done.stderr
