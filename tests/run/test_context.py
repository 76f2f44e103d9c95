"""The run context every run kind fills in (rlray.run.context.RunContext) and the stage timer of online steps
(rlray.run.online.StageTimer). No model is loaded: the context only holds the learner, so a stand-in object does."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from rlray.config import Config
from rlray.data import PromptRow, PromptStream
from rlray.learner.collective import Collective
from rlray.run.context import RunContext
from rlray.run.online import StageTimer


@dataclass
class MinimalRun(RunContext):
    """A run kind that fills in only the abstract methods, so every other method is RunContext's default."""

    def run_step(self, step, end_step):
        return {}

    def evaluate_when_due(self, steps_done):
        return {}

    def progress_text(self, steps_done, metrics):
        return f"step {steps_done}"


class ThreeRanks(Collective):
    rank = 2
    world = 3


LEARNER = object()  # RunContext never calls the learner in the methods tested here


def _stream() -> PromptStream:
    return PromptStream([PromptRow(f"r:{i}", f"question {i}", {"answer": str(i)}) for i in range(5)], seed=1, shuffle=True)


def test_run_context_cannot_be_made_without_its_abstract_methods():
    with pytest.raises(TypeError, match="abstract"):
        RunContext(Config(), Collective(), LEARNER, None)

    @dataclass
    class NoProgress(RunContext):  # progress_text missing
        def run_step(self, step, end_step):
            return {}

        def evaluate_when_due(self, steps_done):
            return {}

    with pytest.raises(TypeError, match="progress_text"):
        NoProgress(Config(), Collective(), LEARNER, None)


def test_rank_and_world_come_from_the_collective():
    one = MinimalRun(Config(), Collective(), LEARNER, None)
    assert (one.rank, one.world) == (0, 1)
    ctx = MinimalRun(Config(), ThreeRanks(), LEARNER, None)
    assert (ctx.rank, ctx.world) == (2, 3)


def test_the_default_cursor_state_is_the_streams_and_loads_back():
    stream = _stream()
    stream.next_batch(7)  # one epoch of 5, then 2 rows into epoch 1
    ctx = MinimalRun(Config(), Collective(), LEARNER, None, stream=stream)
    cursor = ctx.cursor_state()
    assert cursor == stream.state_dict()
    assert (cursor["epoch"], cursor["position"], cursor["num_rows"], cursor["seed"]) == (1, 2, 5, 1)
    stream.next_batch(4)
    ctx.load_cursor_state(cursor)
    assert stream.state_dict() == cursor


def test_start_metrics_is_a_copy_of_the_data_metrics():
    ctx = MinimalRun(Config(), Collective(), LEARNER, None, data_metrics={"data/train_prompts": 5.0})
    metrics = ctx.start_metrics()
    assert metrics == {"data/train_prompts": 5.0}
    metrics["data/train_prompts"] = 0.0
    metrics["extra"] = 1.0
    assert ctx.data_metrics == {"data/train_prompts": 5.0}
    assert MinimalRun(Config(), Collective(), LEARNER, None).start_metrics() == {}


def test_default_reload_rollouts_and_close_do_nothing():
    stream = _stream()
    stream.next_batch(3)
    ctx = MinimalRun(Config(), Collective(), LEARNER, "tok", stream=stream, policy_version=4,
                     data_metrics={"data/train_prompts": 5.0})  # fmt: skip
    before = (ctx.stream.state_dict(), ctx.policy_version, dict(ctx.data_metrics), ctx.tokenizer, ctx.learner)
    assert ctx.reload_rollouts() is None
    assert ctx.close() is None
    assert (ctx.stream.state_dict(), ctx.policy_version, dict(ctx.data_metrics), ctx.tokenizer, ctx.learner) == before


def test_stage_timer_adds_up_blocks_of_the_same_stage():
    timer = StageTimer()
    with timer("x"):
        time.sleep(0.02)
    first = timer.metrics["timing/x_s"]
    with timer("x"):
        time.sleep(0.02)
    assert 0.02 <= first < 1.0
    assert first + 0.02 <= timer.metrics["timing/x_s"] < 2.0
    assert list(timer.metrics) == ["timing/x_s"]
    assert timer.elapsed_s() >= timer.metrics["timing/x_s"]


def test_stage_timer_records_a_block_that_raises():
    timer = StageTimer()
    with pytest.raises(RuntimeError, match="boom"), timer("rollout"):
        time.sleep(0.02)
        raise RuntimeError("boom")
    assert 0.02 <= timer.metrics["timing/rollout_s"] < 1.0
