"""notebooks/analyze_run.ipynb executes against the tiny sweep's MLflow runs and renders its figures."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "analyze_run.ipynb"


def _run(nb: nbformat.NotebookNode, params: str, folder: Path) -> list[dict]:
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source = params
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(folder)}}).execute()
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert all(not c.outputs for c in nb.cells if c.cell_type == "code")
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assert nb.cells.index(params) == 1  # the parameters come first
    for name in ("TRACKING_URI", "EXPERIMENT", "RUN_IDS", "PARENT_RUN_ID"):
        assert f"{name}" in params.source


@pytest.mark.ray
def test_notebook_plots_the_sweep_trials(tiny_sweep, tmp_path):
    result, uri, sweep = tiny_sweep
    nb = nbformat.read(NOTEBOOK, as_version=4)
    outputs = _run(
        nb,
        f'TRACKING_URI = "{uri}"\nEXPERIMENT = "sweeps"\nRUN_IDS = []\nPARENT_RUN_ID = "{result.parent_run_id}"\nMAX_RUNS = 8\n',
        tmp_path,
    )
    assert not [o for o in outputs if o["output_type"] == "error"]
    pngs = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pngs) == 2  # the 2x2 per-step curves and the sweep comparison
    html = "\n".join(o["data"].get("text/html", "") for o in outputs if o["output_type"] == "execute_result")
    for trial in result.trials:  # both trials in the overview table, with their status
        assert trial.run_id in html
    assert "KILLED" in html and "FINISHED" in html
    # the comparison table: one row per trial, labelled by the swept value
    assert "lr=0.0001" in html and "lr=0.001" in html
    printed = "".join(o.get("text", "") for o in outputs if o["output_type"] == "stream")
    assert f"best run: {result.best_run_id}" in printed


@pytest.mark.ray
def test_notebook_compares_the_latest_runs_of_an_experiment(tiny_sweep, tmp_path):
    result, uri, _ = tiny_sweep
    nb = nbformat.read(NOTEBOOK, as_version=4)
    outputs = _run(nb, f'TRACKING_URI = "{uri}"\nEXPERIMENT = "sweeps"\nRUN_IDS = []\nPARENT_RUN_ID = ""\nMAX_RUNS = 8\n', tmp_path)
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert len([o for o in outputs if "image/png" in o.get("data", {})]) == 1  # curves only: not a sweep
    html = "\n".join(o["data"].get("text/html", "") for o in outputs if o["output_type"] == "execute_result")
    assert all(t.run_id in html for t in result.trials)
    assert result.parent_run_id not in html  # the sweep's parent has no per-step metrics: left out



def test_notebook_shows_the_best_and_worst_samples(tmp_path):
    """Against a run written here with rlray's Tracker (no Ray): the samples section reads every step's table and
    puts the best and worst samples by reward side by side, an episode turn by turn, markup escaped."""
    import math

    from rlray.config import config_from_dict
    from rlray.observe.samples import StepSample
    from rlray.observe.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "notebook")
    tracker.log_config(config_from_dict({}))
    for step in (1, 2):
        tracker.log_metrics({"reward/mean": 0.5 * step, "algo/kl": 0.01, "learner/pg_loss": 0.1, "perf/tokens_per_s": 100.0},
                            step=step)
    tracker.log_samples([StepSample(1, "a", "Q1", "worst answer", -1.0, {}, -1.0, "length", 0, 5),
                         StepSample(1, "b", "Q2", "failed", math.nan, {}, math.nan, "stop", 0, 5)], step=1)
    tracker.log_samples([StepSample(2, "c", "Q3", "best <b>answer</b>", 2.0, {}, 1.0, "stop", 1, 5),
                         StepSample(2, "d", "Q4", "5 7", 0.5, {}, 0.0, "stop", 1, 5, "done", 2, (None, 0.5),
                                    ((True, "5"), (False, "higher"), (True, "7")))], step=2)
    tracker.finish()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    outputs = _run(nb, f'TRACKING_URI = "{uri}"\nEXPERIMENT = "notebook"\nRUN_IDS = []\nPARENT_RUN_ID = ""\nMAX_RUNS = 8\n',
                   tmp_path)
    assert not [o for o in outputs if o["output_type"] == "error"], [o for o in outputs if o["output_type"] == "error"]
    printed = "".join(o.get("text", "") for o in outputs if o["output_type"] == "stream")
    assert ": 4 samples kept over 2 steps" in printed
    tables = [o["data"]["text/html"] for o in outputs if o["output_type"] == "display_data" and "text/html" in o.get("data", {})]
    assert len(tables) == 1
    html = tables[0]
    assert "best &lt;b&gt;answer&lt;/b&gt;" in html and "<b>answer" not in html  # escaped by pandas' Styler
    assert html.index("best &lt;b&gt;answer") < html.index("worst answer")  # best first in row 1, worst beside it
    assert "[turn] 5\n[observation] higher\n[turn] 7" in html  # the episode, 2nd best and 2nd worst (of 3 scored)
    assert "failed" not in html.replace("failed_", "")  # a failed reward is left out
