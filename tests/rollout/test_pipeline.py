"""RolloutPipeline without Ray: a multi-turn rollout in flight samples every turn with the weights it was submitted
at (``before_push``), and a snapshot keeps the rollouts of the steps in flight (``in_flight_rollouts``), so that a
restored pipeline hands those steps the samples an uninterrupted one hands them. Through the real step, episodes and
agents: tests/run/test_async_resume.py."""

from __future__ import annotations

import json
import time

import pytest

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


def pipeline(source, *, settle: bool = False, k: int = 1):
    """Returns (a pipeline over ``source`` taking 2 prompts per step from a counter, its cursor)."""
    cursor = {"next": 0}

    def take():
        start = cursor["next"]
        cursor["next"] += 2
        return [f"p{i}" for i in range(start, start + 2)], [[i] for i in range(start, start + 2)]

    pipe = RolloutPipeline(source, take, lambda step: SamplingSpec(n=2, max_new_tokens=4, temperature=1.0, seed=100 + step),
                           k, cursor=lambda: dict(cursor), restore_cursor=cursor.update, settle_before_push=settle)
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


def test_a_rollout_that_fails_while_settling_is_sampled_again_when_its_step_asks():
    class FailsOnce(TurnSource):
        def _episodes(self, prompt_ids, sampling, gap_s=0.0):
            if self.submits == 2 and not getattr(self, "failed", False):
                self.failed = True
                raise RuntimeError("environment host lost")
            return super()._episodes(prompt_ids, sampling, gap_s)

    source = FailsOnce()
    pipe, _ = pipeline(source, settle=True)
    pipe.next(0)
    push(pipe, source)  # step 1's rollout fails here: logged, not raised
    batch = pipe.next(1)
    assert source.submits == 4 and batch.submitted_at_version == 1 and batch.rows == ["p2", "p3"]
