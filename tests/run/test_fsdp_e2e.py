"""FSDP2 end to end on the CPU: 2 Ray Train learner workers with ``resources.learner.strategy=fsdp`` (gloo) run the
tiny GRPO config through the driver, push their gathered weights to the rollout engine after every update, and a
run resumed from the step-2 snapshot (taken sharded) reproduces step 3 of the uninterrupted run exactly (``slow``: the
resume of a sharded snapshot is exact at the learner's level in ``make test``, tests/learner/test_fsdp.py).

The engine is transformers' (``rollout.backend=hf``) in float32, the learner's own arithmetic: its sampling
logprobs equal the learner's for the same weights, so ``rollout/logprob_abs_diff`` near 0 at steps 2 and 3 says the
engine generated with the weights of the update before (a missed push would leave it on older weights, off by about
what an update moves the logprobs)."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlray.checkpoint import storage as checkpoint

FSDP = ["resources.learner.num_workers=2", "resources.learner.strategy=fsdp", "learner.torch_threads=1",
        "rollout.backend=hf", "eval.num_problems=0", "checkpoint.every_steps=2", "guard.kl_threshold=null",
        "algo.kl_coef=0.05"]
SAME = ["reward/mean", "rollout/response_tokens_mean", "learner/loss", "learner/pg_loss", "learner/grad_norm",
        "algo/kl", "rollout/logprob_abs_diff"]


def _straight_run(tiny_grpo_run, tiny_model_path):
    """The 3-step FSDP run: the engine followed every update, step 2's snapshot is sharded (one file per rank), the
    final one a whole Hugging Face folder gathered to rank 0; returns (its metrics, step 2's folder, final weights)."""
    uri, straight, metrics = tiny_grpo_run(["learner/loss", "algo/kl", "rollout/logprob_abs_diff"], *FSDP)
    diff = dict(metrics["rollout/logprob_abs_diff"])
    moved = dict(metrics["algo/kl"])[3]  # the policy's k3 KL to the initial one after 2 updates
    assert max(diff.values()) < 1e-5 and moved > 100 * max(diff.values()), (diff, moved)

    final = Path(straight.final_snapshot)
    step2 = final.parent / checkpoint.snapshot_name(2, 0)
    assert sorted(p.name for p in (step2 / "sharded").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    before = load_file(str(Path(tiny_model_path) / "model.safetensors"))
    after = load_file(str(final / "model" / "model.safetensors"))  # gathered to rank 0: a whole Hugging Face folder
    assert set(after) == set(before)  # the tied lm_head is left out, as save_pretrained leaves it out unsharded
    assert any(not torch.equal(before[k], after[k]) for k in before)
    return metrics, step2, after


@pytest.mark.ray
def test_fsdp_run_syncs_its_weights_and_writes_sharded_snapshots(ray_session, tiny_grpo_run, tiny_model_path):
    _straight_run(tiny_grpo_run, tiny_model_path)


@pytest.mark.slow  # a second run (~45 s on 2 cores); the sharded resume is exact in tests/learner/test_fsdp.py
@pytest.mark.ray
def test_fsdp_run_resumes_exactly(ray_session, tiny_grpo_run, tiny_model_path):
    metrics, step2, after = _straight_run(tiny_grpo_run, tiny_model_path)
    _, resumed, again = tiny_grpo_run([], *FSDP, f"checkpoint.resume_from={step2}")
    assert [s for s, _ in again["learner/loss"]] == [3]  # only the step after the snapshot ran
    for key in SAME:
        assert again[key] == [metrics[key][2]], key
    resumed_w = load_file(str(Path(resumed.final_snapshot) / "model" / "model.safetensors"))
    assert all(torch.equal(after[k], resumed_w[k]) for k in after)
