"""benchmarks/compare_runs.py: two MLflow runs repeat each other, key by key and step by step."""

from __future__ import annotations

import math

import pytest
from mlflow.tracking import MlflowClient

from tests.fixtures.bench import load_bench


@pytest.fixture(scope="module")
def compare():
    yield load_bench("compare_runs")


def _run(client: MlflowClient, exp: str, metrics: dict[str, list[tuple[int, float]]]) -> str:
    run = client.create_run(exp)
    for key, series in metrics.items():
        for step, value in series:
            client.log_metric(run.info.run_id, key, value, step=step)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def test_equal_runs_pass_and_a_difference_fails(compare, tmp_path, capsys):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    exp = client.create_experiment("cmp")
    base = {"reward/mean": [(1, 0.113), (2, 0.25)], "timing/step_s": [(1, 40.0)], "monitor/rss_gib": [(0, 2.0)]}
    a = _run(client, exp, base)
    b = _run(client, exp, {**base, "timing/step_s": [(1, 39.0)], "monitor/rss_gib": [(0, 2.5)]})  # ignored keys differ
    c = _run(client, exp, {**base, "reward/mean": [(1, 0.113), (2, 0.2500001)]})
    d = _run(client, exp, {**base, "algo/kl": [(1, 0.0)]})  # a key only one run has
    assert compare.main([a, b, "--tracking-uri", uri]) == 0
    assert compare.main([a, c, "--tracking-uri", uri]) == 1
    out = capsys.readouterr().out
    assert "reward/mean" in out and "DIFF" in out
    assert compare.main([a, c, "--tracking-uri", uri, "--atol", "1e-6"]) == 0  # |0.25 - 0.2500001| = 1e-7
    assert compare.main([a, d, "--tracking-uri", uri]) == 1


def test_nan_equals_nan_and_not_a_number(compare):
    assert compare.value_diff(math.nan, math.nan) == 0.0
    assert compare.value_diff(1.0, math.nan) == math.inf
    assert compare.compare_series([(1, 1.0)], [(1, 1.0), (2, 2.0)], 0.0)[2] == "steps differ"  # a step only one run has


def test_runs_in_two_stores_with_a_renamed_key(compare, tmp_path, capsys):
    old_uri, new_uri = f"sqlite:///{tmp_path}/old.db", f"sqlite:///{tmp_path}/new.db"
    old, new = MlflowClient(old_uri), MlflowClient(new_uri)
    a = _run(old, old.create_experiment("cmp"), {"reward/accuracy": [(1, 0.5)], "reward/mean": [(1, 0.7)]})
    b = _run(new, new.create_experiment("cmp"), {"reward/gsm8k_correct": [(1, 0.5)], "reward/mean": [(1, 0.7)]})
    common = [a, b, "--tracking-uri", old_uri, "--tracking-uri-b", new_uri]
    assert compare.main(common) == 1  # without the rename each key is only in one run
    assert compare.main([*common, "--rename", "reward/accuracy=reward/gsm8k_correct"]) == 0
    assert "renamed (A -> B): reward/accuracy -> reward/gsm8k_correct" in capsys.readouterr().out
