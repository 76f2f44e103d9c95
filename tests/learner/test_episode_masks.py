"""Observation tokens of multi-turn episodes never reach a loss, a normaliser, an entropy or a KL, for every online
algorithm: with the loss mask off in the middle of rows (a tool result between two assistant turns), whatever the
observation positions hold changes nothing of the objective, its gradient or its diagnostics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlray.algos import algorithm_names
from rlray.config import config_from_dict
from rlray.data import PromptRow
from rlray.learner import Normaliser, policy_objective
from rlray.learner import online as learner_online
from rlray.plan import resolve_plan
from rlray.rollout import Completion
from rlray.rollout.types import EpisodeInfo
from rlray.run.build import update_spec
from rlray.run.experience import build_experience, minibatch_normalisers
from rlray.schema import StepBatch
from tests.learner.batches import step_batch

B, T = 4, 9
# rows: assistant turn (3 tokens), observation (3), assistant turn (2), padding; other rows shorter or single-turn
MASK = torch.tensor([
    [1, 1, 1, 0, 0, 0, 1, 1, 0],
    [1, 1, 0, 0, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 1, 0, 0, 0, 0],
    [1, 0, 0, 0, 1, 0, 0, 0, 0],
], dtype=torch.bool)
LENGTHS = [8, 9, 5, 5]
OBSERVATION = torch.tensor([[i < n for i in range(T)] for n in LENGTHS]) & ~MASK  # inside the row, loss mask off


def _batch(seed: int) -> StepBatch:
    g = torch.Generator().manual_seed(seed)
    return step_batch(
        MASK.clone(),
        reward=torch.tensor([1.0, 0.0, 0.5, 0.25]),
        group_id=torch.tensor([0, 0, 1, 1]),
        old_logprobs=-torch.rand(B, T, generator=g) - 0.1,
        ref_logprobs=-torch.rand(B, T, generator=g) - 0.1,
        rollout_logprobs=-torch.rand(B, T, generator=g) - 0.1,
        old_values=torch.randn(B, T, generator=g),
        baseline_reward=torch.tensor([0.5, 0.5, 0.0, 0.0]),
    )


def _scramble(d: StepBatch, seed: int) -> StepBatch:
    """Returns ``d`` with every per-token tensor replaced at the observation positions by other values."""
    g = torch.Generator().manual_seed(seed)
    changed = {k: torch.where(OBSERVATION, -5 * torch.rand(B, T, generator=g), getattr(d, k))
               for k in ("old_logprobs", "ref_logprobs", "rollout_logprobs", "old_values")}
    return dataclasses.replace(d, **changed)


def _objective(name: str, d: StepBatch, logprobs: torch.Tensor, entropy: torch.Tensor):
    cfg = config_from_dict({"algo": {"name": name, "kl_coef": 0.1, "entropy_coef": 0.01},
                            "rollout": {"samples_per_prompt": 2}, "learner": {"prompts_per_step": 2,
                                                                              "sequences_per_minibatch": 4,
                                                                              "sequences_per_microbatch": 4}})
    spec = update_spec(cfg, 1)
    data = learner_online.advantages(dataclasses.replace(d), spec, dict)
    logprobs = logprobs.clone().requires_grad_(True)
    norm = Normaliser(float(MASK.sum()), float(B))
    loss, stats = policy_objective(logprobs, data, spec.loss, norm, entropy=entropy)
    loss.backward()
    return loss.detach(), logprobs.grad, {k: v.detach() for k, v in stats.items()}, data.advantages


@pytest.mark.parametrize("name", sorted(algorithm_names("online")))
def test_observation_positions_change_nothing(name):
    d = _batch(0)
    g = torch.Generator().manual_seed(1)
    logprobs = -torch.rand(B, T, generator=g) - 0.1
    entropy = torch.rand(B, T, generator=g)
    loss, grad, stats, adv = _objective(name, d, logprobs, entropy)

    other_lp = torch.where(OBSERVATION, -7 * torch.rand(B, T, generator=g), logprobs)
    other_h = torch.where(OBSERVATION, 9 * torch.rand(B, T, generator=g), entropy)
    loss2, grad2, stats2, adv2 = _objective(name, _scramble(d, 2), other_lp, other_h)

    assert torch.isfinite(loss) and loss != 0
    torch.testing.assert_close(loss2, loss, rtol=0, atol=1e-7)
    torch.testing.assert_close(grad2, grad, rtol=0, atol=1e-7)
    assert grad[OBSERVATION].abs().max() == 0  # no gradient reaches an observation token
    torch.testing.assert_close(adv2[MASK], adv[MASK], rtol=0, atol=1e-7)
    assert stats.keys() == stats2.keys()
    for k in stats:
        torch.testing.assert_close(stats2[k], stats[k], rtol=0, atol=1e-6, msg=k)


def test_the_token_normaliser_counts_only_sampled_tokens():
    """An episode row's observation tokens are not in the mini-batch's token count (token-mean denominators)."""
    rows = [PromptRow("p0", "q", {}), PromptRow("p1", "q", {})]
    mask0 = [True, True, False, False, False, True]  # turn, observation, turn
    completions = [
        Completion(0, 0, [5, 6, 7, 8, 9, 10], [-1.0, -1.0, 0.0, 0.0, 0.0, -1.0], "stop", 0, mask0,
                   episode=EpisodeInfo("guess", "done", 2, [None, 1.0], 1.0)),
        Completion(0, 1, [5, 6], [-1.0, -1.0], "stop", 0, episode=EpisodeInfo("guess", "done", 1, [0.0], 0.0)),
        Completion(1, 0, [7], [-1.0], "stop", 0),
        Completion(1, 1, [8, 9, 10], [-1.0] * 3, "stop", 0),
    ]
    table = build_experience(rows, [[1, 2], [3]], completions, {"reward": [1.0, 0.0, 0.5, 0.5]})
    assert table.column("response_mask").to_pylist()[0] == mask0
    assert table.column("stop_reason").to_pylist() == ["done", "done", None, None]
    assert table.column("num_turns").to_pylist() == [2, 1, None, None]
    cfg = config_from_dict({"rollout": {"samples_per_prompt": 2}, "learner": {"prompts_per_step": 2,
                                                                              "sequences_per_minibatch": 4,
                                                                              "sequences_per_microbatch": 4}})
    (norm,) = minibatch_normalisers(table, resolve_plan(cfg), 1)
    assert norm.num_tokens == 3 + 2 + 1 + 3  # the 3 observation tokens of row 0 are not counted
