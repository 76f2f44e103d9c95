"""The prompt ledger: each online step's prompt ids (refills included) go to MLflow at the step boundary, a step run
again replaces its own file, and ``rlray.run.ledger`` checks a ledger against the real seeded PromptStream. Exact
resume: DAPO refills in sync and async mode, restored from a snapshot's cursor, take what an uninterrupted run takes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from rlray.config import config_from_dict
from rlray.data import PromptRow, PromptStream
from rlray.hangs import HangError
from rlray.learner.collective import Collective
from rlray.observe.tracking import Tracker, read_ledger
from rlray.plan import resolve_plan
from rlray.reward.server import LocalRewardClient
from rlray.rollout import Completion
from rlray.rollout.pipeline import RolloutPipeline
from rlray.run import build, experience, ledger
from rlray.run.experience import StageTimer
from rlray.run.lead import FleetCounts, OnlineLead
from rlray.run.online import OnlineRun

ROWS = [PromptRow(f"q{i}", f"question {i}", {}) for i in range(6)]
SEED = 7


def _order(epoch: int) -> list[str]:
    """The stream's documented order of ``epoch``: np.random.default_rng([seed, epoch]).permutation(6)."""
    return [f"q{i}" for i in np.random.default_rng([SEED, epoch]).permutation(6)]


S = _order(0) + _order(1)  # the first 12 prompt ids an uninterrupted run takes


def _check(steps: dict[int, list[str]], **kwargs) -> ledger.LedgerReport:
    return ledger.check_ledger(steps, ROWS, seed=SEED, shuffle=True, **kwargs)


def test_the_documented_order_is_the_streams():
    stream = PromptStream(ROWS, seed=SEED, shuffle=True)
    assert [r.prompt_id for r in stream.next_batch(12)] == S and _order(0) != _order(1)


def test_an_exact_ledger_over_one_and_a_half_epochs_with_a_refill():
    # 4 steps: 2 prompts each, step 2 with one DAPO refill (3 ids): 2 + 3 + 2 + 2 = 9 ids, into epoch 1
    report = _check({1: S[0:2], 2: S[2:5], 3: S[5:7], 4: S[7:9]})
    assert report.ok and report.consumed == 9 and report.expected == 9 and report.first_mismatch is None
    assert report.summary() == "ledger exact: 4 steps took 9 prompts; the stream hands out 9 over that span, each once, in order"


def test_a_step_that_took_the_same_prompts_again_shows_duplicates():
    report = _check({1: S[0:2], 2: S[2:4], 3: S[2:4], 4: S[4:6]})  # step 3 re-took step 2's prompts
    assert not report.ok
    assert report.duplicates == {S[2]: 1, S[3]: 1} and report.missing == () and report.out_of_order == ()
    assert report.first_mismatch == 4 and report.expected == 6
    assert f"2 taken again: {S[2]} x2, {S[3]} x2" in report.summary()


def test_a_lost_step_shows_its_prompts_missing():
    report = _check({1: S[0:2], 2: S[4:6], 3: S[6:8]})  # S[2:4] were never trained on
    assert report.missing == (S[2], S[3]) and report.duplicates == {} and report.first_mismatch == 2
    assert report.expected == 8 and not report.ok


def test_a_refill_taken_after_the_next_steps_prompts_is_out_of_order():
    """Async rollouts with DAPO: step 2's prompts are taken while step 1 trains, so step 1's refill comes after them."""
    report = _check({1: [S[0], S[1], S[4]], 2: [S[2], S[3]], 3: [S[5]]})
    assert report.out_of_order == (S[2], S[3]) and report.missing == () and report.duplicates == {}
    assert report.first_mismatch == 2 and not report.ok
    assert f"2 out of order: {S[2]}, {S[3]}" in report.summary()


def test_in_async_mode_the_next_steps_prompts_come_before_a_refill():
    """max_staleness 1: step 2's prompts are taken when step 1 starts, before step 1's refill; step 3's after it."""
    steps = {1: [S[0], S[1], S[4]], 2: [S[2], S[3]], 3: [S[5], S[6]]}
    report = _check(steps, prompts_per_step=2, max_staleness=1)
    assert report.ok and report.consumed == report.expected == 7
    # max_staleness 2: steps 2 and 3 took S[2:6] before step 1's refill
    assert _check({1: [S[0], S[1], S[6]], 2: S[2:4], 3: S[4:6]}, prompts_per_step=2, max_staleness=2).ok
    # the same ledger with the refill taken again by step 3 is wrong
    report = _check({1: [S[0], S[1], S[4]], 2: [S[2], S[3]], 3: [S[4], S[5]]}, prompts_per_step=2, max_staleness=1)
    assert report.duplicates == {S[4]: 1} and report.missing == () and not report.ok
    with pytest.raises(ValueError, match="max_staleness=1 needs prompts_per_step >= 1"):
        _check(steps, max_staleness=1)


def test_a_step_without_a_ledger_file_and_files_past_the_last_step():
    report = _check({1: S[0:2], 3: S[4:6]})
    assert report.missing_steps == (2,) and report.missing == (S[2], S[3])
    # a rollback abandoned step 3's timeline and the run stopped at step 2: step 3's file is not counted
    report = _check({1: S[0:2], 2: S[2:4], 3: S[0:2]}, last_step=2)
    assert report.ok and report.later_steps == (3,) and report.steps == 2


def test_an_id_outside_the_data_is_unknown():
    report = _check({1: [S[0], "nope"], 2: S[1:3]})
    assert report.unknown == ("nope",) and not report.ok and "1 not in the data: nope" in report.summary()


def test_the_ledger_goes_to_mlflow_and_a_step_run_again_replaces_its_file(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker(uri, "ledger")
    tracker.log_ledger(S[0:2], step=1)
    tracker.log_ledger(["q9", "q9"], step=2)  # a step that later ran again after a restore ...
    tracker.log_ledger(S[2:4], step=2)  # ... replaces its own file
    tracker.set_tags({"rlray.final_step": "2"})
    assert read_ledger(uri, tracker.run_id) == {1: S[0:2], 2: S[2:4]}
    report = ledger.check_run(uri, tracker.run_id, ROWS, seed=SEED, shuffle=True)
    assert report.ok and report.consumed == 4
    tracker.close()


# --------------------------------------------------------------------------------------------
# The step records its prompts and DAPO's refills (stages 1-3b through the real functions, fake rollouts)
# --------------------------------------------------------------------------------------------
G = 2


class _Scripted:
    """Returns the next scripted reward list at each call."""

    def __init__(self, calls):
        self.calls = list(calls)

    def score(self, prompts, completions, columns, completion_ids=None):
        values = self.calls.pop(0)
        assert len(values) == len(completions)
        return {"reward": values}

    def score_with_failures(self, prompts, completions, columns, completion_ids=None):
        return self.score(prompts, completions, columns, completion_ids), []  # no failure texts

    def close(self):
        pass


class _Tokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, x)) for x in ids]


def _completions(num_prompts: int) -> list[Completion]:
    return [Completion(i // G, i % G, [100 + i, 101], [-1.0, -1.0], "stop", 0) for i in range(num_prompts * G)]


def test_collect_experience_records_the_steps_prompts_and_dapos_refills():
    cfg = config_from_dict({}, ["algo.name=dapo", "learner.prompts_per_step=2", f"rollout.samples_per_prompt={G}",
                                "learner.sequences_per_minibatch=4", "learner.sequences_per_microbatch=2"])  # fmt: skip
    stream = PromptStream(ROWS, seed=SEED, shuffle=True)
    first = stream.next_batch(2)  # what the pipeline took for the step
    got = SimpleNamespace(rows=first, prompt_ids=[[1], [2]], completions=_completions(2))
    # round 1: group 0 constant (dropped), group 1 varies; round 2 (1 refill prompt): it varies
    reward = LocalRewardClient(_Scripted([[0.5, 0.5, 0.0, 1.0], [1.0, 0.0]]), 1)
    rollouts = SimpleNamespace(generate=lambda ids, sampling, rows: _completions(len(ids)))
    lead = _lead(stream, reward, rollouts, pipeline=SimpleNamespace(next=lambda step: got))
    got = experience.collect_experience(lead, resolve_plan(cfg), _Tokenizer(), 0, StageTimer(), policy_version=0)
    assert got.metrics["algo/dynamic_sampling_rounds"] == 2.0
    assert got.prompt_ids == S[0:3]  # both prompts of the step, the dropped one too, then the refill
    assert got.table.column("prompt_id").to_pylist() == [S[1]] * G + [S[2]] * G  # the update keeps groups 1 and refill
    assert _check({1: got.prompt_ids}).ok


def _lead(stream, reward, rollouts, pipeline=None, reward_kwargs=None):
    """Returns rank 0's part of a run over ``stream`` without Ray (every prompt's token ids are [3])."""
    return OnlineLead(stream=stream, prompt_ids={r.prompt_id: [3] for r in ROWS}, skipped_long_prompts=0,
                      eval_prompts=[], reward_columns=None, reward=reward, reward_kwargs=reward_kwargs or {},
                      fleet=rollouts, rollouts=rollouts, pipeline=pipeline, logged=FleetCounts())


class _OddQuestionsFlat:
    """Reward: 0 for every sample of an odd-numbered question (a flat group DAPO drops and refills), else the
    parity of the completion's first token (0, 1 within each group of ``_completions``)."""

    def score(self, prompts, completions, columns, completion_ids=None):
        flat = [int(p.split()[1]) % 2 for p in prompts]
        return {"reward": [0.0 if f else float(int(c.split()[0]) % 2) for f, c in zip(flat, completions, strict=True)]}

    def score_with_failures(self, prompts, completions, columns, completion_ids=None):
        return self.score(prompts, completions, columns, completion_ids), []  # no failure texts

    def close(self):
        pass


class _Fleet:
    """A rollout fleet and its pipeline's engine without Ray: ``_completions`` for every prompt."""

    version = 0

    def submit(self, ids, sampling, rows):
        return len(ids)

    def collect(self, num_prompts):
        return _completions(num_prompts)

    def generate(self, ids, sampling, rows):
        return _completions(len(ids))

    def push(self, learner, rank, version):  # the weight sync of reload_rollouts
        pass


def _dapo_run(max_staleness: int) -> OnlineRun:
    """Returns rank 0's context of a DAPO run with the real PromptStream and RolloutPipeline (``setup``'s wiring)."""
    cfg = config_from_dict({}, ["algo.name=dapo", "learner.prompts_per_step=2", f"rollout.samples_per_prompt={G}",
                                "learner.sequences_per_minibatch=4", "learner.sequences_per_microbatch=2",
                                f"rollout.max_staleness={max_staleness}", "algo.dynamic_sampling_max_rounds=20"])  # fmt: skip
    fleet, stream = _Fleet(), PromptStream(ROWS, seed=SEED, shuffle=True)
    lead = _lead(stream, LocalRewardClient(_OddQuestionsFlat(), 1), fleet, reward_kwargs=build.scorer_kwargs(cfg, None))
    ctx = OnlineRun(resolve_plan(cfg), Collective(), None, _Tokenizer(), weight_sync=fleet, lead=lead)
    lead.pipeline = RolloutPipeline(fleet, ctx.take_prompts, ctx.sampling_for, max_staleness, cursor=stream.state_dict,
                                    restore_cursor=stream.load_state_dict)  # fmt: skip
    return ctx


def _steps(ctx: OnlineRun, steps: range, book: dict[int, list[str]]) -> dict[int, list[str]]:
    """Runs stages 1-3b of 0-based ``steps``; each replaces its 1-based ledger entry in ``book`` (as MLflow does)."""
    for step in steps:
        got = experience.collect_experience(ctx.lead, ctx.plan, ctx.tokenizer, step, StageTimer(),
                                            policy_version=ctx.policy_version)
        book[step + 1] = got.prompt_ids
    return book


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_dapo_refills_resume_exactly_from_a_snapshots_cursor(max_staleness):
    """A restart (a fresh context restored from the cursor a snapshot keeps) and a rollback (the same context, steps in
    flight, restored to an earlier cursor) both give every later step the prompts an uninterrupted run gives it."""
    check = dict(prompts_per_step=2, max_staleness=max_staleness)
    uninterrupted = _steps(_dapo_run(max_staleness), range(8), {})
    assert sum(map(len, uninterrupted.values())) > 16  # DAPO refilled (odd questions are flat)
    assert _check(uninterrupted, **check).ok, _check(uninterrupted, **check).summary()

    first = _dapo_run(max_staleness)
    book = _steps(first, range(3), {})
    cursor = first.cursor_state()  # the snapshot of step 3
    assert len(cursor["in_flight"]) == max_staleness
    _steps(first, range(3, 6), book)
    first.load_cursor_state(cursor)  # a rollback to it (session.rollback: restore, then reload_rollouts)
    first.reload_rollouts()
    assert _steps(first, range(3, 8), book) == uninterrupted

    restarted = _dapo_run(max_staleness)  # a restart: a new process restores the snapshot (session.begin)
    restarted.load_cursor_state(cursor)
    restarted.reload_rollouts()
    book = _steps(restarted, range(3, 8), {s: book[s] for s in (1, 2, 3)})
    assert book == uninterrupted and _check(book, **check).ok


class _HangsOnce:
    """A reward client over ``_OddQuestionsFlat`` whose ``hang_at``-th score call (1-based, counted from ``arm``) raises
    ``HangError``, as a reward or judge client does after its report under watchdog.on_hang=stop."""

    def __init__(self, inner: LocalRewardClient) -> None:
        self.inner, self.calls, self.hang_at, self.hung = inner, 0, 0, 0

    def arm(self, hang_at: int) -> None:
        self.calls, self.hang_at = 0, hang_at

    def score(self, prompts, completions, columns, completion_ids=None):
        self.calls += 1
        if self.calls == self.hang_at:
            self.hung += 1
            raise HangError("hang: reward server 'rlray-reward' ... has run score for 0.6 s, past "
                            "reward.server.client_timeout_s=0.5 s; stopping the run (watchdog.on_hang=stop)")
        return self.inner.score(prompts, completions, columns, completion_ids)

    def close(self):
        pass


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_dapo_refill_whose_reward_hangs_under_stop_keeps_the_step_and_its_refills_for_the_resume(max_staleness):
    """watchdog.on_hang=stop, a refill's reward call hangs: the step goes back in flight with its samples and the
    refills' prompts back to the stream (the stop snapshot keeps both: ``cursor_state``, ``in_flight_rollouts``), so a
    resume from that snapshot takes every prompt an uninterrupted run takes, in its order (the stop itself, with the
    snapshot, is ``run_step``'s: HangError is one of ``FATAL_STEP_ERRORS``)."""
    uninterrupted = _steps(_dapo_run(max_staleness), range(8), {})
    hung_step = next(s for s in range(8) if len(uninterrupted[s + 1]) > 2)  # the first step that refills
    first = _dapo_run(max_staleness)
    reward = first.lead.reward = _HangsOnce(first.lead.reward)
    pipeline_next, after_rollout = first.lead.pipeline.next, {}

    def next_step(step: int):  # stages 1-2, then the stream's cursor (the step's prompts and the steps' ahead taken)
        got = pipeline_next(step)
        after_rollout[step] = first.lead.stream.state_dict()
        return got

    first.lead.pipeline.next = next_step
    book = _steps(first, range(hung_step), {})
    reward.arm(2)  # the step's own score, then its first refill's
    with pytest.raises(HangError, match="stopping the run"):
        _steps(first, range(hung_step, hung_step + 1), book)
    assert reward.hung == 1 and first.lead.stream.state_dict() == after_rollout[hung_step]  # the refill's went back
    cursor, kept = first.cursor_state(), first.in_flight_rollouts()  # the stop snapshot (of step hung_step)
    assert len(cursor["in_flight"]) == max_staleness + 1 and kept[0] is not None  # the hung step, with its samples

    resumed = _dapo_run(max_staleness)  # `rlray train --resume` from the stop snapshot (session.begin)
    resumed.load_cursor_state(cursor)
    resumed.load_in_flight_rollouts(kept)
    resumed.reload_rollouts()
    book = _steps(resumed, range(hung_step, 8), book)
    assert book == uninterrupted
    assert _check(book, prompts_per_step=2, max_staleness=max_staleness).ok


def test_an_empty_row_list_is_refused():
    with pytest.raises(ValueError, match="PromptStream needs at least one prompt row"):
        ledger.check_ledger({}, [], seed=0, shuffle=False)
