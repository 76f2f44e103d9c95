"""benchmarks/work_counts.py: a seeded run's work counts against the committed baseline (issue 42: no silent slowdown)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.fixtures.bench import load_bench

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


@pytest.fixture(scope="module")
def wc():
    yield load_bench("work_counts")


def test_counts_sum_each_counter_over_the_steps_and_leave_out_the_rest(wc):
    metrics = {"perf/learner_tokens_real": [(1, 4516.0), (2, 3292.0)], "rollout/engine_calls": [(1, 2.0), (2, 1.0)],
               "timing/step_s": [(1, 40.0), (2, 38.5)], "reward/mean": [(1, 0.5), (2, 0.25)]}
    assert wc.work_counts(metrics) == {"perf/learner_tokens_real": 7808.0, "rollout/engine_calls": 3.0}
    with pytest.raises(ValueError, match=r"'env/steps' is nan at step 2"):
        wc.work_counts({"env/steps": [(1, 0.0), (2, math.nan)]})


def test_growth_within_one_percent_passes_and_beyond_fails_naming_the_counter(wc):
    base = {"perf/learner_tokens_real": 1000.0, "rollout/weight_sync_bytes": 51513856.0}
    ok = wc.compare(base, {"perf/learner_tokens_real": 1009.0, "rollout/weight_sync_bytes": 51513856.0})  # +0.9%
    assert ok.ok and ok.failures == [] and ok.notes == []
    bad = wc.compare(base, {"perf/learner_tokens_real": 1011.0, "rollout/weight_sync_bytes": 51513856.0})  # +1.1%
    assert not bad.ok
    assert bad.failures == ["perf/learner_tokens_real: grew 1000 -> 1011 (+1.10%, more than 1% allowed)"]
    report = bad.report("mixed_tiny")
    assert "perf/learner_tokens_real: grew 1000 -> 1011" in report and "tests/fixtures/work_baseline.json" in report
    assert "RLRAY_UPDATE_WORK_BASELINE=1 pytest" in report  # how to update it on purpose


def test_growth_from_zero_fails_and_a_shrink_passes_with_a_note(wc):
    got = wc.compare({"env/steps": 0.0, "rollout/engine_calls": 100.0}, {"env/steps": 1.0, "rollout/engine_calls": 98.0})
    assert got.failures == ["env/steps: grew 0 -> 1 (+inf%, more than 1% allowed)"]
    assert got.notes == ["rollout/engine_calls: shrank 100 -> 98 (-2.00%); update the baseline to keep the gain"]
    assert wc.compare({"env/steps": 0.0}, {"env/steps": 0.0}).ok
    assert wc.compare({"rollout/engine_calls": 100.0}, {"rollout/engine_calls": 99.5}).notes == []  # -0.5%: quiet
    big = wc.compare({"rollout/weight_sync_bytes": 103027712.0}, {"rollout/weight_sync_bytes": 206055424.0})
    assert big.failures == ["rollout/weight_sync_bytes: grew 103027712 -> 206055424 (+100.00%, more than 1% allowed)"]


def test_a_new_counter_and_a_missing_counter_fail_clearly(wc):
    got = wc.compare({"env/steps": 4.0, "env/gateway_calls": 8.0}, {"env/steps": 4.0, "rollout/engine_calls": 3.0})
    assert got.failures == [
        "env/gateway_calls: in the baseline (8) but this run did not log it (renamed, or no longer logged?)",
        "rollout/engine_calls: new counter (this run: 3), not in the baseline",
    ]
    assert not wc.compare({}, {"env/steps": 4.0}).ok  # no baseline entry at all: every counter is new


def test_the_baseline_is_rewritten_on_purpose_only(wc, tmp_path, monkeypatch):
    path = tmp_path / "work_baseline.json"
    metrics = {"env/episodes": [(1, 6.0), (2, 10.0)], "rollout/engine_calls": [(1, 2.0), (2, 1.0)]}
    monkeypatch.delenv(wc.UPDATE_ENV, raising=False)
    assert not wc.check_run("mixed_tiny", metrics, "a test", path).ok and not path.exists()  # no baseline: fails
    monkeypatch.setenv(wc.UPDATE_ENV, "1")
    assert wc.check_run("mixed_tiny", metrics, "a test", path).ok
    wc.write_baseline("other", {"env/steps": 3.0}, "another test", path)  # a second run's entry keeps the first
    doc = json.loads(path.read_text())
    assert doc["runs"]["mixed_tiny"] == {"source": "a test", "counts": {"env/episodes": 16.0, "rollout/engine_calls": 3.0}}
    assert wc.read_baseline("other", path) == {"env/steps": 3.0} and wc.read_baseline("absent", path) == {}
    monkeypatch.delenv(wc.UPDATE_ENV)
    grown = {**metrics, "rollout/engine_calls": [(1, 2.0), (2, 2.0)]}
    assert wc.check_run("mixed_tiny", grown, "a test", path).failures == [
        "rollout/engine_calls: grew 3 -> 4 (+33.33%, more than 1% allowed)"]
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a work-count baseline"):
        wc.read_baseline("mixed_tiny", path)


def test_the_committed_baseline_holds_the_mixed_run_s_counters(wc):
    counts = wc.read_baseline("mixed_tiny")
    assert set(counts) <= set(wc.COUNTERS)
    for key in ("perf/learner_tokens_real", "perf/learner_tokens_shared", "rollout/engine_calls",
                "rollout/weight_sync_bytes", "rollout/generated_tokens", "env/episodes", "env/steps"):
        assert key in counts, key
    assert counts["env/episodes"] == 16.0  # 8 environment rows x 2 samples (tests/run/test_envs_e2e.py)


def test_every_counter_is_a_registered_count_not_a_time(wc):
    from rlray.observe.metrics import BY_KEY

    for key in wc.COUNTERS:
        assert BY_KEY[key].unit in ("count", "tokens", "bytes"), key
