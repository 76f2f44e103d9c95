"""Lossless async resume under real kills of what a run cannot rerun from inside: a learner rank (its Ray Train worker
process SIGKILLed; Ray Train restarts the group from the newest snapshot) and the driver (the ``rlray train`` process
SIGKILLed; ``rlray train --resume latest`` goes on from its newest snapshot). The run is the mixed async one of
tests/run/test_async_resume.py (environments, an agent, single-turn rows; overlap on, max_staleness 1), killed after a
seeded step, when the next steps' episodes are in flight. Each ends with the uninterrupted run's prompt ledger and every
metric bit for bit (``benchmarks/compare_runs.py``).

The kills of a rollout actor and an environment host (restarted by Ray, the step's rollout run again) are in make
test: tests/run/test_async_resume.py. Four driver runs here (136-320 s on 2 shared cores): slow. The learner kill after
step 1 (seed 1: Ray Train starts over, no snapshot yet) passed too (193 s)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rlray import cli
from rlray.checkpoint import storage as checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
from async_runs import REPO, assert_lossless, make_cfg, overrides_for, write_rows  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
KILL_SEED = 0


def kill_step(seed: int, kind: str) -> int:
    """Returns the seeded step after which ``kind`` is killed, with the next step training and the rollout of the one
    after it in flight (max_staleness 1, so 2 of 4 at the latest): the learner after step 1 (before the first snapshot:
    Ray Train starts the run over) or 2; the driver after step 2 (``--resume`` needs a snapshot: every 2 steps)."""
    return random.Random(seed).choice([1, 2]) if kind == "learner" else 2


def _learner_pids() -> list[int]:
    import ray._private.state

    return [a["Pid"] for a in ray._private.state.actors().values()
            if a["ActorClassName"] == "RayTrainWorker" and a["State"] == "ALIVE"]


def _run_id(client: MlflowClient, experiment: str) -> str | None:
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    return runs[0].info.run_id if runs else None


def _logged_step(client: MlflowClient, run_id: str) -> int:
    return max((m.step for m in client.get_metric_history(run_id, "timing/step_s")), default=0)


def _wait(predicate, timeout_s: float, what: str, alive=lambda: True):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        got = predicate()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what} (alive: {alive()})")


@pytest.fixture(scope="module")
def base(ray_session, tmp_path_factory):
    out = tmp_path_factory.mktemp("kill_resume")
    write_rows(out)
    return out


@pytest.fixture(scope="module")
def straight(base):
    """The uninterrupted run, through the driver (``run_training``) as the killed runs."""
    from rlray.launch.driver import run_training

    res = run_training(make_cfg(base, "straight"))
    assert res.status == "FINISHED", res
    return res.run_id


def test_a_killed_learner_rank_restarts_from_its_snapshot_and_the_run_stays_exact(base, straight):
    from rlray.launch.driver import run_training

    step = kill_step(KILL_SEED, "learner")
    client, result = MlflowClient(f"sqlite:///{base}/mlflow.db"), {}
    thread = threading.Thread(target=lambda: result.update(r=run_training(make_cfg(base, "learner_killed"))), daemon=True)
    thread.start()
    rid = _wait(lambda: _run_id(client, "learner_killed"), 600, "the MLflow run", thread.is_alive)
    _wait(lambda: _logged_step(client, rid) >= step, 600, f"step {step}", thread.is_alive)
    pids = _learner_pids()
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)  # step step+1 trains, the rollout of step+2 runs (max_staleness 1)
    thread.join(timeout=900)
    assert not thread.is_alive() and result["r"].status == "FINISHED" and result["r"].run_id == rid, result
    restored = [m.value for m in client.get_metric_history(rid, "run/restored_step")]
    assert restored in ([], [2.0])  # from the step-2 snapshot, or (none written yet) from the start
    assert "learner restarted by Ray Train" in client.get_run(rid).data.tags["rlray.alert.restart"]
    assert_lossless(base, straight, [(rid, None)], steps=4, staleness=1, name="learner_killed")


def test_a_killed_driver_resumes_from_its_snapshot_and_the_run_stays_exact(ray_session, base, straight, tmp_path, capsys):
    step = kill_step(KILL_SEED, "driver")
    config = tmp_path / "run.yaml"
    config.write_text((REPO / "configs/envs/mixed_tiny.yaml").read_text())
    root = tmp_path / "snapshots"  # a folder of its own: --resume latest finds this run's snapshots only
    overrides = [*overrides_for(base, "driver_killed"), f"checkpoint.uri={root}"]
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address, PYTHONPATH=str(REPO))
    log = tmp_path / "driver.log"
    with log.open("w") as out:
        driver = subprocess.Popen([sys.executable, "-m", "rlray.cli", "train", str(config), *overrides], env=env,
                                  stdout=out, stderr=subprocess.STDOUT)
    client = MlflowClient(f"sqlite:///{base}/mlflow.db")
    alive = lambda: driver.poll() is None  # noqa: E731
    killed = _wait(lambda: _run_id(client, "driver_killed"), 600, "the MLflow run", alive)
    _wait(lambda: _logged_step(client, killed) >= step and checkpoint.latest_snapshot(str(root)), 600,
          f"step {step} and a snapshot", alive)
    os.kill(driver.pid, signal.SIGKILL)
    assert driver.wait(timeout=60) == -signal.SIGKILL, log.read_text()[-3000:]
    assert client.get_run(killed).info.status == "RUNNING"  # nothing ran after the kill
    latest = checkpoint.latest_snapshot(str(root))
    assert checkpoint.read_manifest(latest).step == 2 and checkpoint.read_manifest(latest).data_cursor["in_flight"]

    assert cli.main(["train", str(config), *overrides, "--resume", "latest"]) == 0
    printed = capsys.readouterr().out
    resumed = json.loads(printed[printed.rindex("\n{\n") + 1 :])
    assert resumed["status"] == "FINISHED" and client.get_run(resumed["run_id"]).data.tags["rlray.resumed_from"] == latest
    assert_lossless(base, straight, [(killed, None), (resumed["run_id"], latest)], steps=4, staleness=1,
                    name="driver_killed")
