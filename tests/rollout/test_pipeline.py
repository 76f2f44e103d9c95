"""RolloutPipeline without Ray: a multi-turn rollout in flight samples every turn with the weights it was submitted
at (``before_push``), and a snapshot keeps the rollouts of the steps in flight (``in_flight_rollouts``), so that a
restored pipeline hands those steps the samples an uninterrupted one hands them. Through the real step, episodes and
agents: tests/run/test_async_resume.py."""

from __future__ import annotations

import json
import time

import pytest

from rlray.hangs import HangError
from rlray.rollout import Completion, SamplingSpec
from rlray.rollout.pipeline import RolloutPipeline
from rlray.rollout.types import in_background


class TurnSource:
    """A multi-turn rollout source: each prompt's two turns run on a thread, the second ``gap_s`` after the first,
    each sampled with the version pushed by then (the first rollout submitted runs without a gap); a completion's
    tokens are [seed, prompt, turn-1 version, turn-2 version]. ``version`` is what a push sets."""

    def __init__(self, gap_s: float = 0.0) -> None:
        self.version, self.gap_s, self.submits = 0, gap_s, 0

    def submit(self, prompt_ids, sampling, rows):
        self.submits += 1
        gap_s = self.gap_s if self.submits > 1 else 0.0
        return in_background(lambda: self._episodes(prompt_ids, sampling, gap_s), "test-episodes")

    def _episodes(self, prompt_ids, sampling, gap_s=0.0):
        first = self.version
        time.sleep(gap_s)
        second = self.version
        return [Completion(p, s, [sampling.seed, ids[0], first, second], [-0.25, -0.5], "stop", min(first, second))
                for p, ids in enumerate(prompt_ids) for s in range(sampling.n)]

    def collect(self, pending):
        return pending.result()

    def generate(self, prompt_ids, sampling, rows):
        return self.collect(self.submit(prompt_ids, sampling, rows))


def pipeline(source, *, settle: bool = False, k: int = 1, recover=None):
    """Returns (a pipeline over ``source`` taking 2 prompts per step from a counter, its cursor)."""
    cursor = {"next": 0}

    def take():
        start = cursor["next"]
        cursor["next"] += 2
        return [f"p{i}" for i in range(start, start + 2)], [[i] for i in range(start, start + 2)]

    pipe = RolloutPipeline(source, take, lambda step: SamplingSpec(n=2, max_new_tokens=4, temperature=1.0, seed=100 + step),
                           k, cursor=lambda: dict(cursor), restore_cursor=cursor.update, settle_before_push=settle,
                           recover=recover)
    return pipe, cursor


def push(pipe, source) -> None:
    """Stage 7: the pipeline's ``before_push``, then the new version."""
    pipe.before_push()
    source.version += 1


@pytest.mark.parametrize("settle", [True, False])
def test_a_push_waits_for_the_turns_of_the_episodes_in_flight_only_when_asked(settle):
    source = TurnSource(gap_s=0.3)
    pipe, _ = pipeline(source, settle=settle)
    pipe.next(0)  # submits step 1 (version 0); its second turns come 0.3 s later
    push(pipe, source)
    turns = {tuple(c.response_token_ids[2:]) for c in pipe.next(1).completions}
    # settled: both turns at version 0, as a single-turn rollout submitted before the push; else the push lands between
    assert turns == ({(0, 0)} if settle else {(0, 1)})


def run_steps(pipe, source, steps):
    """Returns each step's (rows, submitted version, completion tokens), pushing a version after each step."""
    out = []
    for step in steps:
        batch = pipe.next(step)
        out.append((batch.rows, batch.submitted_at_version, [c.response_token_ids for c in batch.completions]))
        push(pipe, source)
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_a_restored_pipeline_trains_the_steps_in_flight_on_the_kept_samples(k):
    straight_source = TurnSource()
    straight, _ = pipeline(straight_source, settle=True, k=k)
    expected = run_steps(straight, straight_source, range(5))

    source = TurnSource()
    first, _ = pipeline(source, settle=True, k=k)
    assert run_steps(first, source, range(2)) == expected[:2]
    # the snapshot after step 2 (0-based step 1): the cursor, then what the steps in flight sampled (JSON, as written)
    rollouts = json.loads(json.dumps(first.in_flight_rollouts()))
    state = json.loads(json.dumps(first.cursor_state()))
    assert [r["version"] for r in rollouts] == list(range(2 - k, 2)) and len(state["in_flight"]) == k

    restored_source = TurnSource()
    restored_source.version = 2  # the restore's push of the snapshot's weights
    restored, cursor = pipeline(restored_source, settle=True, k=k)
    restored.load_cursor_state(state)
    restored.keep_rollouts(rollouts)
    assert run_steps(restored, restored_source, range(2, 5)) == expected[2:]
    assert restored_source.submits == 3  # steps 2+k..4+k: only the steps past those kept were sampled
    assert cursor == {"next": 2 * (5 + k)}


def test_without_the_kept_samples_the_steps_in_flight_sample_again_with_newer_weights():
    """What a restore did before the snapshot kept the rollouts in flight: step 3 trained on version-2 samples, where
    the uninterrupted run trains it on version-1 ones."""
    source = TurnSource()
    first, _ = pipeline(source, settle=True)
    run_steps(first, source, range(2))
    state = first.cursor_state()
    restored_source = TurnSource()
    restored_source.version = 2
    restored, _ = pipeline(restored_source, settle=True)
    restored.load_cursor_state(state)
    (rows, version, tokens), = run_steps(restored, restored_source, [2])
    assert rows == ["p4", "p5"] and version == 2 and tokens[0][2:] == [2, 2]


def test_keep_rollouts_refuses_a_count_the_cursor_does_not_name():
    source = TurnSource()
    pipe, _ = pipeline(source)
    pipe.load_cursor_state({"next": 4, "in_flight": [{"next": 2}]})
    with pytest.raises(ValueError, match="keeps the rollouts of 2 steps in flight, and its cursor names 1"):
        pipe.keep_rollouts([None, None])
    pipe.keep_rollouts([None])  # a step without kept samples: sampled again
    assert pipe.next(1).rows == ["p2", "p3"] and source.submits == 2


class FailingSource(TurnSource):
    """A TurnSource whose rollouts numbered in ``fail`` (1-based submits) raise; ``error`` is what they raise."""

    def __init__(self, fail, error=None):
        super().__init__()
        self.fail, self.error = set(fail), error or RuntimeError("environment host lost")

    def _episodes(self, prompt_ids, sampling, gap_s=0.0, number=0):
        if number in self.fail:
            raise self.error
        return super()._episodes(prompt_ids, sampling, gap_s)

    def submit(self, prompt_ids, sampling, rows):
        self.submits += 1
        number = self.submits
        return in_background(lambda: self._episodes(prompt_ids, sampling, 0.0, number), "test-episodes")


def test_a_rollout_that_fails_before_a_push_is_sampled_again_with_its_version_and_seeds(caplog):
    straight_source = TurnSource()
    straight, _ = pipeline(straight_source, settle=True)
    expected = run_steps(straight, straight_source, range(3))

    source, recovered = FailingSource(fail={2}), []
    pipe, _ = pipeline(source, settle=True, recover=lambda: recovered.append(source.version))
    with caplog.at_level("WARNING", logger="rlray.rollout.pipeline"):
        got = run_steps(pipe, source, range(3))  # step 1's rollout (submit 2) fails in step 0's push
    # sampled again before the push: version 0, seed 101, the same tokens [seed, prompt, turn 1, turn 2] as unfailed
    assert got == expected and got[1] == (["p2", "p3"], 0, [[101, 2, 0, 0], [101, 2, 0, 0], [101, 3, 0, 0], [101, 3, 0, 0]])
    assert recovered == [0] and source.submits == 4 + 1  # steps 0-3 (3: the one ahead) and the re-sample
    assert pipe.rerun_prompts == 2 and pipe.stale_rerun_prompts == 0
    assert "sampled again with the weights of version 0 it was submitted at" in caplog.text


def test_a_rollout_submitted_before_the_last_push_is_sampled_again_with_newer_weights_counted_stale(caplog):
    """Single-turn async (no settle before a push): the snapshot after step 0 collects step 1's rollout, submitted at
    version 0 while the actors now hold version 1; version 0's weights are gone, so the re-sample is version 1's."""
    source = FailingSource(fail={2})
    pipe, _ = pipeline(source)
    run_steps(pipe, source, [0])
    with caplog.at_level("WARNING", logger="rlray.rollout.pipeline"):
        kept = pipe.in_flight_rollouts()
    assert [k["version"] for k in kept] == [1] and kept[0]["completions"][0]["response_token_ids"] == [101, 2, 1, 1]
    assert pipe.rerun_prompts == 2 and pipe.stale_rerun_prompts == 2
    assert "with the weights of version 1, not those of version 0 it was submitted at" in caplog.text
    assert pipe.next(1).submitted_at_version == 1  # the samples carry the version that sampled them


def test_a_rollout_whose_resample_fails_too_is_sampled_when_its_step_asks_counted_stale(caplog):
    source = FailingSource(fail={2, 3})
    pipe, _ = pipeline(source, settle=True)
    pipe.next(0)
    with caplog.at_level("WARNING", logger="rlray.rollout.pipeline"):
        push(pipe, source)  # step 1's rollout and its re-sample fail: logged, not raised
        batch = pipe.next(1)
    assert batch.submitted_at_version == 1 and batch.completions[0].response_token_ids == [101, 2, 1, 1]
    assert source.submits == 5 and pipe.rerun_prompts == 2 and pipe.stale_rerun_prompts == 2
    assert "and again when sampled again (environment host lost)" in caplog.text
    assert "not those of version 0 it was submitted at" in caplog.text


def test_a_rollout_that_hung_under_stop_is_left_to_its_step():
    source = FailingSource(fail={2}, error=HangError("rollout actor 0 hung (watchdog.engine_call_s)"))
    pipe, _ = pipeline(source, settle=True, recover=lambda: pytest.fail("a hang under stop is not retried here"))
    pipe.next(0)
    pipe.settle()  # no push: its step samples it at the version it was submitted at
    assert source.submits == 2 and pipe.rerun_prompts == 2
    batch = pipe.next(1)
    assert batch.submitted_at_version == 0 and pipe.stale_rerun_prompts == 0 and source.submits == 4
