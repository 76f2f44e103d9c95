"""Tracker.finish_unless_ended: a run that someone else ended (a sweep closing a stopped trial's run) keeps
its status when the dying run process ends it afterwards; a running run is ended as asked. Metric keys keep
what MLflow allows and collisions are refused; processes started together create one fresh store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import validate_param_and_metric_name

from rlray.observe.tracking import KeySanitizer, Tracker, get_run_metrics, sanitize_key


def test_a_run_ended_by_someone_else_keeps_its_status(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = Tracker(uri, "sweep")
    closer = Tracker(uri, "sweep", run_id=run.run_id)  # TrialRunCloser's view of the same run
    closer.set_tags({"rlray.stop_reason": "stopped early by the Tune scheduler"})
    closer.finish("KILLED")
    run.log_metrics({"reward/mean": 0.25}, step=1)  # still written: the process logs until it dies
    assert run.finish_unless_ended("FAILED", {"rlray.status": "FAILED"}) == "KILLED"
    got = MlflowClient(uri).get_run(run.run_id)
    assert got.info.status == "KILLED"
    assert "rlray.status" not in got.data.tags
    assert got.data.tags["rlray.stop_reason"] == "stopped early by the Tune scheduler"
    assert get_run_metrics(uri, run.run_id)["reward/mean"] == [(1, 0.25)]


def test_a_running_run_is_ended_as_asked(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = Tracker(uri, "plain")
    assert run.finish_unless_ended("FAILED", {"rlray.status": "FAILED"}) == "FAILED"
    got = MlflowClient(uri).get_run(run.run_id)
    assert got.info.status == "FAILED" and got.data.tags["rlray.status"] == "FAILED"


def test_sanitize_keeps_every_character_mlflow_allows():
    # MLflow allows alphanumerics, '_', '-', '.', ' ', ':' and '/' (mlflow/utils/validation.py)
    kept = "algo/kl:k3 v1.2-final_x/Ünïcode"
    assert sanitize_key(kept) == kept and validate_param_and_metric_name(kept)
    for bad in ("loss@0", "loss#0", "loss(0)", "loss[0]", "a,b", "x=y", "q?", "tab\there"):
        clean = sanitize_key(bad)
        assert validate_param_and_metric_name(clean), clean
        assert clean != bad
    assert sanitize_key("loss@0") == "loss_0"


def test_keys_that_would_merge_are_refused_naming_both(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "keys")
    with pytest.raises(ValueError, match=r"'loss@0' and 'loss#0' both become the MLflow key 'loss_0'"):
        tracker.log_metrics({"loss@0": 1.0, "loss#0": 2.0}, step=1)
    key = KeySanitizer()
    assert key("eval/acc(gsm8k)") == "eval/acc_gsm8k_"
    assert key("eval/acc(gsm8k)") == "eval/acc_gsm8k_"  # the same key again is fine
    with pytest.raises(ValueError, match=r"'eval/acc\(gsm8k\)' and 'eval/acc\[gsm8k\]'"):
        key("eval/acc[gsm8k]")  # a later call: refused too


RACE = """
import sys, time
from pathlib import Path
from rlray.observe.tracking import Tracker, child_runs, resolve_tracking_uri
i = int(sys.argv[1])
Path(f"ready-{i}").touch()
while len(list(Path(".").glob("ready-*"))) < 3:  # start the store work at the same moment
    time.sleep(0.005)
uri = resolve_tracking_uri("sqlite:///mlruns/mlflow.db")  # the default store of a working folder
if i == 2:
    child_runs(uri, parent_run_id=None, experiment="race")
else:
    Tracker(uri, "race", run_name=f"run-{i}")
"""


def test_three_processes_create_a_fresh_store_together(tmp_path):
    # Before the file lock, 2 of 3 died in MLflow's migrations ("duplicate column name: step").
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(i)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(3)]  # fmt: skip
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-3000:] for o in outputs)
    runs = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}").search_runs(
        [MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}").get_experiment_by_name("race").experiment_id]
    )
    assert sorted(r.info.run_name for r in runs) == ["run-0", "run-1"]
