"""calibrate's verdict on its own topology (cocodiff.calibration.verdict), the loops timed
under a busy-polling transport, and --strict refusing to write what the verdict rejects."""

import json

import pytest
from test_calibrate_host import _calibration

from cocodiff.calibration.fits import CpuFit
from cocodiff.calibration.loaded import LoadedPoint, unpriced_loops
from cocodiff.calibration.options import CalibrateOptions, CalibrationError
from cocodiff.calibration.result import (
    MAX_CALL_WAIT_US,
    HostMeasurement,
    judge_calibration,
    write_outputs,
)
from cocodiff.calibration.verdict import LOOPS_LIMIT, judge, machine_warnings


def _loops(*errors):
    return [{"shape": "world", "bytes_per_peer": 2048, "measured_s": 0.010,
             "predicted_s": 0.010 * (1 + error), "error": error} for error in errors]


def test_the_verdict_holds_when_the_simulator_reproduces_the_loops():
    verdict = judge(_loops(-0.05, 0.10, 0.40), [])  # the median decides, not the worst
    assert verdict.holds is True and verdict.line() is None
    assert verdict.loops_median_abs_error == pytest.approx(0.10)


def test_loops_missed_by_more_than_the_limit_say_in_one_line_that_predictions_will_not_hold():
    # 4 MPICH ranks on 2 cores before the loops were timed under busy-poll: -27% to -38%
    verdict = judge(_loops(-0.38, -0.37, -0.32, -0.27), [])
    assert verdict.holds is False and LOOPS_LIMIT < 0.345
    line = verdict.line()
    assert "\n" not in line and line.startswith("predictions from this topology will not hold")
    assert "median 34%" in line and "measured 10.00 ms, simulated 6.20 ms" in line
    assert json.loads(json.dumps(verdict.to_json()))["holds"] is False


def test_a_busy_or_drifting_machine_is_a_reason_and_no_loops_is_no_verdict():
    warnings = machine_warnings((3.0, 9.5), 2.0, 4, 0.15, 0.10)
    assert warnings == [
        "load average 9.5 on 2 cores: other work shared them (calibrate again on a quiet "
        "machine)", "the machine's speed moved +15% during the calibration (calibrate again)"]
    assert machine_warnings((3.0, 5.0), 2.0, 4, 0.05, 0.10) == []
    # Other processes' share of the cores, from the host's own account (neighbours.py).
    assert machine_warnings((3.0, 5.0), 2.0, 4, 0.05, 0.10, 0.05) == []
    [busy] = machine_warnings((3.0, 5.0), 2.0, 4, 0.05, 0.10, 0.40)
    assert busy.startswith("other processes used 40% of the host's cores")
    assert judge(_loops(0.01), warnings).holds is False
    unchecked = judge([], [])
    assert unchecked.holds is None and unchecked.line() is None and unchecked.notes


def test_a_call_wait_fitted_to_its_cap_is_a_reason():
    capped = judge_calibration(_calibration(HostMeasurement(2.0, None, None,
                                                            call_wait_us=MAX_CALL_WAIT_US)))
    assert capped.holds is False
    assert "reached its 20 ms cap" in capped.line() and "\n" not in capped.line()
    fitted = judge_calibration(_calibration(HostMeasurement(2.0, None, None,
                                                            call_wait_us=470.0)))
    assert not any("cap" in reason for reason in fitted.reasons)


def test_a_spinning_transport_keeps_its_loops_and_waits_per_call_but_pays_no_price():
    point = LoadedPoint("world", 2048, 9, 54, 54 * 2048, 2.5e-3, 12.7e-3, 9)
    loaded = unpriced_loops([point], 3.7e-3, 8.0e-3, "the model's forward")
    assert (loaded.call_cpu_us, loaded.message_cpu_us, loaded.copy_gbps) == (0.0, 0.0, None)
    spinning = CpuFit(message_cpu_us=20.0, copy_gbps=5.0, busy_fraction=0.9, wait_spin=0.9)
    host = HostMeasurement(2.0, None, spinning, loaded, call_wait_us=470.0).spec()
    assert host.busy_poll and host.call_wait_us == 470.0
    assert (host.call_cpu_us, host.message_cpu_us, host.copy_gbps) == (0.0, 0.0, None)


def test_strict_refuses_to_write_a_topology_its_own_check_rejects(tmp_path, capsys):
    result = _calibration(HostMeasurement(2.0, None, None))
    result.load_average = (1.0, 12.0)  # other work on the machine's 2 cores
    assert judge_calibration(result).holds is False
    output, measured = tmp_path / "m.toml", tmp_path / "m.json"
    with pytest.raises(CalibrationError, match="refused .--strict.: predictions from this "):
        write_outputs(result, CalibrateOptions(strict=True, output=output, json=measured))
    assert not output.exists() and not measured.exists()
    write_outputs(result, CalibrateOptions(output=output, json=measured))  # the default
    assert "warning: predictions from this topology will not hold" in capsys.readouterr().out
    assert "# verdict: predictions from this topology will not hold" in output.read_text()
    assert json.loads(measured.read_text())["verdict"]["holds"] is False
