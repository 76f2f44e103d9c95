"""Rollout correction in the objective, and the rollout/learner mismatch metrics of the update (hand-computed)."""

import dataclasses
import math

import pytest
import torch

from rlray.algos import get_algorithm
from rlray.config import config_from_dict
from rlray.learner import LossSpec, Normaliser, policy_objective
from rlray.learner import online as learner_online
from rlray.learner.batching import MicroBatching
from rlray.learner.objective import MAX_STAT_KEYS, STAT_KEYS, reduce_stat
from rlray.learner.packing import TokenCounts
from rlray.run.build import update_spec
from tests.learner.batches import step_batch

LN = math.log
PLAIN = LossSpec(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0, kl_estimator="k3", loss_agg="token-mean",
                 max_response_tokens=3, policy_loss="ppo_clip")
SPEC = dataclasses.replace(PLAIN, correction="token_truncate", correction_min=0.6, correction_max=2.0)


def _mb():
    # old - rollout = d: row 0 [ln 3, 0, ln 0.5], row 1 [ln 1.2, masked garbage]
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, 7.0, 7.0]])
    d = torch.tensor([[LN(3.0), 0.0, LN(0.5)], [LN(1.2), -50.0, 50.0]])
    return step_batch(
        torch.tensor([[True, True, True], [True, False, False]]),
        old_logprobs=old,
        rollout_logprobs=old - d,
        advantages=torch.tensor([[1.0] * 3, [-1.0] * 3]),
    )


def _update_spec(loss: LossSpec, **options) -> learner_online.UpdateSpec:
    return learner_online.UpdateSpec(estimator=get_algorithm("grpo").advantage, loss=loss, advantage=None, epochs=1,
                                     rows_per_minibatch=2, batching=MicroBatching(2), old_logprobs_before_update=False, **options)


def test_mismatch_statistics_hand_computed():
    mb = _mb()
    lp = mb.old_logprobs.clone().requires_grad_(True)
    loss, stats = policy_objective(lp, mb, SPEC, Normaliser(4.0, 2.0))
    # token ratios [3, 1, 0.5], [1.2] in [0.6, 2]: weights [2, 1, 0.6], [1.2] (sum 4.8); 2 tokens of 1 row corrected
    assert float(stats["is_weight_sum"]) == pytest.approx(4.8, abs=1e-6)
    assert (float(stats["corrected_tokens"]), float(stats["corrected_sequences"]), float(stats["sequences"])) == (2, 1, 2)
    # k3 of KL(pi_rollout || pi_old) per token: e^d - 1 - d = [0.901388, 0, 0.193147], [0.017678]
    assert float(stats["rollout_kl_sum"]) == pytest.approx(0.901388 + 0.193147 + 0.017678, abs=1e-5)
    assert float(stats["rollout_ratio_max"]) == pytest.approx(3.0, abs=1e-6)  # the masked e^50 never counts
    assert float(stats["rollout_diff_sum"]) == pytest.approx(LN(3.0) + LN(2.0) + LN(1.2), abs=1e-6)
    # on-policy (ratio 1): loss = -(2 + 1 + 0.6 - 1.2) / 4 = -0.6
    assert float(loss.detach()) == pytest.approx(-0.6, abs=1e-6)


def test_a_float32_gap_below_float32_resolution_gives_its_k3_not_noise():
    # d = 2^-17 on every token (float32 logprobs ~ -1 hold it exactly): k3 = e^d - d - 1 = d^2/2 + d^3/6 = 3.7253e-11
    # per token, 4 tokens. In float32 e^d - d - 1 rounds to 0 or below (float32's step at 1 is 1.2e-7).
    d = 2.0**-17
    old = torch.full((2, 3), -1.0)
    mb = step_batch(torch.tensor([[True, True, True], [True, False, False]]), old_logprobs=old,
                    rollout_logprobs=old - d, advantages=torch.ones(2, 3))
    _, stats = policy_objective(old.clone().requires_grad_(True), mb, PLAIN, Normaliser(4.0, 2.0))
    assert float(stats["rollout_kl_sum"]) == pytest.approx(4 * (d * d / 2 + d**3 / 6), rel=1e-5)


def test_update_metrics_take_the_max_ratio_over_ranks_and_sum_the_rest():
    mb = _mb()
    _, stats = policy_objective(mb.old_logprobs.clone(), mb, SPEC, Normaliser(4.0, 2.0))
    totals = {k: float(v) for k, v in stats.items()} | {"loss": 0.0, "grad_norm": 1.0, "lr": 1e-6}
    spec = _update_spec(SPEC, loss_world_size=2)

    def two_equal_ranks(values):
        return {k: 2 * v for k, v in values.items()}

    def other_rank_has_ratio_5(values):
        assert set(values) == set(MAX_STAT_KEYS)
        return {k: max(v, 5.0) for k, v in values.items()}

    out = learner_online._update_metrics(totals, 1, spec, False, two_equal_ranks, other_rank_has_ratio_5,
                                         TokenCounts(real=10, padding=2, shared=5))
    # the learner's computed tokens are summed over ranks like the other sums
    assert (out["perf/learner_tokens_real"], out["perf/learner_tokens_padding"], out["perf/learner_tokens_shared"]) == (20, 4, 10)
    assert out["algo/rollout_kl"] == pytest.approx((0.901388 + 0.193147 + 0.017678) / 4, abs=1e-5)
    assert out["algo/rollout_ratio_max"] == 5.0
    assert out["algo/rollout_corrected_token_fraction"] == pytest.approx(2 / 4)
    assert out["algo/rollout_corrected_sequence_fraction"] == pytest.approx(1 / 2)
    assert out["algo/rollout_is_weight_mean"] == pytest.approx(4.8 / 4)
    off = learner_online._update_metrics(totals, 1, _update_spec(PLAIN), False, dict, dict, TokenCounts())
    assert "algo/rollout_kl" in off and "algo/rollout_is_weight_mean" not in off  # mismatch is logged even when off


def test_max_statistics_are_maxed_across_microbatches():
    assert "rollout_ratio_max" in STAT_KEYS and reduce_stat("rollout_ratio_max", 3.0, 2.0) == 3.0
    assert reduce_stat("tokens", 3.0, 2.0) == 5.0 and reduce_stat("rollout_ratio_max", None, 2.0) == 2.0


def test_correction_needs_rollout_logprobs():
    mb = dataclasses.replace(_mb(), rollout_logprobs=None)
    with pytest.raises(ValueError, match="rollout correction 'token_truncate' needs rollout_logprobs"):
        policy_objective(mb.old_logprobs.clone(), mb, SPEC, Normaliser(4.0, 2.0))


def test_config_reaches_the_loss_spec():
    cfg = config_from_dict({"algo": {"rollout_correction": {"mode": "sequence_mask", "ratio_min": 0.5, "ratio_max": 3.0}}})
    loss = update_spec(cfg, 1).loss
    assert (loss.correction, loss.correction_min, loss.correction_max) == ("sequence_mask", 0.5, 3.0)
    default = update_spec(config_from_dict({}), 1).loss
    assert (default.correction, default.correction_min, default.correction_max) == ("token_truncate", None, 2.0)
