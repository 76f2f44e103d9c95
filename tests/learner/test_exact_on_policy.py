"""rollout.backend=exact through the learner's code: the exact engine's rollout logprobs are the learner's bit for bit,
so on an on-policy step every rollout importance ratio is exactly 1 and the rollout k3 exactly 0; the default layout
(padded rows, a shared prompt) is the control that shows the assertions can fail."""

import pytest
import torch

from rlray import schema
from rlray.learner import LossSpec, Normaliser, OptimizerSpec, PolicyLearner
from rlray.learner.batching import MicroBatching
from rlray.rollout.engine import RolloutEngine
from rlray.rollout.types import SamplingSpec

N = 8  # rollout.max_new_tokens
SPEC = LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0, kl_estimator="k3", loss_agg="token-mean",
                max_response_tokens=N, correction="token_truncate", correction_min=0.5, correction_max=2.0)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return RolloutEngine(tiny_model_path, backend="exact", dtype="float32", seed=0, max_model_len=64)


def _step_table(engine, tokenizer, sampling: SamplingSpec):
    prompts = [tokenizer.encode(text) for text in ("What is 2 + 3?", "Name a colour.", "Say hi")]
    completions = engine.generate(prompts, sampling)
    rows = {k: [] for k in ("prompt_id", "group_id", "sample_index", "prompt_token_ids", "response_token_ids",
                            "response_mask", "rollout_logprobs", "reward", "reward_components", "policy_version",
                            "finish_reason")}
    for c in completions:
        rows["prompt_id"].append(f"p{c.prompt_index}")
        rows["group_id"].append(c.prompt_index)
        rows["sample_index"].append(c.sample_index)
        rows["prompt_token_ids"].append(prompts[c.prompt_index])
        rows["response_token_ids"].append(c.response_token_ids)
        rows["response_mask"].append([True] * len(c.response_token_ids))
        rows["rollout_logprobs"].append(c.rollout_logprobs)
        rows["reward"].append(float(len(c.response_token_ids) % 3))
        rows["reward_components"].append({})
        rows["policy_version"].append(0)
        rows["finish_reason"].append(c.finish_reason)
    return schema.make_table(rows), completions


def _on_policy_stats(learner, batch, batching):
    batch.advantages = torch.where(batch.response_mask, batch.reward[:, None] - 1.0, 0.0)
    norm = Normaliser(float(batch.response_mask.sum()), float(batch.num_rows))
    return learner.train_minibatch(batch, SPEC, norm, batching)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_exact_on_policy_step_has_ratio_one_and_zero_rollout_kl(dtype, engine, tiny_model_path, tiny_tokenizer):
    if dtype == "bfloat16":  # float32 master weights under bf16 autocast on both sides
        engine = RolloutEngine(tiny_model_path, backend="exact", dtype=dtype, seed=0, max_model_len=64)
    sampling = SamplingSpec(n=2, max_new_tokens=N, temperature=0.9, seed=11)
    table, completions = _step_table(engine, tiny_tokenizer, sampling)
    pad = tiny_tokenizer.pad_token_id
    learner = PolicyLearner(tiny_model_path, dtype=dtype, temperature=0.9,
                            optim=OptimizerSpec(lr=1e-3, max_grad_norm=1e9))
    exact = MicroBatching(sequences=4, exact_new_tokens=N)
    batch = schema.collate(table, pad)
    # stage 4 (old logprobs, eval mode, no grad) equals the engine's logprobs bit for bit
    old = learner.logprobs(batch.inputs, reference=False, batching=exact)
    mask = batch.response_mask
    assert torch.equal(old[mask], batch.rollout_logprobs[mask])
    # stage 6 on-policy (old = the detached current logprobs, train mode, with grad): every ratio exactly 1
    stats = _on_policy_stats(learner, batch, exact)
    tokens = float(mask.sum())
    assert stats["rollout_kl_sum"] == 0.0 and stats["rollout_diff_sum"] == 0.0
    assert stats["rollout_ratio_max"] == 1.0 and stats["is_weight_sum"] == tokens
    assert stats["corrected_tokens"] == 0.0 and stats["tokens"] == tokens


def test_the_default_layout_is_not_exact(engine, tiny_model_path, tiny_tokenizer):
    # the control: the same rollouts through the learner's padded (shared-prompt) layout differ in the last bits
    sampling = SamplingSpec(n=2, max_new_tokens=N, temperature=0.9, seed=11)
    table, _ = _step_table(engine, tiny_tokenizer, sampling)
    learner = PolicyLearner(tiny_model_path, dtype="float32", temperature=0.9,
                            optim=OptimizerSpec(lr=1e-3, max_grad_norm=1e9))
    batch = schema.collate(table, tiny_tokenizer.pad_token_id)
    stats = _on_policy_stats(learner, batch, MicroBatching(sequences=4))
    assert 0.0 < stats["rollout_kl_sum"] < 1e-6  # the same distribution, not the same bits
    assert stats["rollout_diff_sum"] > 0.0


def test_a_response_longer_than_the_buffer_is_refused_by_row(tiny_model_path):
    learner = PolicyLearner(tiny_model_path, dtype="float32", temperature=1.0,
                            optim=OptimizerSpec(lr=1e-3, max_grad_norm=1e9))
    inputs = schema.pack_sequences([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 15]], 0)
    with pytest.raises(ValueError, match="row 1 has a response of 4 tokens, more than rollout.max_new_tokens=3"):
        learner.logprobs(inputs, reference=False, batching=MicroBatching(sequences=2, exact_new_tokens=3))
    with pytest.raises(ValueError, match="exact_new_tokens=3 needs >= 1 and packing off or auto, not 'on'"):
        MicroBatching(sequences=2, packing="on", exact_new_tokens=3)
