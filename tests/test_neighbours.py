"""Other work on the ranks' hosts (cocodiff.calibration.neighbours): the host's busy time
less the ranks' own CPU, per host, as a share of its cores."""

import os
import time

import pytest

from cocodiff.calibration import neighbours
from cocodiff.calibration.neighbours import foreign_of_rows, foreign_text


def _row(host, busy_s, own_s, wall_s=10.0, cores=4, known=True):
    return [float(host), float(known), busy_s, own_s, wall_s, float(cores)]


def test_two_ranks_of_one_host_count_its_busy_time_once():
    # 10 s on 4 cores = 40 core-s; the host was busy 30 s, its two ranks used 9 + 9.
    rows = [_row(1, 30.0, 9.0), _row(1, 30.0, 9.0)]
    assert foreign_of_rows(rows) == pytest.approx(12.0 / 40.0)


def test_the_busiest_host_decides_and_a_quiet_one_reads_zero():
    rows = [_row(1, 8.0, 8.0), _row(2, 20.0, 4.0), _row(2, 20.0, 4.0)]
    assert foreign_of_rows(rows) == pytest.approx(12.0 / 40.0)
    # Clock granularity can make the ranks' CPU exceed the host's: never below zero.
    assert foreign_of_rows([_row(1, 7.9, 8.0)]) == 0.0


def test_a_host_that_does_not_account_its_cpus_gives_no_answer():
    assert foreign_of_rows([_row(1, 0.0, 4.0, known=False), _row(2, 9.0, 4.0)]) is None


def test_only_a_share_past_the_warning_gets_a_line():
    assert foreign_text(None) is None
    assert foreign_text(neighbours.FOREIGN_WARNING) is None
    line = foreign_text(0.37)
    assert line is not None and "37%" in line and "quiet machine" in line


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat here")
def test_a_snapshot_sees_this_process_busy_on_the_host():
    began = neighbours.snapshot()
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    now = neighbours.snapshot()
    own = now.own_cpu_s - began.own_cpu_s
    # The host's busy time includes this process's 0.2 s (ticks of 1/CLK_TCK s).
    assert own >= 0.2
    assert now.host_busy_s - began.host_busy_s >= own - 2 / os.sysconf("SC_CLK_TCK")
