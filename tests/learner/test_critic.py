"""PPO's critic on the real learner: the value loss falls on a fixed batch; GAE advantages come from critic values."""

import dataclasses

import pytest
import torch

from rlray import algos, schema
from rlray.algos import AdvantageSpec, get_algorithm
from rlray.learner import LossSpec, Normaliser, OptimizerSpec, PolicyLearner
from rlray.learner import online as learner_online
from rlray.learner.batching import MicroBatching
from rlray.learner.critic import build_critic, critic_values, train_critic_minibatch


def _batch(pad: int):
    g = torch.Generator().manual_seed(0)
    rows = {k: [] for k in ("prompt_id", "group_id", "sample_index", "prompt_token_ids", "response_token_ids",
                            "response_mask", "rollout_logprobs", "reward", "reward_components", "policy_version",
                            "finish_reason")}  # fmt: skip
    for i in range(4):
        n = 2 + 3 * i  # ragged responses: 2, 5, 8, 11 tokens
        rows["prompt_id"].append(f"p{i}")
        rows["group_id"].append(i)
        rows["sample_index"].append(0)
        rows["prompt_token_ids"].append(torch.randint(10, 1000, (3 + i,), generator=g).tolist())
        rows["response_token_ids"].append(torch.randint(10, 1000, (n,), generator=g).tolist())
        rows["response_mask"].append([True] * n)
        rows["rollout_logprobs"].append([-1.0] * n)
        rows["reward"].append([1.0, 0.0, 0.5, -1.0][i])
        rows["reward_components"].append({})
        rows["policy_version"].append(0)
        rows["finish_reason"].append("stop")
    return schema.collate(schema.make_table(rows), pad)


def test_value_loss_decreases_on_a_fixed_batch(tiny_model_path, tiny_tokenizer):
    critic = build_critic(tiny_model_path, dtype="float32", lr=1e-3, max_grad_norm=1.0)
    batch = _batch(tiny_tokenizer.pad_token_id)
    mask = batch.response_mask
    batch.old_values = critic_values(critic, batch.inputs, mask, batching=MicroBatching(4))
    batch.returns = torch.where(mask, batch.reward[:, None].expand(mask.shape), 0.0)  # Monte-Carlo, gamma 1
    norm = Normaliser(float(mask.sum()), 4.0)
    losses = []
    for _ in range(8):
        stats = train_critic_minibatch(critic, batch, None, norm, batching=MicroBatching(2))
        losses.append(stats["value_loss_sum"] / stats["value_tokens"])
    assert stats["value_tokens"] == 26.0  # 2 + 5 + 8 + 11
    # seen: 0.32 -> 0.02 in 8 AdamW steps (lr 1e-3; not monotone step to step)
    assert losses[-1] < 0.2 * losses[0] and max(losses[-3:]) < min(losses[:2]), losses


def test_gae_advantages_come_from_the_critic(tiny_model_path, tiny_tokenizer):
    critic = build_critic(tiny_model_path, dtype="float32", lr=1e-3, max_grad_norm=1.0)
    with torch.no_grad():  # a critic that says V(s) = 0.25 everywhere
        critic.module.score.weight.zero_()
        critic.module.score.bias.fill_(0.25)
    policy = PolicyLearner(tiny_model_path, dtype="float32", optim=OptimizerSpec(lr=1e-3, max_grad_norm=1.0),
                           temperature=1.0, use_reference=False, critic=critic)
    batch = _batch(tiny_tokenizer.pad_token_id)
    mask = batch.response_mask
    loss = LossSpec(clip_eps_low=0.2, clip_eps_high=0.2, kl_coef=0.0, kl_estimator="k1", loss_agg="token-mean",
                    max_response_tokens=16)
    spec = learner_online.UpdateSpec(
        estimator=get_algorithm("ppo").advantage, loss=loss, advantage=AdvantageSpec(gamma=1.0, lam=1.0),
        epochs=1, rows_per_minibatch=4, batching=MicroBatching(2), old_logprobs_before_update=False, value_clip_eps=0.5,
    )  # fmt: skip
    data = learner_online.reference_and_old(policy, batch, spec)
    assert torch.equal(data.old_values, torch.where(mask, 0.25, 0.0))  # stage 4 ran the critic
    data = learner_online.advantages(data, spec, lambda d: d)
    # gamma = lambda = 1: returns are the sequence reward on every token; advantages r - V, whitened over the batch
    torch.testing.assert_close(data.returns, torch.where(mask, batch.reward[:, None].expand(mask.shape), 0.0))
    raw = torch.where(mask, batch.reward[:, None] - 0.25, 0.0)
    torch.testing.assert_close(data.advantages, algos.whiten(raw, mask), atol=1e-6, rtol=0)
    # lambda 0.95 goes through algos.gae_advantages on the same critic values
    spec95 = dataclasses.replace(spec, advantage=AdvantageSpec(gamma=1.0, lam=0.95))
    got = learner_online.advantages(dataclasses.replace(data), spec95, lambda d: d)
    token_rewards = algos.token_level_rewards(batch.reward, mask)
    adv, ret = algos.gae_advantages(token_rewards, data.old_values, mask, gamma=1.0, lam=0.95)
    torch.testing.assert_close(got.returns, ret)
    torch.testing.assert_close(got.advantages, algos.whiten(adv, mask))
    # stage 6 steps the policy and the critic once per mini-batch
    metrics = learner_online.update(policy, data, [Normaliser(float(mask.sum()), 4.0)], spec, lambda d: dict(d))
    assert metrics["learner/value_loss"] == pytest.approx(float((0.5 * (raw**2)).sum() / mask.sum()), rel=1e-5)
    assert metrics["learner/critic_grad_norm"] > 0 and critic.module.score.bias.item() != 0.25
