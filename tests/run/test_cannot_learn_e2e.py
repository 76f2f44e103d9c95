"""End to end (issue 29): a run that cannot learn stops and says why. ``rlray train`` in a subprocess, on the tiny model
with a TRL environment_factory class whose get_reward always raises (every episode fails: at a normal end inside its
step, at the turn limit in get_reward), started from another folder than the environment file's.

The preflight passes (the class loads and its first episode opens), and then the run must not end FINISHED with
reward=nan: each step's first failure reaches the console as an alert naming the environment, the source line and
the error; after guard.max_failed_steps=2 steps in which every sample failed the run ends FAILED, the reason on the
console, in MLflow (tag rlray.error) and the failure of each kept sample in the samples table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlray.observe.stored import StoredRun
from rlray.observe.tracking import get_run, get_run_metrics

REPO = Path(__file__).resolve().parents[2]
BROKEN = REPO / "tests" / "fixtures" / "envs" / "broken_envs.py"


@pytest.mark.ray
def test_a_run_whose_every_episode_fails_stops_failed_with_the_reason_on_the_console(tmp_path, tiny_model_path):
    rows = [{"prompt": f"Add {n} with the bump tool, then say done."} for n in range(4)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "model": {"path": "tiny-random", "dtype": "float32", "chat_template": "smollm2-tools"},
        "data": {"train_files": ["rows.jsonl"], "eval_files": ["rows.jsonl"]},
        "env": {"environments": {"broken": f"{BROKEN}:RewardRaises"}, "default": "broken", "max_turns": 2},
        "reward": {"functions": []},
        "rollout": {"backend": "hf", "samples_per_prompt": 2, "max_new_tokens": 8},
        "learner": {"prompts_per_step": 2, "sequences_per_minibatch": 4, "sequences_per_microbatch": 2, "torch_threads": 1},
        "run": {"max_steps": 5, "output_dir": "out"}, "eval": {"num_problems": 0}, "guard": {"kl_threshold": None},
        "monitor": {"port": 0}, "tracking": {"mlflow_uri": f"sqlite:///{tmp_path}/mlflow.db", "samples_per_step": 2}}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "rlray.cli", "train", "run.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    out, err = done.stdout, done.stderr
    assert done.returncode == 1, err[-3000:]
    result = json.loads(out[out.rindex("{\n"):])
    assert result["status"] == "FAILED"
    # the console: each step's first failure as one alert line, naming the environment, the source and the error
    alerts = [line for line in err.splitlines() if line.startswith("rlray: alert env_failed at step 1: ")]
    assert alerts, err[-3000:]
    assert alerts[0].startswith("rlray: alert env_failed at step 1: 4 of 4 episodes failed (env/failed); first: "
                                "environment 'broken' (")
    assert "raised ZeroDivisionError: the reward divides by the number of answers, 0 (at " in alerts[0]
    assert f"{BROKEN}:" in alerts[0]  # the file and line of the user's code
    # the reason the run stopped, on the console and in MLflow
    stop = "every sample failed in 2 steps in a row (steps 1-2; guard.max_failed_steps=2): the run cannot learn. " \
           "First failures: environment 'broken' ("
    assert f"rlray train: CannotLearnError: {stop}" in err
    assert "rlray: FAILED at step 1/5" in out  # the last lines
    uri = result["tracking_uri"]
    run = get_run(uri, result["run_id"])
    assert run.info.status == "FAILED" and stop in run.data.tags["rlray.error"]
    assert run.data.tags["rlray.alert.env_failed"].startswith("4 of 4 episodes failed (env/failed); first: environment")
    assert stop in run.data.tags["rlray.alert.run_failed"]
    metrics = get_run_metrics(uri, result["run_id"])
    assert metrics["env/failed"] == [(1, 4.0)] and metrics["reward/failed"] == [(1, 4.0)]
    assert sum(v for k, series in metrics.items() if k.startswith("env/failed/") for _, v in series) == 4.0
    # each kept sample says why it has no reward
    status, doc = StoredRun(uri, result["run_id"]).samples_of(1)
    assert status == 200 and len(doc["samples"]) == 2
    assert all(s["reward"] is None and s["failure"].startswith("environment 'broken' (") and "ZeroDivisionError" in
               s["failure"] for s in doc["samples"])
