"""Rollback without a run (rlray.checkpoint.lineage, ``rlray rollback``): snapshots written here on local disk are
found by run folder and step, and the CLI writes the config that resumes from one, with the snapshot's trained
sections, secrets cleared. The registered-version path (``--to v3``) runs end to end in tests/run/test_session.py."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from rlray.checkpoint import lineage
from rlray.checkpoint import storage as checkpoint
from rlray.checkpoint.storage import SnapshotError
from rlray.cli import main as cli_main
from rlray.config import config_from_dict, load_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
from snapshot_manifests import manifest  # noqa: E402


@pytest.fixture
def run_folder(tmp_path):
    """A run folder with complete snapshots at steps 2 and 4, trained with learner.lr=5e-4 and a webhook."""
    trained = config_from_dict({}, ["learner.lr=5e-4", "model.gradient_checkpointing=true",
                                    "monitor.webhook_url=https://hooks.example/T0k3n", "monitor.alerts=[log,webhook]"])
    payload = tmp_path / "payload"
    payload.mkdir()
    (payload / "config.yaml").write_text(yaml.safe_dump(trained.model_dump(mode="json"), sort_keys=False))
    root = str(tmp_path / "snaps" / "run-a")
    for step in (2, 4):
        checkpoint.write_snapshot(checkpoint.join(root, checkpoint.snapshot_name(step)), payload, manifest(step), None)
    return root


def test_find_snapshot_by_run_folder_and_step(run_folder, tmp_path):
    where = lineage.Registry(f"sqlite:///{tmp_path / 'mlflow.db'}", "rb")
    assert lineage.find_snapshot(run_folder, "4", where) == f"{run_folder}/step_00000004"
    with pytest.raises(SnapshotError, match="no complete snapshot at step 3 under"):
        lineage.find_snapshot(run_folder, "3", where)
    with pytest.raises(SnapshotError, match=r"--to 'x2': give a step \(12\) or a registered model version \(v3\)"):
        lineage.find_snapshot(run_folder, "x2", where)


def test_rollback_cli_writes_the_trained_config_resuming_from_the_snapshot(run_folder, tmp_path, capsys):
    store = f"tracking.mlflow_uri=sqlite:///{tmp_path / 'mlflow.db'}"
    assert cli_main(["rollback", run_folder, "--to", "2", "--dest", str(tmp_path / "rb"), store]) == 0
    got = json.loads(capsys.readouterr().out)
    snap = f"{run_folder}/step_00000002"
    assert got == {"snapshot": snap, "step": 2, "policy_version": 2, "config": str(tmp_path / "rb" / "config.yaml"),
                   "command": f"rlray train {tmp_path / 'rb' / 'config.yaml'}"}
    cfg = load_config(got["config"])
    assert (cfg.checkpoint.resume_from, cfg.learner.lr, cfg.model.gradient_checkpointing) == (snap, 5e-4, True)
    assert (cfg.monitor.webhook_url, cfg.monitor.alerts) == (None, ["log"])  # secrets are not written to disk

    # --config: that config, but the snapshot's trained sections (learner, algo, reward, model.gradient_checkpointing)
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({"run": {"seed": 7}, "learner": {"lr": 1e-2},
                                    "checkpoint": {"s3": {"access_key_id": "AKIAXYZ", "secret_access_key": "s3cr3t"}}}))
    assert cli_main(["rollback", run_folder, "--to", "4", "--dest", str(tmp_path / "rb2"), "--config", str(base), store]) == 0
    cfg = load_config(json.loads(capsys.readouterr().out)["config"])
    assert (cfg.run.seed, cfg.learner.lr, cfg.model.gradient_checkpointing) == (7, 5e-4, True)
    assert cfg.checkpoint.resume_from == f"{run_folder}/step_00000004" and cfg.checkpoint.s3.access_key_id is None
    assert "s3cr3t" not in (tmp_path / "rb2" / "config.yaml").read_text()

    assert cli_main(["rollback", run_folder, "--to", "3", store]) == 2
    assert "no complete snapshot at step 3" in capsys.readouterr().err
