"""An algorithm registered from this file alone (no change in rlray/) validates in a config and runs a real step.

"sign_grpo": the advantage is the sign of the group-centred reward (+1 above the group mean, -1 below), with PPO's
clipped loss. Stages 1-3 run on a rank-0 context without Ray (a fixed rollout, a scripted reward: the pattern of
tests/faults/test_step_faults.py), stages 4-6 on a real tiny learner, exactly as ``rlray.run.online.run_step`` runs
them on one rank.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlray import algos, schema
from rlray.algos import ALGORITHMS, AdvantageInputs, Advantages, AdvantageSpec, Algorithm, estimators, register
from rlray.config import ConfigError, config_from_dict
from rlray.learner import PolicyLearner
from rlray.learner import online as learner_online
from rlray.learner.policy import OptimizerSpec
from rlray.run import build, experience, online_sampling
from rlray.run.experience import StageTimer
from tests.faults.test_step_faults import _completions, _FixedScorer, _rank0_ctx


def sign_grpo(inputs: AdvantageInputs, spec: AdvantageSpec, sum_fn: algos.SumFn) -> Advantages:
    """Returns sign(r - mean of the group's valid rewards) on every valid token (an ``algos.Estimator``)."""
    rewards, valid, mask = estimators.sequence_inputs(inputs, spec)
    centred = algos.dr_grpo_advantages(rewards, inputs.group_id, valid_mask=valid)
    return estimators.broadcast(torch.sign(centred), mask)


@pytest.fixture
def sign_grpo_algorithm():
    """Registers "sign_grpo" for one test and removes it after, so no other test sees it."""
    algorithm = register(Algorithm("sign_grpo", "online", advantage=sign_grpo, policy_loss="ppo_clip", needs_groups=True))
    yield algorithm
    del ALGORITHMS[algorithm.name]


def _cfg(*overrides: str):
    return config_from_dict({}, [
        "algo.name=sign_grpo", "learner.prompts_per_step=2", "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8",
        "learner.sequences_per_minibatch=8", "learner.sequences_per_microbatch=4", "algo.kl_coef=0.04",
        "model.dtype=float32", "learner.lr=1e-3", *overrides])  # fmt: skip


def test_an_unregistered_name_is_refused():
    assert "sign_grpo" not in ALGORITHMS
    with pytest.raises(ConfigError, match=r"algo.name='sign_grpo': Input should be 'grpo', .* or 'sft'"):
        _cfg()


def test_a_registered_algorithm_validates_and_reads_its_entry(sign_grpo_algorithm):
    cfg = _cfg()
    assert cfg.algo.family == "online" and cfg.algo.algorithm is sign_grpo_algorithm
    spec = build.update_spec(cfg, 1)
    assert spec.estimator is sign_grpo and spec.loss.policy_loss == "ppo_clip"
    extras = online_sampling.spec_from(cfg)
    assert not extras.dynamic_sampling and not extras.greedy_baseline
    with pytest.raises(ConfigError, match="the group estimator 'sign_grpo' needs at least 2 samples per prompt"):
        _cfg("rollout.samples_per_prompt=1", "learner.sequences_per_minibatch=2", "learner.sequences_per_microbatch=2")


def test_a_registered_algorithm_runs_a_step(sign_grpo_algorithm, tiny_model_path):
    cfg = _cfg()
    lengths = [3, 2, 4, 1, 2, 5, 3, 3]
    rewards = [1.0, 0.0, 0.5, 0.25] + [0.0, 0.0, 1.0, 0.0]
    ctx = _rank0_ctx(cfg, _completions(lengths), _FixedScorer(rewards))
    table = experience.collect_experience(ctx.lead, cfg, ctx.tokenizer, 0, StageTimer(), policy_version=0).table
    learner = PolicyLearner(tiny_model_path, dtype="float32", optim=OptimizerSpec(lr=1e-3, max_grad_norm=1.0),
                            temperature=1.0, use_reference=True)  # fmt: skip
    before = {n: p.detach().clone() for n, p in learner.module.named_parameters()}

    spec = build.update_spec(cfg, 1)  # stages 4-6 as online.run_step runs them on one rank
    batch = learner_online.reference_and_old(learner, schema.collate(table, 0), spec)
    batch = learner_online.advantages(batch, spec, lambda d: d)
    metrics = learner_online.update(learner, batch, experience.minibatch_normalisers(table, cfg, 1), spec, lambda d: d)

    # group means 1.75 / 4 = 0.4375 and 1 / 4 = 0.25: signs [+, -, +, -] and [-, -, +, -] on every response token
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, -1.0, 1.0, -1.0])
    expected = torch.where(batch.response_mask, signs[:, None], 0.0)
    assert torch.equal(batch.advantages, expected)
    assert batch.returns is None and batch.ref_logprobs is not None  # the KL to the reference is on
    # on-policy (ratio 1) the PPO-clip loss of a token is -A: token mean -(3 - 2 + 4 - 1 - 2 - 5 + 3 - 3) / 23
    assert metrics["learner/pg_loss"] == pytest.approx(3 / 23, abs=1e-6)
    assert all(math.isfinite(v) for v in metrics.values())
    changed = [n for n, p in learner.module.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed and metrics["learner/grad_norm"] > 0  # the step moved the policy
