"""Online composition: each algo.name's registry entry picks its estimator and loss; batch statistics are global over
ranks; options."""

import dataclasses
import threading

import pytest
import torch

from rlray import algos
from rlray.algos import AdvantageInputs, AdvantageSpec, algorithm_names, get_algorithm
from rlray.config import config_from_dict
from rlray.learner import LossSpec, Normaliser, policy_objective
from rlray.learner.online import collective_sum
from rlray.run.build import update_spec
from tests.learner.batches import step_batch

B, T = 8, 5
ONLINE_ALGOS = algorithm_names("online")


def _data(seed: int = 0) -> AdvantageInputs:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 1, 4, 2, 5, 5, 3])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return AdvantageInputs(
        reward=torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 0.0, 1.0, 0.25]),
        group_id=torch.arange(B) // 4,
        response_mask=mask,
        old_logprobs=-torch.rand(B, T, generator=g),
        ref_logprobs=-torch.rand(B, T, generator=g),
        old_values=torch.randn(B, T, generator=g),
        baseline_reward=torch.tensor([0.5] * 4 + [1.0] * 4),
    )


def _rows(d: AdvantageInputs, rows: slice) -> AdvantageInputs:
    return dataclasses.replace(d, **{f.name: getattr(d, f.name)[rows] for f in dataclasses.fields(d)})


def _advantages(name: str, d: AdvantageInputs, spec: AdvantageSpec, sum_fn=None) -> torch.Tensor:
    return get_algorithm(name).advantage(d, spec, sum_fn or _local).advantages


def _local(x):
    return x


def test_every_online_algo_has_an_estimator_and_a_loss():
    loss_of = {name: get_algorithm(name).policy_loss for name in ONLINE_ALGOS}
    assert len(ONLINE_ALGOS) == 10 and all(callable(get_algorithm(n).advantage) for n in ONLINE_ALGOS)
    assert set(loss_of.values()) <= set(algos.POLICY_LOSSES)
    assert {n for n, loss in loss_of.items() if loss != "ppo_clip"} == {"gspo", "cispo"}


def test_estimators_are_the_algos_functions():
    d, spec = _data(), AdvantageSpec(std_scale="group", eps=1e-6)
    mask, r, gid = d.response_mask, d.reward, d.group_id

    def seq(a):
        return torch.where(mask, a[:, None].expand(mask.shape), 0.0)

    expect = {
        "grpo": seq(algos.grpo_advantages(r, gid, eps=1e-6)),
        "dr_grpo": seq(algos.dr_grpo_advantages(r, gid)),
        "rloo": seq(algos.rloo_advantages(r, gid)),
        "remax": seq(r - d.baseline_reward),
        "reinforce_pp": algos.reinforce_pp_advantages(algos.token_level_rewards(r, mask), mask),
        "reinforce_pp_baseline": algos.reinforce_pp_baseline_advantages(r, gid, mask),
        "ppo": algos.whiten(algos.gae_advantages(algos.token_level_rewards(r, mask), d.old_values, mask,
                                                 gamma=1.0, lam=1.0)[0], mask),  # fmt: skip
    }
    for name in ("dapo", "gspo", "cispo"):
        expect[name] = expect["grpo"]
    for name, want in expect.items():
        got = _advantages(name, d, spec)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0, msg=name)


def test_kl_in_the_reward_enters_the_advantage():
    # one group of 2 one-token responses, KL k1 = old - ref: row 0 +0.5 nats, row 1 -0.5; beta 0.2
    d = AdvantageInputs(torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), torch.ones(2, 1, dtype=torch.bool),
                        old_logprobs=torch.tensor([[-1.0], [-1.0]]), ref_logprobs=torch.tensor([[-1.5], [-0.5]]))
    spec = AdvantageSpec(reward_kl_coef=0.2, kl_estimator="k1")
    # rewards after the penalty: 1 - 0.1 = 0.9 and 1 + 0.1 = 1.1; Dr.GRPO advantage r - mean: -0.1, +0.1
    torch.testing.assert_close(_advantages("dr_grpo", d, spec), torch.tensor([[-0.1], [0.1]]))
    # without the penalty both rewards are 1: zero advantage
    assert _advantages("dr_grpo", d, AdvantageSpec()).abs().max() == 0


@pytest.mark.parametrize("std_scale", ["group", "batch"])
def test_constant_groups_get_exactly_zero_in_every_group_baseline_algo(std_scale):
    # groups of 3 x 0.1 and 7 x 0.7 (fp32 sum / count misses both by an ulp) next to a group with spread
    rewards = torch.tensor([0.1] * 3 + [0.7] * 7 + [0.0, 1.0])
    d = AdvantageInputs(rewards, torch.tensor([0] * 3 + [1] * 7 + [2] * 2), torch.ones(12, 2, dtype=torch.bool))
    for name in ("grpo", "dr_grpo", "dapo", "gspo", "cispo", "rloo"):
        adv = _advantages(name, d, AdvantageSpec(std_scale=std_scale, eps=1e-6))
        assert (adv[:10] == 0).all(), (name, adv[:10, 0].tolist())
        assert (adv[10:, 0] != 0).all(), name


def _two_ranks(fn):
    """Runs fn(rank, sum_fn) on 2 threads whose sum_fn all-reduces a 0-dim tensor; returns both results."""
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def all_reduce_sum(values: dict[str, float], rank: int) -> dict[str, float]:
        slots[rank] = values
        barrier.wait()
        total = {k: slots[0][k] + slots[1][k] for k in values}
        barrier.wait()
        return total

    def run(rank):
        out[rank] = fn(rank, collective_sum(lambda v: all_reduce_sum(v, rank)))

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.mark.parametrize("name, std_scale", [("reinforce_pp", "group"), ("reinforce_pp_baseline", "group"),
                                             ("ppo", "group"), ("grpo", "batch")])  # fmt: skip
def test_batch_statistics_are_global_over_ranks(name, std_scale):
    """Each rank holds half the groups; with the collective sum its advantages equal the full batch's rows."""
    d, spec = _data(), AdvantageSpec(std_scale=std_scale)
    full = _advantages(name, d, spec)
    halves = _two_ranks(lambda rank, sum_fn: _advantages(name, _rows(d, slice(rank * 4, (rank + 1) * 4)), spec, sum_fn))
    torch.testing.assert_close(torch.cat(halves), full, atol=1e-6, rtol=0)
    local = _advantages(name, _rows(d, slice(0, 4)), spec)
    assert not torch.allclose(local, full[:4])  # the sum really matters


def _objective_inputs():
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    mb = step_batch(
        mask,
        old_logprobs=-torch.rand(2, 3, generator=g),
        rollout_logprobs=-torch.rand(2, 3, generator=g),
        ref_logprobs=-torch.rand(2, 3, generator=g),
        advantages=torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.0, 0.0]]),
    )
    logprobs = (mb.old_logprobs + 0.3 * torch.randn(2, 3, generator=g)).requires_grad_(True)
    return logprobs, mb


def test_objective_options_compose_the_algos_pieces():
    logprobs, mb = _objective_inputs()
    mask = mb.response_mask
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    spec = LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.1, kl_estimator="k2", loss_agg="token-mean",
                    max_response_tokens=3, policy_loss="ppo_clip", dual_clip=3.0, entropy_coef=0.01,
                    correction="token_truncate", correction_max=2.0)
    loss, stats = policy_objective(logprobs, mb, spec, Normaliser(4.0, 2.0, world_size=2), entropy=entropy)
    pg, diag = algos.ppo_clip_loss(logprobs, mb.old_logprobs, mb.advantages, mask, clip_eps_low=0.2,
                                   clip_eps_high=0.28, dual_clip=3.0)  # fmt: skip
    w, _ = algos.rollout_correction_weights(mb.old_logprobs, mb.rollout_logprobs, mask, mode="token_truncate",
                                            ratio_max=2.0)  # fmt: skip
    per_token = w * pg + 0.1 * algos.kl_penalty(logprobs, mb.ref_logprobs, "k2") - 0.01 * entropy
    want = 2 * torch.where(mask, per_token, 0.0).sum() / 4.0  # token-mean over 4 global tokens, x world_size 2
    torch.testing.assert_close(loss, want)
    assert float(stats["entropy_sum"]) == pytest.approx(1 + 2 + 3 + 4)  # masked 99s never count
    assert float(stats["is_weight_sum"]) == pytest.approx(float(w.sum()))
    assert float(stats["tokens"]) == 4.0


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_sequence_and_cispo_losses_are_dispatched(name):
    logprobs, mb = _objective_inputs()
    spec = LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0, kl_estimator="k1", loss_agg="seq-mean-token-mean",
                    max_response_tokens=3, policy_loss=get_algorithm(name).policy_loss)
    loss, _ = policy_objective(logprobs, mb, spec, Normaliser(4.0, 2.0))
    per_token, _ = algos.POLICY_LOSSES[name](logprobs, mb.old_logprobs, mb.advantages, mb.response_mask,
                                             clip_eps_low=0.2, clip_eps_high=0.28)  # fmt: skip
    torch.testing.assert_close(loss, algos.aggregate_loss(per_token, mb.response_mask, "seq-mean-token-mean"))


def test_update_spec_places_the_kl():
    in_loss = update_spec(config_from_dict({"algo": {"name": "grpo", "kl_coef": 0.04}}), 1)
    assert (in_loss.loss.kl_coef, in_loss.advantage.reward_kl_coef, in_loss.old_logprobs_before_update) == (0.04, 0.0, False)
    in_reward = update_spec(config_from_dict({"algo": {"name": "ppo", "kl_coef": 0.01, "kl_in": "reward"}}), 1)
    assert (in_reward.loss.kl_coef, in_reward.advantage.reward_kl_coef) == (0.0, 0.01)
    assert in_reward.old_logprobs_before_update  # the reward's KL needs old logprobs before the update
    assert in_reward.loss.policy_loss == "ppo_clip"
    cfg = config_from_dict({"algo": {"name": "cispo"}, "learner": {"sequences_per_minibatch": 16}})
    spec = update_spec(cfg, 2)
    assert spec.loss.policy_loss == "cispo" and spec.rows_per_minibatch == 8 and spec.old_logprobs_before_update
