"""End to end on the distributed topology: 2 rollout actors, 2 Ray Train learner workers (DDP on
gloo), the reward on Ray Serve, the reference model as its own actor, and async rollouts (k = 1),
for 3 GRPO steps on `tiny-random`, with the main-job assertions (tests/run/test_online_e2e.py)."""

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlray.algos.registry import ALGORITHMS
from rlray.observe.tracking import get_run

REPO = Path(__file__).resolve().parents[2]
REQUIRED = [
    "reward/mean", "reward/completion_length", "reward/completion_length_skipped", "reward/version", "algo/kl", "learner/pg_loss",
    "learner/grad_norm", "rollout/response_tokens_mean", "rollout/truncated_rate", "rollout/staleness_mean",
    "rollout/staleness_max", "perf/tokens_per_s", "timing/rollout_s", "timing/reward_s", "timing/logprobs_s",
    "timing/update_s", "timing/weight_sync_s", "timing/step_s",
]


@pytest.mark.ray
def test_two_rollouts_two_learners_serve_reward_async(ray_session, tiny_grpo_run, tiny_model_path):
    from rlray.rollout.weight_sync import free_port

    uri, result, metrics = tiny_grpo_run(
        REQUIRED, "learner.torch_threads=1", "resources.rollout.num_workers=2", "resources.learner.num_workers=2",
        "resources.reference.placement=actor", "reward.server.enabled=true", f"reward.server.port={free_port()}",
        "reward.version=7", "rollout.max_staleness=1", "rollout.overlap=on",
    )
    # k = 1: step 2 trains on the rollout made with version 0 while step 1 trained, step 3 on version 1
    assert [v for _, v in metrics["rollout/policy_version"]] == [0.0, 0.0, 1.0]
    assert [v for _, v in metrics["rollout/staleness_max"]] == [0.0, 1.0, 1.0]
    # every step was scored by the Serve application, version 7
    assert [v for _, v in metrics["reward/version"]] == [7.0, 7.0, 7.0]
    assert [s for s, _ in metrics["eval/reward_mean"]] == [0, 3]
    run = get_run(uri, result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["resources.learner.num_workers"] == "2"
    assert "completion_length" in run.data.params["reward.functions"]
    assert metrics["reward/mean"][0][1] > 0
    assert metrics["algo/kl"][-1][1] > 0  # reference logprobs came from the reference actor
    # both ranks' calls to it ran under watchdog.reference_call_s, none past it (their counts summed into run/hangs)
    assert run.data.params["watchdog.reference_call_s"] == "1800.0"
    assert [v for _, v in metrics["run/hangs"]] == [0.0, 0.0, 0.0]
    final = Path(result.final_snapshot)
    assert (final / "manifest.json").exists() and (final / "trainer_state.pt").exists()
    before = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    after = load_file(str(final / "model" / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) // 2


@pytest.mark.ray
def test_two_learners_stop_together_after_a_snapshot_when_evaluation_hangs_under_stop(ray_session, tmp_path,
                                                                                        gsm8k_dir, tiny_model_path):
    """watchdog.on_hang=stop, 2 Ray Train ranks: rank 0's evaluation after step 1 hangs in a user reward function (a
    real sleep, killed at its 2 s timeout: HangError); both ranks stop together (through the step's guard broadcast)
    after a 'stop' snapshot of step 1, the run FAILED with the report, instead of rank 0 raising alone while rank 1
    waits in a collective."""
    import json

    from rlray.checkpoint import storage as checkpoint
    from rlray.config import RewardFunctionConfig, load_config
    from rlray.launch.driver import run_training
    from rlray.observe.tracking import get_run_metrics

    counter = tmp_path / "eval_batches"
    rows = [json.loads(line) for line in (gsm8k_dir / "test.jsonl").read_text().splitlines()[:2]]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({**r, "hang_counter": str(counter)}) + "\n" for r in rows))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(REPO / "configs/grpo_gsm8k_tiny.yaml", [
        f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}", f"data.train_files=[{gsm8k_dir}/train.jsonl]",
        f"data.eval_files=[{tmp_path}/eval.jsonl]", "run.max_steps=3", "eval.num_problems=2", "eval.every_steps=1",
        "checkpoint.every_steps=3", "learner.torch_threads=1", "resources.learner.num_workers=2",
        "watchdog.on_hang=stop"])
    cfg.reward.functions = [RewardFunctionConfig(
        function=f"{REPO}/tests/fixtures/faulty_rewards.py:hangs_in_second_eval", weight=1.0, timeout_s=2.0)]
    result = run_training(cfg)
    assert result.status == "FAILED" and counter.read_text() == "2"
    assert result.error.startswith("HangError in evaluation: hang: reward function")
    run = get_run(uri, result.run_id)
    assert run.data.tags["rlray.error"].startswith("HangError in evaluation: hang: reward function")
    metrics = get_run_metrics(uri, result.run_id)
    assert [s for s, _ in metrics["learner/pg_loss"]] == [1] and [s for s, _ in metrics["eval/reward_mean"]] == [0]
    manifest = checkpoint.read_manifest(result.final_snapshot)
    assert (manifest.step, manifest.kind) == (1, "stop")


STALLING_ALGORITHM = '''
import os
import time

import torch
import torch.distributed as dist

from rlray import algos
from rlray.algos import Algorithm, estimators

FLAG, CALLS = {flag!r}, {calls!r}


def rank_1_never_arrives():
    time.sleep(120)


def stalling_grpo(inputs, spec, sum_fn):
    """sign_grpo's advantage (docs/examples/sign_grpo.py); rank 1 stalls in its second call while FLAG exists."""
    if dist.get_rank() == 1:
        calls = int(open(CALLS).read()) + 1 if os.path.exists(CALLS) else 1
        open(CALLS, "w").write(str(calls))
        if calls == 2 and os.path.exists(FLAG):
            os.remove(FLAG)
            rank_1_never_arrives()
    rewards, valid, mask = estimators.sequence_inputs(inputs, spec)
    centred = algos.dr_grpo_advantages(rewards, inputs.group_id, valid_mask=valid)
    return estimators.broadcast(torch.sign(centred), mask)


STALLING = Algorithm("stalling_grpo", "online", advantage=stalling_grpo, policy_loss="ppo_clip", needs_groups=True)
'''


def stalled_run(tmp_path, gsm8k_dir, name: str, *overrides: str):
    """Runs 2 steps of the tiny GRPO config on 2 Ray Train ranks with STALLING_ALGORITHM registered as ``name`` (its own
    name per test: one registry per process, forgotten after the run), watchdog.collective_s=3, a snapshot every step;
    returns (the MLflow URI, the stall flag, the calls file, the run's result)."""
    from rlray.config import RewardFunctionConfig, load_config
    from rlray.launch.driver import run_training

    flag, calls = tmp_path / "stall", tmp_path / "calls"
    flag.touch()
    source = STALLING_ALGORITHM.format(flag=str(flag), calls=str(calls))
    (tmp_path / "stalling.py").write_text(source.replace('"stalling_grpo"', f'"{name}"'))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(REPO / "configs/grpo_gsm8k_tiny.yaml", [
        f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}", f"data.train_files=[{gsm8k_dir}/train.jsonl]",
        f"data.eval_files=[{gsm8k_dir}/test.jsonl]", "run.max_steps=2", "eval.num_problems=0", "checkpoint.every_steps=1",
        "learner.torch_threads=1", "resources.learner.num_workers=2", f"algo.name={name}",
        f"algo.user_algorithms=[{tmp_path}/stalling.py:STALLING]", "watchdog.collective_s=3", "monitor.max_failures=1",
        "monitor.port=0", *overrides])
    cfg.reward.functions = [RewardFunctionConfig(function=f"{REPO}/tests/fixtures/rewards.py:completion_length",
                                                 weight=1.0)]
    try:
        return uri, flag, calls, run_training(cfg)
    finally:
        ALGORITHMS.pop(name, None)  # registered in this process by the config: no other test sees it


@pytest.mark.ray
def test_a_rank_that_never_reaches_a_collective_is_named_with_its_stack_and_ray_train_restarts_the_group(
        ray_session, tmp_path, gsm8k_dir):
    """watchdog.collective_s=3, on_hang=restart, 2 Ray Train ranks: in step 2 rank 1 stalls in its advantage estimator
    (a user algorithm) before stage 5's all-reduce; rank 0, waiting in it, sends the hang alert naming rank 1 with the
    stack taken from rank 1's process, then exits; Ray Train restarts the group from step 1's snapshot and the run
    finishes."""
    from rlray.observe.tracking import get_run, get_run_metrics

    uri, flag, _, result = stalled_run(tmp_path, gsm8k_dir, "stalling_grpo", "monitor.restart_delay_s=1")
    assert result.status == "FINISHED" and not flag.exists()
    alert = get_run(uri, result.run_id).data.tags["rlray.alert.hang"]
    head = alert.partition("\n")[0]
    assert head.startswith("hang: learner rank 0 (pid ") and "past watchdog.collective_s=3 s" in head
    assert "stage 5 (advantages) of step 2" in head and "ranks behind: 1 (last entered collective" in head
    assert head.endswith("exiting the rank (Ray Train restarts the group)")
    assert 3.0 <= float(re.search(r"\) for (\d+\.\d) s, past", head).group(1)) < 3.0 + 5.0  # within a poll or so (one decimal)
    assert "stacks of learner rank 1 (pid " in alert and "in rank_1_never_arrives" in alert
    assert [s for s, _ in get_run_metrics(uri, result.run_id)["learner/pg_loss"]][-1] == 2


@pytest.mark.ray
def test_under_stop_a_rank_that_never_reaches_a_collective_ends_the_run_failed_at_the_newest_snapshot(
        ray_session, tmp_path, gsm8k_dir):
    """The stall above under watchdog.on_hang=stop: rank 0 reports it, records the run's end and exits; the group Ray
    Train starts again ends at once, and the run ends FAILED with the report as its error and step 1's snapshot as
    the one to resume from, instead of waiting on the stuck rank for ever (a stuck rank cannot write a snapshot)."""
    from rlray.checkpoint import storage as checkpoint
    from rlray.observe.tracking import get_run, get_run_metrics

    uri, flag, calls, result = stalled_run(tmp_path, gsm8k_dir, "stalling_grpo_stop", "watchdog.on_hang=stop")
    assert result.status == "FAILED" and not flag.exists() and calls.read_text() == "2"  # no step ran after the stop
    assert result.error.startswith("hang: learner rank 0 (pid ") and "ranks behind: 1 (last entered collective" in result.error
    assert result.error.endswith("stopping the run (watchdog.on_hang=stop: it ends FAILED, resumable from its newest "
                                 "snapshot if it has one)")
    manifest = checkpoint.read_manifest(result.final_snapshot)
    assert (manifest.step, manifest.kind) == (1, "periodic")
    run = get_run(uri, result.run_id)
    assert run.info.status == "FAILED" and run.data.tags["rlray.error"] == result.error
    assert run.data.tags["rlray.alert.hang"].partition("\n")[0] == result.error
    assert "stacks of learner rank 1 (pid " in run.data.tags["rlray.alert.hang"]
    assert run.data.tags["rlray.alert.run_failed"] == f"the run stops: {result.error}"
    assert [s for s, _ in get_run_metrics(uri, result.run_id)["learner/pg_loss"]] == [1]
