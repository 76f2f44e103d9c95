"""End to end (issue 41): GRPO trains 2 steps on tiny-random on a reasoning-gym mix through Ray (configs/
grpo_reasoning_gym_smollm2.yaml at test size): the rows are generated, the reward is their generators' score_answer
(reward/reasoning_gym beside the summed reward), and eval runs on the held-out split."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs/grpo_reasoning_gym_smollm2.yaml"
MIX = "reasoning-gym:leg_counting:3,basic_arithmetic:1"


@pytest.mark.ray
def test_grpo_two_steps_on_a_reasoning_gym_mix(ray_session, tmp_path):
    pytest.importorskip("reasoning_gym")
    from rlray.config import load_config
    from rlray.launch.driver import run_training
    from rlray.observe.metrics import METRIC_KEYS, term_keys
    from rlray.observe.tracking import get_run_metrics

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = load_config(CONFIG, [
        f"run.output_dir={tmp_path}/out", f"tracking.mlflow_uri={uri}", "model.path=tiny-random", "model.dtype=float32",
        f"data.train_files={MIX}?size=32&seed=0", f"data.eval_files={MIX}?size=4&seed=0&split=heldout",
        "run.max_steps=2", "rollout.backend=hf", "learner.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=8", "learner.sequences_per_minibatch=4", "learner.sequences_per_microbatch=2",
        "learner.torch_threads=1", "eval.num_problems=4", "monitor.port=0", "guard.kl_threshold=null"])
    began_ms = time.time() * 1000
    result = run_training(cfg)
    assert result.status == "FINISHED"
    # the learner group started without the Ray Train helpers a run has no use for (rlray.launch.ray_setup): Ray
    # Data's DatasetManager (no datasets) and, on this one-node cluster that the test process started, the
    # PreemptionWatcher, the PlacementGroupCleaner and the AutoscalingCoordinator; its own actors did start
    from ray._private.state import actors

    started = {a["ActorClassName"] for a in actors().values() if a["StartTime"] >= began_ms}
    assert {"TrainController", "RayTrainWorker", "RolloutActor"} <= started, started
    assert not started & {"DatasetManager", "PreemptionWatcher", "PlacementGroupCleaner", "_AutoscalingCoordinatorActor"}, started
    metrics = get_run_metrics(uri, result.run_id)
    required = ["reward/mean", "reward/reasoning_gym", "reward/reasoning_gym_skipped", "learner/pg_loss"]
    assert set(required) <= set(METRIC_KEYS) | set(term_keys(["reasoning_gym"]))
    for key in required:
        assert [s for s, _ in metrics[key]] == [1, 2], key
    # every sample is a generated item: the term applied to all of them, with reasoning-gym's scores in [0, 1]
    assert all(v == 0.0 for _, v in metrics["reward/reasoning_gym_skipped"])
    assert all(0.0 <= v <= 1.0 for _, v in metrics["reward/reasoning_gym"])
    assert all(math.isfinite(v) for _, v in metrics["learner/pg_loss"])
    assert [s for s, _ in metrics["eval/reasoning_gym"]] == [0, 2]  # the held-out rows, before and after
