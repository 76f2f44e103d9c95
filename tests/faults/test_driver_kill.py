"""The driver killed (SIGKILL, no clean-up of any kind) after its first snapshot: `rlray train --resume latest`
with the same config continues from the newest complete snapshot and finishes the remaining steps. The run also
has a prompt past data.max_prompt_tokens: skipped, and counted in data/skipped_long_prompts at every step.

About 75 s (two driver start-ups, the transformers rollout backend); the exactness of a resume is pinned by
tests/run/test_session.py::test_resume_reproduces_the_uninterrupted_run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from rlray import cli
from rlray.checkpoint import storage as checkpoint
from rlray.config import load_config
from rlray.data import load_prompt_rows, prepare_prompts

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 3


@pytest.mark.ray
@pytest.mark.slow  # 161 s on the 2-core CI machine; resume itself is covered in make test by tests/run/test_session.py and test_restart.py
def test_a_killed_driver_resumes_from_its_latest_snapshot(ray_session, tmp_path, gsm8k_dir, tiny_tokenizer, capsys):
    lines = (gsm8k_dir / "train.jsonl").read_text().splitlines()[:4]
    (tmp_path / "train4.jsonl").write_text("\n".join(lines) + "\n")
    uri, root = f"sqlite:///{tmp_path}/mlflow.db", f"{tmp_path}/out/snapshots"
    config = tmp_path / "run.yaml"
    config.write_text((REPO / "configs/grpo_gsm8k_tiny.yaml").read_text())
    overrides = [f"data.train_files=[{tmp_path}/train4.jsonl]", "eval.num_problems=0", f"run.max_steps={MAX_STEPS}",
                 f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}", "tracking.experiment=killed",
                 "rollout.backend=hf", "rollout.max_new_tokens=8", "checkpoint.every_steps=1", "guard.kl_threshold=null",
                 f"reward.functions=[{{function: '{REPO}/tests/fixtures/rewards.py:completion_length', weight: 1.0}}]"]  # fmt: skip
    # the longest of the 4 prompts is past data.max_prompt_tokens: skipped, and counted in every step's metrics
    cfg = load_config(config, overrides)
    rows = load_prompt_rows(cfg.data.train_files, prompt_column=cfg.data.prompt_column)
    lengths = sorted(len(ids) for ids in prepare_prompts(rows, tiny_tokenizer, max_prompt_tokens=10**9,
                                                         instruction=cfg.data.instruction, system_prompt=cfg.data.system_prompt)[1])  # fmt: skip
    assert lengths[-1] > lengths[-2]
    overrides.append(f"data.max_prompt_tokens={lengths[-2]}")
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address, PYTHONPATH=str(REPO))
    log = tmp_path / "driver.log"
    with log.open("w") as out:
        driver = subprocess.Popen([sys.executable, "-m", "rlray.cli", "train", str(config), *overrides], env=env,
                                  stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.monotonic() + 600
    while checkpoint.latest_snapshot(root) is None and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.3)
    assert driver.poll() is None, log.read_text()[-3000:]
    os.kill(driver.pid, signal.SIGKILL)
    assert driver.wait(timeout=60) == -signal.SIGKILL
    client = MlflowClient(uri)
    killed = client.search_runs([client.get_experiment_by_name("killed").experiment_id])[0]
    assert killed.info.status == "RUNNING"  # nothing ran after the kill: not even the MLflow run's end
    latest = checkpoint.latest_snapshot(root)
    step = checkpoint.read_manifest(latest).step
    assert MAX_STEPS > step >= 1 and f"run-{killed.info.run_id}/step_" in latest

    assert cli.main(["train", str(config), *overrides, "--resume", "latest"]) == 0
    printed = capsys.readouterr().out  # Ray's worker logs, then the result as indented JSON
    result = json.loads(printed[printed.rindex("\n{\n") + 1 :])
    assert result["status"] == "FINISHED" and result["run_id"] != killed.info.run_id
    resumed = client.get_run(result["run_id"])
    assert resumed.data.tags["rlray.resumed_from"] == latest
    assert sorted(m.step for m in client.get_metric_history(result["run_id"], "timing/step_s")) == list(range(step + 1, MAX_STEPS + 1))
    assert checkpoint.read_manifest(result["final_snapshot"]).step == MAX_STEPS
    skipped = client.get_metric_history(result["run_id"], "data/skipped_long_prompts")
    assert [m.value for m in skipped] == [1.0] * (MAX_STEPS - step)
