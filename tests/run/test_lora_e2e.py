"""End to end with LoRA (issue 28): GRPO steps with `tiny-random`, LoRA rank 8, whose weight syncs ship the adapter
alone (rollout.lora_sync=adapter; auto picks it on GPUs) to a vLLM rollout actor that keeps the base weights.

The engine's logprobs of each step's samples match the learner's own (old) logprobs of the same tokens, while the
policy moves away from the base model (algo/kl grows): the rollouts were sampled with the adapter of the version
before the step, not with the base weights."""

from pathlib import Path

import pytest
from safetensors.torch import load_file

REQUIRED = ["reward/mean", "algo/kl", "rollout/logprob_abs_diff", "timing/weight_sync_s"]


@pytest.mark.ray
@pytest.mark.slow
def test_grpo_with_an_adapter_only_sync(ray_session, tiny_grpo_run):
    uri, result, metrics = tiny_grpo_run(REQUIRED, "model.lora.rank=8", "rollout.lora_sync=adapter", "learner.lr=2e-2")
    assert [v for _, v in metrics["rollout/policy_version"]] == [0.0, 1.0, 2.0]
    kl = [v for _, v in metrics["algo/kl"]]
    assert kl[0] < 1e-9 and min(kl[1:]) > 1e-3  # step 1 samples the initial policy (lora_B = 0); then it moves
    # float32 engine and learner on the same adapter: measured ~3.5e-7 nats per token (with algo/kl ~0.02, the base
    # weights alone would be off by ~0.1 nats per token)
    assert max(v for _, v in metrics["rollout/logprob_abs_diff"]) < 1e-4
    final = Path(result.final_snapshot) / "model"
    assert (final / "adapter_config.json").exists() and load_file(str(final / "adapter_model.safetensors"))
