"""`ray job submit` of jobs/train.py to a Ray head started by this test, `ray job stop` mid-run, and
rlray's dashboard metrics (``ray.util.metrics``) read from the head's metrics export port.

The head runs on 127.0.0.1 with its own free ports and temp dir, as a child process of this test,
and is stopped by terminating that process (never `ray stop`, which would end every Ray cluster on
the machine). Nothing here sets RAY_ADDRESS: jobs are submitted over HTTP with an explicit address.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from rlray.observe.metrics import METRIC_KEYS
from rlray.observe.tracking import get_run_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from ports import free_ports  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RUNTIME_ENV = REPO / "jobs" / "runtime_env.yaml"
PER_STEP = ["reward/mean", "algo/kl", "learner/loss", "perf/tokens_per_s", "timing/step_s"]


class Head(NamedTuple):
    """A private Ray head: its dashboard (job submission) URL and its Prometheus metrics URL."""

    url: str
    metrics_url: str


@pytest.fixture(scope="module")
def ray_head():
    """Yields the URLs of a private single-node Ray head (2 CPUs) on 127.0.0.1."""
    gcs, dash, agent, client, metrics = free_ports(5)
    temp_dir = tempfile.mkdtemp(prefix="rr")  # short: Ray's socket paths must stay < 108 chars
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "PYTHONPATH"}
    # Loopback only, so no token auth (Ray 2.60's `ray start` default): the client here sends no token.
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}", HF_HUB_OFFLINE="1", RAY_AUTH_MODE="disabled",
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
               RAY_metrics_report_interval_ms="1000")  # application metrics reach the export port within ~1 s
    ray_bin = Path(sys.executable).parent / "ray"
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={gcs}",
         f"--temp-dir={temp_dir}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
         "--include-dashboard=true", f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}",
         f"--metrics-export-port={metrics}", "--num-cpus=2", "--num-gpus=0", "--object-store-memory=300000000"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{dash}"
    try:
        from ray.job_submission import JobSubmissionClient

        deadline = time.monotonic() + 180
        while True:
            try:
                JobSubmissionClient(url).list_jobs()
                break
            except Exception:
                if head.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Ray head did not come up (exit code {head.poll()})") from None
                time.sleep(2)
        yield Head(url, f"http://127.0.0.1:{metrics}/metrics")
    finally:
        # SIGTERM to `ray start --block` stops its own head; the process group catches stragglers.
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(10)
        shutil.rmtree(temp_dir, ignore_errors=True)


class Job(NamedTuple):
    """A submitted job: its client, id, MLflow store and folder."""

    client: Any
    job_id: str
    uri: str
    folder: Path


def _submit(url: str, folder: Path, gsm8k_dir: Path, overrides: list[str]) -> Job:
    from ray.job_submission import JobSubmissionClient

    uri = f"sqlite:///{folder}/mlflow.db"
    args = [
        "configs/grpo_gsm8k_tiny.yaml", f"run.output_dir={folder}/out", f"tracking.mlflow_uri={uri}",
        f"data.train_files=[{gsm8k_dir}/train.jsonl]", f"data.eval_files=[{gsm8k_dir}/test.jsonl]",
        "eval.num_problems=0", "rollout.backend=hf", "tracking.experiment=jobs", *overrides,
    ]
    runtime_env = {**yaml.safe_load(RUNTIME_ENV.read_text()), "working_dir": str(REPO)}
    client = JobSubmissionClient(url)
    job_id = client.submit_job(entrypoint=" ".join([sys.executable, "jobs/train.py", *args]), runtime_env=runtime_env)
    return Job(client, job_id, uri, folder)


@pytest.fixture(scope="module")
def job(ray_head, tmp_path_factory, gsm8k_dir, tiny_model_path) -> Job:
    """Submits one long job (500 steps): read while it runs (the dashboard metrics), then stopped (`ray job stop`),
    then checked as a job (the uploaded code, its logs, MLflow). One job: a second one that runs to the end would cost
    ~100 s of a 2-core machine, and every other end-to-end test checks a FINISHED run and its final snapshot."""
    return _submit(ray_head.url, tmp_path_factory.mktemp("long"), gsm8k_dir, ["run.max_steps=500"])


def _wait_status(client, job_id: str, done: set[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while (status := str(client.get_job_status(job_id).value)) not in done:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {status}:\n{client.get_job_logs(job_id)[-4000:]}")
        time.sleep(2)
    return status


def _only_run(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("jobs").experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def test_runtime_env_uploads_the_code_and_leaves_data_behind():
    from ray._private.runtime_env.packaging import _get_excludes  # what `ray job submit` applies

    runtime_env = yaml.safe_load(RUNTIME_ENV.read_text())
    assert set(runtime_env) == {"excludes", "env_vars"}  # nothing installed: no pip/uv/conda/py_modules
    assert int(runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"]) >= 60
    excluded = _get_excludes(REPO, runtime_env["excludes"])
    code = [p for d in ("rlray", "jobs", "configs") for p in (REPO / d).rglob("*") if p.suffix in {".py", ".yaml"}]
    assert any(p.parts[-2] == "data" for p in code)  # rlray/data is code, not data
    assert [p for p in code if excluded(p)] == []
    for left_behind in ("data/gsm8k/train.jsonl", "outputs/run/snapshots/run-x/step_1/manifest.json", "mlruns/mlflow.db", ".venv/bin/python"):
        assert excluded(REPO / left_behind), left_behind


# gauge on Ray's metrics endpoint -> the step metric it shows (rlray.observe.metrics.STEP_GAUGES, "ray_" prefixed)
DASHBOARD = {"ray_rlray_reward_mean": "reward/mean", "ray_rlray_kl": "algo/kl",
             "ray_rlray_tokens_per_s": "perf/tokens_per_s", "ray_rlray_staleness": "rollout/staleness_mean"}


def _scrape(metrics_url: str, run_id: str) -> dict[str, float]:
    """Returns {series name: value} of the ``ray_rlray_*`` samples labelled ``run_id`` on a Prometheus page."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) if family.name.startswith("ray_rlray_")
            for s in family.samples if s.labels.get("run_id") == run_id}


@pytest.mark.ray
def test_dashboard_metrics_on_the_ray_metrics_endpoint(ray_head, job):
    """The run's monitor actor feeds ray.util.metrics; the head exports them on its metrics port.

    A finished job's series age out of Ray's export (two report intervals after its actor died), so
    they are read while the long job runs (before the next test stops it): the scrape must show a
    step >= 2 together with exactly that step's figures as MLflow logged them.
    """
    client, job_id, uri, folder = job
    deadline, seen = time.monotonic() + 600, {}
    while True:
        assert time.monotonic() < deadline, f"no consistent rlray series on {ray_head.metrics_url}; last seen {seen}"
        assert str(client.get_job_status(job_id).value) in {"PENDING", "RUNNING"}, client.get_job_logs(job_id)[-4000:]
        run_id = _only_run(uri).info.run_id if "rlray step 1/500" in client.get_job_logs(job_id) else None
        seen = _scrape(ray_head.metrics_url, run_id) if run_id else {}
        step = int(seen.get("ray_rlray_step", 0))
        if step >= 2:
            logged = {k: dict(v) for k, v in get_run_metrics(uri, run_id).items()}  # MLflow logs before the monitor
            want = {name: logged[key].get(step) for name, key in DASHBOARD.items()}
            want["ray_rlray_healthy"] = 1.0
            if all(name in seen and seen[name] == pytest.approx(v, rel=1e-9) for name, v in want.items()):
                break  # gauges are exported one by one: a scrape may catch the step before its figures
        time.sleep(1)
    assert seen["ray_rlray_tokens_per_s"] > 0.0


@pytest.mark.ray
def test_job_stop_marks_run_killed(job):
    client, job_id, uri, folder = job
    deadline = time.monotonic() + 600
    while True:  # wait until the first step is logged: the run is mid-way
        assert str(client.get_job_status(job_id).value) in {"PENDING", "RUNNING"}, client.get_job_logs(job_id)[-4000:]
        if "rlray step 1/500" in client.get_job_logs(job_id):
            break
        assert time.monotonic() < deadline, "no step finished in 10 minutes"
        time.sleep(2)
    assert client.stop_job(job_id)
    assert _wait_status(client, job_id, {"STOPPED", "SUCCEEDED", "FAILED"}, 300) == "STOPPED"
    run = _only_run(uri)
    logs = client.get_job_logs(job_id)
    assert run.info.status == "KILLED", logs[-4000:]
    assert run.data.tags["rlray.stop_reason"] == "SIGTERM"
    assert "SIGTERM: stopping at the next step boundary" in logs
    steps = [s for s, _ in get_run_metrics(uri, run.info.run_id)["reward/mean"]]
    assert 500 > len(steps) >= 1 and steps == list(range(1, len(steps) + 1))
    # the run ended at a step boundary with a snapshot of its last logged step
    assert run.data.tags["rlray.status"] == "stopped: SIGTERM"
    manifest = json.loads((Path(run.data.tags["rlray.last_snapshot"]) / "manifest.json").read_text())
    assert manifest["step"] == steps[-1] and manifest["kind"] == "stop"


@pytest.mark.ray
def test_job_submit_runs_rlray_train(job):
    """The stopped job (the test before) as a job: the code Ray uploaded ran, its logs carry the progress and the
    JSON summary of `rlray train`, and MLflow has every step it logged."""
    client, job_id, uri, folder = job
    assert str(client.get_job_status(job_id).value) == "STOPPED"
    logs = client.get_job_logs(job_id)
    # rlray came from the uploaded working dir, not from the editable install in the venv
    origin = next(line for line in logs.splitlines() if line.startswith("rlray 0."))
    assert "_ray_pkg_" in origin and str(REPO) not in origin, origin
    run = _only_run(uri)
    steps = [s for s, _ in get_run_metrics(uri, run.info.run_id)["reward/mean"]]
    # progress: one line per step in `ray job logs`
    assert all(f"rlray step {s}/500" in logs for s in steps), logs[-4000:]
    # the same output as `rlray train`: its JSON summary with the run id and how it ended
    assert re.search(r'"run_id": "(\w+)"', logs).group(1) == run.info.run_id
    assert '"status": "stopped: SIGTERM"' in logs, logs[-4000:]
    assert run.data.params["run.max_steps"] == "500"
    metrics = get_run_metrics(uri, run.info.run_id)
    for key in PER_STEP:
        assert key in METRIC_KEYS and [s for s, _ in metrics[key]] == steps, key
