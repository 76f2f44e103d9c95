"""Faults inside a step, through the real stage functions and a real tiny learner (world size 1): failed rewards,
constant rewards, every response truncated (with overlong shaping, and left out by algo.mask_truncated), empty
responses, and a fatal reward error."""

from __future__ import annotations

import dataclasses
import logging
import math
from types import SimpleNamespace

import pytest
import torch

from rlray import schema
from rlray.config import config_from_dict
from rlray.data import PromptRow
from rlray.learner import PolicyLearner
from rlray.learner import online as learner_online
from rlray.learner.collective import Collective
from rlray.learner.policy import OptimizerSpec
from rlray.plan import resolve_plan
from rlray.reward import RewardFunctionError
from rlray.reward.server import LocalRewardClient
from rlray.rollout import Completion
from rlray.run import build, experience, online, worker
from rlray.run.experience import StageTimer
from rlray.run.lead import FleetCounts, OnlineLead
from rlray.run.online import OnlineRun
from rlray.run.state import WorkerArgs

G = 4  # samples per prompt
ROWS = [PromptRow("p0", "q0", {"answer": "1"}), PromptRow("p1", "q1", {"answer": "2"})]
PROMPT_IDS = [[11, 12, 13], [21, 22, 23, 24]]


def _cfg(*overrides: str):
    return config_from_dict({}, [
        "learner.prompts_per_step=2", f"rollout.samples_per_prompt={G}", "rollout.max_new_tokens=8",
        "learner.sequences_per_minibatch=8", "learner.sequences_per_microbatch=4", "algo.kl_coef=0.04",
        "model.dtype=float32", *overrides])  # fmt: skip


@pytest.fixture(scope="module")
def learner(tiny_model_path):
    return PolicyLearner(tiny_model_path, dtype="float32", optim=OptimizerSpec(lr=1e-3, max_grad_norm=1.0),
                         temperature=1.0, use_reference=True)  # fmt: skip


def _completions(lengths: list[int], finish: str = "stop") -> list[Completion]:
    return [Completion(i // G, i % G, [100 + t for t in range(n)], [-1.0] * n, finish, 0) for i, n in enumerate(lengths)]


def _rewards(values: list[float]) -> dict[str, list[float]]:
    return {"reward": values, "accuracy": [0.0] * len(values), "format": [0.0] * len(values)}


def _stages_4_to_6(cfg, learner, table):
    """Stages 4-6 exactly as online.run_step runs them on one rank; returns (data, metrics)."""
    spec = build.update_spec(cfg, 1)
    data = schema.collate(table, 0)
    data = learner_online.reference_and_old(learner, data, spec)
    data = learner_online.advantages(data, spec, lambda d: d)
    metrics = learner_online.update(learner, data, experience.minibatch_normalisers(table, resolve_plan(cfg), 1), spec, lambda d: d)
    return data, metrics


def _finite(data: schema.StepBatch, metrics: dict) -> bool:
    tensors = [v for f in dataclasses.fields(data) if isinstance(v := getattr(data, f.name), torch.Tensor)
               and v.is_floating_point() and f.name != "reward"]
    return all(bool(t.isfinite().all()) for t in tensors) and all(math.isfinite(v) for v in metrics.values())


def test_failed_rewards_are_left_out_of_the_statistics_and_the_loss_and_counted(learner):
    cfg = _cfg()
    nan = math.nan
    rewards = _rewards([1.0, nan, 0.0, 0.5, nan, nan, nan, nan])  # group 1 failed entirely
    completions = _completions([3, 2, 4, 1, 2, 2, 3, 3])
    table = experience.build_experience(ROWS, PROMPT_IDS, completions, rewards)
    masks = table.column("response_mask").to_pylist()
    assert [any(m) for m in masks] == [True, False, True, True, False, False, False, False]
    assert [len(m) for m in masks] == [3, 2, 4, 1, 2, 2, 3, 3]  # the masks keep the response lengths
    assert math.isnan(table.column("reward")[1].as_py())  # the table says "no reward", it does not invent one
    stats = experience.rollout_stats(table, rewards, 2, 0)
    assert stats["reward/failed"] == 5.0
    assert stats["reward/mean"] == pytest.approx(0.5) and stats["reward/std"] == pytest.approx(math.sqrt(1 / 6))
    assert stats["algo/groups_without_signal"] == 0.5  # group 1 has no scored sample
    # every token still counts for throughput; only the 8 valid tokens count in the loss normaliser
    assert stats["rollout/generated_tokens"] == 20.0
    assert [n.num_tokens for n in experience.minibatch_normalisers(table, resolve_plan(cfg), 1)] == [8.0]
    data, metrics = _stages_4_to_6(cfg, learner, table)
    # group 0's valid rewards [1, 0, 0.5]: mean 0.5, unbiased std 0.5, so advantages [1, -1, 0]; failed rows 0
    adv = data.advantages[:, 0]
    torch.testing.assert_close(adv, torch.tensor([1.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    assert _finite(data, metrics)


def test_every_group_with_constant_reward_is_logged_and_gives_zero_advantages(learner, caplog):
    cfg = _cfg()
    completions = _completions([3, 2, 4, 1, 2, 5, 3, 3])
    ctx = _rank0_ctx(cfg, completions, _FixedScorer([0.3] * G + [1.0] * G))
    with caplog.at_level(logging.WARNING, logger="rlray.run.experience"):
        table, metrics = _collect(ctx, 6, StageTimer())
    assert metrics["algo/groups_without_signal"] == 1.0 and metrics["reward/failed"] == 0.0
    assert "step 7: no prompt group has rewards that differ: the advantages are zero" in caplog.text
    data, learned = _stages_4_to_6(cfg, learner, table)
    assert torch.count_nonzero(data.advantages) == 0
    assert learned["learner/pg_loss"] == 0.0
    assert _finite(data, learned)


def test_every_response_truncated_keeps_masks_and_gets_the_overlong_penalty(learner):
    cfg = _cfg("algo.overlong_cache_tokens=4", "algo.overlong_penalty_factor=1.0")
    completions = _completions([8] * 8, finish="length")  # all at rollout.max_new_tokens=8, none with EOS
    ctx = _rank0_ctx(cfg, completions, _FixedScorer([0.0, 1.0] * G))
    table, metrics = _collect(ctx, 0, StageTimer())
    assert metrics["rollout/truncated_rate"] == 1.0
    assert table.column("response_mask").to_pylist() == [[True] * 8] * 8  # every generated token counts
    # DAPO soft overlong punishment: length 8 = max_new_tokens, past the 4-token interval: the full -1.0
    components = [dict(c) for c in table.column("reward_components").to_pylist()]
    assert [c["overlong"] for c in components] == [-1.0] * 8
    assert table.column("reward").to_pylist() == [-1.0, 0.0] * G
    assert metrics["reward/overlong_penalty_mean"] == -1.0
    data, learned = _stages_4_to_6(cfg, learner, table)
    assert _finite(data, learned)


def _mixed_truncation() -> list[Completion]:
    """Group 0: rows 0 and 2 hit max_new_tokens=8, rows 1 and 3 stopped; group 1: all four hit it."""
    lengths, finish = [8, 3, 8, 2, 8, 8, 8, 8], ["length", "stop", "length", "stop"] + ["length"] * 4
    return [Completion(i // G, i % G, [100 + t for t in range(n)], [-1.0] * n, f, 0)
            for i, (n, f) in enumerate(zip(lengths, finish, strict=True))]


def test_mask_truncated_leaves_truncated_rows_out_of_the_loss_and_counts_them(learner):
    cfg = _cfg("algo.mask_truncated=true")
    rewards = _rewards([0.0, 1.0, 0.5, 0.0, 0.2, 0.4, 0.6, 0.8])
    table = experience.build_experience(ROWS, PROMPT_IDS, _mixed_truncation(), rewards, mask_truncated=True)
    masks = table.column("response_mask").to_pylist()
    assert [any(m) for m in masks] == [False, True, False, True, False, False, False, False]
    assert [len(m) for m in masks] == [8, 3, 8, 2, 8, 8, 8, 8]  # lengths kept, every position False
    assert table.column("reward").to_pylist() == pytest.approx(rewards["reward"])  # rewards kept
    stats = experience.rollout_stats(table, rewards, 2, 0, mask_truncated=True)
    assert stats["rollout/truncated_masked"] == 6.0 and stats["rollout/truncated_rate"] == 0.75
    assert stats["reward/mean"] == pytest.approx(3.5 / 8) and stats["reward/failed"] == 0.0  # all 8 rewards count
    assert stats["algo/groups_without_signal"] == 0.5  # group 1 has no row left in the update
    assert stats["rollout/generated_tokens"] == 53.0  # 8+3+8+2+32 generated; the loss normaliser sees 3+2
    assert [n.num_tokens for n in experience.minibatch_normalisers(table, resolve_plan(cfg), 1)] == [5.0]
    data, metrics = _stages_4_to_6(cfg, learner, table)
    # group 0's rows in the update, rewards [1.0, 0.0]: mean 0.5, unbiased std sqrt(0.5), advantages +-0.7071
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    adv = data.advantages
    torch.testing.assert_close(adv[1, :3], torch.full((3,), a), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv[3, :2], torch.full((2,), -a), atol=1e-5, rtol=0)
    assert torch.count_nonzero(adv[[0, 2, 4, 5, 6, 7]]) == 0
    assert _finite(data, metrics)


def test_without_mask_truncated_truncated_rows_train_and_no_count_is_logged():
    rewards = _rewards([0.0, 1.0, 0.5, 0.0, 0.2, 0.4, 0.6, 0.8])
    table = experience.build_experience(ROWS, PROMPT_IDS, _mixed_truncation(), rewards)
    assert all(all(m) for m in table.column("response_mask").to_pylist())
    stats = experience.rollout_stats(table, rewards, 2, 0)
    assert "rollout/truncated_masked" not in stats and stats["algo/groups_without_signal"] == 0.0
    assert [n.num_tokens for n in experience.minibatch_normalisers(table, resolve_plan(_cfg()), 1)] == [53.0]


def test_algo_mask_truncated_reaches_the_step_and_its_metric():
    cfg = _cfg("algo.mask_truncated=true")
    ctx = _rank0_ctx(cfg, _mixed_truncation(), _FixedScorer([0.0, 1.0, 0.5, 0.0, 0.2, 0.4, 0.6, 0.8]))
    table, metrics = _collect(ctx, 0, StageTimer())
    assert metrics["rollout/truncated_masked"] == 6.0
    assert sum(any(m) for m in table.column("response_mask").to_pylist()) == 2
    assert _cfg().algo.mask_truncated is False  # off by default, as in TRL


def test_empty_responses_do_not_break_the_schema_or_the_learner(learner):
    """The engines never return 0 tokens (max_new_tokens >= 1, and a stop keeps its EOS), but a 0-token row must
    still flow: it has no valid token, so like a failed row it is left out of the statistics and the loss."""
    cfg = _cfg()
    completions = _completions([0, 2, 0, 3, 0, 0, 0, 0])
    rewards = _rewards([0.5, 1.0, 0.0, 0.0, 0.2, 0.2, 0.2, 0.2])
    table = experience.build_experience(ROWS, PROMPT_IDS, completions, rewards)
    batch = schema.collate(table, 0)
    assert batch.response_mask.shape == (8, 3) and batch.response_mask.sum().item() == 5
    stats = experience.rollout_stats(table, rewards, 2, 0)
    assert stats["rollout/response_tokens_mean"] == pytest.approx(5 / 8)
    data, metrics = _stages_4_to_6(cfg, learner, table)
    adv = data.advantages
    assert torch.count_nonzero(adv[[0, 2, 4, 5, 6, 7]]) == 0  # rows without tokens carry nothing
    # the two rows with tokens form group 0's valid set: rewards [1.0, 0.0] -> advantages +-0.7071 (unbiased std)
    torch.testing.assert_close(adv[1, :2], torch.full((2,), 0.5 / (math.sqrt(0.5) + 1e-6)), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv[3, :3], torch.full((3,), -0.5 / (math.sqrt(0.5) + 1e-6)), atol=1e-5, rtol=0)
    assert _finite(data, metrics)


def test_a_reward_function_with_the_wrong_count_stops_every_rank_at_once():
    cfg = _cfg()
    ctx = _rank0_ctx(cfg, _completions([2] * 8), _Raising(RewardFunctionError("reward function 'f.py:f' returned 7 values for 8 completions")))
    ctx.coll = Collective()
    with pytest.raises(online.FatalStepError, match="RewardFunctionError: reward function 'f.py:f' returned 7 values"):
        online.run_step(ctx, 0)
    other_rank = SimpleNamespace(rank=1, coll=SimpleNamespace(broadcast=lambda _: online.StepHandout([], [], {}, "DataError: x")))
    with pytest.raises(online.FatalStepError, match="DataError: x"):
        online.distribute(other_rank, None, None)


def test_the_training_function_ends_normally_after_a_fatal_step(monkeypatch):
    """Ray Train restarts a worker whose function raises; a fatal step was already recorded, so it returns."""
    calls = []

    def fatal_train(*args, **kwargs):
        calls.append(args[0].max_steps)  # the plan of the shipped config
        raise online.FatalStepError("RewardFunctionError: wrong count")

    monkeypatch.setattr(worker, "train", fatal_train)
    args = WorkerArgs(config=_cfg("run.max_steps=7").model_dump(), model_dir="m", run_id="r")
    assert worker.train_worker({"args": args}) is None and calls == [7]


# --------------------------------------------------------------------------------------------
# A rank-0 context for stages 1-3 without Ray: a fixed rollout and a scripted reward
# --------------------------------------------------------------------------------------------
class _FixedScorer:
    def __init__(self, values):
        self.values = values

    def score(self, prompts, completions, columns, completion_ids=None):
        return _rewards(list(self.values))

    def score_with_failures(self, prompts, completions, columns, completion_ids=None):
        return self.score(prompts, completions, columns, completion_ids), []  # no failure texts

    def close(self):
        pass


class _Raising(_FixedScorer):
    def __init__(self, err):
        self.err = err

    def score(self, prompts, completions, columns, completion_ids=None):
        raise self.err


class _Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]


def _rank0_ctx(cfg, completions, scorer):
    got = SimpleNamespace(rows=ROWS, prompt_ids=PROMPT_IDS, completions=completions)
    lead = OnlineLead(stream=None, prompt_ids={}, skipped_long_prompts=0, eval_prompts=[], reward_columns=[],
                      reward=LocalRewardClient(scorer, 1), reward_kwargs={}, fleet=None, rollouts=None,
                      pipeline=SimpleNamespace(next=lambda step: got), logged=FleetCounts())
    return OnlineRun(resolve_plan(cfg), Collective(), None, _Tokenizer(), lead=lead)


def _collect(ctx, step, timer):
    """Stages 1-3 of 0-based ``step`` as ``online.run_step`` runs them on rank 0; returns (table, metrics)."""
    got = experience.collect_experience(ctx.lead, ctx.plan, ctx.tokenizer, step, timer, policy_version=ctx.policy_version)
    return got.table, got.metrics
