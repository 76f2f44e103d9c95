"""Snapshots of a run (rlray.run.snapshots), in this process at world size 1 on the tiny model: when one is due,
where the run's log lives, a written snapshot (URI, manifest, MLflow) and a failed write (None, alert metric,
no manifest). Ray Train is off (``in_ray_train=False``); the Ray Train reporting is covered by tests/run/test_session.py."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlray.checkpoint import contents, lineage
from rlray.checkpoint import storage as checkpoint
from rlray.checkpoint.storage import SnapshotError
from rlray.config import Config, config_from_dict
from rlray.data import PromptRow, PromptStream
from rlray.learner import PolicyLearner
from rlray.learner.collective import Collective
from rlray.learner.policy import OptimizerSpec
from rlray.observe.tracking import Tracker, get_run, get_run_metrics
from rlray.plan import resolve_plan
from rlray.run import snapshots
from rlray.run.context import RunContext
from rlray.run.state import RunServices, RunState

CURSOR = {"epoch": 7, "position": 3, "seed": 11, "shuffle": False, "num_rows": 4, "rows_fingerprint": "cursor-from-ctx"}


@dataclass
class StubRun(RunContext):
    """A run kind with no steps: the session only asks it for the data cursor a snapshot keeps."""

    stream: PromptStream | None = None

    def run_step(self, step):
        raise AssertionError("a snapshot runs no step")

    def evaluate_when_due(self, steps_done):
        return {}

    def progress_text(self, steps_done, metrics):
        return ""

    def data_epoch(self):
        return self.stream.epoch

    def cursor_state(self):
        return dict(CURSOR)  # differs from the stream's own state_dict (epoch 0, position 0)

    def load_cursor_state(self, state):
        self.stream.load_state_dict(state)


def _cfg(*overrides: str) -> Config:
    return config_from_dict({}, ["model.dtype=float32", "checkpoint.every_steps=3", "run.max_steps=10", *overrides])


@pytest.mark.parametrize(
    ("step", "due"),
    [(1, False), (2, False), (3, True), (4, False), (6, True), (9, True), (10, True)],  # every 3rd, and 10 is the last
)
def test_snapshot_due_every_n_steps_and_at_the_last_step(step, due):
    assert snapshots.snapshot_due(resolve_plan(_cfg()), step) is due


def test_snapshot_due_at_the_last_step_only_when_every_steps_is_larger():
    cfg = _cfg("checkpoint.every_steps=1000", "run.max_steps=5")
    assert [s for s in range(1, 6) if snapshots.snapshot_due(resolve_plan(cfg), s)] == [5]


def test_local_log_path_is_under_a_local_output_dir(tmp_path):
    run = RunState("abc123", "unused", {}, in_ray_train=False)
    path = snapshots.local_log_path(resolve_plan(_cfg(f"run.output_dir={tmp_path}/out")), run)
    assert path == tmp_path / "out" / checkpoint.LOGS_DIR / "run-abc123.log"


def test_local_log_path_of_an_s3_output_dir_is_in_the_temp_folder():
    run = RunState("abc123", "unused", {}, in_ray_train=False)
    path = snapshots.local_log_path(resolve_plan(_cfg("run.output_dir=s3://bucket/out")), run)
    assert path == Path(tempfile.gettempdir()) / "rlray" / checkpoint.LOGS_DIR / "run-abc123.log"


@pytest.fixture(scope="module")
def learner(tiny_model_path):
    return PolicyLearner(tiny_model_path, dtype="float32", optim=OptimizerSpec(lr=1e-3, max_grad_norm=1.0),
                         temperature=1.0, use_reference=False)  # fmt: skip


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """Returns one MLflow store for the module (each test makes its own run; a new store's set-up takes seconds)."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture
def session(tmp_path, mlflow_uri, learner, tiny_tokenizer):
    """Returns (context, run state, MLflow uri) of a fresh run at step 4, policy version 9, in ``tmp_path``."""
    uri = mlflow_uri
    cfg = _cfg(f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}", "tracking.experiment=snaps")
    tracker = Tracker(uri, cfg.tracking.experiment)
    stream = PromptStream([PromptRow(f"r:{i}", f"question {i}", {"answer": str(i)}) for i in range(4)], seed=0, shuffle=False)
    ctx = StubRun(resolve_plan(cfg), Collective(), learner, tiny_tokenizer, stream=stream, tracker=tracker, policy_version=9)
    run = RunState(tracker.run_id, checkpoint.join(cfg.checkpoint_uri, checkpoint.run_dir_name(tracker.run_id)),
                   cfg.checkpoint.s3.storage_options(), in_ray_train=False, step=4)  # fmt: skip
    yield ctx, run, uri
    tracker.close()


def test_snapshot_writes_the_manifest_and_logs_to_mlflow(session):
    ctx, run, uri = session
    out = snapshots.snapshot(ctx, run, RunServices(git_commit="abc"), kind="periodic", metrics={"reward/mean": 0.5})
    assert out == f"{ctx.settings.run.output_dir}/snapshots/run-{run.run_id}/step_00000004"
    assert run.last_snapshot == out
    manifest = checkpoint.read_manifest(out)  # verifies every listed file's size too
    assert (manifest.kind, manifest.step, manifest.policy_version, manifest.run_id) == ("periodic", 4, 9, run.run_id)
    assert manifest.data_cursor == CURSOR and manifest.epoch == 7  # the context's cursor, not the stream's
    assert manifest.dataset_hash == "cursor-from-ctx"
    assert manifest.git_commit == "abc" and manifest.metrics == {"reward/mean": 0.5}
    assert "model/config.json" in manifest.files and "rng/rank_0.pt" in manifest.files
    assert ctx.tracker.pending == 0  # everything reached the store
    metrics = get_run_metrics(uri, run.run_id)
    [(step, seconds)] = metrics["timing/snapshot_s"]
    assert step == 4 and 0.0 < seconds < 120.0
    assert "checkpoint/failures" not in metrics
    assert get_run(uri, run.run_id).data.tags["rlray.last_snapshot"] == out
    assert run.model_version is not None and run.model_version == lineage.version_of(uri, "snaps", out)  # registered


def test_a_failed_write_returns_none_alerts_and_leaves_no_manifest(session, monkeypatch):
    ctx, run, uri = session
    run.last_snapshot = "earlier/step_00000002"

    def full_disk(*args, **kwargs):
        raise SnapshotError("disk full")

    monkeypatch.setattr(contents, "write_rank0", full_disk)
    out = snapshots.snapshot(ctx, run, RunServices(), kind="periodic", metrics={})
    assert out is None
    assert run.last_snapshot == "earlier/step_00000002"
    target = checkpoint.join(run.run_dir, checkpoint.snapshot_name(4))
    assert not Path(target, "manifest.json").exists()
    with pytest.raises(SnapshotError, match="manifest.json is missing"):
        checkpoint.read_manifest(target)
    assert ctx.tracker.pending == 0  # everything reached the store
    metrics = get_run_metrics(uri, run.run_id)
    assert metrics["checkpoint/failures"] == [(4, 1.0)]
    assert "timing/snapshot_s" not in metrics
    alert = get_run(uri, run.run_id).data.tags["rlray.alert.snapshot_failed"]  # monitor.alerts has "mlflow" by default
    assert alert == "snapshot at step 4 failed: disk full; the last complete one is earlier/step_00000002"
