"""benchmarks/docs_pictures.py: the learning curve of a small synthetic MLflow run (what the run logged is what is
drawn, and make demo's before/after held-out success from its results file), written as a PNG. The monitor picture
needs chromium: tests/observe/test_browser.py drives the same capture (tests/fixtures/page_demo.py)."""

from __future__ import annotations

import json

import pytest

from rlray.observe.tracking import Tracker
from tests.fixtures.bench import load_bench


@pytest.fixture(scope="module")
def pictures():
    yield load_bench("docs_pictures")


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """Returns (uri, run id, results file) of a 4-step run that logged reward/mean and, at steps 2 and 4, eval."""
    folder = tmp_path_factory.mktemp("curve")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    tracker = Tracker(uri, "demo")
    for step, reward in enumerate([0.05, 0.12, 0.2, 0.31], start=1):
        tracker.log_metrics({"reward/mean": reward, "timing/step_s": 100.0}, step)
        if step % 2 == 0:
            tracker.log_metrics({"eval/env_success": 0.1 * step}, step)
    tracker.finish()
    results = folder / "env_learning.json"
    results.write_text(json.dumps({"run_id": tracker.run_id, "config": "configs/envs/retry_arith_smollm2.yaml", "seed": 0,
                                   "before": {"success": 0.27}, "after": {"success": 0.385}}))
    return uri, tracker.run_id, results


def test_the_curve_draws_what_the_run_logged_and_the_held_out_points(pictures, demo_run):
    uri, run_id, _ = demo_run
    series = pictures.run_series(uri, run_id)
    assert series == {"reward/mean": [(1, 0.05), (2, 0.12), (3, 0.2), (4, 0.31)], "eval/env_success": [(2, 0.2), (4, 0.4)]}
    fig = pictures.plot_learning_curve(series, (0.27, 0.385), "demo")
    lines = {line.get_label(): list(zip(line.get_xdata(), line.get_ydata(), strict=True)) for line in fig.axes[0].lines}
    assert lines["reward/mean"] == [(1, 0.05), (2, 0.12), (3, 0.2), (4, 0.31)]
    assert lines["eval/env_success"] == [(2, 0.2), (4, 0.4)]
    assert lines["held-out success (before, after)"] == [(0, 0.27), (4, 0.385)]  # step 0 and the run's last step
    assert [t.get_text() for t in fig.axes[0].texts] == ["before 27.0%", "after 38.5%"]


def test_curve_command_writes_a_png_named_by_the_results_file(pictures, demo_run, tmp_path):
    from PIL import Image

    uri, _, results = demo_run
    out = tmp_path / "images" / "learning_curve.png"
    assert pictures.main(["curve", "--results", str(results), "--tracking-uri", uri, "--out", str(out)]) == 0
    assert Image.open(out).size == (960, 540)  # figsize 8 x 4.5 inches at 120 dpi


def test_nothing_to_plot_is_an_error(pictures):
    with pytest.raises(ValueError, match="nothing to plot"):
        pictures.plot_learning_curve({}, None, "empty")
