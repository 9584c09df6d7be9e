"""The watchdog's load on the rendezvous store grows with the number of ranks, not its square, and a killed or
frozen rank is still named within its bound: 24 heartbeat-only processes on loopback, 8 per pretend host
(``python -m scripts.studies.watchdog_load`` runs the same with 64, 128 and 256; figures in docs/faults.md)."""

from __future__ import annotations

import pytest

from tests.helpers.watchdog_load import measure

pytestmark = [pytest.mark.slow, pytest.mark.faults, pytest.mark.serial]  # store requests per second

RANKS, TIMEOUT_S = 24, 5.0


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_store_load_is_linear_and_a_failed_rank_is_named_in_time(fault):
    result = measure(RANKS, fault, per_host=8, timeout_s=TIMEOUT_S, window_s=5.0)
    # two requests per rank per second (its heartbeat, and one read), a little more on a loaded machine's
    # uneven seconds; reading every other rank's key would be RANKS**2 = 576 per second
    assert result["store_requests_per_s"] <= 3 * RANKS, result
    assert result["verdict"]["rank"] == RANKS - 1, result
    if fault == "kill":  # a rank on the victim's host sees its process gone
        assert result["verdict"]["what"] == "died" and result["detect_s"] < 5, result
    else:  # rank 0 sees its heartbeat stand still for timeout_s
        assert result["verdict"]["what"].startswith("stopped responding") and result["detect_s"] < TIMEOUT_S + 5, result
    assert result["all_exited_s"] is not None and result["all_exited_s"] < result["detect_s"] + 10, result
