"""A verifiers environment trains unchanged: `rlray train configs/envs/verifiers_sum_smollm2.yaml` at test size
(tiny-random, 2 steps), through rollout actors, the environment host's gateway and the verifiers bridge in
.venvs/verifiers, Ray Train and MLflow. The environment (tests/envs/verifiers/vf_sum.py) is verifiers' own code; its
rubric's reward is the episode's reward and its two functions are logged as reward terms."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from rlray import cli
from rlray.envs.servers.verifiers import DEFAULT_VENV
from rlray.observe.tracking import get_run, get_run_metrics

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.ray
@pytest.mark.skipif(not (DEFAULT_VENV / "bin" / "python").exists() and "RLRAY_VERIFIERS_PYTHON" not in os.environ,
                    reason="no .venvs/verifiers: `make verifiers-venv` (make install) builds it")
def test_a_verifiers_environment_trains_two_steps(ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sizes = ["model.path=tiny-random", "model.dtype=float32", "rollout.backend=hf", "run.max_steps=2",
             "learner.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=12",
             "learner.sequences_per_minibatch=4", "learner.sequences_per_microbatch=2", "learner.torch_threads=1",
             "monitor.port=0", "guard.kl_threshold=null", f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}"]
    assert cli.main(["train", "configs/envs/verifiers_sum_smollm2.yaml", *sizes]) == 0
    out = capsys.readouterr().out
    run_id = json.loads(out[out.rindex("{\n"):])["run_id"]
    assert get_run(uri, run_id).info.status == "FINISHED"
    metrics = {k: [v for _, v in series] for k, series in get_run_metrics(uri, run_id).items()}
    assert metrics["env/episodes"] == [4.0, 4.0] and metrics["env/failed"] == [0.0, 0.0]
    assert all(v >= 1.0 for v in metrics["env/gateway_calls_mean"])  # the harness's model calls reached the gateway
    # the rubric: reward = 1.0 * correct + 0.5 * formatted, each episode's scores in {0, 1}
    correct, formatted = metrics["reward/vf_sum/correct"], metrics["reward/vf_sum/formatted"]
    assert all(0.0 <= v <= 1.0 for v in correct + formatted)
    assert [round(e, 9) for e in metrics["reward/env"]] == [round(c + 0.5 * f, 9) for c, f in zip(correct, formatted, strict=True)]
    assert all(math.isfinite(v) for v in metrics["learner/pg_loss"]) and len(metrics["learner/pg_loss"]) == 2
    # the bridge is a supervised server: no restart, and its log in the run's log folder
    assert metrics["env/server_restarts/verifiers-vf_sum"] == [0.0, 0.0]
    bridge_log = tmp_path / "out" / "logs" / run_id / "servers" / "env-0" / "verifiers-vf_sum.log"
    assert "rlray-verifiers-bridge listening on http://127.0.0.1:" in bridge_log.read_text()
