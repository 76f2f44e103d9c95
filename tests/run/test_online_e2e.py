"""End to end: GRPO steps with `tiny-random` through vLLM rollout actors, Ray Train and MLflow.

Under `slow`: `make test` runs the same checks (weight sync reaching the engines, eval before and after, a
complete final snapshot whose weights changed) on the mixed-environment GRPO run of tests/run/test_envs_e2e.py."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlray.observe.tracking import get_run

REPO = Path(__file__).resolve().parents[2]
REQUIRED = [
    "reward/mean", "reward/completion_length", "reward/completion_length_skipped", "algo/kl", "learner/pg_loss", "learner/grad_norm",
    "rollout/response_tokens_mean", "rollout/truncated_rate", "perf/tokens_per_s",
    "timing/rollout_s", "timing/reward_s", "timing/logprobs_s", "timing/update_s", "timing/weight_sync_s", "timing/step_s",
]


@pytest.mark.ray
@pytest.mark.slow
def test_grpo_three_steps_through_ray(ray_session, tiny_grpo_run, tiny_model_path):
    uri, result, metrics = tiny_grpo_run(REQUIRED)
    # step s rolled out with the policy of version s-1: every sync reached the engine
    assert [v for _, v in metrics["rollout/policy_version"]] == [0.0, 1.0, 2.0]
    # eval before training (step 0) and after the last step
    assert [s for s, _ in metrics["eval/reward_mean"]] == [0, 3]
    run = get_run(uri, result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["learner.prompts_per_step"] == "2"
    assert "completion_length" in run.data.params["reward.functions"]
    assert metrics["reward/mean"][0][1] > 0
    assert run.data.tags["rlray.config_hash"]
    # the weights changed, and the final snapshot is complete
    final = Path(result.final_snapshot)
    assert (final / "manifest.json").exists() and (final / "trainer_state.pt").exists()
    before = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    after = load_file(str(final / "model" / "model.safetensors"))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) >= len(before) // 2
