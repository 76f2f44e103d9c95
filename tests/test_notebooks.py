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

