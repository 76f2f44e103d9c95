"""Agent episodes cut into segments become rows of their own (rlray.run.segments): the experience table, its layout
over learner ranks with padding rows, the mini-batches, the statistics and the advantages."""

from __future__ import annotations

import math

import torch

from rlray import schema
from rlray.algos import estimators
from rlray.config import config_from_dict
from rlray.data import PromptRow
from rlray.plan import resolve_plan
from rlray.rollout import Completion
from rlray.rollout.types import AgentInfo, EpisodeInfo
from rlray.run.experience import build_experience, minibatch_normalisers, rollout_stats
from rlray.run.segments import PADDING, experience_rows, layout_for_ranks, sample_rows

ROWS = [PromptRow("p0", "q0", {}), PromptRow("p1", "q1", {})]


def _episode(p, s, tokens, segments=()):
    earlier = [Completion(p, s, list(t), [-0.5] * len(t), "stop", 1, prompt_token_ids=[90 + j],
                          episode=EpisodeInfo("solver", "template_drift", 1, [None]))
               for j, t in enumerate(segments)]
    info = EpisodeInfo("solver", "done", 1 + len(earlier), [None, 1.0], 1.0,
                       agent=AgentInfo(earlier, gateway_calls=1 + len(earlier), template_drift=len(earlier)))
    return Completion(p, s, list(tokens), [-0.25] * len(tokens), "stop", 2, prompt_token_ids=[80], episode=info)


def _step():
    """2 prompts x 2 samples; sample (0, 1) was cut twice (3 segments), sample (1, 0) once."""
    return [_episode(0, 0, [1, 2]), _episode(0, 1, [3, 4, 5], [[6], [7, 8]]),
            _episode(1, 0, [9], [[10, 11]]), _episode(1, 1, [12, 13])]


def test_a_cut_episode_gives_a_row_per_segment_with_the_episode_reward():
    completions = _step()
    assert [(i, j) for i, _, j in experience_rows(completions)] == [(0, None), (1, 2), (2, 1), (3, None),
                                                                    (1, 0), (1, 1), (2, 0)]
    table = build_experience(ROWS, [[1], [2]], completions, {"reward": [1.0, 0.5, math.nan, 0.0], "t": [1.0, 0.5, None, 0.0]})
    got = table.to_pylist()
    assert [r["response_token_ids"] for r in got] == [[1, 2], [3, 4, 5], [9], [12, 13], [6], [7, 8], [10, 11]]
    assert [r["prompt_token_ids"] for r in got] == [[80], [80], [80], [80], [90], [91], [90]]
    assert [r["segment"] for r in got] == [None, 2, 1, None, 0, 1, 0]
    assert [(r["group_id"], r["sample_index"]) for r in got] == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 1), (0, 1), (1, 0)]
    assert [r["reward"] for r in got][4:6] == [0.5, 0.5] and math.isnan(got[6]["reward"])
    assert got[6]["response_mask"] == [False, False]  # the failed reward masks every segment of its episode
    assert [r["stop_reason"] for r in got] == ["done"] * 4 + ["template_drift"] * 3
    assert [r["policy_version"] for r in got] == [2, 2, 2, 2, 1, 1, 1]
    # reward statistics are over the 4 samples, token statistics over every row
    stats = rollout_stats(table, {"reward": [1.0, 0.5, math.nan, 0.0]}, 2, 2)
    assert stats["reward/failed"] == 1.0 and stats["reward/mean"] == 0.5
    assert stats["rollout/generated_tokens"] == 2 + 3 + 1 + 2 + 1 + 2 + 2


def test_a_step_without_segments_keeps_its_table_and_minibatches():
    completions = [_episode(0, 0, [1]), _episode(0, 1, [2]), _episode(1, 0, [3]), _episode(1, 1, [4])]
    table = build_experience(ROWS, [[1], [2]], completions, {"reward": [1.0, 0.0, 1.0, 0.0]})
    assert table.column("segment").null_count == 4
    assert layout_for_ranks(table, 4, 2, 2) is table


def test_the_layout_keeps_groups_on_their_rank_and_evens_the_shards_with_padding():
    completions = _step()
    table = build_experience(ROWS, [[1], [2]], completions, {"reward": [1.0, 0.5, 0.25, 0.0]})
    laid = layout_for_ranks(table, 4, 2, 1)
    # rank 0: group 0's samples + its 2 segments; rank 1: group 1's samples + its 1 segment + 1 padding row
    assert laid.num_rows == 8
    rows = laid.to_pylist()
    assert [r["group_id"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [r["segment"] for r in rows] == [None, 2, 0, 1, 1, None, 0, PADDING]
    pad = rows[7]
    assert pad["response_mask"] == [False] and len(pad["response_token_ids"]) == 1 and len(pad["prompt_token_ids"]) == 1
    assert pad["token_versions"] == [1] and pad["rollout_logprobs"] == [-0.5]  # every per-token column cut to one
    assert sample_rows(laid) == [0, 1, 2, 3, 4, 5, 6]
    for r in range(2):  # each rank's shard holds whole groups
        shard = laid.slice(schema.shard_rows(8, r, 2).start, 4)
        assert set(shard.column("group_id").to_pylist()) == {r}
    # one learner, 2 mini-batches: 7 rows padded to 8, mini-batches of 4 rows (larger, not more of them)
    one = layout_for_ranks(table, 4, 1, 2)
    assert one.num_rows == 8 and one.column("segment").to_pylist()[-1] == PADDING
    cfg = config_from_dict({"rollout": {"samples_per_prompt": 2}, "learner": {
        "prompts_per_step": 2, "sequences_per_minibatch": 2, "sequences_per_microbatch": 2}})
    norms = minibatch_normalisers(one, resolve_plan(cfg), 1)
    assert len(norms) == cfg.minibatches_per_epoch == 2
    assert [n.num_tokens for n in norms] == [2 + 3 + 1 + 2, 1 + 2 + 2 + 0]  # the padding row counts no token


def test_padding_rows_take_no_part_in_the_advantages():
    table = layout_for_ranks(build_experience(ROWS, [[1], [2]], _step(), {"reward": [1.0, 0.5, 0.25, 0.0]}), 4, 1, 2)
    batch = schema.collate(table, pad_token_id=0)
    inputs = estimators.AdvantageInputs(batch.reward, batch.group_id, batch.response_mask)
    adv = estimators.grpo(inputs, estimators.AdvantageSpec(), lambda x: x).advantages
    assert torch.all(adv[-1] == 0.0)
    # rows: g0 s0, g0 s1 (last segment), g1 s0, g1 s1, then g0 s1's segments 0 and 1, g1 s0's segment 0, padding.
    # Group 0 holds rewards 1.0, 0.5, 0.5, 0.5 (its cut sample counts once per segment): mean 0.625, unbiased std
    # sqrt((0.375^2 + 3 * 0.125^2) / 3) = 0.25, so (1.0 - 0.625) / 0.25 = 1.5 and (0.5 - 0.625) / 0.25 = -0.5.
    seq = adv[:, 0]
    torch.testing.assert_close(seq[[0, 1, 4, 5]], torch.tensor([1.5, -0.5, -0.5, -0.5]), rtol=0, atol=1e-5)
    assert seq[6] == seq[2]  # group 1's cut sample: its segment and its last row share the advantage


class _Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]


class _NoReward:
    """Reward functions that skip every sample: the agents' own rewards are the samples' rewards."""

    def score(self, prompts, completions, columns, completion_ids=None):
        return {"reward": [0.0] * len(completions), "none": [None] * len(completions)}

    def score_with_failures(self, prompts, completions, columns, completion_ids=None):
        return self.score(prompts, completions, columns, completion_ids), [""] * len(completions)

    def close(self):
        pass


def _agent_group(p, rewards, cut_first=False):
    """Two agent episodes of prompt ``p`` with rewards ``rewards``; the first cut into 2 segments when ``cut_first``."""
    out = []
    for s, r in enumerate(rewards):
        c = _episode(p, s, [10 * p + s, 1], [[50 + s]] if (cut_first and s == 0) else ())
        c.episode.env_reward, c.episode.turn_rewards = r, [None, r]
        out.append(c)
    return out


def test_a_dapo_step_with_a_refill_lays_out_its_segment_rows_for_two_ranks():
    """DAPO drops a flat group and refills from the agent rollout; the kept groups' segments become rows on their
    group's rank, each rank's shard padded to the same whole mini-batches."""
    from types import SimpleNamespace

    from rlray.data import PromptStream
    from rlray.reward.server import LocalRewardClient
    from rlray.rollout.pipeline import RolloutBatch
    from rlray.run import experience
    from rlray.run.experience import StageTimer
    from rlray.run.lead import FleetCounts, OnlineLead

    rows = [PromptRow(f"q{i}", f"question {i}", {"environment": "solver"}) for i in range(4)]
    cfg = config_from_dict({"env": {"agents": {"solver": "m:agent"}, "default": "solver"}}, [
        "algo.name=dapo", "learner.prompts_per_step=2", "rollout.samples_per_prompt=2",
        "learner.sequences_per_minibatch=2", "learner.sequences_per_microbatch=2"])
    step = [*_agent_group(0, [0.0, 0.0]), *_agent_group(1, [1.0, 0.0], cut_first=True)]  # group 0 is flat: dropped
    refill = _agent_group(0, [0.0, 1.0], cut_first=True)
    stream = PromptStream(rows[2:], seed=0, shuffle=False)
    rollouts = SimpleNamespace(generate=lambda ids, sampling, rs: list(refill))
    lead = OnlineLead(stream=stream, prompt_ids={r.prompt_id: [3] for r in rows}, skipped_long_prompts=0, eval_prompts=[],
                      reward_columns=None, reward=LocalRewardClient(_NoReward(), 1), reward_kwargs={}, fleet=rollouts,
                      rollouts=rollouts, logged=FleetCounts(),
                      pipeline=SimpleNamespace(next=lambda s: RolloutBatch(s, rows[:2], [[3], [3]], step, 0)))
    got = experience.collect_experience(lead, resolve_plan(cfg), _Tokenizer(), 0, StageTimer(), policy_version=0, world=2)
    assert got.metrics["algo/dynamic_sampling_rounds"] == 2.0
    assert got.metrics["env/template_drift"] == 2.0 and got.metrics["env/episodes"] == 4.0
    table = got.table
    # kept: group 1 (rank 0) and the refill (rank 1), each 2 samples + 1 segment row, padded to 2 mini-batches of 2
    assert table.num_rows == 8
    assert table.column("prompt_id").to_pylist() == ["q1"] * 4 + ["q2"] * 4
    assert table.column("segment").to_pylist() == [1, None, 0, PADDING, 1, None, 0, PADDING]
    assert table.column("reward").to_pylist()[:3] == [1.0, 0.0, 1.0]  # the segment has its episode's reward
    assert [n.num_sequences for n in minibatch_normalisers(table, resolve_plan(cfg), 2)] == [4.0, 4.0]
