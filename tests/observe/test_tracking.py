"""Tracker.finish_unless_ended: a run that someone else ended (a sweep closing a stopped trial's run) keeps
its status when the dying run process ends it afterwards; a running run is ended as asked. Metric keys keep
what MLflow allows and collisions are refused; processes started together create one fresh store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from mlflow.utils.validation import validate_param_and_metric_name

from rlray.observe.metrics import KeySanitizer, sanitize_key
from rlray.observe.tracking import Tracker, get_run_metrics


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
    # Before the file lock, 2 of 3 died in MLflow's migrations ("duplicate column name: step"). A fresh cache:
    # they also race to make the store template (rlray.observe.tracking_store).
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "RLRAY_CACHE": str(tmp_path / "c")}
    procs = [subprocess.Popen([sys.executable, "-c", RACE, str(i)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(3)]  # fmt: skip
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(o[-3000:] for o in outputs)
    runs = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}").search_runs(
        [MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}").get_experiment_by_name("race").experiment_id]
    )
    assert sorted(r.info.run_name for r in runs) == ["run-0", "run-1"]


def test_tensorboard_gets_every_scalar_mlflow_gets(tmp_path):
    """With tensorboard_dir, the step and eval metrics logged through the Tracker are also TensorBoard scalars in
    <dir>/<run id>, with the same keys, values and steps as MLflow holds; closing the run closes the writer."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "tb", tensorboard_dir=tmp_path / "tb")
    tracker.log_metrics({"eval/reward_mean": 0.125}, step=0)  # the initial policy's eval
    tracker.log_metrics({"reward/mean": 0.25, "algo/kl": 0.001, "learner/pg_loss": -0.5}, step=1)
    tracker.log_metrics({"reward/mean": 0.5, "algo/kl": 0.002, "learner/pg_loss": 0.75, "eval/reward_mean": 0.375}, step=2)
    tracker.log_metrics({"loss@0": 1.5}, step=2)  # sanitised the same way for both
    tracker.finish()
    assert tracker._tb is None
    events = EventAccumulator(str(tmp_path / "tb" / tracker.run_id))
    events.Reload()
    in_tensorboard = {k: [(e.step, e.value) for e in events.Scalars(k)] for k in events.Tags()["scalars"]}
    in_mlflow = get_run_metrics(uri, tracker.run_id)
    assert set(in_tensorboard) == set(in_mlflow) == {"eval/reward_mean", "reward/mean", "algo/kl", "learner/pg_loss", "loss_0"}
    for key, series in in_mlflow.items():  # TensorBoard stores float32: equal to float32 precision
        assert [s for s, _ in in_tensorboard[key]] == [s for s, _ in series], key
        assert [v for _, v in in_tensorboard[key]] == pytest.approx([v for _, v in series], rel=1e-6), key


def test_no_tensorboard_files_without_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "plain")
    tracker.log_metrics({"reward/mean": 0.25}, step=1)
    tracker.finish()
    assert tracker.tensorboard_dir is None and not list(tmp_path.rglob("events.out.tfevents*"))


def test_samples_are_a_table_per_step(tmp_path):
    """log_samples writes samples/step_<step>.json as an MLflow table: one row per sample, each reward term a
    column, a failed term "failed", a skipped one null, a failed reward and a missing advantage null."""
    import math

    from rlray.observe.samples import StepSample

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "samples")
    samples = [
        StepSample(3, "p1", "Q: 1+1?", "2</s>", 1.0, {"math": 1.0, "fmt": None}, 0.5, "stop", 2, 4),
        StepSample(3, "p2", "Q: <script>x</script>", "oops", math.nan, {"math": math.nan, "fmt": 0.0}, math.nan, "length", 2, 9),
    ]
    tracker.log_samples(samples, step=3)
    tracker.log_samples([], step=4)  # nothing kept: no artifact
    client = MlflowClient(uri)
    assert [f.path for f in client.list_artifacts(tracker.run_id, "samples")] == ["samples/step_000003.json"]
    assert {"path": "samples/step_000003.json", "type": "table"} in json.loads(
        client.get_run(tracker.run_id).data.tags["mlflow.loggedArtifacts"])  # the MLflow UI shows it as a table
    table = json.loads(Path(client.download_artifacts(tracker.run_id, "samples/step_000003.json", str(tmp_path))).read_text())
    rows = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]  # pandas' "split" layout
    assert rows[0]["prompt"] == "Q: 1+1?" and rows[1]["prompt"] == "Q: <script>x</script>"
    assert [r["reward/math"] for r in rows] == [1.0, "failed"] and [r["reward/fmt"] for r in rows] == [None, 0.0]
    assert [(r["reward"], r["advantage"]) for r in rows] == [(1.0, 0.5), (None, None)]
    assert [(r["finish_reason"], r["policy_version"], r["response_tokens"], r["step"]) for r in rows] == [
        ("stop", 2, 4, 3), ("length", 2, 9, 3)]
    assert [r["completion"] for r in rows] == ["2</s>", "oops"] and [r["prompt_id"] for r in rows] == ["p1", "p2"]
