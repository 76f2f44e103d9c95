"""The samples a step keeps (stage 5b and 8): rows picked across the whole step, the sequence advantage of each
gathered from the learner rank whose shard holds it, prompts and completions decoded, reward terms as the
experience table has them (NaN failed, None skipped)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from rlray import schema
from rlray.data import PromptRow
from rlray.learner.collective import Collective
from rlray.rollout import Completion
from rlray.run import experience, online
from rlray.run.context import StepResult

ROWS = [PromptRow("a", "What is 2+2?", {}), PromptRow("b", "Capital of Peru?", {})]


class FakeTokenizer:
    """Decodes ids as 't<id>' joined by spaces; special tokens are kept (the viewer shows the template and EOS)."""

    def batch_decode(self, ids, skip_special_tokens):
        assert not skip_special_tokens
        return [" ".join(f"t{i}" for i in seq) for seq in ids]

    def decode(self, ids, skip_special_tokens):
        return self.batch_decode([ids], skip_special_tokens)[0]


def _table():
    completions = [Completion(0, 0, [5, 6], [-0.1, -0.2], "stop", 3), Completion(0, 1, [7], [-0.3], "length", 3),
                   Completion(1, 0, [8, 9, 10], [-0.1] * 3, "stop", 3), Completion(1, 1, [11], [-0.2], "stop", 3)]
    rewards = {"reward": [1.0, 0.0, math.nan, 0.5], "math": [1.0, 0.0, math.nan, None]}
    return experience.build_experience(ROWS, [[1, 2], [3]], completions, rewards)


def _shard_data(table, rank, world):
    s = schema.shard_rows(table.num_rows, rank, world)
    data = schema.collate(table.slice(s.start, s.stop - s.start), pad_token_id=0)
    # per-token advantages: row r holds 10*r + t at token t, so the first token's value names the row
    rows = torch.arange(s.start, s.stop, dtype=torch.float32)[:, None]
    data.advantages = 10 * rows + torch.arange(data.response_mask.shape[1], dtype=torch.float32)
    return data


class _TwoRanks:
    """The all-gather of a 2-rank group, played in two passes: the first records each rank's shard of sequence
    advantages, the second hands every rank the concatenation (what ``torch.distributed.all_gather`` returns)."""

    def __init__(self) -> None:
        self.shards: dict[int, torch.Tensor] = {}

    def rank_view(self, rank: int) -> SimpleNamespace:
        def all_gather(local: torch.Tensor) -> torch.Tensor:
            self.shards[rank] = local
            return torch.cat([self.shards.get(r, torch.zeros_like(local)) for r in range(2)])

        return SimpleNamespace(rank=rank, coll=SimpleNamespace(all_gather=all_gather))


def test_each_rank_gives_its_rows_and_the_gather_names_every_kept_row():
    table, rows = _table(), [0, 2, 3]
    group = _TwoRanks()
    for rank in range(2):  # pass 1: each rank's shard
        online.sample_advantages(group.rank_view(rank), _shard_data(table, rank, 2), rows)
    assert group.shards[0].tolist() == [0.0, 10.0]  # rank 0 holds rows 0-1: their first tokens' advantages
    assert math.isnan(group.shards[1][0]) and group.shards[1][1] == 30.0  # row 2 failed its reward: no loss token
    for rank in range(2):  # pass 2: every rank gets the same kept advantages
        got = online.sample_advantages(group.rank_view(rank), _shard_data(table, rank, 2), rows)
        assert got[0] == 0.0 and math.isnan(got[1]) and got[2] == 30.0
    one = online.sample_advantages(SimpleNamespace(rank=0, coll=Collective()), _shard_data(table, 0, 1), [1, 3])
    assert one == [10.0, 30.0]
    assert online.sample_advantages(SimpleNamespace(rank=0, coll=Collective()), _shard_data(table, 0, 1), []) == []


def test_step_samples_decode_and_carry_every_field():
    table = _table()
    got = experience.step_samples(FakeTokenizer(), table, [1, 2, 3], [10.0, math.nan, 30.0], step=7)
    assert [(s.step, s.prompt_id, s.prompt, s.completion) for s in got] == [
        (7, "a", "t1 t2", "t7"), (7, "b", "t3", "t8 t9 t10"), (7, "b", "t3", "t11")]
    assert [s.terms for s in got][0] == {"math": 0.0} and got[2].terms == {"math": None}
    assert math.isnan(got[1].reward) and math.isnan(got[1].terms["math"]) and math.isnan(got[1].advantage)
    assert [(s.reward, s.advantage) for s in (got[0], got[2])] == [(0.0, 10.0), (0.5, 30.0)]
    assert [(s.finish_reason, s.policy_version, s.response_tokens) for s in got] == [("length", 3, 1), ("stop", 3, 3),
                                                                                    ("stop", 3, 1)]
    assert experience.step_samples(FakeTokenizer(), table, [], [], step=7) == []


def test_step_samples_cut_an_episode_into_turns_and_observations():
    """An episode's sampled tokens (mask on) and observation tokens (mask off) become segments in order; its stop
    reason, turns and turn rewards are kept; a single-turn row and an episode whose mask is all off (failed reward)
    have no segments."""
    from rlray.rollout.types import EpisodeInfo

    ep = EpisodeInfo("guess", "done", 2, [None, 1.0])
    completions = [
        Completion(0, 0, [5, 6, 20, 21, 22, 7], [-0.1] * 6, "stop", 3, [True, True, False, False, False, True], episode=ep),
        Completion(0, 1, [8, 23, 9], [-0.1] * 3, "stop", 3, [True, False, True], episode=EpisodeInfo("guess", "max_turns", 2, [0.0, 0.0])),
        Completion(1, 0, [11], [-0.2], "stop", 3),
    ]
    table = experience.build_experience(ROWS, [[1, 2], [3]], completions, {"reward": [1.0, math.nan, 0.5]})
    got = experience.step_samples(FakeTokenizer(), table, [0, 1, 2], [0.5, math.nan, 0.0], step=3)
    assert got[0].segments == ((True, "t5 t6"), (False, "t20 t21 t22"), (True, "t7"))
    assert (got[0].stop_reason, got[0].num_turns) == ("done", 2)
    assert math.isnan(got[0].turn_rewards[0]) and got[0].turn_rewards[1] == 1.0  # None is NaN in the table
    assert got[1].segments == () and got[1].stop_reason == "max_turns"  # reward failed: mask all off, no cut
    assert (got[2].segments, got[2].stop_reason, got[2].num_turns, got[2].turn_rewards) == ((), None, None, None)
    from rlray.observe.samples import json_row

    row = json_row(got[0])
    assert row["segments"] == [{"role": "assistant", "text": "t5 t6"}, {"role": "observation", "text": "t20 t21 t22"},
                               {"role": "assistant", "text": "t7"}]
    assert (row["stop_reason"], row["num_turns"], row["turn_rewards"]) == ("done", 2, [None, 1.0])


def test_step_samples_cut_a_partial_rollout_where_its_version_changes():
    """A response sampled by versions 0, 0, 1, 2 (a generation across 2 weight updates) is kept in 3 parts, each with
    its version and token count, decoded on its own; a row of one version has no parts; the page record carries them."""
    from rlray.observe.samples import json_row, table_columns

    completions = [Completion(0, 0, [5, 6, 7, 8], [-0.1] * 4, "length", 0, versions=[0, 0, 1, 2]),
                   Completion(0, 1, [9, 10], [-0.1] * 2, "stop", 1)]
    table = experience.build_experience(ROWS, [[1, 2]], completions, {"reward": [1.0, 0.0]})
    got = experience.step_samples(FakeTokenizer(), table, [0, 1], [0.5, -0.5], step=4)
    assert got[0].version_parts == ((0, 2, "t5 t6"), (1, 1, "t7"), (2, 1, "t8"))
    assert (got[0].policy_version, got[0].completion) == (0, "t5 t6 t7 t8")  # the oldest token's version, whole text
    assert got[1].version_parts == ()
    assert json_row(got[0])["version_parts"] == [{"version": 0, "tokens": 2, "text": "t5 t6"},
                                                 {"version": 1, "tokens": 1, "text": "t7"},
                                                 {"version": 2, "tokens": 1, "text": "t8"}]
    assert table_columns(got)["version_parts"][1] == []


class _Remote:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def remote(self, *args):
        self.calls.append((self.name, args))


class _Recorder:
    """Stands in for the Tracker and the MonitorActor handle: records each call."""

    def __init__(self):
        self.calls = []
        self.record_step, self.record_samples = _Remote(self.calls, "record_step"), _Remote(self.calls, "record_samples")

    def log_metrics(self, metrics, step):
        self.calls.append(("log_metrics", (step,)))

    def log_samples(self, samples, step):
        self.calls.append(("log_samples", (step, len(samples))))

    def log_ledger(self, prompt_ids, step):
        self.calls.append(("log_ledger", (step, tuple(prompt_ids))))

    def take_outages(self):
        return 0


def test_stage_8_logs_the_samples_once_and_sends_them_to_the_page():
    from rlray.observe.samples import StepSample
    from rlray.run import session

    tracker, monitor = _Recorder(), _Recorder()
    ctx = SimpleNamespace(tracker=tracker, data_epoch=lambda: 1, policy_version=5)
    services = SimpleNamespace(monitor=monitor)
    kept = [StepSample(5, "a", "q", "c", 1.0, {}, 0.5, "stop", 4, 1)]
    run = SimpleNamespace(step=5, logged_through=4)
    session.record(ctx, run, StepResult({"reward/mean": 1.0}, kept, ["p3", "p1"]), services)
    assert tracker.calls == [("log_ledger", (5, ("p3", "p1"))), ("log_metrics", (5,)), ("log_samples", (5, 1))]
    assert run.logged_through == 5
    assert [(name, args[0]) for name, args in monitor.calls] == [("record_step", 5), ("record_samples", 5)]
    assert monitor.calls[1][1][1] == kept
    tracker.calls.clear(), monitor.calls.clear()
    # a step MLflow already has (a restart): its ledger is replaced (the step ran again), its metrics are not logged again
    session.record(ctx, run, StepResult({"reward/mean": 1.0}, kept, ["p3", "p4"]), services)
    assert tracker.calls == [("log_ledger", (5, ("p3", "p4")))]
    assert [name for name, _ in monitor.calls] == ["record_step", "record_samples"]
    monitor.calls.clear()
    session.record(ctx, SimpleNamespace(step=6, logged_through=5), StepResult({}), services)  # offline: no samples
    assert [name for name, _ in monitor.calls] == ["record_step"]
