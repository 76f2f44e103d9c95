"""A learner worker killed mid-run: Ray Train restarts it from the latest snapshot (on S3, moto) and the run
reaches max_steps, redoing only the steps after that snapshot and logging each step once. Also checks the
driver's wiring: /health on a free port, tags, the final status and the snapshots' lineage."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rlray.checkpoint import lineage
from rlray.checkpoint import storage as checkpoint
from rlray.config import load_config

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 4


def _learner_pids() -> list[int]:
    import ray._private.state  # the GCS actor table; ray.util.state needs the dashboard, off in tests

    return [a["Pid"] for a in ray._private.state.actors().values()
            if a["ActorClassName"] == "RayTrainWorker" and a["State"] == "ALIVE"]


def _wait(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.ray
def test_killed_learner_restarts_from_the_latest_snapshot(ray_session, tmp_path, gsm8k_dir, moto_s3):
    from rlray.launch.driver import run_training

    lines = (gsm8k_dir / "train.jsonl").read_text().splitlines()[:4]
    (tmp_path / "train4.jsonl").write_text("\n".join(lines) + "\n")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    root = f"s3://{moto_s3['bucket']}/restart"
    cfg = load_config(REPO / "configs/grpo_gsm8k_tiny.yaml", [
        f"data.train_files=[{tmp_path}/train4.jsonl]", "eval.num_problems=0", f"run.max_steps={MAX_STEPS}",
        f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}", "tracking.experiment=restart",
        "rollout.backend=hf", "checkpoint.every_steps=1", f"checkpoint.uri={root}",
        f"checkpoint.s3.endpoint_url={moto_s3['endpoint_url']}", f"checkpoint.s3.region={moto_s3['region']}",
        f"checkpoint.s3.access_key_id={moto_s3['key']}", f"checkpoint.s3.secret_access_key={moto_s3['secret']}",
        "monitor.restart_delay_s=1", "monitor.max_failures=1", "monitor.heartbeat_s=2"])
    opts = cfg.checkpoint.s3.storage_options()
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(r=run_training(cfg)), daemon=True)
    thread.start()
    client = MlflowClient(uri)

    def run_id():
        exp = client.get_experiment_by_name("restart")
        runs = client.search_runs([exp.experiment_id]) if exp else []
        return runs[0].info.run_id if runs else None

    rid = _wait(run_id, 300, "the MLflow run")
    url = _wait(lambda: client.get_run(rid).data.tags.get("rlray.monitor_url"), 300, "the monitor")
    assert url.startswith("http://127.0.0.1:") and not url.endswith(":8888")  # monitor.port=0: a free port
    _wait(lambda: max((m.step for m in client.get_metric_history(rid, "timing/step_s")), default=0) >= 2, 600, "step 2")
    health = json.loads(urllib.request.urlopen(f"{url}/health", timeout=10).read())
    assert health["status"] == "healthy" and health["run_id"] == rid and health["step"] >= 1
    assert {"epoch", "policy_version", "seconds_since_heartbeat"} <= set(health)
    assert f'rlray_step{{run_id="{rid}"}}' in urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    pids = _learner_pids()
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    killed_at = max(m.step for m in client.get_metric_history(rid, "timing/step_s"))
    run_dir = f"{root}/run-{rid}"
    complete = [s.step for s in checkpoint.list_snapshots(run_dir, opts) if s.complete]
    with urllib.request.urlopen(f"{url}/health", timeout=10) as r:  # the monitor outlives the learner
        assert json.loads(r.read())["run_id"] == rid
    thread.join(timeout=900)
    assert not thread.is_alive()

    res = result["r"]
    assert res.status == "FINISHED" and res.run_id == rid
    tags = client.get_run(rid).data.tags
    assert tags["rlray.status"] == "FINISHED" and client.get_run(rid).info.status == "FINISHED"
    params = client.get_run(rid).data.params
    assert params["checkpoint.s3.secret_access_key"] == "**********" and params["checkpoint.s3.access_key_id"] == "**********"
    assert "learner restarted by Ray Train" in tags["rlray.alert.restart"]
    restored = [(m.step, m.value) for m in client.get_metric_history(rid, "run/restored_step")]
    assert len(restored) == 1 and restored[0][1] == max(complete)  # the newest complete snapshot at the kill
    assert killed_at - 1 <= max(complete) <= MAX_STEPS - 1
    # every step's metrics once, 1..MAX_STEPS, though the steps after the snapshot ran twice
    steps = sorted(m.step for m in client.get_metric_history(rid, "timing/step_s"))
    assert steps == list(range(1, MAX_STEPS + 1))
    assert sorted(m.step for m in client.get_metric_history(rid, "reward/mean")) == steps
    # snapshots live on S3: Ray Train kept the newest keep_last=3 and they chain in the registry
    final = [s for s in checkpoint.list_snapshots(run_dir, opts) if s.complete]
    assert [s.step for s in final] == [MAX_STEPS - 2, MAX_STEPS - 1, MAX_STEPS]
    assert res.final_snapshot == final[-1].uri and final[-1].manifest.kind == "final"
    versions = lineage.run_versions(uri, "restart", rid)
    assert [v["tags"]["rlray.step"] for v in versions] == [str(s) for s in range(1, MAX_STEPS + 1)]
    chain = lineage.chain(uri, "restart", versions[-1]["version"])
    assert [v["tags"]["rlray.step"] for v in chain] == [str(s) for s in range(MAX_STEPS, 0, -1)]
    fs, _ = checkpoint.open_fs(run_dir, opts)
    assert fs.exists(f"{run_dir.removeprefix('s3://')}/checkpoint_manager_snapshot.json")  # Ray Train's own state
    # heartbeats: a log line and an MLflow metric each (both learner starts), the log copied next to the snapshots
    beats = client.get_metric_history(rid, "monitor/heartbeat_s")
    log_text = Path(tmp_path, "out", "logs", f"run-{rid}.log").read_text()
    assert len(beats) >= 2 and 0 <= log_text.count(f"heartbeat run={rid}") - len(beats) <= 1  # the kill may fall between
    assert fs.exists(f"{root.removeprefix('s3://')}/logs/run-{rid}.log")
