"""benchmarks/startup.py's pure parts: the JSON summary read back from a run's console, and the phase table."""

from __future__ import annotations

import pytest

from tests.fixtures.bench import load_bench


@pytest.fixture(scope="module")
def startup():
    yield load_bench("startup")


def test_summary_json_is_the_last_object_after_the_console_lines(startup):
    log = "rlray: MLflow run abc\nrlray step 1/2\n{\n  \"status\": \"FINISHED\",\n  \"startup/total_s\": 50.5\n}\n"
    assert startup.summary_json(log) == {"status": "FINISHED", "startup/total_s": 50.5}
    assert startup.summary_json("rlray: FAILED at step 0/2\nTraceback (most recent call last):\n") is None
    assert startup.summary_json("{\n  \"status\": \n") is None  # cut off


def test_phase_rows_in_order_with_wall_and_outside(startup):
    runs = [
        {"wall_s": 80.0, "startup": {"startup/ray_s": 5.0, "startup/checks_s": 1.0, "startup/total_s": 70.0,
                                     "startup/env-0_s": 3.0}},
        {"wall_s": 90.0, "startup": {}},  # a checkout before the startup/* figures: wall time only
    ]
    assert startup.phase_rows(runs) == [
        ["checks", 1.0, None], ["ray", 5.0, None], ["total", 70.0, None], ["env-0", 3.0, None],
        ["wall", 80.0, 90.0], ["outside", 10.0, None],
    ]
